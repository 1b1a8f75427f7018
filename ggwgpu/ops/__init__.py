"""All ops. Each module registers one family; `OPS` maps op names to their definitions."""
from .registry import OPS, Case, Dispatch, Input, OpDef, register  # noqa: F401
from .elementwise import *  # noqa: F401,F403
from .draws import *  # noqa: F401,F403
from .reduce import *  # noqa: F401,F403
from .layout import *  # noqa: F401,F403
from .matmul import *  # noqa: F401,F403
from .optim import *  # noqa: F401,F403
from .rows import *  # noqa: F401,F403
from .rope import *  # noqa: F401,F403
from .norm import *  # noqa: F401,F403
from .softmax import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
from .quant import *  # noqa: F401,F403
from .conv import *  # noqa: F401,F403
from .experts import *  # noqa: F401,F403

# `from ggwgpu.ops import *` (as ggwgpu itself does) gives the op constructors, one per
# registry entry, and the registry's names; not the family modules, whose names (quant, ...)
# would shadow ggwgpu's own modules.
__all__ = sorted(OPS) + ["OPS", "Case", "Dispatch", "Input", "OpDef", "register"]
