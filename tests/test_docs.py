"""The Python examples of docs/python-api.md run as they are, in order, in an empty folder
(on the NumPy backend): a documented call that stopped working fails here."""
import re
from pathlib import Path

DOC = Path(__file__).parent.parent / "docs" / "python-api.md"


def runnable_blocks(text: str) -> list[str]:
    """The ```python blocks, but those right after a <!-- not run ... --> comment."""
    blocks = re.findall(r"(<!-- not run[^>]*-->\n)?```python\n(.*?)```", text, re.S)
    return [code for skipped, code in blocks if not skipped]


def test_the_python_api_examples_run(tmp_path, monkeypatch, capsys):
    blocks = runnable_blocks(DOC.read_text())
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GGWGPU_BACKEND", "numpy")
    namespace = {}
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), namespace)
    out = capsys.readouterr().out
    assert "perplexity" in out and "30" in out.split()
    for name in ("tiny.gguf", "adapter.gguf", "chat-adapter.best.gguf", "merged.gguf"):
        assert (tmp_path / name).stat().st_size > 0, name
