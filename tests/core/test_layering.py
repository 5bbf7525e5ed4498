"""xattn/core must not import torch or jax in its own code (front ends are thin adapters); no module imports
another's private name (shared names are promoted or moved); the NeMo drop-in modules only re-export."""

import ast
import pathlib

import pytest

XATTN = pathlib.Path(__file__).resolve().parents[2] / "xattn"
CORE = XATTN / "core"
FORBIDDEN = {"torch", "jax", "jaxlib", "flax", "numpy"}


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_module_imports_no_framework(path):
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in FORBIDDEN]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in FORBIDDEN:
                found.append(node.module)
    assert not found, f"{path.name} imports {found}"


def test_core_dir_is_not_empty():
    assert len(list(CORE.glob("*.py"))) >= 5


def _source_of(path: pathlib.Path, node: ast.ImportFrom) -> pathlib.Path | None:
    """The xattn module or package an import reads from (as a path without suffix), None outside xattn."""
    if node.level == 0:
        return pathlib.Path(*node.module.split(".")) if node.module.split(".")[0] == "xattn" else None
    package = path.relative_to(XATTN.parent).parent.parts
    package = package[:len(package) - (node.level - 1)]
    return pathlib.Path(*package, *(node.module.split(".") if node.module else ()))


def test_no_private_name_is_imported_across_modules():
    found = []
    for path in sorted(XATTN.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            source = _source_of(path, node) if isinstance(node, ast.ImportFrom) else None
            for alias in node.names if source is not None else ():
                sub = XATTN.parent / source / alias.name
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and not (sub.with_suffix(".py").exists() or sub.is_dir()):  # a private submodule is fine
                    found.append(f"{path.relative_to(XATTN)}:{node.lineno} {alias.name} from {source}")
    assert not found, found


@pytest.mark.parametrize("name", ["torch/ffpa_attention.py", "torch/fa4.py"])
def test_nemo_facades_only_re_export(name):
    """NeMo's contract and nothing else: the docstring, imports, ``__all__`` and, for NeMo's module state read
    live from where it is kept, a module ``__getattr__``."""
    body = ast.parse((XATTN / name).read_text()).body
    assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), "no module docstring"
    for node in body[1:]:
        assert isinstance(node, (ast.Import, ast.ImportFrom)) \
            or isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"] \
            or isinstance(node, ast.FunctionDef) and node.name == "__getattr__", f"{name}:{node.lineno} is code"
