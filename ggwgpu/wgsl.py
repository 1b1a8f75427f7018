"""WGSL assembly, in one place: how the source of a shader module is put together, and the
layout of the Params uniform block its kernels read. Text only: nothing here needs wgpu.

    module_source(stem, dtypes)  what the backend compiles for module <stem> when its
                                 bindings (dst, src0 .. src3) hold `dtypes`:
                                 dtype_prelude(dtypes) + shader_source(stem)
    shader_source(stem)          shaders/<stem>.wgsl, or a generated part, with its
                                 `// #include NAME` lines resolved
    GENERATED, add_part          the parts made from Python tables (name -> function giving
                                 WGSL), included by name like files; the ops register theirs
    binding_dtypes(tensors)      the element type of each binding of a dispatch
    uniform_layout()             the Params block's layout, read from common.wgsl's struct
    kernel_name(entry)           the WGSL function of an entry point

The generated parts' templates are here too: the elementwise kernels (elementwise_kernels),
the row families' modules per variant (row_module_source), the tiled kernels' entry points
(tile_entries), the quantized kernels' type codes and subgroup entry points (type_codes,
subgroup_entries).
"""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Callable, Iterable

from .kernels import QUANT_TILED, TYPE_CODE, row_entry

MAX_SRCS = 4            # source bindings (src0 .. src3) common.wgsl declares after dst
# The override constant of a kernel that reads source 0 bound as several ranges
# (quant_blocks.wgsl's src0_word): the words of one range.
PART_WORDS = "SRC0_PART_WORDS"


def shader_dir() -> Path:
    """Where the WGSL files are: inside the installed package, or the source checkout's
    top-level shaders/ folder."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "shaders", here.parent / "shaders"):
        if (candidate / "common.wgsl").is_file():
            return candidate
    raise FileNotFoundError(f"WGSL shaders not found next to {here}")


class ShaderError(ValueError):
    """A shader that cannot be put together: a missing include or an include cycle."""


# Shader parts generated from Python tables (name -> function returning WGSL): a shader
# includes one by name (`// #include NAME`) as it includes a file.
GENERATED: dict[str, Callable[[], str]] = {}


def add_part(name: str, make: Callable[[], str]) -> None:
    """Register a generated part: `// #include name` then stands for make()'s WGSL."""
    if name in GENERATED:
        raise ValueError(f"WGSL part {name!r} generated twice")
    GENERATED[name] = make


INCLUDE = re.compile(r"//\s*#include\s+(\S+)\s*")


def shader_source(stem: str, folder: Path | None = None) -> str:
    """The WGSL of <stem>.wgsl (in `folder`, else shader_dir()) with its includes resolved:
    a line `// #include NAME` stands for NAME.wgsl, itself resolved the same way, or for
    the code GENERATED[NAME] makes from a Python table. Each part comes in once, where it
    is first included, so families share code without copies. A missing part or an include
    cycle raises ShaderError naming the file and line."""
    return _compose(stem, folder or shader_dir(), (), set())


def _compose(name: str, folder: Path, stack: tuple, done: set) -> str:
    stack = (*stack, name)
    done.add(name)
    text = GENERATED[name]() if name in GENERATED else (folder / f"{name}.wgsl").read_text()
    out = []
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        found = INCLUDE.fullmatch(line.rstrip("\n"))
        if not found:
            out.append(line)
            continue
        part, where = found[1], f"shader {name}.wgsl line {number}"
        if part in stack:
            raise ShaderError(f"{where}: include cycle {' -> '.join((*stack, part))}")
        if part in done:
            continue
        if part not in GENERATED and not (folder / f"{part}.wgsl").is_file():
            raise ShaderError(f"{where}: includes {part!r}, but there is no {part}.wgsl "
                              f"in {folder}")
        out.append(_compose(part, folder, stack, done))
    return "".join(out)


def reads_src0_in_parts(stem: str) -> bool:
    """Whether module <stem> reads source 0 through src0_word (quant_blocks.wgsl), and can
    therefore take it bound as several ranges (PART_WORDS words each)."""
    return f"override {PART_WORDS}" in shader_source(stem)


def kernel_name(entry: str) -> str:
    # The k_ prefix keeps kernels such as exp or abs from shadowing WGSL's builtins.
    return f"k_{entry}"


# -- element types -----------------------------------------------------------------------------

F32_BINDINGS = ("f32",) * (1 + MAX_SRCS)
BINDING_ALIASES = ("TD", "T0", "T1", "T2", "T3")   # common.wgsl's element types, by binding


def binding_dtypes(tensors) -> tuple[str, ...]:
    """The element type of each common binding (dst, src0 .. src3) of a dispatch: f16 for an
    f16 element tensor, else f32 (the bindings of i32 and block-type tensors are read through
    their own views: rows.wgsl's src1_i32, quant_blocks.wgsl's src0_u32)."""
    kinds = ["f16" if t.dtype == "f16" and not t.is_quantized else "f32" for t in tensors]
    return tuple(kinds + ["f32"] * (1 + MAX_SRCS - len(kinds)))


# f32 -> f16 as IEEE round-to-nearest-even overflows: WGSL leaves a value between the largest
# half (65504) and 2^16 to the implementation (the largest half or infinity), so those are
# placed explicitly; 2^16 and beyond must become infinity. The rounding of values in range
# is the implementation's: to nearest even on lavapipe (tests/test_ops.py checks it).
HALF_RANGE = """
fn half_range(v: f32) -> f32 {
    let a = abs(v);
    return select(select(v, sign(v) * 65504.0, a > 65504.0), sign(v) * 131072.0, a >= 65520.0);
}
"""


def dtype_prelude(dtypes=F32_BINDINGS) -> str:
    """The WGSL put before a family's source: `enable f16;` where a binding is f16, the
    aliases common.wgsl declares its bindings with, and the stores' conversions from f32
    (to_TD(v), to_TD4(v), to_T0(v) ..)."""
    out = ["enable f16;\n" if "f16" in dtypes else ""]
    for alias, dtype in zip(BINDING_ALIASES, dtypes):
        out.append(f"alias {alias} = {dtype};\n")
        if dtype == "f16":
            out.append(f"fn to_{alias}(v: f32) -> f16 {{ return f16(half_range(v)); }}\n"
                       f"fn to_{alias}4(v: vec4f) -> vec4<f16> {{ return vec4<f16>(vec4f("
                       f"half_range(v.x), half_range(v.y), half_range(v.z), half_range(v.w))); }}\n")
        else:
            out.append(f"fn to_{alias}(v: f32) -> f32 {{ return v; }}\n"
                       f"fn to_{alias}4(v: vec4f) -> vec4f {{ return v; }}\n")
    return "".join(out) + (HALF_RANGE if "f16" in dtypes else "")


def module_source(stem: str, dtypes=F32_BINDINGS) -> str:
    """The WGSL the backend compiles for module <stem> with bindings of `dtypes`
    (binding_dtypes): the prelude, then the resolved source."""
    return dtype_prelude(dtypes) + shader_source(stem)


# -- the Params uniform block ------------------------------------------------------------------

# Words of the WGSL types a Params field may have, and their alignment in words (WGSL's
# uniform layout rules).
PARAM_TYPES = {"u32": (1, 1), "i32": (1, 1), "f32": (1, 1),
               "vec4u": (4, 4), "vec4i": (4, 4), "vec4f": (4, 4)}
TENSOR_TAGS = ("d", "0", "1", "2", "3")   # dst, then the sources: ne_<tag>, nb_<tag>


def params_layout(source: str) -> tuple[dict[str, int], int]:
    """The uniform block's layout, read from the `struct Params` of `source` (common.wgsl):
    ({field: first 32-bit word}, size in bytes). The one description of the block is the
    WGSL struct; the backend writes each value at its field's word. Raises ValueError naming
    what does not fit what the backend writes."""
    found = re.search(r"struct\s+Params\s*\{(.*?)\}", source, re.S)
    if not found:
        raise ValueError("common.wgsl: no `struct Params { ... }`")
    body = re.sub(r"//[^\n]*", "", found[1])
    words, at, align_max = {}, 0, 1
    for name, kind in re.findall(r"(\w+)\s*:\s*([\w<>]+)", body):
        if kind not in PARAM_TYPES:
            raise ValueError(f"common.wgsl: Params.{name} has type {kind}, not one of "
                             f"{', '.join(PARAM_TYPES)}")
        size, align = PARAM_TYPES[kind]
        at = -(-at // align) * align
        words[name] = at
        at += size
        align_max = max(align_max, align)
    want = {"n": "u32", "off": "vec4u", "off3": "vec4u", "f": "vec4f", "u": "vec4u",
            **{f"{k}_{t}": "vec4u" for t in TENSOR_TAGS for k in ("ne", "nb")}}
    kinds = dict(re.findall(r"(\w+)\s*:\s*([\w<>]+)", body))
    for name, kind in want.items():
        if kinds.get(name) != kind:
            raise ValueError(f"common.wgsl: Params needs field {name}: {kind} "
                             f"(found {kinds.get(name)})")
    return words, -(-at // align_max) * align_max * 4


@functools.cache
def uniform_layout() -> tuple[dict[str, int], int]:
    """params_layout of the shipped common.wgsl, read once (when a device needs it: the
    NumPy backend runs without the shader files)."""
    return params_layout((shader_dir() / "common.wgsl").read_text())


# -- templates of the generated parts ------------------------------------------------------------

# An elementwise kernel: the bounds check, the element's 4-D index, one load per source,
# and the op's value of dst there (from a = src0, b = src1, c = src2, tiled to dst's shape).
ELEMENTWISE_KERNEL = """
@compute @workgroup_size(WG)
fn k_{name}(@builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {{
    let i = flat_id(gid, nwg); if (i >= p.n) {{ return; }}
    let idx = unravel(i, p.ne_d);
{loads}    dst[at_d(idx)] = to_TD({value});
}}
"""
ELEMENTWISE_LOADS = ("    let a = f32(src0[at_0(idx)]);\n",
                     "    let b = f32(src1[at_1(idx % p.ne_1)]);\n",
                     "    let c = f32(src2[at_2(idx % p.ne_2)]);\n")


def elementwise_kernels(kernels: Iterable[tuple[str, int, str]]) -> str:
    """The elementwise entry points: one per (entry, number of sources, WGSL value)."""
    return "".join(ELEMENTWISE_KERNEL.format(name=entry, value=value,
                                             loads="".join(ELEMENTWISE_LOADS[:n_srcs]))
                   for entry, n_srcs, value in kernels)


# A row op's entry point: its row (the bound check is uniform per workgroup in the
# 'workgroup' variant, so the reductions after it stay in uniform control flow), then the
# op's pass over it.
ROW_ENTRY = """
@compute @workgroup_size(WG)
fn k_{name}(@builtin(local_invocation_id) lid: vec3u, @builtin(workgroup_id) wid: vec3u,
        @builtin(global_invocation_id) gid: vec3u, @builtin(num_workgroups) nwg: vec3u) {{
    let row = row_index(wid, gid, nwg);
    if (row >= p.n) {{ return; }}
    {entry}_row(row_work(row, row_lane(lid)));
}}
"""


def row_module_source(family: str, variant: str, entries) -> str:
    """The WGSL of a row family's module of one variant (kernels.row_module): the variant's
    row split and reductions, the family's shader, and one entry point per entry (calling
    its <entry>_row)."""
    return (f"// #include row_{variant}\n// #include {family}\n"
            + "".join(ROW_ENTRY.format(name=row_entry(e, variant), entry=e) for e in entries))


def type_codes() -> str:
    """kernels.TYPE_CODE as WGSL constants (F16 = 0u, ...), which the quantized kernels
    branch on."""
    return "".join(f"const {name.upper()}: u32 = {code}u;\n" for name, code in TYPE_CODE.items())


# quant_subgroup.wgsl's entry points, one per kernel and type: the type a constant the
# compiler folds away.
SUBGROUP_ENTRY = """
@compute @workgroup_size(8)
fn k_{kernel}_{dtype}(@builtin(subgroup_invocation_id) lane: u32,
        @builtin(workgroup_id) wid: vec3u, @builtin(num_workgroups) nwg: vec3u) {{
    {kernel}({const}, lane, flat_group(wid, nwg));
}}
"""


# The tiled kernels' entry points (tiles.wgsl), one per kernel for each product that runs
# them (matmul.wgsl's mul_mat, quant_tiled.wgsl's mul_mat_q): k_<product>_<kernel>.
TILE_ENTRY = """
@compute @workgroup_size({threads}_THREADS)
fn k_{product}_{kernel}(@builtin(local_invocation_index) lid: u32,
        @builtin(workgroup_id) wid: vec3u, @builtin(num_workgroups) nwg: vec3u) {{
    mul_mat_{kernel}(lid, wid, nwg);
}}
"""


def tile_entries(product: str) -> str:
    """The entry points of `product` on each tiled kernel (kernels.QUANT_TILED)."""
    return "".join(TILE_ENTRY.format(product=product, kernel=kernel, threads=kernel.upper())
                   for kernel in QUANT_TILED)


def subgroup_entries(kernel: str) -> str:
    """An entry point k_<kernel>_<type> per block type, calling <kernel>(TYPE, ...)."""
    return "".join(SUBGROUP_ENTRY.format(kernel=kernel, dtype=name, const=name.upper())
                   for name in TYPE_CODE)
