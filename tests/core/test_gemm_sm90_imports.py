"""The sm90 GEMM launcher modules share xattn.core.gemm_sm90_common and form no import circle: the packed
route's module never imports the dense one (gemm_sm90.compile_gemm dispatching to it is the one way)."""

import ast
import pathlib

CORE = pathlib.Path(__file__).resolve().parents[2] / "xattn" / "core"


def _imported_modules(name: str) -> set[str]:
    """The xattn.core modules ``name`` imports (relative or absolute, at any depth of the file)."""
    found = set()
    for node in ast.walk(ast.parse((CORE / name).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            module = node.module.removeprefix("xattn.core.") if node.level == 0 else node.module
            found.add(module)
    return found


def test_segments_module_does_not_import_the_dense_launchers():
    assert "gemm_sm90" not in _imported_modules("gemm_segments_sm90.py")


def test_both_launcher_modules_import_the_shared_pieces():
    for name in ("gemm_sm90.py", "gemm_segments_sm90.py"):
        assert "gemm_sm90_common" in _imported_modules(name), name
    assert not {"gemm_sm90", "gemm_segments_sm90"} & _imported_modules("gemm_sm90_common.py")


def test_the_shared_module_keys_the_launchers_cache():
    """Its bytes shape the launchers, so they are in the GEMM launchers' source digest."""
    text = (CORE / "gemm_sm90.py").read_text()
    assert '"gemm_sm90_common.py"' in text.split("def source_digest", 1)[1].split("\ndef ", 1)[0]
