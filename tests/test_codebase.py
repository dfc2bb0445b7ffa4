"""The shape of the package: small modules with unique names, no reaching into another module's private names,
the internals of Ray and DeepSpeed used only from rayspeed.compat (and only at the versions it was written for)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "platform" / "rayspeed"
MAX_FILE_LINES = 450
MAX_CLASS_LINES = 300


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def test_no_module_over_450_lines_and_no_class_over_300():
    long_files = {str(p.relative_to(PACKAGE)): n for p in _modules()
                  if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long_files, f"modules over {MAX_FILE_LINES} lines (split them by concern): {long_files}"
    long_classes = {}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long_classes[f"{p.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long_classes, f"classes over {MAX_CLASS_LINES} lines: {long_classes}"


def test_no_two_modules_share_a_basename():
    names = Counter(p.name for p in _modules() if p.name not in ("__init__.py", "__main__.py"))
    twice = {n: sorted(str(p.relative_to(PACKAGE)) for p in _modules() if p.name == n)
             for n, c in names.items() if c > 1}
    assert not twice, f"module basenames used more than once (name each for its concern): {twice}"


def test_no_module_uses_another_modules_private_names():
    """`from rayspeed.x import _y` and `x._y` (x a rayspeed module imported by name) are both reaching in."""
    found = []
    for p in _modules():
        me = _module_name(p)
        tree = ast.parse(p.read_text())
        aliases = {}  # local name -> rayspeed module it refers to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rayspeed"):
                for a in node.names:
                    target = f"{node.module}.{a.name}"
                    if a.name.startswith("_") and not a.name.startswith("__") and node.module != me:
                        found.append(f"{p.relative_to(PACKAGE)}: from {node.module} import {a.name}")
                    aliases[a.asname or a.name] = target
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("rayspeed"):
                        aliases[a.asname or a.name.split(".")[0]] = a.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and aliases[node.value.id] != me):
                found.append(f"{p.relative_to(PACKAGE)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not found, "private names used across modules (make them public or move the code):\n" + "\n".join(found)


def test_ray_and_deepspeed_internals_only_in_compat():
    allowed = {"compat.py"}
    found = []
    for p in _modules():
        if p.name in allowed:
            continue
        text = p.read_text()
        for needle in ("ray.train.v2._internal", "_create_default_callbacks", "__compatible_ops__",
                       "_count_possible_workers"):
            if needle in text:
                found.append(f"{p.relative_to(PACKAGE)}: {needle}")
    assert not found, f"internals of Ray/DeepSpeed outside rayspeed/compat.py: {found}"


def test_pinned_ray_and_deepspeed_still_have_the_internals_compat_patches():
    from rayspeed import compat

    problems = compat.check()
    assert not problems, "\n".join(problems)
