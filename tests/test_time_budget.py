"""The suite's time budget (tests/_budget.py, tests/time_budget.yaml): a module over its tolerance, and the whole run
(every session adding to RAYSPEED_TIME_SPENT) over total_s, fail the session."""

from __future__ import annotations

import json

import yaml

import _budget


def test_the_whole_run_is_held_to_its_total(tmp_path, monkeypatch):
    spec = yaml.safe_load(_budget.BUDGET_FILE.read_text())
    limit, budgets = float(spec["total_s"]), spec["modules"]
    assert limit == 3600
    spent = tmp_path / "spent.json"
    monkeypatch.setenv(_budget.SPENT_ENV, str(spent))
    module = max(budgets, key=budgets.get)  # 15 s more stays within its own budget
    # An earlier session of the same run (make test) spent all but 10 s of the total, each module within its budget.
    earlier = {f"tests/earlier_{i}.py": 1.0 for i in range(int(limit) - 10)}
    spent.write_text(json.dumps(earlier))
    b = _budget.Budget()
    b.add(f"{module}::t", 5.0)
    assert b.problems() == [] and b.total() == limit - 5
    b.add(f"{module}::u", 10.0)  # this session takes it past the total
    (problem,) = b.problems()
    assert problem.startswith(f"the whole suite so far: {limit + 5:.0f} s, over its total_s of {limit:.0f} s")


def test_a_module_past_its_tolerance_fails_alone(tmp_path, monkeypatch):
    monkeypatch.delenv(_budget.SPENT_ENV, raising=False)
    spec = yaml.safe_load(_budget.BUDGET_FILE.read_text())
    module, budget = next(iter(spec["modules"].items()))
    b = _budget.Budget()
    b.add(f"{module}::t", float(spec["tolerance"]) * budget + 1)
    assert b.problems() == [f"{module}: {spec['tolerance'] * budget + 1:.0f} s, over {spec['tolerance']:g} x its "
                            f"budget of {budget:.0f} s"]
