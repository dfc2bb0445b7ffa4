"""The suite's time budget (tests/_budget.py, tests/time_budget.yaml): a module over its tolerance, and the whole run
(every session adding its wall-clock seconds to RAYSPEED_TIME_SPENT) over total_s, fail the session."""

from __future__ import annotations

import json

import pytest
import yaml

import _budget


def test_the_whole_run_is_held_to_its_total(tmp_path, monkeypatch):
    spec = yaml.safe_load(_budget.BUDGET_FILE.read_text())
    limit, budgets = float(spec["total_s"]), spec["modules"]
    assert limit == 3600
    spent = tmp_path / "spent.json"
    monkeypatch.setenv(_budget.SPENT_ENV, str(spent))
    module = max(budgets, key=budgets.get)
    # An earlier session of the same run (make test, its modules in two processes) took all but 10 s of the total
    # on the wall clock; its modules' seconds add up to more (they ran side by side) and count only module by module.
    earlier = {f"tests/earlier_{i}.py": 2.0 for i in range(int(limit))}
    earlier[f"{_budget.WALL}session 1"] = limit - 10
    spent.write_text(json.dumps(earlier))
    b = _budget.Budget()
    b.add(f"{module}::t", 50.0)
    b.started -= 5.0  # this session has run 5 s
    assert b.problems() == [] and b.total() == pytest.approx(limit - 5, abs=0.5)
    b.started -= 10.0  # and now 15 s: past the total
    (problem,) = b.problems()
    assert problem.startswith(f"the whole suite so far: {limit + 5:.0f} s, over its total_s of {limit:.0f} s")
    b.write_spent()
    written = json.loads(spent.read_text())
    assert written[f"{_budget.WALL}session 2"] == pytest.approx(15, abs=0.5) and written[module] == 50.0


def test_a_module_past_its_tolerance_fails_alone(tmp_path, monkeypatch):
    monkeypatch.delenv(_budget.SPENT_ENV, raising=False)
    spec = yaml.safe_load(_budget.BUDGET_FILE.read_text())
    module, budget = next(iter(spec["modules"].items()))
    b = _budget.Budget()
    b.add(f"{module}::t", float(spec["tolerance"]) * budget + 1)
    assert b.problems() == [f"{module}: {spec['tolerance'] * budget + 1:.0f} s, over {spec['tolerance']:g} x its "
                            f"budget of {budget:.0f} s"]
