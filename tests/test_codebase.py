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


def _is_private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _chain(node: ast.AST) -> tuple[str | None, list[str]]:
    """`a.b.c` -> ("a", ["b", "c"]); the root is None when the chain starts at a call or a subscript."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attrs[::-1]


# Documented settings of a library, assigned as its docs say (not patches of its code).
LIBRARY_SETTINGS = ("torch.backends.",)
# rayspeed's own objects set by name (the library rule cannot see types): (module, first argument).
OWN_SETATTR = {("config/hf_config.py", "model")}


def _own_private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines itself (functions, classes, variables, attributes it assigns, names it
    imports): `other._x` on one of these is the module's own business, not a library's internals."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.alias):
            own.add((node.asname or node.name).split(".")[-1])
    return {n for n in own if _is_private(n)}


def library_private_uses(path: Path) -> list[str]:
    """A library's private names (`_x` in an import, an attribute chain or a method overridden in a subclass),
    importlib of a library module by name, and patches of library objects (attribute assignment, setattr, delattr).
    The type of a local variable cannot be read from the source, so on anything but a library's name (a parameter,
    a local, `self.engine`) a private attribute counts unless the module defines that name itself; `getattr(x,
    "_name")` is the same reach spelled as a string."""
    tree = ast.parse(path.read_text())
    rel = str(path.relative_to(PACKAGE))
    lib: dict[str, str] = {}  # local name -> the library object it is bound to
    own = _own_private_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "rayspeed":
                    lib[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                    if _is_private(a.name):
                        found.append(f"{rel}:{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] != "rayspeed":
            for a in node.names:
                lib[a.asname or a.name] = f"{node.module}.{a.name}"
                if _is_private(node.module) or _is_private(a.name):
                    found.append(f"{rel}:{node.lineno}: from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            root, attrs = _chain(node)
            if root in lib and _is_private(node.attr):
                found.append(f"{rel}:{node.lineno}: {root}.{'.'.join(attrs)}")
            elif (_is_private(node.attr) and node.attr not in own
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                root, attrs = _chain(t) if isinstance(t, ast.Attribute) else (None, [])
                dotted = f"{lib.get(root, '')}.{'.'.join(attrs)}"
                if root in lib and not dotted.startswith(LIBRARY_SETTINGS):
                    found.append(f"{rel}:{node.lineno}: {root}.{'.'.join(attrs)} = ... (patches {lib[root]})")
        elif isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            first = node.args[0] if node.args else None
            if name in ("setattr", "delattr") and first is not None:
                if (rel, getattr(first, "id", None)) not in OWN_SETATTR:
                    found.append(f"{rel}:{node.lineno}: {name}({ast.unparse(first)}, ...)")
            if (name == "import_module" and isinstance(first, ast.Constant)
                    and not str(first.value).startswith("rayspeed")):
                found.append(f"{rel}:{node.lineno}: import_module({first.value!r})")
            attr = node.args[1] if name == "getattr" and len(node.args) > 1 else None
            if (isinstance(attr, ast.Constant) and isinstance(attr.value, str) and _is_private(attr.value)
                    and attr.value not in own):
                found.append(f"{rel}:{node.lineno}: getattr({ast.unparse(first)}, {attr.value!r})")
        elif isinstance(node, ast.ClassDef):
            bases = [_library_object(lib, b) for b in node.bases if _chain(b)[0] in lib]
            for item in node.body:
                if (isinstance(item, ast.FunctionDef) and _is_private(item.name)
                        and any(b is None or hasattr(b, item.name) for b in bases)):
                    found.append(f"{rel}:{item.lineno}: {node.name}.{item.name} overrides a library class's own")
    return found


def _library_object(lib: dict[str, str], node: ast.AST):
    """The library class a base-class expression names (None when it cannot be imported here)."""
    import importlib

    root, attrs = _chain(node)
    parts = lib[root].split(".") + attrs
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for a in parts[i:]:
                obj = getattr(obj, a)
            return obj
        except AttributeError:
            return None
    return None


def test_library_internals_only_in_compat():
    """Every private use of Ray, DeepSpeed, MLflow, torch or any other library lives in rayspeed/compat/ (a module
    per library), where each says why and when it can go, and compat.check() verifies it still exists."""
    found = [f for p in _modules() if p.parent.name != "compat" for f in library_private_uses(p)]
    assert not found, "library internals outside rayspeed/compat/ (move them there):\n" + "\n".join(found)


def test_the_private_use_check_finds_each_kind(tmp_path):
    probe = PACKAGE / "_probe_private_use.py"
    probe.write_text(
        "import torch._dynamo\nfrom ray.train.v2._internal import x\nimport importlib\nimport deepspeed\n"
        "from deepspeed.pipe import PipelineModule\nimport torch\n"
        "m = importlib.import_module('deepspeed.comm.comm')\nn = deepspeed.comm._private_thing\n"
        "deepspeed.comm.cdb = None\nsetattr(m, 'all_reduce', None)\ntorch.backends.cudnn.allow_tf32 = True\n"
        "class P(PipelineModule):\n    def _partition_layers(self):\n        pass\n    def _mine(self):\n"
        "        pass\n"
        "def f(t, ds, other):\n    s = t.untyped_storage()\n    a = s._cdata + t.grad._base\n"
        "    b = getattr(ds, '_fingerprint', None)\n    c = getattr(other, '_mine', None), other._mine\n"
        "    return a, b, c, getattr(ds, '__dict__', None)\n")
    try:
        found = library_private_uses(probe)
    finally:
        probe.unlink()
    kinds = sorted(f.split(": ", 1)[1] for f in found)
    assert kinds == sorted([
        "import torch._dynamo", "from ray.train.v2._internal import x", "deepspeed.comm._private_thing",
        "deepspeed.comm.cdb = ... (patches deepspeed)", "import_module('deepspeed.comm.comm')", "setattr(m, ...)",
        "P._partition_layers overrides a library class's own", "s._cdata", "t.grad._base",
        "getattr(ds, '_fingerprint')"]), kinds


def family_name_uses(path: Path, architectures: tuple[str, ...], model_types: tuple[str, ...]) -> list[str]:
    """Where code outside rayspeed/families/ names a model family itself. The rule: a string standing alone as a
    statement (a module, class, function or attribute docstring) may mention a name; every other string constant
    (f-string parts included) may neither contain an architecture name nor be exactly a family's model_type."""
    tree = ast.parse(path.read_text())
    docs = {id(n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docs:
            continue
        named = [a for a in architectures if a in node.value] + [t for t in model_types if node.value == t]
        found += [f"{path.name}:{node.lineno}: {name!r}" for name in named]
    return found


def family_names() -> tuple[tuple[str, ...], tuple[str, ...]]:
    from rayspeed import families

    return families.names(), tuple(f.model_type for f in families.FAMILIES)


def test_model_families_are_named_only_in_their_records():
    """Architecture names and model_types live in rayspeed/families/ (one record per family); code elsewhere
    asks the record (`families.by_architecture(...).qkv_bias`) instead of keeping a list or comparing names."""
    archs, types = family_names()
    found = [f"{p.relative_to(PACKAGE).parent}/{f}" for p in _modules()
             if "families" not in p.relative_to(PACKAGE).parts for f in family_name_uses(p, archs, types)]
    assert not found, "model families named outside rayspeed/families/ (read the family's record):\n" + "\n".join(found)


def test_the_family_name_check_finds_each_kind(tmp_path):
    probe = tmp_path / "probe_family_names.py"
    probe.write_text(
        '"""Runs LlamaForCausalLM and qwen2."""\n'
        'ARCHS = ("LlamaForCausalLM", "MistralForCausalLM")\n'
        'def f(arch, m):\n'
        '    """Qwen2ForCausalLM has biases."""\n'
        '    if arch == "Qwen2ForCausalLM":\n'
        '        return {"qwen2": 1}\n'
        '    return f"{arch} is not a LlamaForCausalLM"\n'
        'class C:\n'
        '    kind: str = "llama3"\n'
        '    """Not MistralForCausalLM: a note, not code."""\n'
        '    mt = "mistral"\n')
    found = family_name_uses(probe, *family_names())
    assert sorted(found) == sorted([
        "probe_family_names.py:2: 'LlamaForCausalLM'", "probe_family_names.py:2: 'MistralForCausalLM'",
        "probe_family_names.py:5: 'Qwen2ForCausalLM'", "probe_family_names.py:6: 'qwen2'",
        "probe_family_names.py:7: 'LlamaForCausalLM'", "probe_family_names.py:11: 'mistral'"]), found


def test_pinned_ray_and_deepspeed_still_have_the_internals_compat_patches():
    from rayspeed import compat

    problems = compat.check()
    assert not problems, "\n".join(problems)
