"""granitehybrid (IBM Granite 4.0 H: 350M, 1B, micro; llama.cpp's src/models/granite-hybrid.cpp
and mamba-base.cpp): granite's block and scales, with a Mamba2 mixer instead of attention on
the layers whose attention.head_count_kv is 0. The attention layers rope only when
rope.scaling.finetuned is true (the hybrids' files say false: no position encoding).

A Mamba2 layer of h (its attn_norm): ssm_in h = z | xBC | dt (d_inner = 2 n_embd,
xBC = x | B | C of d_inner, ssm.group_count x ssm.state_size each); xBC through the causal
depthwise convolution ssm_conv1d of ssm.conv_kernel taps, its bias, silu; per head (of
ssm.time_step_rank, each d_inner / heads wide, reading B and C of group head // (heads /
groups)) and token the scan

    S = exp(dt A) S + dt x B^T,   y = S C + D x,   dt = softplus(dt + ssm_dt.bias)

(A = ssm_a, stored as -exp(A_log); D = ssm_d): delta_rule without the delta correction.
Then y * silu(z), RMS-normed in groups of d_inner / groups by ssm_norm, and ssm_out; the
branch times residual_scale, as attention's. The decoder keeps each layer's state and its
convolution's inputs, as qwen35's. With expert_count (H-tiny, H-small) the feed-forwards are
granite's mixture of experts with its shared expert."""
import math

from gguf import GGUFValueType

from .. import ops as O
from ..gguf_file import GGUFError
from ..tensor import ShapeError
from . import blocks as B
from .granite import Granite

_T = GGUFValueType
INNER_SIZE = "{arch}.ssm.inner_size"
ROPE_FINETUNED = "{arch}.rope.scaling.finetuned"


def inner_size(cfg) -> int:
    """A Mamba2 layer's d_inner: ssm_inner, or granitehybrid's 2 n_embd."""
    return cfg.ssm_inner or 2 * cfg.n_embd


def mamba2_shapes(cfg, width: int) -> dict:
    """A Mamba2 mixer's tensors (block-relative name -> shape), its convolution `width`."""
    e, d, heads = cfg.n_embd, inner_size(cfg), cfg.ssm_heads
    shapes = {"ssm_in.weight": (d + width + heads, e),
              "ssm_conv1d.weight": (width, cfg.conv_kernel), "ssm_conv1d.bias": (width,),
              "ssm_dt.bias": (heads,), "ssm_a": (heads, 1), "ssm_d": (heads, 1),
              "ssm_norm.weight": (cfg.ssm_groups, d // cfg.ssm_groups), "ssm_out.weight": (e, d)}
    if not cfg.mamba_norm:
        del shapes["ssm_norm.weight"]
    return shapes


def mamba2(cfg, p, b, i, h, seq):
    """Block b's Mamba2 mixer of h (module docstring), before ssm_out: (*rows, d_inner)."""
    rows, d = h.shape[:-1], inner_size(cfg)
    heads, groups, n = cfg.ssm_heads, cfg.ssm_groups, cfg.ssm_state
    z, xbc, dt = B.columns(B.linear(p, b + "ssm_in.weight", h), (d, d + 2 * groups * n, heads))
    conv = seq.convolve(i, O.cont(xbc), p[b + "ssm_conv1d.weight"])
    conv = O.silu(O.add(conv, p[b + "ssm_conv1d.bias"]))
    x, bs, cs = B.columns(conv, (d, groups * n, groups * n))
    x = O.reshape(O.cont(x), rows + (heads, d // heads))
    bs, cs = (per_head(cfg, t, rows) for t in (bs, cs))
    dt = O.softplus(O.add(O.cont(dt), p[b + "ssm_dt.bias"]))                   # (*rows, heads)
    decay = O.mul(dt, O.reshape(p[b + "ssm_a"], (heads,)))
    y = seq.recur(i, cs, bs, x, decay, dt, delta=False, scale=1.0)           # (*rows, heads, p)
    y = O.add(y, O.mul(x, p[b + "ssm_d"]))
    y = O.mul(y, O.silu(O.reshape(O.cont(z), rows + (heads, d // heads))))
    if cfg.mamba_norm:
        y = B.rms_norm(cfg, O.reshape(y, rows + (groups, d // groups)), p[b + "ssm_norm.weight"])
    return O.reshape(y, rows + (d,))


def per_head(cfg, t, rows):
    """B or C (*rows, groups * state) as (*rows, heads, state): head h reads group
    h // (heads / groups) (ggml_ssm_scan's repeat_interleave)."""
    heads, groups, n = cfg.ssm_heads, cfg.ssm_groups, cfg.ssm_state
    t = O.cont(t)
    if heads == groups:
        return O.reshape(t, rows + (heads, n))
    r = math.prod(rows)
    t = O.repeat(O.reshape(t, (r, groups, 1, n)), (r, groups, heads // groups, n))
    return O.reshape(t, rows + (heads, n))


def check_mamba2(cfg):
    """A ShapeError where cfg's Mamba2 sizes do not fit together."""
    if min(cfg.ssm_state, cfg.ssm_heads, cfg.ssm_groups) < 1 or cfg.conv_kernel < 2:
        raise ShapeError(f"a {cfg.arch} needs ssm_state, ssm_heads, ssm_groups and a "
                         f"conv_kernel of at least 2, got {cfg.ssm_state}, {cfg.ssm_heads}, "
                         f"{cfg.ssm_groups}, {cfg.conv_kernel}")
    if cfg.ssm_heads % cfg.ssm_groups or inner_size(cfg) % cfg.ssm_heads:
        raise ShapeError(f"ssm_heads {cfg.ssm_heads} must be a multiple of ssm_groups "
                         f"{cfg.ssm_groups} and divide the inner size {inner_size(cfg)}")


MAMBA2_KEYS = {"conv_kernel": "{arch}.ssm.conv_kernel", "ssm_state": "{arch}.ssm.state_size",
               "ssm_heads": "{arch}.ssm.time_step_rank", "ssm_groups": "{arch}.ssm.group_count"}


class Mamba2Layers:
    """What the families with Mamba2 layers (cfg.recurrent_layers) share: the sizes' keys
    (llama.cpp requires them), the values stored 2-D, the convolutions' widths, the states'
    sizes. Listed before the family's base class."""
    required = tuple(MAMBA2_KEYS)
    values_only = ("ssm_conv1d.weight", "ssm_a", "ssm_d", "ssm_norm.weight")

    def conv_widths(self, cfg):
        width = inner_size(cfg) + 2 * cfg.ssm_groups * cfg.ssm_state
        return {i: width for i in cfg.recurrent_layers}

    def state_size(self, cfg):
        return inner_size(cfg) * cfg.ssm_state


class GraniteHybrid(Mamba2Layers, Granite):
    arch = "granitehybrid"
    keys = {**Granite.keys, **MAMBA2_KEYS}
    unsupported = {"attn_output.bias": "an attention output bias",
                   "ffn_up.bias": "feed-forward biases", "ffn_down.bias": "feed-forward biases",
                   "ffn_gate.bias": "feed-forward biases"}

    # -- the model's sizes -----------------------------------------------------------------

    def check(self, cfg):
        check_mamba2(cfg)
        if cfg.ssm_inner not in (0, 2 * cfg.n_embd):    # llama.cpp asserts it
            raise ShapeError(f"a granitehybrid's ssm_inner {cfg.ssm_inner} must be twice "
                             f"n_embd {cfg.n_embd}")
        if cfg.no_rope and not cfg.recurrent_layers:   # the converter makes those 'granite'
            raise ShapeError("a granitehybrid without rope needs Mamba2 layers (their "
                             "convolutions take the positions)")

    def attends(self, cfg, i):
        return i not in cfg.recurrent_layers

    def ropes(self, cfg, i):
        return not cfg.no_rope

    def layers_alike(self, cfg):
        return False

    def kv_free_layers(self, cfg):
        return cfg.recurrent_layers

    def kv_free_fields(self, layers, hp):
        return {"recurrent_layers": layers}

    # -- files -----------------------------------------------------------------------------

    def more_keys(self, cfg):
        return {INNER_SIZE.format(arch=self.arch): (inner_size(cfg), _T.UINT32),
                ROPE_FINETUNED.format(arch=self.arch): (not cfg.no_rope, _T.BOOL)}

    def read_more_keys(self, f, hp):
        key = INNER_SIZE.format(arch=self.arch)
        if f.int_key(key) != 2 * hp["n_embd"]:
            raise GGUFError(f"{f.path}: {key} = {f.meta[key]} is not twice the embedding "
                            f"length {hp['n_embd']}, the one Mamba2 expansion llama.cpp has")
        return {"no_rope": not f.meta.get(ROPE_FINETUNED.format(arch=self.arch), True)}

    # -- tensors ---------------------------------------------------------------------------

    def block_shapes(self, cfg, i):
        shapes = super().block_shapes(cfg, i)
        if i not in cfg.recurrent_layers:
            return shapes
        mamba = {"attn_norm.weight": (cfg.n_embd,),
                 **mamba2_shapes(cfg, self.conv_widths(cfg)[i])}
        return {**mamba, **{n: s for n, s in shapes.items() if n.startswith("ffn_")}}

    # -- the graph -------------------------------------------------------------------------

    def mix(self, cfg, p, i, x, seq):
        if i not in cfg.recurrent_layers:
            return super().mix(cfg, p, i, x, seq)
        b = f"blk.{i}."
        h = B.rms_norm(cfg, x, p[b + "attn_norm.weight"])
        return B.linear(p, b + "ssm_out.weight", mamba2(cfg, p, b, i, h, seq),
                        residual=x, alpha=cfg.residual_scale)



FAMILY = GraniteHybrid()
