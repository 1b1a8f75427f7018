"""hunyuan-dense (Tencent Hunyuan 0.5B .. 7B dense; llama.cpp's src/models/hunyuan-vl.cpp,
which its hunyuan-dense graph is): llama's block with neox rope and per-head RMS norms of Q
and K after rope (`attn_q_norm`, `attn_k_norm`); no rope frequency factors (llama.cpp
loads none for the arch). Hunyuan's NTK-aware alpha scaling is a larger rope base:
llama.cpp's converter stores the base already scaled; a file with rope.scaling.alpha has
base * alpha^(d / (d - 2)) (d the head size), as llama.cpp reads it, which reading folds
into the base."""
from ..gguf_file import GGUFError
from ..tensor import ShapeError
from .family import Family

ALPHA = "{arch}.rope.scaling.alpha"     # (gguf-py 0.17 lacks it)


class HunyuanDense(Family):
    arch = "hunyuan-dense"
    fusable_qkv = False     # llama.cpp's hunyuan-dense reads attn_q, attn_k, attn_v only
    rope_mode = "neox"
    qk_norm = True
    qk_norm_after_rope = True

    def check(self, cfg):
        if cfg.rot != cfg.head_dim:
            raise ShapeError(f"llama.cpp's hunyuan-dense ropes every dim of a head: n_rot "
                             f"{cfg.rot} differs from the head size {cfg.head_dim}")

    def read_more_keys(self, f, hp):
        alpha = f.float_key(ALPHA.format(arch=self.arch), default=0.0, allow_zero=True)
        if not alpha:
            return {}
        d = hp.get("n_embd_head") or hp["n_embd"] // hp["n_head"]
        if d <= 2:
            raise GGUFError(f"{f.path}: {ALPHA.format(arch=self.arch)} scales the rope base by "
                            f"alpha^(d / (d - 2)), which heads of {d} cannot have")
        return {"rope_freq_base": hp["rope_freq_base"] * alpha ** (d / (d - 2))}


FAMILY = HunyuanDense()
