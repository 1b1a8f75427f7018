"""qwen35 (Qwen3.5 0.8B .. 27B dense; llama.cpp's src/models/qwen35.cpp and
delta-net-base.cpp): blocks of two kinds, each x + mixer(attn_norm(x)), then
x + SwiGLU(post_attention_norm(x)) (the file's post_attention_norm is the feed-forward's
pre-norm; there is no ffn_norm).

- Gated delta-net blocks (the file's attention.recurrent_layers, else all but every
  full_attention_interval-th, 4 by default): attn_qkv of h gives q | k | v (ssm.group_count
  query/key heads, ssm.time_step_rank value heads, all of ssm.state_size), convolved by a
  causal depthwise convolution of ssm.conv_kernel taps (ssm_conv1d) and passed through
  silu; q and k are L2-normed, and when there are fewer of them than value heads, value head
  h reads query/key head h % group_count (ggml's repeat). The delta rule (models.delta_net)
  runs with decay g = softplus(ssm_alpha h + ssm_dt.bias) * ssm_a (ssm_a holds -exp(A_log))
  and strength sigmoid(ssm_beta h); its output is RMS-normed per head (ssm_norm) times
  silu(attn_gate h), then ssm_out.
- Gated attention blocks: attn_q gives, per head, the query and then an output gate of the
  same size; Q and K are RMS-normed per head, roped, attend, and the output times
  sigmoid(gate) goes through attn_output.
Rope is llama.cpp's IMROPE, which for text tokens (all three position components equal, the
fourth 0) is neox rope over rope.dimension_count dims: rope.dimension_sections must not give
any rotated pair to the fourth component (it would stay still), as no published file does.
Norm weights are stored as they multiply (the converter adds 1 to those Qwen3.5 keeps as
offsets from 1). The multi-token-prediction block that the converter appends by default
(nextn_predict_layers blocks past the model's, counted in block_count) is read past, as
llama.cpp's main graph does (it runs it only to draft tokens); files ggwgpu writes leave it
out."""

from gguf import GGUFValueType as _T

from .. import ops as O
from ..gguf_file import GGUFError
from ..tensor import ShapeError
from . import blocks as B
from .delta_net import l2_norm
from .family import Family, past_trunk, trunk_layers

# Qwen3.5's keys, as llama.cpp's converter writes them (strings: gguf-py names some of them
# only in releases newer than the oldest this package supports)
FULL_ATTENTION_INTERVAL = "{arch}.full_attention_interval"
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"
DIMENSION_SECTIONS = "{arch}.rope.dimension_sections"
INNER_SIZE = "{arch}.ssm.inner_size"
DEFAULT_INTERVAL = 4        # llama.cpp's full_attention_interval when the file has none


def interval_layers(n_layer: int, interval: int) -> tuple:
    """The recurrent layers of a full_attention_interval: all but every interval-th."""
    return tuple(i for i in range(n_layer) if (i + 1) % interval)


def still_pairs(n_rot: int, sections) -> list:
    """The rotated pairs that IMROPE turns by the fourth position component (0 for text, so
    they stay still), from llama.cpp's ggml_mrope_cache_init with interleaved sections."""
    total = sum(sections)
    still = []
    for pair in range(n_rot // 2):
        sector = pair % total if total else 0
        if not any(sector % 3 == r and sector < 3 * sections[s]
                   for r, s in ((0, 0), (1, 1), (2, 2))):
            still.append(pair)
    return still


class Qwen35(Family):
    arch = "qwen35"
    fusable_qkv = False     # attn_qkv is the delta-nets'; the attention's attn_q has the gate
    rope_mode = "neox"
    partial_rope = True
    qk_norm = True
    keys = {"conv_kernel": "{arch}.ssm.conv_kernel", "ssm_state": "{arch}.ssm.state_size",
            "ssm_heads": "{arch}.ssm.time_step_rank", "ssm_groups": "{arch}.ssm.group_count"}
    required = ("conv_kernel", "ssm_state", "ssm_heads", "ssm_groups")
    values_only = ("ssm_conv1d.weight",)

    # -- the model's sizes -----------------------------------------------------------------

    def key_dim(self, cfg) -> int:
        return cfg.ssm_groups * cfg.ssm_state

    def value_dim(self, cfg) -> int:
        return cfg.ssm_heads * cfg.ssm_state

    def conv_widths(self, cfg) -> dict:
        return {i: 2 * self.key_dim(cfg) + self.value_dim(cfg) for i in cfg.recurrent_layers}

    def check(self, cfg):
        if min(cfg.ssm_state, cfg.ssm_heads, cfg.ssm_groups) < 1 or cfg.conv_kernel < 2:
            raise ShapeError("a qwen35 needs ssm_state, ssm_heads, ssm_groups and a "
                             f"conv_kernel of at least 2, got {cfg.ssm_state}, "
                             f"{cfg.ssm_heads}, {cfg.ssm_groups}, {cfg.conv_kernel}")
        if cfg.ssm_heads % cfg.ssm_groups:
            raise ShapeError(f"ssm_heads {cfg.ssm_heads} is not a multiple of ssm_groups "
                             f"{cfg.ssm_groups}")
        if len(cfg.rope_sections) != 4 or sum(cfg.rope_sections) > cfg.head_dim:
            raise ShapeError(f"rope_sections {cfg.rope_sections} must be 4 sizes whose sum "
                             f"is at most the head size {cfg.head_dim}")
        still = still_pairs(cfg.rot, cfg.rope_sections)
        if still:
            raise ShapeError(f"rope_sections {cfg.rope_sections} leave rotated pairs "
                             f"{still[:4]} to the fourth position component: not supported")

    def attends(self, cfg, i: int) -> bool:
        return i not in cfg.recurrent_layers

    def layers_alike(self, cfg) -> bool:
        return False

    # -- files -----------------------------------------------------------------------------

    def more_keys(self, cfg) -> dict:
        keys = {INNER_SIZE.format(arch=self.arch): (self.value_dim(cfg), _T.UINT32),
                DIMENSION_SECTIONS.format(arch=self.arch): (list(cfg.rope_sections), _T.ARRAY)}
        for interval in range(2, cfg.n_layer + 2):
            if interval_layers(cfg.n_layer, interval) == cfg.recurrent_layers:
                keys[FULL_ATTENTION_INTERVAL.format(arch=self.arch)] = (interval, _T.UINT32)
                return keys
        keys[RECURRENT_LAYERS.format(arch=self.arch)] = (
            [i in cfg.recurrent_layers for i in range(cfg.n_layer)], _T.ARRAY)
        return keys

    def read_more_keys(self, f, hp: dict) -> dict:
        blocks, arch = hp["n_layer"], self.arch
        n_layer = trunk_layers(f, arch, blocks)
        sections = f.meta.get(DIMENSION_SECTIONS.format(arch=arch))
        if not isinstance(sections, list) or len(sections) < 4 or \
                not all(isinstance(s, int) and s >= 0 for s in sections[:4]):
            raise GGUFError(f"{f.path}: {DIMENSION_SECTIONS.format(arch=arch)} must be an "
                            f"array of 4 sizes, got {sections!r}")
        layers = f.meta.get(RECURRENT_LAYERS.format(arch=arch))
        if layers is not None:
            if not isinstance(layers, list) or len(layers) != blocks:
                raise GGUFError(f"{f.path}: {RECURRENT_LAYERS.format(arch=arch)} must hold one "
                                f"value per block ({blocks})")
            recurrent = tuple(i for i, v in enumerate(layers[:n_layer]) if v)
        else:
            interval = f.int_key(FULL_ATTENTION_INTERVAL.format(arch=arch),
                                 default=DEFAULT_INTERVAL, minimum=1)
            recurrent = interval_layers(n_layer, interval)
        inner = f.int_key(INNER_SIZE.format(arch=arch))
        if inner != hp["ssm_heads"] * hp["ssm_state"]:
            raise GGUFError(f"{f.path}: {INNER_SIZE.format(arch=arch)} = {inner} is not "
                            f"{arch}.ssm.time_step_rank * {arch}.ssm.state_size = "
                            f"{hp['ssm_heads'] * hp['ssm_state']}")
        return {"rope_sections": tuple(sections[:4]), "recurrent_layers": recurrent,
                "n_layer": n_layer}

    def ignored(self, cfg, name):
        """The multi-token-prediction blocks' tensors, past the model's blocks."""
        return past_trunk(cfg, name)

    # -- tensors ---------------------------------------------------------------------------

    def block_shapes(self, cfg, i):
        e = cfg.n_embd
        shapes = {"attn_norm.weight": (e,), "post_attention_norm.weight": (e,)}
        if i in cfg.recurrent_layers:
            heads, values = cfg.ssm_heads, self.value_dim(cfg)
            width = self.conv_widths(cfg)[i]
            shapes.update({"attn_qkv.weight": (width, e), "attn_gate.weight": (values, e),
                           "ssm_conv1d.weight": (width, cfg.conv_kernel),
                           "ssm_dt.bias": (heads,), "ssm_a": (heads,),
                           "ssm_beta.weight": (heads, e), "ssm_alpha.weight": (heads, e),
                           "ssm_norm.weight": (cfg.ssm_state,),
                           "ssm_out.weight": (e, values)})
        else:
            hd = cfg.head_dim
            shapes.update({"attn_q.weight": (2 * cfg.q_dim, e), "attn_k.weight": (cfg.kv_dim, e),
                           "attn_v.weight": (cfg.kv_dim, e), "attn_output.weight": (e, cfg.q_dim),
                           "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
        shapes.update(self.ffn_shapes(cfg))
        return shapes

    # -- the graph -------------------------------------------------------------------------

    def block(self, cfg, p, i, x, seq):
        b = f"blk.{i}."
        x = self.mix(cfg, p, i, x, seq)
        h = B.rms_norm(cfg, x, p[b + "post_attention_norm.weight"])
        if cfg.n_expert:
            return O.add(x, self.mixture(cfg, p, b, h))
        return B.linear(p, b + "ffn_down.weight", self.gate(p, b, h), residual=x)

    def mix(self, cfg, p, i, x, seq):
        b = f"blk.{i}."
        h = B.rms_norm(cfg, x, p[b + "attn_norm.weight"])
        if i in cfg.recurrent_layers:
            return self.delta_net(cfg, p, b, i, h, x, seq)
        full = B.split_heads(B.linear(p, b + "attn_q.weight", h), seq.lead, cfg.n_head,
                             2 * cfg.head_dim)
        q, gate = B.columns(O.cont(full), 2)             # per head: the query, then its gate
        k, v = (B.split_heads(B.linear(p, b + f"attn_{n}.weight", h), seq.lead, cfg.kv_heads,
                              cfg.head_dim) for n in "kv")
        q, k = (B.rms_norm(cfg, t, p[b + f"attn_{n}_norm.weight"]) for n, t in zip("qk", (q, k)))
        q, k = (self.rope(cfg, p, i, t, seq.positions) for t in (q, k))
        att = seq.attend(i, q, k, v, self.attention_scale(cfg), 0)
        gate = O.reshape(O.cont(gate), att.shape)
        return B.linear(p, b + "attn_output.weight", O.mul(att, O.sigmoid(gate)), residual=x)

    def delta_net(self, cfg, p, b, i, h, x, seq):
        """x + block i's gated delta-net of h (its attn_norm)."""
        rows, s = x.shape[:-1], cfg.ssm_state
        keys, values = self.key_dim(cfg), self.value_dim(cfg)
        mixed = B.linear(p, b + "attn_qkv.weight", h)
        z = B.linear(p, b + "attn_gate.weight", h)
        beta = O.sigmoid(B.linear(p, b + "ssm_beta.weight", h))
        alpha = O.add(B.linear(p, b + "ssm_alpha.weight", h), p[b + "ssm_dt.bias"])
        decay = O.mul(O.softplus(alpha), p[b + "ssm_a"])           # log of each step's decay
        conv = O.silu(seq.convolve(i, mixed, p[b + "ssm_conv1d.weight"]))
        q, k, v = B.columns(conv, (keys, keys, values), s)
        q, k = (l2_norm(O.cont(t), cfg.norm_eps) for t in (q, k))
        if cfg.ssm_groups != cfg.ssm_heads:     # value head h reads query/key head h % groups
            q, k = (O.repeat(t, rows + (cfg.ssm_heads, s)) for t in (q, k))
        o = seq.recur(i, q, k, O.cont(v), decay, beta)              # (*rows, heads, s)
        gated = O.mul(B.rms_norm(cfg, o, p[b + "ssm_norm.weight"]),
                      O.silu(B.split_heads(z, rows, cfg.ssm_heads, s)))
        return B.linear(p, b + "ssm_out.weight", O.reshape(gated, rows + (values,)), residual=x)


FAMILY = Qwen35()
