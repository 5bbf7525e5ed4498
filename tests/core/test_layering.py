"""xattn/core must not import torch or jax in its own code (front ends are thin adapters)."""

import ast
import pathlib

import pytest

CORE = pathlib.Path(__file__).resolve().parents[2] / "xattn" / "core"
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
