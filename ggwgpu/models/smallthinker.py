"""smallthinker (PowerInfer SmallThinker-4B-A0.6B, 21B-A3B; llama.cpp's
src/models/smallthinker.cpp): llama's pre-norm attention (neox rope) and a mixture of experts
for every feed-forward: the router reads the block's input (before attention, not normed),
the experts (expert_feed_forward_length wide) read ffn_norm of the attention's residual, each
relu(gate) * up (ReGLU), weights normalized, by the router's softmax or sigmoids
(expert_gating_func). With attention.sliding_window, llama.cpp windows the layers i % 4 != 0
at 4096 positions whatever the file says (and ropes them at rope.freq_base_swa where set),
the others global without rope; without it every layer is global and roped."""
from gguf import Keys

from .. import ops as O
from ..tensor import ShapeError
from . import blocks as B
from .family import EXPERT_FF, EXPERT_KEYS, Family, swa_base_rope

WINDOW = 4096       # llama.cpp's n_swa of the arch
PATTERN = 4         # its load_swa_pattern(ml, 4, dense_first): layer i % 4 == 0 global


def reglu(gate, up):
    """ReGLU: relu(gate) * up (llama.cpp's LLM_FFN_RELU of a gated feed-forward)."""
    return O.mul(O.relu(gate), up)


class SmallThinker(Family):
    arch = "smallthinker"
    rope_mode = "neox"
    experts = True
    keys = {**EXPERT_KEYS, **EXPERT_FF, "expert_gating": Keys.LLM.EXPERT_GATING_FUNC,
            "sliding_window": Keys.Attention.SLIDING_WINDOW,
            "rope_freq_base_swa": "{arch}.rope.freq_base_swa"}
    required = ("n_expert", "n_expert_used", "n_ff_exp")

    def check(self, cfg):
        if not (cfg.n_expert and cfg.n_ff_exp):
            raise ShapeError(f"llama.cpp's {self.arch} needs n_expert and n_ff_exp > 0 "
                             f"(expert_count, expert_feed_forward_length)")
        if cfg.sliding_window not in (0, WINDOW):
            raise ShapeError(f"llama.cpp windows a {self.arch}'s layers at {WINDOW} positions "
                             f"whatever the file says: sliding_window {cfg.sliding_window} "
                             f"must be 0 or {WINDOW}")

    def expert_ff(self, cfg):
        return cfg.n_ff_exp

    def read_more_keys(self, f, hp):
        return {"sliding_window": WINDOW if hp["sliding_window"] else 0}

    def local(self, cfg, i):
        return cfg.sliding_window > 0 and i % PATTERN != 0

    def ropes(self, cfg, i):
        return not cfg.sliding_window or self.local(cfg, i)

    def rope_params(self, cfg, i):
        return swa_base_rope(self, cfg, i)

    def block(self, cfg, p, i, x, seq):
        b = f"blk.{i}."
        y = self.mix(cfg, p, i, x, seq)
        h = B.rms_norm(cfg, y, p[b + "ffn_norm.weight"])
        return O.add(y, B.experts(cfg, p, b, h, True, router_input=x, act=reglu))


FAMILY = SmallThinker()
