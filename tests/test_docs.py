"""The documentation that is generated: docs/ops.md is what the op registry gives."""
from pathlib import Path

from ggwgpu_cli.ops import ops_markdown

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_the_op_list_is_the_registry():
    assert (DOCS / "ops.md").read_text() == ops_markdown(), (
        "docs/ops.md differs from the op registry: regenerate it with "
        "`ggwgpu ops list --markdown > docs/ops.md`")
