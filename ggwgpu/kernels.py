"""Kernel variants: which WGSL kernels each op family runs on which adapter, in one place.

Some families have two kernels for one op, one fast on GPUs and one fast on CPU devices
such as Mesa's lavapipe (WGPU_NOTES: workgroup barriers and shared memory cost more there
than the work they save). The backend picks one variant per family for its adapter
(`choose_variants`, WgpuBackend.kernel_variants, keyed by the family's shader file); the
ops' dispatch functions look the variant's kernels up here; lavapipe's tests force each
variant in turn, so every one stays tested.

    matmul        'tiled' (workgroup-memory tiles, GPUs) | 'subgroup' (subgroup broadcasts,
                  lavapipe) | 'wide' | 'small' (larger, smaller tiles), $GGWGPU_MATMUL
                  overriding; on a hardware adapter each product's kernel and split of K
                  are chosen by timing them on the device as plans meet it (TunedMatmul;
                  $GGWGPU_TUNE)
    quant         'portable' | 'subgroup': follows matmul (its subgroup kernels want the
                  same adapters) | 'tiled' | 'small' | 'wide' (mul_mat's tiled kernels
                  over a weight dequantized as it is staged), timed as matmul's are
    norm, softmax 'workgroup' (a workgroup and a tree of barriers per row, GPUs) |
                  'rowwise' (one invocation per row, no barriers, CPU adapters); each
                  row op's pass over a row is written once, and its family is compiled
                  once per variant (`row_module`, its WGSL wgsl.row_module_source)

Also here: the block types' codes the quantized kernels branch on (p.u.x).
"""
from __future__ import annotations

import os
from typing import NamedTuple

from .quant import TYPES

MATMUL_ENV = "GGWGPU_MATMUL"
TUNE_ENV = "GGWGPU_TUNE"

class MatmulKernels(NamedTuple):
    """mul_mat's kernels that read vec4s, of one variant: the entry, its shader file, the tile
    of the result one workgroup computes as (M, N); `entry_t`, where there is one, reads an
    `a` and a `b` both stored K-outermost; `either_layout`: the entry reads each operand in
    either layout, as a flag in p.u.y says (ops/matmul.py's tiled_layouts)."""
    entry: str
    shader: str
    tile: tuple[int, int]
    entry_t: str | None = None
    either_layout: bool = False


# 'subgroup' reads a K-outermost `a` and `b` (out_prod) as they lie; 'tiled' reads any
# mix of layouts (the backward products' transposed views) as it lies, and so do 'wide', its
# 128 x 128 tiles of 8 x 8 per invocation, and 'small', 32 x 32 tiles of 64 invocations
# (no adapter's default: a TunedMatmul times them beside 'tiled' for each product,
# docs/gpu-notes.md).
MATMUL_KERNELS = {"tiled": MatmulKernels("mul_mat_tiled", "matmul", (64, 64),
                                         either_layout=True),
                  "subgroup": MatmulKernels("mul_mat_subgroup", "matmul_subgroup", (32, 16),
                                            "mul_mat_subgroup_t"),
                  "wide": MatmulKernels("mul_mat_wide", "matmul", (128, 128),
                                        either_layout=True),
                  "small": MatmulKernels("mul_mat_small", "matmul", (32, 32),
                                         either_layout=True)}

# A product that the either_layout kernel would run in fewer than SPLIT_TARGET workgroups (a
# card has a hundred or more multiprocessors, each with room for several) is cut along K
# into up to SPLIT_TARGET / tiles chunks of at least SPLIT_MIN_K, computed side by side and
# summed by one more dispatch (ops/matmul.py's split_k): the output head's gradient d x
# (576 x 512 over a 49 152 vocabulary: 72 workgroups of 3 072 steps each) runs in 288.
SPLIT_TARGET = 512
SPLIT_MIN_K = 512
# The shallowest chunk of K a tuned product is timed with (ops/matmul.py product_choices):
# the 576-deep products of a 135M model over 512 tokens fill 72 tiles unsplit.
TUNE_MIN_K = 128

# mul_mat_q's and mul_mat_q_back's kernels by variant: (shader file, tile of the forward
# (M, N), tile of the backward (K, N)). 'portable' (quant.wgsl) runs anywhere. Products
# whose variant is a TunedMatmul also time QUANT_TILED.
# The quant variants that run mul_mat's tiled kernels (shaders/tiles.wgsl) on a weight whose
# quads are dequantized as a workgroup stages them (quant_tiled.wgsl): no default, chosen
# by timing a product on the device (TunedMatmul) or forced.
QUANT_TILED = ("tiled", "small", "wide")
QUANT_KERNELS = {"portable": ("quant", (4, 8), (4, 8)),
                 "subgroup": ("quant_subgroup", (32, 16), (32, 16)),
                 **{name: ("quant_tiled", MATMUL_KERNELS[name].tile, MATMUL_KERNELS[name].tile)
                    for name in QUANT_TILED}}

# The row ops' variants (ops/norm.py, ops/softmax.py): every row op has both; its
# 'rowwise' entry is k_<entry>_rowwise. Each family's shader (shaders/<family>.wgsl) writes an
# op's pass over a row once, as <entry>_row(w: Row); shaders/row_<variant>.wgsl defines how a
# row is split and reduced, and wgsl.row_module_source puts the two together with the entry
# points.
ROW_VARIANTS = ("workgroup", "rowwise")
ROW_FAMILIES = ("norm", "softmax")
# lavapipe stops an invocation's loops after about 65534 iterations in all (measured: a
# rowwise kernel with two passes over a row of 32768 leaves the last 3 elements unwritten,
# one over 28672 is right). Longer rows take the workgroup kernel: each of its invocations
# loops over a 64th of the row.
ROWWISE_MAX = 16384
# A product sums over its contraction (mul_mat's K, mul_mat_q_back's weight rows) in one
# loop per invocation: a dispatch takes at most this many (a multiple of 4), and the next
# ones add to its sums (Gemma 3's 262 144-token vocabulary gave wrong gradients in one).
SUM_ROWS_MAX = 32768

# p.u.x of the portable quantized kernels: the order of ggwgpu/quant.py's TYPES (as WGSL
# constants: wgsl.type_codes).
TYPE_CODE = {name: code for code, name in enumerate(TYPES)}


def row_kernel(variant: str, row_len: int) -> str:
    """The kernel variant a row of row_len elements runs: 'rowwise' only up to ROWWISE_MAX."""
    return "workgroup" if row_len > ROWWISE_MAX else variant


def row_module(family: str, variant: str) -> str:
    """The shader module of a row op family's kernels of one variant (e.g. softmax_rowwise)."""
    return f"{family}_{variant}"


def row_entry(entry: str, variant: str) -> str:
    return entry if variant == "workgroup" else f"{entry}_{variant}"


def matmul_variant(adapter, device) -> str:
    """The vec4 matmul kernel for this adapter, or the one $GGWGPU_MATMUL names. 'subgroup'
    where it was measured fastest: lavapipe, whose subgroups are its SIMD lanes (8 or 16, as
    the kernel needs); 'tiled' everywhere else."""
    forced = os.environ.get(MATMUL_ENV)
    if forced:
        if forced not in MATMUL_KERNELS:
            raise ValueError(f"${MATMUL_ENV}={forced!r}: choose one of "
                             f"{', '.join(MATMUL_KERNELS)}")
        return forced
    info = adapter.info
    lanes = (info.get("adapter_type") == "CPU" and info.get("vendor") == "llvmpipe"
             and "subgroup" in device.features)
    return "subgroup" if lanes else "tiled"


def row_variant(adapter) -> str:
    """The kernels of the row ops: 'rowwise' on CPU adapters, where workgroup barriers cost
    more than a row of work (lavapipe, `bench ops` tiny: soft_max 15x, rms_norm_mul 5x
    faster); 'workgroup' everywhere else."""
    return "rowwise" if adapter.info.get("adapter_type") == "CPU" else "workgroup"


class TunedMatmul(str):
    """The variant of a product family (matmul, quant) where products are timed on the
    device: the variant's name, which runs every product not timed, and `chosen` {product
    key: (variant, chunks of K)}, filled as plans meet products with more than one choice
    (ops/matmul.py product_choices; backends/tuning.py), with `seconds` {product key:
    {choice: device seconds}} beside it. A plain name (tests force one) times nothing."""
    def __new__(cls, name: str):
        tuned = super().__new__(cls, name)
        tuned.chosen, tuned.seconds = {}, {}
        return tuned


def tunes_products(adapter) -> bool:
    """Whether products are timed on this adapter: $GGWGPU_TUNE (1 or 0) if set, else on a
    hardware adapter unless $GGWGPU_MATMUL forces a kernel (lavapipe's choice was measured
    once, on its cores: kernels.py's 'subgroup')."""
    forced = os.environ.get(TUNE_ENV)
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(f"${TUNE_ENV}={forced!r}: choose 1 (time products) or 0")
        return forced == "1"
    return adapter.info.get("adapter_type") != "CPU" and not os.environ.get(MATMUL_ENV)


def choose_variants(adapter, device) -> dict[str, str]:
    """{shader family: variant} for this adapter and device."""
    matmul = matmul_variant(adapter, device)
    rows = row_variant(adapter)
    quant = "subgroup" if matmul == "subgroup" else "portable"
    tuned = tunes_products(adapter)
    return {"matmul": TunedMatmul(matmul) if tuned else matmul,
            "quant": TunedMatmul(quant) if tuned else quant,
            "norm": rows, "softmax": rows}
