"""olmo2 (OLMo 2 1B .. 32B, OLMo 3; llama.cpp's src/models/olmo2.cpp): no norm before either
branch, an RMS norm after each (post_attention_norm, post_ffw_norm) before its residual add;
Q and K RMS-normed over their whole width (attn_q_norm of q_dim, attn_k_norm of kv_dim), not
per head, before neox rope; SwiGLU. With attention.sliding_window (OLMo 3) three layers of
every four (i % 4 < 3) attend only to the last `sliding_window` positions, roped with
frequency scale 1 at the global base (llama.cpp's graph reads no rope.freq_base_swa)."""
from gguf import Keys

from ..tensor import ShapeError
from . import blocks as B
from .family import Family


class Olmo2(Family):
    arch = "olmo2"
    rope_mode = "neox"
    pre_norms = False
    post_norms = True
    swa_pattern = 4           # llama.cpp's for olmo2: every fourth layer is global
    keys = {"sliding_window": Keys.Attention.SLIDING_WINDOW}

    def check(self, cfg):
        if cfg.head_dim * cfg.n_head != cfg.n_embd or cfg.rot != cfg.head_dim:
            raise ShapeError(f"llama.cpp's olmo2 takes heads of n_embd / n_head, all rotated: "
                             f"got heads of {cfg.head_dim} ({cfg.rot} rotated) for n_embd "
                             f"{cfg.n_embd} over {cfg.n_head}")

    def block_shapes(self, cfg, i):
        shapes = super().block_shapes(cfg, i)
        c = self.layer(cfg, i)
        shapes.update({"attn_q_norm.weight": (c.q_dim,), "attn_k_norm.weight": (c.kv_dim,)})
        return shapes

    def project_qkv(self, cfg, p, b, h, lead):
        """q, k and v of h, q and k RMS-normed over their whole width before the heads."""
        q, k, v = (B.linear(p, b + f"attn_{n}.weight", h) for n in "qkv")
        q, k = (B.rms_norm(cfg, t, p[b + f"attn_{n}_norm.weight"]) for n, t in zip("qk", (q, k)))
        return tuple(B.split_heads(t, lead, heads, cfg.head_dim)
                     for t, heads in zip((q, k, v), (cfg.n_head, cfg.kv_heads, cfg.kv_heads)))

    def rope_params(self, cfg, i):
        # OLMo 3's windowed layers: plain rope, no YaRN (llama.cpp's olmo2.cpp)
        if self.local(cfg, i):
            return B.rope_params(cfg, cfg.rope_freq_base, 1.0, scaled=False)
        return super().rope_params(cfg, i)


FAMILY = Olmo2()
