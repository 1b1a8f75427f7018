"""The op registry: one entry per op pairs everything about it.

    shape rule  -> (srcs, params) -> (shape, dtype), checked when a node is built
    reference   -> NumPy function over the source arrays (float32 or float64)
    fast        -> optional: the NumPy backend's kernel, writing the reference's result (up
                   to float rounding) into a given array without its temporaries and copies
    split       -> optional: how that kernel may be cut along the result's first dim, so
                   the NumPy backend runs the pieces of a big node on several threads
                   (split_rows)
    shader      -> WGSL file + entry point k_<name>; `dispatches` derives uniforms and grid
    backward    -> builds the gradient of each source from other registered ops (None only
                   for optimizer updates, which run after the backward and are never
                   differentiated)
    cases       -> the op's rows in the test matrix (forward and gradient checks)
    frozen_variant -> the op that builds the node instead when source 0 is a frozen weight in
                   a block type (mul_mat -> mul_mat_q, get_rows -> get_rows_q; ops/quant.py)
    dtypes      -> float sources may be f32 or f16 (`f16=False`: the op has no f16 kernel and
                   refuses f16 sources by name); the result's dtype is decided here, in
                   result_dtype, for every op: f16 when all float sources are f16, else f32
                   (`result="f32"`: always f32, losses and optimizer ops; "own": the shape
                   rule's, for views and casts). Kernels compute in f32 whatever the storage.
                   `f16_nmse` bounds the op's f16 cases in the test matrix.

Adding an op is one `register(...)` call plus one WGSL entry point.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .. import wgsl
from ..kernels import ROW_VARIANTS, row_entry, row_kernel, row_module
from ..tensor import FLOAT_DTYPES, ShapeError, Tensor

WORKGROUP = 64  # invocations per workgroup of the elementwise kernels (matches shaders)


@dataclass(frozen=True)
class Dispatch:
    """One compute dispatch: entry point, the tensors bound, uniforms and grid size.

    `dst` and `srcs` may be layouts (views) of node storage; the backend binds their storage
    and passes shapes, strides and offsets through the uniform block.
    """
    entry: str
    dst: Tensor
    srcs: tuple[Tensor, ...] = ()
    n: int = 0                      # invocations that do work (bounds check in the shader)
    workgroups: int = 0             # 0: ceil(n / WORKGROUP)
    f: tuple[float, ...] = ()       # up to 4 float parameters
    u: tuple[int, ...] = ()         # up to 4 integer parameters
    shader: str | None = None       # the module: another family's file, to reuse its kernel,
                                    # or a row family's variant (else the op's file)

    def grid(self) -> int:
        return self.workgroups or max(1, math.ceil(self.n / WORKGROUP))


@dataclass(frozen=True)
class Input:
    """An input of a test case: values uniform in [lo, hi) (integers in [lo, hi) for i32).
    layout: 'contiguous', 'permuted' (a permuted view of a leaf), 'strided' (a view with
    padded rows and an offset into a bigger leaf) or 'padded_t' (the last two axes swapped
    of a view with rows padded to a multiple of 4, no offset: stored K-outermost)."""
    shape: tuple[int, ...]
    lo: float = -1.0
    hi: float = 1.0
    layout: str = "contiguous"
    dtype: str = "f32"
    dist: str = "uniform"   # or "probs": positive rows that sum to 1 (cross-entropy targets),
                            # "nonfinite": uniform with one NaN or infinity, or an
                            # attention mask of testing.MASKS (-inf where hidden);
                            # i32 "distinct": no value twice


@dataclass(frozen=True)
class Case:
    inputs: tuple[Input, ...]
    params: dict = field(default_factory=dict)
    grad: bool = True               # small enough for finite differences
    nmse: float | None = None       # None: the op's bound


@dataclass(frozen=True)
class OpDef:
    """One op's registry entry, built by keyword (register); every optional field's default
    is declared here, once."""
    name: str
    n_srcs: int
    shape: Callable            # (srcs, **params) -> (shape, dtype, extra node kwargs)
    reference: Callable        # (*arrays, **params) -> array
    backward: Callable | None  # (node, grad) -> tuple of grads (None: no gradient)
    cases: Callable            # () -> list[Case]
    param_names: tuple[str, ...] = ()
    shader: str | None = None  # WGSL file stem, None for pure views (no dispatch)
    entry: str | None = None   # the kernel's entry point; default the op's name (no shader: None)
    # node -> list[Dispatch]; default elementwise_dispatch (no shader: None)
    dispatches: Callable | None = None
    no_grad: tuple[int, ...] = ()   # sources that take no gradient (ids, positions, ...)
    updates: bool = False           # an optimizer step: writes its sources' state in place
    nmse: float = 1e-7
    fd: tuple = (1e-6, 1e-5, 1e-3)  # finite differences: eps, atol, rtol (float64)
    # gradient checks see grad_head(op output) when the output itself is no smooth loss
    # term (diag_mask_inf's -inf goes through soft_max, as ggml's test-grad0 does)
    grad_head: Callable | None = None
    uniforms: Callable = lambda node: {}   # node -> {"f": (...), "u": (...)} for the shader
    doc: str = ""
    frozen_variant: str | None = None   # the op that takes over when source 0 is a frozen
                                        # block-type weight (ggwgpu.quant.TYPES; ops/quant.py)
    # kernel variants of the op's shader family; `dispatches` then takes (node, variant) and
    # the backend picks one per adapter (dispatches_on)
    variants: tuple[str, ...] = ()
    defaults: dict = field(default_factory=dict)   # values of trailing params one may omit
    # (out, *arrays, **params) -> None: the reference's result written into `out` (the
    # node's own contiguous storage, or the parameter an update writes), for speed; the NumPy
    # backend runs it instead of the reference, and tests/test_backends.py holds it to the
    # reference on every case of the op, in float32 and float64
    fast: Callable | None = None
    f16: bool = True                # float sources may be f16 (the kernel reads halves)
    result: str = "float"           # "float": f16 iff all float sources are, "f32", "own"
    # bound of the op's f16 cases (inputs rounded to halves): the rounding of a stored half
    # is nmse <= 2^-22 / 3 ~ 8e-8 (measured up to 1.3e-7 on lavapipe, mul_mat's small sums)
    f16_nmse: float = 1e-6
    dtype_from: tuple[int, ...] = ()  # the sources the result dtype follows (default: all)
    # (result shape, *source shapes) -> per source the dim of it that lines up with the
    # result's first dim, cut with it, or None: passed whole to every piece; None for the
    # whole rule where this node may not be cut. The pieces of `fast` then give the uncut
    # result bit for bit (split_rows)
    split: Callable | None = None

    def __post_init__(self):
        """Checks the entry, fills the defaults that follow from the shader, and stores the
        sequences given as lists as tuples (and `defaults` as a dict of its own)."""
        if self.result not in ("float", "f32", "own"):
            raise ValueError(f"op {self.name}: result must be 'float', 'f32' or 'own', not "
                             f"{self.result!r}")
        if (self.backward is None) != self.updates:
            raise ValueError(f"op {self.name}: only optimizer updates (updates=True) have no "
                             f"backward")
        kernel = self.shader is not None
        derived = {"entry": (self.entry or self.name) if kernel else None,
                   "dispatches": (self.dispatches or elementwise_dispatch) if kernel else None,
                   "defaults": dict(self.defaults)}
        derived.update({k: tuple(getattr(self, k)) for k in (
            "param_names", "no_grad", "fd", "variants", "dtype_from")})
        for k, v in derived.items():
            object.__setattr__(self, k, v)

    @property
    def src_names(self) -> tuple[str, ...]:
        """The sources' names: the reference's first positional parameters (src<i> where it
        names fewer)."""
        try:
            named = [p.name for p in inspect.signature(self.reference).parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:self.n_srcs]
        except (TypeError, ValueError):  # a reference without an introspectable signature
            named = []
        if len(named) < self.n_srcs or set(named) & set(self.param_names):
            named = [f"src{i}" for i in range(self.n_srcs)]
        return tuple(named)

    def signature(self) -> inspect.Signature:
        """The graph constructor's signature: the sources (positional only), then the
        params (defaults where declared)."""
        P = inspect.Parameter
        return inspect.Signature(
            [P(n, P.POSITIONAL_ONLY, annotation=Tensor) for n in self.src_names]
            + [P(n, P.POSITIONAL_OR_KEYWORD, default=self.defaults.get(n, P.empty))
               for n in self.param_names],
            return_annotation=Tensor)

    @property
    def is_view(self) -> bool:
        return self.shader is None

    def dispatches_on(self, node: Tensor, variants: dict | None = None) -> list[Dispatch]:
        """The dispatches of `node`; an op with kernel variants gets the one `variants`
        ({shader family: variant}) names, else its first."""
        if not self.variants:
            return self.dispatches(node)
        return self.dispatches(node, (variants or {}).get(self.shader, self.variants[0]))


OPS: dict[str, OpDef] = {}


def elementwise_dispatch(node: Tensor) -> list[Dispatch]:
    """The default: one invocation per element of the result, entry named like the op."""
    opdef = OPS[node.op]
    return [Dispatch(opdef.entry, node, node.srcs, n=node.nelements, **opdef.uniforms(node))]


def row_dispatch(node: Tensor, variant: str, dst: Tensor | None = None, **uniforms) -> Dispatch:
    """The dispatch of a row op (kernels.py ROW_VARIANTS) over the rows of its first source:
    one workgroup per row, or one invocation per row ('rowwise', rows up to ROWWISE_MAX), in
    its family's module of that variant. dst: the node, or a scratch the kernel writes."""
    opdef, x = OPS[node.op], node.srcs[0]
    rows = x.nelements // x.shape[-1]
    kind = row_kernel(variant, x.shape[-1])
    return Dispatch(row_entry(opdef.entry, kind), node if dst is None else dst, node.srcs,
                    n=rows, workgroups=rows if kind == "workgroup" else 0,
                    shader=row_module(opdef.shader, kind), **uniforms)


def register_row_modules(family: str):
    """Generate the shader modules of a row family's variants, with an entry point for each
    of its ops (call once its ops are registered)."""
    entries = sorted({op.entry for op in OPS.values()
                      if op.shader == family and op.variants == ROW_VARIANTS})
    for variant in ROW_VARIANTS:
        wgsl.add_part(row_module(family, variant),
                      lambda v=variant: wgsl.row_module_source(family, v, entries))


def register(name: str, *, params=(), **fields) -> Callable[..., Tensor]:
    """Declare an op, OpDef(name=name, param_names=params, **fields) (the fields not given
    take OpDef's defaults), and return its graph constructor `fn(*srcs, *params) -> Tensor`.
    `defaults` gives values for trailing params the caller may leave out."""
    if name in OPS:
        raise ValueError(f"op {name} registered twice")
    try:
        opdef = OpDef(name=name, param_names=params, **fields)
    except TypeError as e:      # a field OpDef lacks, or a required one missing
        raise TypeError(f"op {name}: {e}") from None
    OPS[name] = opdef

    def build(*args, **kwargs) -> Tensor:
        given = set(opdef.param_names[:max(0, len(args) - opdef.n_srcs)]) | set(kwargs)
        kwargs.update({k: v for k, v in opdef.defaults.items() if k not in given})
        return make_node(opdef, args, kwargs)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = opdef.doc
    build.__signature__ = opdef.signature()   # what help() and editors show, not *args
    return build


def make_node(opdef: OpDef, args: Sequence, kwargs: dict) -> Tensor:
    srcs, rest = args[:opdef.n_srcs], args[opdef.n_srcs:]
    if len(srcs) != opdef.n_srcs or not all(isinstance(s, Tensor) for s in srcs):
        raise TypeError(f"{opdef.name}: expects {opdef.n_srcs} tensor argument(s), got "
                        f"{[type(a).__name__ for a in args[:opdef.n_srcs]]}")
    if opdef.frozen_variant and srcs[0].is_quantized:
        return make_frozen(opdef, OPS[opdef.frozen_variant], srcs, rest, kwargs)
    if len(rest) > len(opdef.param_names):
        raise TypeError(f"{opdef.name}: too many arguments")
    params = dict(zip(opdef.param_names, rest))
    for k, v in kwargs.items():
        if k not in opdef.param_names or k in params:
            raise TypeError(f"{opdef.name}: unexpected or repeated argument {k!r}")
        params[k] = v
    missing = [p for p in opdef.param_names if p not in params]
    if missing:
        raise TypeError(f"{opdef.name}: missing argument(s) {missing}")
    try:
        shape, dtype, extra = opdef.shape(srcs, **params)
        dtype = result_dtype(opdef, srcs, dtype, extra)
    except ShapeError as e:
        shapes = ", ".join(str(s.shape) for s in srcs)
        raise ShapeError(f"{opdef.name}({shapes}): {e}") from None
    return Tensor(shape, dtype, op=opdef.name, srcs=srcs, params=params, **extra)


def make_frozen(opdef: OpDef, variant: OpDef, srcs, rest, kwargs) -> Tensor:
    """The node of `variant` (opdef's frozen_variant) for a frozen source 0. Params the
    variant lacks (mul_mat's alpha) may only hold their defaults."""
    params = {**dict(zip(opdef.param_names, rest)), **kwargs}
    dropped = [k for k in params if k not in variant.param_names]
    changed = [k for k in dropped if params[k] != opdef.defaults.get(k, object())]
    if changed:
        raise ShapeError(f"{opdef.name}: a frozen {srcs[0].dtype} weight ({variant.name}) "
                         f"takes no {', '.join(changed)}")
    return make_node(variant, srcs, {k: v for k, v in params.items() if k not in dropped})


def split_rows(keep=0, whole=(), rows=()):
    """A `split` rule for a fast kernel whose result at index i of its first dim reads the
    sources at their index i only, or whole. `keep`: the innermost dims it needs whole (a
    softmax row, a masked matrix, rope's tokens, which its positions index), so the result
    must have more. Sources in `whole` are passed whole (hyper-parameters, positions, a
    scalar); those in `rows` are cut (per-row ids and weights, of the result's leading
    dims); any other is cut where it has the result's dims and first size, passed whole
    where ggml tiling broadcasts it along the first dim (fewer dims, or size 1 there), and
    the node is not cut otherwise (b of size 2 tiled over 8 would not line up).
    Reductions over the kept dims stay whole in every piece: same rounding as uncut."""
    def rule(out, *srcs):
        if len(out) <= keep:
            return None
        cut = []
        for i, s in enumerate(srcs):
            if i in whole or i in rows:
                cut.append(0 if i in rows else None)
            elif len(s) == len(out) and s[0] == out[0]:
                cut.append(0)
            elif len(s) < len(out) or s[0] == 1:
                cut.append(None)
            else:
                return None
        return tuple(cut)
    return rule


# -- shape rules shared by several ops ------------------------------------------------------

def pad4(shape) -> tuple[int, ...]:
    return (1,) * (4 - len(shape)) + tuple(shape)


def can_repeat(small, big) -> bool:
    """ggml_can_repeat: every dim of `big` is a multiple of that dim of `small`."""
    return all(b % s == 0 for s, b in zip(pad4(small), pad4(big)))


def same_shape(srcs, **_):
    return srcs[0].shape, srcs[0].dtype, {}


def need_float(*srcs):
    """Sources that must hold floats: f32 or f16 element tensors (result_dtype refuses f16
    for the ops without an f16 kernel)."""
    for s in srcs:
        if s.dtype not in FLOAT_DTYPES or s.is_quantized:
            raise ShapeError(f"needs f32 or f16 tensors, got {s.dtype}")


def result_dtype(opdef: OpDef, srcs, dtype: str, extra: dict) -> str:
    """The one dtype rule of float ops: the result is f16 when every float source is an f16
    element tensor, else f32 (mixed -> f32); integer sources (ids, positions) and frozen
    block-type weights do not count, nor the sources outside an op's `dtype_from` (rope_ff's
    frequency factors). Ops with result="f32" (losses, optimizer ops) always
    give f32; views (a result that shares a source's storage) and result="own" ops keep the
    shape rule's dtype."""
    floats = [s.dtype for s in srcs if s.dtype in FLOAT_DTYPES and not s.is_quantized]
    if "f16" in floats and not opdef.f16:
        raise ShapeError("has no f16 kernel: give it f32 tensors (cast them)")
    if dtype not in FLOAT_DTYPES or opdef.result == "own" or "view_src" in extra:
        return dtype
    if opdef.dtype_from:
        floats = [srcs[i].dtype for i in opdef.dtype_from]
    if opdef.result == "f32" or not floats:
        return "f32"
    return "f16" if all(d == "f16" for d in floats) else "f32"


def f32_only_ops() -> list[str]:
    """The ops without an f16 kernel (register(..., f16=False)), by name."""
    return sorted(name for name, op in OPS.items() if not op.f16)


def tile(a: np.ndarray, shape) -> np.ndarray:
    """ggml repeat: tile `a` to `shape` (index i reads a[i % a.shape])."""
    a = a.reshape(pad4(a.shape))
    reps = [b // s for s, b in zip(a.shape, pad4(shape))]
    return np.tile(a, reps).reshape(shape)


def untile(g: np.ndarray, shape) -> np.ndarray:
    """ggml repeat_back: sum the tiles of `g` into `shape`."""
    small, big = pad4(shape), pad4(g.shape)
    split = []
    for s, b in zip(small, big):
        split += [b // s, s]
    return g.reshape(split).sum(axis=(0, 2, 4, 6)).reshape(shape)
