"""ggwgpu's preference losses (DPO with and without label smoothing, IPO, ORPO, CPO, SimPO
with and without the NLL term, KTO) against an
independent PyTorch computation (torch is never a dependency of ggwgpu): a tiny llama in
float64 written here from llama.cpp's definitions (RMSNorm, rope in ggml's normal mode,
grouped-query attention, SwiGLU), its weights read with the `gguf` package from the GGUF
files ggwgpu writes (a base, a perturbed copy of it, a LoRA adapter), and TRL's loss
formulas (DPOTrainer's sigmoid loss with label smoothing and its IPO loss on per-token
means, ORPOTrainer's odds-ratio loss plus the chosen answers' NLL, CPOTrainer's sigmoid
and SimPO losses plus cpo_alpha times that NLL, KTOTrainer's loss with its KL estimate
from the second sequence of each pair, taken as the mismatched one, under no_grad), each
sequence on its own.
ggwgpu runs the same pairs on its NumPy backend in float64, padded (one sequence a row) and
packed (several pairs to each two rows), its reference log-probabilities its own
(preference.sequence_logps). Prints, per objective x LoRA/full x padded/packed, the loss
difference and the largest relative gradient error over the trained tensors (each tensor's
max |ggwgpu - torch| / max |torch|).

The policy is not its reference: a LoRA finetune's adapter has random A and B (its
reference is the base), a full finetune's weights are the base plus noise (its reference is
the base). ggwgpu's graph takes its per-sequence constants (reference log-probabilities,
1 / answer length, weights) as f32 inputs: those roundings, not the float64 arithmetic,
bound the agreement (reference log-probabilities of tens of nats in f32: ~1e-6 nats).

Not a test (pytest does not collect it): it needs torch in a throwaway venv, e.g.

    python3 -m venv /tmp/torchref
    /tmp/torchref/bin/pip install torch numpy gguf 'wgpu>=0.32,<0.33' click regex jinja2
    PYTHONPATH=. /tmp/torchref/bin/python tests/referee_torch_preference.py

(a CPU build of torch is all it needs). It exits 1 when a gradient differs by more than
1e-5, or by more than 1e-8 once torch takes the same f32 inputs.
"""
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGUFReader

from ggwgpu import gguf_llama, lora, testing
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.graph import build_backward
from ggwgpu.models import ModelConfig, build_train_graph, init_parameters
from ggwgpu.pairs import PairBatches
from ggwgpu.tokenizer import ByteTokenizer
from ggwgpu.training.preference import PreferenceGraph, PreferenceLoss, sequence_logps

CFG = ModelConfig(n_vocab=ByteTokenizer.n_vocab, n_embd=32, n_head=4, n_head_kv=2, n_layer=2,
                  n_ff=48, n_ctx=40, norm_eps=1e-5, rope_freq_base=10000.0)
N_PAIRS = 8         # a power of two: the pair weights 1 / N_PAIRS are exact in f32
OBJECTIVES = {"dpo": PreferenceLoss("dpo", beta=0.1),
              "dpo ls=0.1": PreferenceLoss("dpo", beta=0.1, label_smoothing=0.1),
              "ipo": PreferenceLoss("ipo", beta=0.1),
              "orpo": PreferenceLoss("orpo", orpo_lambda=0.1),
              "cpo": PreferenceLoss("cpo", beta=0.1),
              "simpo": PreferenceLoss("simpo", beta=2.0, simpo_gamma=0.5),
              "simpo ls=0.1 alpha=0.5": PreferenceLoss("simpo", beta=2.0, simpo_gamma=0.5,
                                                      label_smoothing=0.1, cpo_alpha=0.5),
              "kto": PreferenceLoss("kto", beta=0.1, undesirable_weight=1.5)}
LABELS = np.arange(N_PAIRS) % 3 != 1        # KTO's: which examples are good
# KTO's reference log-probabilities, both sides' lowered by this many nats, so that the KL
# estimate (else about -0.25 here, clamped to 0) is above 0 and its detach matters
KTO_SHIFT = 1.0


# -- the files and the pairs -------------------------------------------------------------------

def write_files(d: Path) -> None:
    """base.gguf, policy.gguf (the base plus noise) and adapter.gguf (random A and B)."""
    rng = np.random.default_rng(7)
    base = init_parameters(CFG, seed=11)
    gguf_llama.save_model(d / "base.gguf", CFG, base, ByteTokenizer())
    policy = {k: v + np.float32(0.02) * rng.standard_normal(v.shape).astype(np.float32)
              for k, v in base.items()}
    gguf_llama.save_model(d / "policy.gguf", CFG, policy, ByteTokenizer())
    adapter = lora.init_adapter(CFG, lora.lora_ranks(CFG, 4), alpha=8.0, seed=3)
    adapter.tensors = {k: (v + 0.05 * rng.standard_normal(v.shape)).astype(np.float32)
                       for k, v in adapter.tensors.items()}
    lora.save_adapter(d / "adapter.gguf", adapter, CFG)


def make_pairs(seed: int = 5) -> list:
    """N_PAIRS pairs of chat.Example sharing a prompt (3-8 tokens), answers of 2-12."""
    return testing.example_pairs(N_PAIRS, CFG.n_vocab, (3, 9), (2, 13), seed)


# -- PyTorch: the model and TRL's losses -------------------------------------------------------

def read_tensors(path) -> tuple[dict, dict]:
    """The GGUF's metadata (key -> value) and tensors (name -> float64 torch tensor, NumPy
    order: GGUF's ne reversed)."""
    r = GGUFReader(str(path))
    meta = {name: field.contents() for name, field in r.fields.items()
            if not name.startswith("tokenizer.")}
    tensors = {t.name: torch.tensor(np.array(t.data, np.float64).reshape(
        tuple(int(n) for n in reversed(t.shape)))) for t in r.tensors}
    return meta, tensors


class TorchLlama:
    """llama.cpp's llama (build_llama in src/models/llama.cpp) for one sequence."""

    def __init__(self, meta: dict):
        self.n_layer = meta["llama.block_count"]
        self.n_head = meta["llama.attention.head_count"]
        self.n_head_kv = meta["llama.attention.head_count_kv"]
        self.eps = meta["llama.attention.layer_norm_rms_epsilon"]
        self.base = meta["llama.rope.freq_base"]

    def norm(self, x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.eps) * w

    def rope(self, x, n_rot):
        """ggml's normal mode: dims (2i, 2i + 1) turned by pos * base^(-2i / n_rot)."""
        pos = torch.arange(x.shape[0], dtype=torch.float64)
        theta = pos[:, None] * self.base ** (-2.0 * torch.arange(n_rot // 2) / n_rot)
        cos, sin = theta.cos()[:, None, :], theta.sin()[:, None, :]
        x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        turned = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2)
        return torch.cat([turned, x[..., n_rot:]], -1)

    def logits(self, w: dict, ids) -> torch.Tensor:
        n = len(ids)
        x = w["token_embd.weight"][torch.as_tensor(ids, dtype=torch.long)]
        causal = torch.full((n, n), -math.inf).triu(1)
        for i in range(self.n_layer):
            p = f"blk.{i}."
            h = self.norm(x, w[p + "attn_norm.weight"])
            q = (h @ w[p + "attn_q.weight"].T).view(n, self.n_head, -1)
            k = (h @ w[p + "attn_k.weight"].T).view(n, self.n_head_kv, -1)
            v = (h @ w[p + "attn_v.weight"].T).view(n, self.n_head_kv, -1)
            hd = q.shape[-1]
            q, k = self.rope(q, hd), self.rope(k, hd)
            group = self.n_head // self.n_head_kv        # query head j reads K/V head j // group
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + causal
            out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
            x = x + out @ w[p + "attn_output.weight"].T
            h = self.norm(x, w[p + "ffn_norm.weight"])
            x = x + (F.silu(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)) \
                @ w[p + "ffn_down.weight"].T
        x = self.norm(x, w["output_norm.weight"])
        return x @ w.get("output.weight", w["token_embd.weight"]).T


def merged(base: dict, pairs: dict, alpha: float) -> dict:
    """The base with each LoRA pair added as llama.cpp applies it: W + alpha / r * B A, the
    embedding E + alpha / r * A B^T (A (n_vocab, r) there)."""
    out = dict(base)
    for name in [n[:-len(".lora_a")] for n in pairs if n.endswith(".lora_a")]:
        a, b = pairs[name + ".lora_a"], pairs[name + ".lora_b"]
        scale = alpha / b.shape[1]
        out[name] = base[name] + scale * (a @ b.T if name == "token_embd.weight" else b @ a)
    return out


def torch_logps(model: TorchLlama, w: dict, pairs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed log-probability of its answer tokens (2 N_PAIRS,) and its
    answer tokens, chosen and rejected alternating; the token log-probabilities of the
    chosen answers too (for ORPO's NLL)."""
    logps, counts, chosen_tokens = [], [], []
    for pair in pairs:
        for side, e in enumerate(pair):
            ids, trained = e.ids[:CFG.n_ctx + 1], e.trained[:CFG.n_ctx + 1]
            logsm = model.logits(w, ids[:-1]).log_softmax(-1)
            at = torch.as_tensor(np.flatnonzero(trained[1:]))
            token = logsm[at, torch.as_tensor(ids[1:][trained[1:]], dtype=torch.long)]
            logps.append(token.sum())
            counts.append(len(at))
            if side == 0:
                chosen_tokens.append(token)
    return torch.stack(logps), torch.tensor(counts, dtype=torch.float64), \
        torch.cat(chosen_tokens)


def trl_loss(loss: PreferenceLoss, logps, counts, chosen_tokens, ref_logps,
             rounded: bool = False):
    """TRL's losses (trl/trainer/dpo_trainer.py dpo_loss, orpo_trainer.py odds_ratio_loss,
    cpo_trainer.py cpo_loss).
    `rounded`: with the per-sequence constants rounded to f32 where ggwgpu's graph takes
    them as f32 inputs (the reference log-probabilities, 1 / answer length, ORPO's 1 / the
    chosen answers' tokens), the rest float64."""
    def f32(t):
        return t.float().double() if rounded else t

    def per_token(x):
        return x * f32(1 / counts) if rounded else x / counts
    # CrossEntropyLoss's mean over the chosen answers' tokens
    nll = -chosen_tokens.sum() * f32(torch.tensor(1 / len(chosen_tokens)))
    if loss.kind == "kto":      # KTOTrainer.kto_loss: the KL of the mismatched answers
        ratios = logps - f32(ref_logps)
        kl = ratios[1::2].detach().mean().clamp(min=0)
        good = torch.as_tensor(LABELS)
        answers = ratios[0::2]
        chosen = 1 - F.sigmoid(loss.beta * (answers[good] - kl))
        rejected = 1 - F.sigmoid(loss.beta * (kl - answers[~good]))
        return torch.cat([loss.desirable_weight * chosen,
                          loss.undesirable_weight * rejected]).mean()
    if loss.kind == "orpo":     # average_log_prob=True; beta is ORPO's lambda
        avg = per_token(logps)
        c, r = avg[0::2], avg[1::2]
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        ratio = F.logsigmoid(log_odds)
        return nll - (loss.orpo_lambda * ratio).mean()
    if loss.kind in ("cpo", "simpo"):       # CPOTrainer: no reference model
        if loss.kind == "simpo":            # average_log_prob, the margin gamma / beta
            logps = per_token(logps)
        logits = logps[0::2] - logps[1::2]
        if loss.kind == "simpo":
            logits = logits - loss.simpo_gamma / loss.beta
        eps = loss.label_smoothing
        losses = (-F.logsigmoid(loss.beta * logits) * (1 - eps)
                  - F.logsigmoid(-loss.beta * logits) * eps)
        return losses.mean() + loss.nll_weight * nll
    if loss.kind == "ipo":      # DPOTrainer divides IPO's log-probabilities by the length
        logps, ref_logps = per_token(logps), ref_logps / counts
    ref_logps = f32(ref_logps)
    logits = (logps[0::2] - logps[1::2]) - (ref_logps[0::2] - ref_logps[1::2])
    if loss.kind == "ipo":
        return ((logits - 1 / (2 * loss.beta)) ** 2).mean()
    eps = loss.label_smoothing
    return (-F.logsigmoid(loss.beta * logits) * (1 - eps)
            - F.logsigmoid(-loss.beta * logits) * eps).mean()


def torch_run(d: Path, loss: PreferenceLoss, mode: str, pairs: list, rounded: bool = False
              ) -> tuple[float, dict]:
    """TRL's loss and its gradients (trained tensor name -> float64 array)."""
    meta, base = read_tensors(d / "base.gguf")
    model = TorchLlama(meta)
    if mode == "lora":
        adapter_meta, trained = read_tensors(d / "adapter.gguf")
        alpha = adapter_meta["adapter.lora.alpha"]

        def weights():
            return merged(base, trained, alpha)
    else:
        trained = read_tensors(d / "policy.gguf")[1]

        def weights():
            return trained
    with torch.no_grad():
        ref = torch_logps(model, base, pairs)[0] - (KTO_SHIFT if loss.kind == "kto" else 0)
    for t in trained.values():
        t.requires_grad_(True)
    logps, counts, chosen_tokens = torch_logps(model, weights(), pairs)
    value = trl_loss(loss, logps, counts, chosen_tokens, ref, rounded)
    value.backward()
    return value.item(), {name: t.grad.numpy() for name, t in trained.items()}


# -- ggwgpu ------------------------------------------------------------------------------------

def ggwgpu_run(d: Path, loss: PreferenceLoss, mode: str, pairs: list, pack: bool
               ) -> tuple[float, dict]:
    """The same with ggwgpu's preference graph on its NumPy backend in float64, all the
    pairs in one batch (padded: N_PAIRS units; packed: as many units as they take)."""
    backend = NumpyBackend(np.float64)
    cfg, base, _ = gguf_llama.load_model(d / "base.gguf")
    base = {k: np.asarray(v, np.float64) for k, v in base.items()}
    adapter = None
    if mode == "lora":
        adapter = lora.load_adapter(d / "adapter.gguf")
        adapter.tensors = {k: v.astype(np.float64) for k, v in adapter.tensors.items()}
        values = base
    else:
        values = {k: np.asarray(v, np.float64)
                  for k, v in gguf_llama.load_model(d / "policy.gguf")[1].items()}
    units = len(PairBatches(pairs, cfg.n_ctx, 1, 0, pack=pack).units)
    batches = PairBatches(pairs, cfg.n_ctx, units, 0, pack=pack,
                          labels=LABELS if loss.kind == "kto" else None)
    if loss.needs_reference:
        batches.reference = sequence_logps(cfg, base, batches, backend, "f32") - (
            KTO_SHIFT if loss.kind == "kto" else 0)
    g = build_train_graph(cfg, values, 2 * batches.batch, lora=adapter, packed=batches.packed,
                          sequences=2 * batches.pair_slots(batches.batch))
    pg = PreferenceGraph(g, loss)
    grads = build_backward(pg.loss, list(g.params.values()))
    plan = backend.plan([pg.loss, *grads.values()])
    if not g.packed:
        plan.write(g.positions, np.arange(cfg.n_ctx, dtype=np.int32))
    (batch,) = batches.in_order()
    plan.run(pg.feeds(*batch))
    return float(plan.read(pg.loss)[0]), {p.name: plan.read(grad) for p, grad in grads.items()}


def main() -> int:
    torch.set_default_dtype(torch.float64)
    pairs = make_pairs()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        write_files(d)
        units = len(PairBatches(pairs, CFG.n_ctx, 1, 0, pack=True).units)
        print(f"{N_PAIRS} pairs, n_ctx {CFG.n_ctx}: padded {N_PAIRS} units of two rows, "
              f"packed {units}; torch {torch.__version__}")
        print("| objective | trained | rows | loss (torch) | loss difference | max relative "
              "gradient error | the same, torch with ggwgpu's f32 inputs |")
        print("|---|---|---|---|---|---|---|")
        for name, loss in OBJECTIVES.items():
            for mode in ("lora", "full"):
                runs = [torch_run(d, loss, mode, pairs, rounded) for rounded in (False, True)]
                for pack in (False, True):
                    got, grads = ggwgpu_run(d, loss, mode, pairs, pack)
                    errors = []
                    for want, want_grads in runs:
                        assert set(grads) == set(want_grads), set(grads) ^ set(want_grads)
                        errors += [got - want, max(np.abs(grads[k] - g).max() / np.abs(g).max()
                                                   for k, g in want_grads.items())]
                    rows.append(errors)
                    print(f"| {name} | {'LoRA' if mode == 'lora' else 'full'} | "
                          f"{'packed' if pack else 'padded'} | {runs[0][0]:.6f} | "
                          f"{errors[0]:.1e} | {errors[1]:.1e} | loss {errors[2]:.1e}, "
                          f"gradients {errors[3]:.1e} |", flush=True)
    worst = np.abs(rows).max(axis=0)
    print(f"worst: loss difference {worst[0]:.1e}, relative gradient error {worst[1]:.1e}; "
          f"with the f32 inputs {worst[2]:.1e} and {worst[3]:.1e}")
    return 0 if worst[1] < 1e-5 and worst[3] < 1e-8 else 1


if __name__ == "__main__":
    sys.exit(main())
