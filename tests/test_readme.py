"""The README's examples run as written (sizes scaled down for the CPU; the JAX one on the reference
backend, the torch one on the GPU), and its links point at files that exist."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SMALL = {"8192": "256", "5192": "200", "3000": "56", "4096": "128"}


def _block(after: str) -> str:
    """The first ```python block after the heading ``after``."""
    text = README[README.index(after):]
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def _scaled(code: str) -> str:
    return re.sub(r"\b(8192|5192|3000|4096)\b", lambda m: SMALL[m.group(1)], code)


def test_front_page_is_short():
    assert len(README.splitlines()) <= 150


def test_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target
    for doc in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith("http"):
                assert (doc.parent / target).exists(), (doc.name, target)


def test_jax_example_runs():
    pytest.importorskip("flax")
    code = _scaled(_block("## JAX"))
    scope: dict = {}
    exec(compile(code, "README.md (JAX)", "exec"), scope)
    assert scope["out"].shape == (2, 256, 32, 512) and scope["dq"].shape == (2, 256, 32, 512)
    assert scope["y"].shape == (2, 128, 1024)


def test_torch_example_compiles():
    compile(_block("## PyTorch"), "README.md (torch)", "exec")


@pytest.mark.gpu
def test_torch_example_runs():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    code = _scaled(_block("## PyTorch")).split("model_id =")[0]  # no checkpoint download
    scope: dict = {}
    exec(compile(code, "README.md (torch)", "exec"), scope)
    assert scope["out"].shape == (2, 256, 32, 512) and scope["packed"].shape == (256, 32, 512)
    assert scope["q"].grad is not None


def test_design_doc_lists_every_module():
    design = (ROOT / "docs" / "design.md").read_text()
    for f in sorted([*(ROOT / "xattn").glob("*/*.py"), *(ROOT / "xattn").glob("*/*/*.py")]):  # packages too
        if f.name != "__init__.py":
            assert f"  {f.name} " in design, f"docs/design.md does not list {f.relative_to(ROOT)}"
