"""The training step is plain or pipelined plus the guard, nothing else (read from rayspeed.train.step's source, as
the loop's test reads the loop): TrainStep is at most 40 lines at cyclomatic complexity at most 8, it calls only
its parts' declared methods, and nothing under rayspeed.train probes a model for a feature with getattr or hasattr
(the model returns an output record and declares its routing). Each check finds a planted violation."""

from __future__ import annotations

import ast

from _cluster import ROOT

TRAIN = ROOT / "platform" / "rayspeed" / "train"
STEP = TRAIN / "step.py"
MAX_LINES, MAX_COMPLEXITY = 40, 8
# What the step may ask of each part (self.<part>.<method>, or a local bound to the part).
CALLS = {"engine": {"backward", "step", "is_gradient_accumulation_boundary"},
         "objective": {"scale", "loss", "whole", "pipeline_step"},
         "readings": {"clip"}, "guard": {"arm", "act"}, "chaos": {"at_step", "poisons_loss"},
         "timing": {"timed_step", "step_timed"}, "device": set(), "pipelined": set()}
BRANCHES = (ast.If, ast.For, ast.While, ast.IfExp, ast.ExceptHandler, ast.comprehension, ast.Assert)
MODEL_NAMES = ("module", "model")


def step_class(source: str) -> ast.ClassDef:
    return next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == "TrainStep")


def complexity(node: ast.AST) -> int:
    """McCabe's count over the class: one path, plus one per branch and per extra operand of and/or."""
    extra = sum(len(n.values) - 1 for n in ast.walk(node) if isinstance(n, ast.BoolOp))
    return 1 + extra + sum(1 for n in ast.walk(node) if isinstance(n, BRANCHES))


def step_violations(source: str) -> list[str]:
    """Calls of a part's method outside CALLS, and getattr / hasattr, in TrainStep."""
    cls = step_class(source)
    aliases = {}  # local name -> part, from `engine, objective = self.engine, self.objective`
    for n in ast.walk(cls):
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Tuple) and isinstance(n.value, ast.Tuple):
            for t, v in zip(n.targets[0].elts, n.value.elts):
                if isinstance(t, ast.Name) and isinstance(v, ast.Attribute) and v.attr in CALLS:
                    aliases[t.id] = v.attr
    out = []
    for n in ast.walk(cls):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr"):
            out.append(f"line {n.lineno}: {n.func.id}")
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
            continue
        chain, root = [], n.func
        while isinstance(root, ast.Attribute):
            chain.insert(0, root.attr)
            root = root.value
        if not isinstance(root, ast.Name):
            continue
        if root.id == "self" and len(chain) > 1:
            part, method = chain[0], ".".join(chain[1:])
        elif root.id in aliases:
            part, method = aliases[root.id], ".".join(chain)
        else:
            continue
        if method not in CALLS.get(part, set()):
            out.append(f"line {n.lineno}: {part}.{method}")
    return out


def names_of(node: ast.AST) -> list[str]:
    """The identifiers of a plain reference (a.b.c); none for anything else (a call's result)."""
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    return out + [node.id] if isinstance(node, ast.Name) else []


def model_probes(source: str) -> list[str]:
    """getattr / hasattr calls whose object is a model or a module (a feature found by probing)."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr") \
                and n.args and set(names_of(n.args[0])) & set(MODEL_NAMES):
            out.append(f"line {n.lineno}: {ast.unparse(n)}")
    return out


def test_the_step_is_small_and_simple():
    cls = step_class(STEP.read_text())
    assert cls.end_lineno - cls.lineno + 1 <= MAX_LINES
    assert complexity(cls) <= MAX_COMPLEXITY


def test_the_complexity_count_sees_a_planted_branch():
    source = STEP.read_text()
    planted = source.replace("        self.guard.act(done)\n",
                             "        self.guard.act(done)\n        if done and index or micro:\n            pass\n")
    assert complexity(step_class(planted)) == complexity(step_class(source)) + 3


def test_the_step_calls_only_its_parts_declared_methods():
    assert step_violations(STEP.read_text()) == []


def test_the_step_check_finds_planted_calls():
    planted = STEP.read_text().replace("engine.backward(losses.trained)",
                                       "engine.backward(losses.trained); getattr(engine, 'x'); engine.module.train()")
    found = sorted(v.split(": ", 1)[1] for v in step_violations(planted))
    assert found == ["engine.module.train", "getattr"]


def test_nothing_in_train_probes_a_model_for_a_feature():
    found = {p.name: model_probes(p.read_text()) for p in sorted(TRAIN.glob("*.py"))}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_probe_check_finds_a_planted_probe():
    assert model_probes("x = getattr(engine.module, 'balance_loss', None)\ny = hasattr(model, 'router_stats')\n") \
        == ["line 1: getattr(engine.module, 'balance_loss', None)", "line 2: hasattr(model, 'router_stats')"]
