"""The documentation that can go stale: docs/ops.md is what the op registry gives, and the
Python examples of docs/python-api.md run as they are, in order, in an empty folder (on the
NumPy backend), so a documented call that stopped working fails here."""
import re
from pathlib import Path

from ggwgpu_cli.ops import ops_markdown

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_the_op_list_is_the_registry():
    assert (DOCS / "ops.md").read_text() == ops_markdown(), (
        "docs/ops.md differs from the op registry: regenerate it with "
        "`ggwgpu ops list --markdown > docs/ops.md`")


def runnable_blocks(text: str) -> list[str]:
    """The ```python blocks, but those right after a <!-- not run ... --> comment."""
    blocks = re.findall(r"(<!-- not run[^>]*-->\n)?```python\n(.*?)```", text, re.S)
    return [code for skipped, code in blocks if not skipped]


def test_the_python_api_examples_run(tmp_path, monkeypatch, capsys):
    doc = DOCS / "python-api.md"
    blocks = runnable_blocks(doc.read_text())
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GGWGPU_BACKEND", "numpy")
    namespace = {}
    for code in blocks:
        exec(compile(code, str(doc), "exec"), namespace)
    out = capsys.readouterr().out
    assert "perplexity" in out and "30" in out.split()
    for name in ("tiny.gguf", "adapter.gguf", "chat-adapter.best.gguf", "merged.gguf"):
        assert (tmp_path / name).stat().st_size > 0, name
