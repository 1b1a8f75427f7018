"""Benchmarks of the backends, the machinery of `ggwgpu bench`: its configs, the timing of a
planned step, the same llama trained on every backend and checked before any timing, the
dispatches a step records per layer, the planned memory against the least a step can hold,
and a PyTorch peer, run in a process of its own, for the configs it represents.

A bench whose results are wrong reports no number: it raises BenchError instead.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from .backends import Backend, NumpyBackend
from .backends.base import Plan
from .backends.tuning import timings
from .models import LORA_A, LORA_B, ModelConfig
from .ops import OPS
from .ops.matmul import product_key, product_of


class BenchError(RuntimeError):
    """A backend computed something else than NumPy: the bench reports no timing."""


# (M, N, K) for mul_mat(a [M, K], b [N, K]) -> [N, M]: the projections of a small llama
# layer (d_model 256, ffn 768, 512 tokens) and the classic cube.
BENCH_SIZES = ((256, 512, 256), (768, 512, 256), (256, 512, 768), (1024, 1024, 1024))
BENCH_MAX_REL_ERR = 1e-4


@dataclass(frozen=True)
class BenchConfig:
    """A `bench train` config: a llama's shape, the samples per step and how it trains."""
    model: dict                 # ModelConfig fields
    batch: int
    base: str | None = None     # LoRA on a frozen base stored in this type ("f32" or a block type)
    lora_rank: int = 4          # rank of every block matrix's pair (alpha = rank: scale 1)
    checkpointing: bool = False
    steps: int = 5              # timed steps unless --steps says otherwise
    shape_of: str = ""          # the published model it is shaped like

    @property
    def lora(self) -> bool:
        return self.base is not None

    @property
    def quantized_base(self) -> bool:
        return self.lora and self.base != "f32"


# SmolLM2's published shapes (head size 64, grouped-query attention, tied embeddings)
SMOLLM2_135M = dict(n_vocab=49152, n_embd=576, n_head=9, n_head_kv=3, n_layer=30, n_ff=1536,
                    rope_freq_base=100000.0, tied_embeddings=True, n_ctx=128)
SMOLLM2_360M = dict(n_vocab=49152, n_embd=960, n_head=15, n_head_kv=5, n_layer=32, n_ff=2560,
                    rope_freq_base=100000.0, tied_embeddings=True, n_ctx=128)
# a finetune as the README's chat demo runs one: 4 x 128 tokens, rank 4 on every block
# matrix; checkpointing as a memory-bound finetune would; one timed step (lavapipe: minutes)
PUBLISHED_FINETUNE = dict(batch=4, lora_rank=4, checkpointing=True, steps=1)
BENCH_TRAIN_CONFIGS = {
    "tiny": BenchConfig(dict(n_vocab=256, n_embd=128, n_head=4, n_layer=4, n_ff=352,
                             n_ctx=64), batch=8),
    "small": BenchConfig(dict(n_vocab=2048, n_embd=256, n_head=8, n_layer=8, n_ff=704,
                              n_ctx=128), batch=8),
    # tiny as a mixture of experts (Mixtral's llama): 8 experts of 176, 2 taken, so a token
    # goes through as wide a feed-forward as tiny's
    "tiny-moe": BenchConfig(dict(n_vocab=256, n_embd=128, n_head=4, n_layer=4, n_ff=176,
                                 n_ctx=64, n_expert=8, n_expert_used=2), batch=8),
    "smollm-135m": BenchConfig(SMOLLM2_135M, base="q4_0", shape_of="SmolLM2-135M",
                               **PUBLISHED_FINETUNE),
    "smollm-135m-q8": BenchConfig(SMOLLM2_135M, base="q8_0", shape_of="SmolLM2-135M",
                                  **PUBLISHED_FINETUNE),
    "smollm-360m": BenchConfig(SMOLLM2_360M, base="q4_0", shape_of="SmolLM2-360M",
                               **PUBLISHED_FINETUNE),
    "smollm-135m-full": BenchConfig(SMOLLM2_135M, shape_of="SmolLM2-135M",
                                    **{**PUBLISHED_FINETUNE, "lora_rank": 0}),
    # the same LoRA finetune on an f32 base, every activation kept: what the PyTorch peer
    # trains too (f32 against f32, on a GPU)
    "smollm-135m-lora-f32": BenchConfig(SMOLLM2_135M, base="f32", shape_of="SmolLM2-135M",
                                        **{**PUBLISHED_FINETUNE, "checkpointing": False}),
}
BENCH_TRAIN_MAX_REL_ERR = 1e-3
F16_MAX_REL_ERR = 1e-2      # the same for the f16 step (activations rounded to halves)
# planned device memory against the minimum (memory_against_minimum): the budgets
MEMORY_BUDGET = {"lora": 1.5, "full": 1.25}
HOST_SHARE_BUDGET = 0.05    # host work per step, as a share of the step, on lavapipe
F16_KEY = "wgpu f16"        # the f16 step's row, beside "wgpu", "numpy" and "torch"


# -- timing ---------------------------------------------------------------------------------

def median_seconds(fn, repeat: int) -> float:
    """Median time of `repeat` calls after a warm-up: robust to another process's (or
    lavapipe's) threads stealing the CPU for one call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def timed_steps(step, n: int) -> tuple[float, float]:
    """(the loss of one warm-up step, mean seconds of the next n steps)."""
    loss = step()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return loss, (time.perf_counter() - t0) / n


def step_stats(plan, repeat: int) -> dict:
    """What one planned wgpu step costs, inputs already written (medians of `repeat` runs):
    host µs per dispatch (recording, finishing and submitting the step in one submit while
    the device is idle, over its dispatches), device ms from timestamp queries (None without
    them), wall ms from submit to done, the whole step's ms (run to done) in one submit and
    submitted in parts (WgpuPlan.run), and the planned memory by role."""
    host, wall, whole, parts, device = [], [], [], [], []
    for _ in range(repeat):
        plan.sync()
        t0 = time.perf_counter()
        plan.run(parts=False)
        t1 = time.perf_counter()
        plan.sync()
        host.append(t1 - t0)
        wall.append(time.perf_counter() - t1)
        whole.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plan.run(parts=True)
        plan.sync()
        parts.append(time.perf_counter() - t0)
        device.append(plan.device_seconds())
    n = len(plan.recorded)
    ms = {key: 1e3 * float(np.median(v)) for key, v in
          (("host_ms", host), ("wall_ms", wall), ("step_ms", whole), ("in_parts_ms", parts))}
    return {"dispatches": n, "host_us_per_dispatch": 1e3 * ms["host_ms"] / max(n, 1), **ms,
            "device_ms": None if device[0] is None else 1e3 * float(np.median(device)),
            "memory": plan.memory()}


def matmul_row(backend: Backend, m: int, n: int, k: int, repeat: int,
               rng: np.random.Generator) -> dict:
    """GFLOP/s of mul_mat(a [M, K], b [N, K]) on `backend` (a wgpu one: the mean time of
    back-to-back runs of a planned graph up to the device finishing) and of NumPy's
    `b @ a.T` in float32 (median), after checking the result against float64 NumPy
    (BenchError beyond BENCH_MAX_REL_ERR); with step_stats of the plan."""
    from . import input_tensor, mul_mat
    a_val = rng.standard_normal((m, k), dtype=np.float32)
    b_val = rng.standard_normal((n, k), dtype=np.float32)
    a, b = input_tensor((m, k), name="a"), input_tensor((n, k), name="b")
    out = mul_mat(a, b)
    plan = backend.plan([out])
    plan.write(a, a_val)
    plan.write(b, b_val)

    # NumPy first: on a software adapter, lavapipe's threads are busy for a while after
    # the wgpu runs and would slow NumPy down.
    t_numpy = median_seconds(lambda: b_val @ a_val.T, repeat)

    # The warm-up run (pipelines compiled) is also the one checked before any timing.
    plan.run()
    ref = b_val.astype(np.float64) @ a_val.T.astype(np.float64)
    rel = float(np.max(np.abs(plan.read(out) - ref)) / max(np.max(np.abs(ref)), 1e-30))
    if not rel <= BENCH_MAX_REL_ERR:  # also catches NaN
        raise BenchError(f"wgpu mul_mat is wrong for M={m} N={n} K={k}: max relative error "
                         f"{rel:.2e} > {BENCH_MAX_REL_ERR:.0e}; no timing reported")

    # Runs queue up on the GPU in order: submit them back to back, wait once at the end.
    t0 = time.perf_counter()
    for _ in range(repeat):
        plan.run()
    plan.sync()
    t_wgpu = (time.perf_counter() - t0) / repeat
    stats = step_stats(plan, repeat)
    flop = 2.0 * m * n * k
    g_wgpu, g_numpy = flop / t_wgpu / 1e9, flop / t_numpy / 1e9
    return {"m": m, "n": n, "k": k, "gflops": {"wgpu": g_wgpu, "numpy": g_numpy},
            "ratio_wgpu_numpy": g_wgpu / g_numpy, "max_rel_err": rel, **stats,
            "tuned": timings(backend, product_key(product_of(out)))}


# -- training steps ---------------------------------------------------------------------------

class RandomBatches:
    """Uniformly random tokens, as a Trainer's batch source: the same batches for the same
    seed, so every backend trains on the same data."""

    def __init__(self, n_vocab: int, n_ctx: int, batch: int, seed: int = 0):
        self.shape, self.n_vocab = (batch, n_ctx + 1), n_vocab
        self.rng, self.taken = np.random.default_rng(seed), 0

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        tokens = self.rng.integers(0, self.n_vocab, self.shape, dtype=np.int32)
        self.taken += 1
        return np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(tokens[:, 1:])

    def state(self) -> dict:
        return {"batches": self.taken}


def bench_model(config_name: str, **changes):
    """(ModelConfig, TrainOptions) of a bench config; `changes` replace model fields
    (n_layer=2: the same shape, fewer layers)."""
    from .training import TrainOptions
    config = BENCH_TRAIN_CONFIGS[config_name]
    return (ModelConfig(**{**config.model, **changes}),
            TrainOptions(batch=config.batch, lr=1e-3, checkpointing=config.checkpointing))


def bench_weights(config_name: str, cfg: ModelConfig):
    """(values, adapter) of a bench config: train-text-from-scratch's random init (seed 0);
    for a LoRA config its 2-D weights in the base's type and a fresh adapter of lora_rank
    on every block matrix (what `ggwgpu finetune` trains), else adapter None."""
    from .models import init_parameters
    from .quant import quantize_model
    config = BENCH_TRAIN_CONFIGS[config_name]
    values = init_parameters(cfg, 0)
    if not config.lora:
        return values, None
    return (quantize_model(values, config.base) if config.quantized_base else values,
            bench_adapter(cfg, config.lora_rank))


def bench_adapter(cfg: ModelConfig, rank: int):
    """The fresh adapter a LoRA bench config trains: rank `rank` on every block matrix,
    alpha = rank (scale 1), seed 0."""
    from . import lora
    return lora.init_adapter(cfg, lora.lora_ranks(cfg, rank), alpha=rank, seed=0)


def bench_trainer(config_name: str, backend: Backend, cfg: ModelConfig, options, weights):
    """A Trainer of the config on `backend` over `weights` (bench_weights), on
    RandomBatches: the same batches on every backend."""
    from .training import Trainer
    values, adapter = weights
    return Trainer(cfg, values, backend, options,
                   RandomBatches(cfg.n_vocab, cfg.n_ctx, options.batch), lora=adapter)


def checked_trainers(config_name: str, wgpu_backend: Backend | None,
                     **changes) -> tuple[dict, dict, dict]:
    """A Trainer per backend (NumPy, and wgpu when there is one) on the same weights and
    batches, each after one warm-up step; BenchError unless their losses agree.
    Returns (trainers, warm-up losses, seconds each took to plan: graph, backward, storage
    plan and upload)."""
    cfg, options = bench_model(config_name, **changes)
    weights = bench_weights(config_name, cfg)
    backends = {"numpy": NumpyBackend()}
    if wgpu_backend is not None:
        backends["wgpu"] = wgpu_backend
    trainers, plan_seconds = {}, {}
    for key, b in backends.items():
        t0 = time.perf_counter()
        trainers[key] = bench_trainer(config_name, b, cfg, options, weights)
        plan_seconds[key] = time.perf_counter() - t0
    warm = {key: tr.train_step()["loss"] for key, tr in trainers.items()}
    if wgpu_backend is not None:
        rel = abs(warm["wgpu"] - warm["numpy"]) / max(abs(warm["numpy"]), 1e-30)
        if not rel <= BENCH_TRAIN_MAX_REL_ERR:  # also catches NaN
            raise BenchError(
                f"wgpu training is wrong: warm-up loss {warm['wgpu']:.6f}, NumPy's "
                f"{warm['numpy']:.6f} (relative difference {rel:.2e} > "
                f"{BENCH_TRAIN_MAX_REL_ERR:.0e}); no timing reported")
    return trainers, warm, plan_seconds


def f16_trainer(config_name: str, backend: Backend, numpy_loss: float, **changes):
    """The config's Trainer with --precision f16 on `backend`, after its warm-up step
    (`warm_loss`); BenchError unless that loss is within F16_MAX_REL_ERR of NumPy's f32."""
    cfg, options = bench_model(config_name, **changes)
    trainer = bench_trainer(config_name, backend, cfg,
                            dataclasses.replace(options, precision="f16"),
                            bench_weights(config_name, cfg))
    trainer.warm_loss = trainer.train_step()["loss"]
    rel = abs(trainer.warm_loss - numpy_loss) / max(abs(numpy_loss), 1e-30)
    if not rel <= F16_MAX_REL_ERR:
        raise BenchError(
            f"wgpu f16 training is wrong: warm-up loss {trainer.warm_loss:.6f}, NumPy's f32 "
            f"{numpy_loss:.6f} (relative difference {rel:.2e} > {F16_MAX_REL_ERR:.0e})")
    return trainer


def timed_wgpu_steps(trainer, steps: int) -> tuple[float, list]:
    """(mean seconds of `steps` steps of a wgpu Trainer after a warm-up one, the plan's
    host_seconds of each timed step)."""
    host = []

    def step():
        result = trainer.train_step()["loss"]
        host.append(trainer.plan.host_seconds)
        return result
    _, seconds = timed_steps(step, steps)
    return seconds, host[1:]        # the timed steps'


def train_step_stats(plan, host: list, step_seconds: float) -> dict:
    """What the host spent on the timed wgpu steps (WgpuPlan.host_seconds of each run:
    inputs written, dispatches recorded and submitted; medians) against the step's
    seconds, and the planned memory."""
    n = len(plan.recorded)
    host_s = float(np.median([h[0] for h in host]))
    record_s = float(np.median([h[1] for h in host]))
    return {"dispatches": n, "host_us_per_dispatch": 1e6 * record_s / max(n, 1),
            "host_ms": 1e3 * host_s, "step_ms": 1e3 * step_seconds,
            "host_share": host_s / step_seconds, "memory": plan.memory()}


def rate_ratios(rate: dict) -> dict:
    """The ratios of bench train's tokens/s ({row: tokens/s}): each against torch, wgpu
    against NumPy, f16 against f32, where both rows are there."""
    ratios = {}
    if "torch" in rate:
        ratios.update({f"{key}/torch": rate[key] / rate["torch"]
                       for key in ("wgpu", F16_KEY, "numpy") if key in rate})
    if "wgpu" in rate:
        ratios["wgpu/numpy"] = rate["wgpu"] / rate["numpy"]
    if F16_KEY in rate:
        ratios[f"{F16_KEY}/wgpu"] = rate[F16_KEY] / rate["wgpu"]
    return ratios


def describe_config(config_name: str, **changes) -> str:
    """A bench config in words: parameters, shape, tokens per step, how it trains."""
    from . import lora
    from .models import parameter_shapes
    config = BENCH_TRAIN_CONFIGS[config_name]
    cfg, options = bench_model(config_name, **changes)
    n_params = sum(math.prod(s) for s in parameter_shapes(cfg).values())
    heads = f"{cfg.n_head}/{cfg.kv_heads}" if cfg.kv_heads != cfg.n_head else f"{cfg.n_head}"
    text = (f"{config_name}: {n_params / 1e6:.2f} M parameters (vocab {cfg.n_vocab}, embd "
            f"{cfg.n_embd}, {heads} heads, {cfg.n_layer} layers, ff {cfg.n_ff}"
            f"{', tied' if cfg.tied_embeddings else ''}"
            f"{f'; shaped like {config.shape_of}' if config.shape_of else ''}), "
            f"{options.batch} x {cfg.n_ctx} tokens per step, AdamW")
    if config.lora:
        ranks = lora.lora_ranks(cfg, config.lora_rank)
        n_trained = sum(sum(math.prod(s) for s in lora.pair_shapes(cfg, w, r))
                        for w, r in ranks.items())
        text += (f", LoRA rank {config.lora_rank} on {len(ranks)} matrices ({n_trained / 1e6:.2f}"
                 f" M trained) of a frozen {config.base} base")
    return text + (", checkpointing" if options.checkpointing else "")


def op_times(trainers: dict) -> dict:
    """One training step run op by op on both backends of checked_trainers: on wgpu each
    dispatch timed alone (WgpuPlan.profile: on the device by timestamp queries where the
    adapter has them, else a submit and a wait each), on NumPy each node timed.
    {"ops": {op: nodes, dispatches, wgpu_ms, numpy_ms}, "kernels": {shader:entry point:
    dispatches, wgpu_ms}, "total_ms": {backend: ms}, "nodes": NumPy's nodes, "dispatches":
    wgpu's, "wgpu_clock": "device" or "host"}."""
    numpy_times = trainers["numpy"].plan.profile()
    plan = trainers["wgpu"].plan
    profiled = plan.profile()
    wgpu_times = [(op, s) for op, (_, s) in zip(plan.dispatch_ops, profiled)]
    ops, kernels = {}, {}
    for backend, times in (("numpy", numpy_times), ("wgpu", wgpu_times)):
        for op, s in times:
            row = ops.setdefault(op, {"nodes": 0, "dispatches": 0, "wgpu_ms": 0.0,
                                      "numpy_ms": 0.0})
            row["nodes" if backend == "numpy" else "dispatches"] += 1
            row[f"{backend}_ms"] += 1e3 * s
    for kernel, s in profiled:
        row = kernels.setdefault(kernel, {"dispatches": 0, "wgpu_ms": 0.0})
        row["dispatches"] += 1
        row["wgpu_ms"] += 1e3 * s
    total = {key: sum(r[f"{key}_ms"] for r in ops.values()) for key in ("wgpu", "numpy")}
    return {"ops": ops, "kernels": kernels, "total_ms": total, "nodes": len(numpy_times),
            "dispatches": len(wgpu_times), "wgpu_clock": plan.profile_clock}


# -- the PyTorch peer -------------------------------------------------------------------------

# The ModelConfig fields the peer's llama follows; any other must keep its default (its
# neutral value: no window, no softcap, scales of 1, no rope factors, no convolutions).
PEER_FIELDS = ("n_vocab", "n_embd", "n_head", "n_layer", "n_ff", "n_ctx", "n_rot", "norm_eps",
               "rope_freq_base", "rope_freq_scale", "n_head_kv", "n_embd_head",
               "tied_embeddings", "arch")


def torch_peer_refusal(cfg: ModelConfig, base: str | None = None) -> str | None:
    """Why the PyTorch peer (torch_llama_step) does not train what ggwgpu trains for `cfg`
    (with LoRA on a frozen `base` of that block type, if given), in words; None where it
    does. The peer is llama's block (RMS norms, rope in normal mode, SwiGLU) with
    grouped-query attention, tied embeddings, trained whole or by LoRA pairs on an f32 base,
    with AdamW: no other family, no rope frequency factors or other family hyper-parameter,
    no block-type base. It keeps every activation: a checkpointing config's model and
    results, without its recomputation."""
    if base not in (None, "f32"):
        return f"PyTorch has no {base} matmul, and an f32 base would time other work"
    if cfg.arch != "llama":
        return (f"the PyTorch peer is a llama (GQA, tied embeddings), not {cfg.arch}: it "
                f"would time another model")
    defaults = ModelConfig()
    other = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in PEER_FIELDS
             and getattr(cfg, f.name) != getattr(defaults, f.name)]
    if other:
        return (f"the PyTorch peer is a llama (GQA, tied embeddings) without "
                f"{', '.join(other)}: it would time another model")
    return None


def f32_products(torch):
    """f32 against f32: no TF32 in PyTorch's products on a CUDA card (its default for
    matmul, made sure of)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def torch_llama_step(cfg: ModelConfig, options, values: dict, batches, device: str = "cpu",
                     adapter=None):
    """One AdamW training step of the same llama in PyTorch on `device` ("cpu", "cuda"), as a
    function that returns the loss (read back: each step waits for its kernels); None when
    torch is not importable (it is no dependency of ggwgpu). With `adapter` (a lora.Adapter
    on block matrices) the base is frozen and the pairs train: W x + scale B (A x), as
    ggwgpu computes it. Only for the configs it represents (torch_peer_refusal). Call it
    only where no lavapipe device exists (torch_peer in its own process)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    f32_products(torch)
    params = {name: torch.tensor(v, device=device, requires_grad=adapter is None)
              for name, v in values.items()}
    pairs = {} if adapter is None else {
        name: torch.tensor(v, device=device, requires_grad=True)
        for name, v in adapter.tensors.items()}
    trained = pairs or params
    groups = [{"params": [p for p in trained.values() if p.ndim >= 2],
               "weight_decay": options.weight_decay},
              {"params": [p for p in trained.values() if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=options.lr, betas=(options.beta1, options.beta2),
                            eps=options.eps)
    t, rot = cfg.n_ctx, cfg.rot
    inv_freq = cfg.rope_freq_scale * cfg.rope_freq_base ** (-2.0 * np.arange(rot // 2) / rot)
    theta = np.arange(t)[:, None] * inv_freq                       # (ctx, rot / 2)
    cos = torch.tensor(np.cos(theta), dtype=torch.float32, device=device)[:, None, :]
    sin = torch.tensor(np.sin(theta), dtype=torch.float32, device=device)[:, None, :]
    mask = torch.full((t, t), float("-inf"), device=device).triu(1)
    scale = 1.0 / float(np.sqrt(cfg.head_dim))

    def rms_norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    def linear(x, i, name):
        """Block i's matrix `name` applied to x, with its LoRA pair where it has one."""
        weight = f"blk.{i}.{name}.weight"
        y = F.linear(x, params[weight])
        if weight + LORA_A in pairs:
            y = y + adapter.scale(weight) * F.linear(F.linear(x, pairs[weight + LORA_A]),
                                                     pairs[weight + LORA_B])
        return y

    def rope(x):  # (batch, ctx, head, dim), ggml's "normal" mode: pairs (2k, 2k + 1)
        x0, x1 = x[..., 0:rot:2], x[..., 1:rot:2]
        rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)
        return torch.cat((rotated, x[..., rot:]), -1)

    def step() -> float:
        inputs, targets = batches.next_batch()
        b = inputs.shape[0]
        x = params["token_embd.weight"][torch.from_numpy(inputs).long().to(device)]
        for i in range(cfg.n_layer):
            h = rms_norm(x, params[f"blk.{i}.attn_norm.weight"])
            q, k, v = (linear(h, i, f"attn_{n}").view(b, t, heads, cfg.head_dim)
                       for n, heads in zip("qkv", (cfg.n_head, cfg.kv_heads, cfg.kv_heads)))
            q, k, v = (y.transpose(1, 2) for y in (rope(q), rope(k), v))
            # grouped-query attention: each K/V head serves n_head / n_head_kv query heads
            k, v = (y.repeat_interleave(cfg.n_head // cfg.kv_heads, dim=1) for y in (k, v))
            att = torch.softmax(q @ k.transpose(-1, -2) * scale + mask, -1) @ v
            x = x + linear(att.transpose(1, 2).reshape(b, t, cfg.q_dim), i, "attn_output")
            h = rms_norm(x, params[f"blk.{i}.ffn_norm.weight"])
            x = x + linear(F.silu(linear(h, i, "ffn_gate")) * linear(h, i, "ffn_up"), i,
                           "ffn_down")
        out = params.get("output.weight", params["token_embd.weight"])    # tied embeddings
        logits = F.linear(rms_norm(x, params["output_norm.weight"]), out)
        loss = F.cross_entropy(logits.reshape(-1, cfg.n_vocab),
                               torch.from_numpy(targets).long().reshape(-1).to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if options.grad_clip:
            torch.nn.utils.clip_grad_norm_(list(trained.values()), options.grad_clip)
        opt.step()
        return loss.item()

    return step


def torch_peer(cfg: ModelConfig, options, steps: int, device: str = "cpu",
               lora_rank: int = 0) -> dict | None:
    """PyTorch training of a bench llama on `device` (same weights and batches as the other
    backends; with `lora_rank`, bench_adapter's pairs on its f32 base), meant for
    in_own_process(): {'loss': of the warm-up step, 'seconds': mean of `steps` timed
    steps}, or None when torch is not importable. A config the peer does not represent
    raises ValueError saying why (torch_peer_refusal)."""
    from .models import init_parameters
    refusal = torch_peer_refusal(cfg)
    if refusal:
        raise ValueError(refusal)
    step = torch_llama_step(cfg, options, init_parameters(cfg, 0),
                            RandomBatches(cfg.n_vocab, cfg.n_ctx, options.batch), device,
                            bench_adapter(cfg, lora_rank) if lora_rank else None)
    if step is None:
        return None
    loss, seconds = timed_steps(step, steps)
    return {"loss": loss, "seconds": seconds}


def torch_matmul(sizes, repeat: int, device: str = "cpu") -> dict | None:
    """GFLOP/s of PyTorch's f32 `b @ a.T` on `device` for each (M, N, K) of `sizes`, as bench
    matmul times wgpu (the mean of back-to-back runs up to the device finishing, after a
    warm-up): {"MxNxK": GFLOP/s}; None when torch is not importable. TF32 is off, so a CUDA
    GPU is measured at its f32 rate: f32 against f32. For in_own_process."""
    try:
        import torch
    except ImportError:
        return None
    f32_products(torch)
    done = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rates = {}
    for m, n, k in sizes:
        a = torch.randn(m, k, device=device)
        b = torch.randn(n, k, device=device)
        b @ a.T
        done()
        t0 = time.perf_counter()
        for _ in range(repeat):
            b @ a.T
        done()
        rates[f"{m}x{n}x{k}"] = 2.0 * m * n * k * repeat / (time.perf_counter() - t0) / 1e9
    return rates


def _send_result(conn, fn, args):
    try:
        conn.send((True, fn(*args)))
    except Exception as e:
        conn.send((False, f"{type(e).__name__}: {e}"))
    conn.close()


def in_own_process(fn, *args):
    """fn(*args) in a fresh Python process: (its result, None), or (None, why it failed).

    PyTorch runs there, never here: importing it (its triton loads LLVM) in a process where
    lavapipe's LLVM is loaded crashes that process, and whatever a peer's version pulls in,
    a crash over there is one line here. `fn` must be importable by its module name."""
    import multiprocessing
    import signal
    spawn = multiprocessing.get_context("spawn")    # a new interpreter: no device, no LLVM
    receive, send = spawn.Pipe(duplex=False)
    child = spawn.Process(target=_send_result, args=(send, fn, args), daemon=True)
    child.start()
    send.close()
    try:
        ok, value = receive.recv()
    except EOFError:                                # it died before sending anything
        child.join()
        code = child.exitcode
        died = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
                else f"exit code {code}")
        return None, f"its process died ({died})"
    finally:
        receive.close()
    child.join()
    return (value, None) if ok else (None, value)


# -- dispatches per layer ---------------------------------------------------------------------

class DispatchCounter(Backend):
    """A backend that plans no storage: Trainer(..., DispatchCounter(backend), ...).plan.counts
    holds the dispatches per op that the step records on `backend` (its kernel variants and
    binding limits, which decide the logits chunks), or on the NumPy backend's terms."""
    name = "count"

    def __init__(self, backend: Backend | None = None):
        like = backend or NumpyBackend()
        self.has_f16, self.emulates_f16 = like.has_f16, like.emulates_f16
        self.storage_limits, self.kernel_variants = like.storage_limits, like.kernel_variants
        self.info = like.info

    def plan(self, outputs, sentinel=0, shared=()):
        class CountedPlan(Plan):
            def write(self, t, value, everywhere=False):    # no storage: nothing to write
                pass

        plan = CountedPlan(outputs)
        plan.counts = Counter({})
        for node in plan.nodes:
            plan.counts[node.op] += len(OPS[node.op].dispatches_on(node, self.kernel_variants))
        return plan


def dispatches_per_layer(config_name: str, backend: Backend, cfg: ModelConfig,
                         plan=None) -> dict:
    """Dispatches per op of one layer, exactly: the step of 3 layers less that of 2 (layer 0
    does less than the others: nothing below it takes a gradient), and those of the rest of
    the step (the first layer's difference included), such that the step of n layers
    records rest + n * per layer. With `plan` (a WgpuPlan of cfg), that identity is checked
    against the dispatches it records (BenchError where it fails)."""
    counter = DispatchCounter(backend)
    counts = {}
    for n in (2, 3):
        c, options = bench_model(config_name, **{**dataclasses.asdict(cfg), "n_layer": n})
        weights = bench_weights(config_name, c)
        counts[n] = bench_trainer(config_name, counter, c, options, weights).plan.counts
    per_layer = {op: counts[3][op] - counts[2][op] for op in counts[3]}
    rest = {op: counts[2][op] - 2 * per_layer[op] for op in counts[3]}
    report = {"per_layer": {op: n for op, n in per_layer.items() if n},
              "rest": {op: n for op, n in rest.items() if n}, "n_layer": cfg.n_layer}
    if plan is not None:
        recorded = Counter(plan.dispatch_ops)
        expected = {op: rest.get(op, 0) + cfg.n_layer * per_layer.get(op, 0)
                    for op in set(rest) | set(per_layer)}
        if {op: n for op, n in recorded.items()} != {op: n for op, n in expected.items() if n}:
            raise BenchError(f"dispatch count per layer is off: the plan records "
                             f"{dict(recorded)}, the layers say {expected}")
    return report


# -- memory ---------------------------------------------------------------------------------------

def memory_against_minimum(trainer, config: BenchConfig) -> dict:
    """A training step's planned device memory against the least it can hold, by role:
    the frozen base weights in their storage type, the trained weights, AdamW's two moments
    and one gradient of each, the inputs, and the other activations live at the planner's
    peak (with checkpointing when the config has it). What the plan holds besides: other
    constants (the loss's seed, the clip's), and in the buffers that blocks share by
    liveness, the gradients the clip scales into new blocks and the gaps that offsets
    aligned for binding leave. Bytes, and planned / minimum. The roles need not peak
    together: the gradients come after the activations' peak (a full step's without
    checkpointing, a LoRA step's adapter gradients), so the plan can be below the minimum."""
    from .models import parameter_shapes
    plan = trainer.plan
    layout = plan.layout or plan.storage_layout()
    m = plan.memory()
    model = set(parameter_shapes(trainer.cfg))
    moments = {id(t.storage) for pair in trainer.moments.values() for t in pair}
    leaves = [t for t in plan.roots if t.op is None]
    nbytes = {id(t): plan.nbytes(t) for t in plan.roots}
    base = sum(plan.nbytes(t) for t in leaves if not t.is_param and t.name in model)
    moment_bytes = sum(nbytes[k] for k in moments)
    # gradients live at the peak are counted as gradients, not activations
    grads = {id(g.storage) for g in trainer.gradients.values()}
    grads_at_peak = sum(nbytes.get(k, 0) for k in grads & layout.peak_keys)
    minimum = {"base weights": base, "trained weights": m["weights"],
               "optimizer moments": moment_bytes, "inputs": m["inputs"],
               "gradients": m["weights"], "activations at the peak":
               m["activations"] - grads_at_peak}
    planned = {role: minimum[role] for role in list(minimum)[:4]}
    planned["other constants"] = m["state"] - base - moment_bytes
    planned["shared buffers"] = m["planned"] - sum(planned.values())
    kind = "lora" if config.lora else "full"
    return {"minimum": minimum, "planned": planned, "minimum_bytes": sum(minimum.values()),
            "planned_bytes": m["planned"], "peak_bytes": m["peak"],
            "ratio": m["planned"] / sum(minimum.values()),
            "budget": MEMORY_BUDGET[kind], "kind": kind}


MEMORY_ROLES = ("weights", "gradients", "state", "inputs", "activations")


def planned_memory(config_name: str, backend: Backend, layers, precisions):
    """The planned memory (Plan.memory) of the config's training step for each n_layer of
    `layers`, without and with checkpointing (every round(sqrt(n_layer))-th block output
    kept), in each of `precisions` ("f32" first): one dict a plan, as it is made, with the
    roles' `sum`, and where f32 was planned too, the f16 plan's `f16_of_f32`. Plans only:
    nothing runs."""
    from .models import build_train_graph
    from .training import Trainer, logits_bound
    rows = []
    for n_layer, checkpointing, precision in itertools.product(layers, (False, True),
                                                               precisions):
        cfg, options = bench_model(config_name, n_layer=n_layer)
        options = dataclasses.replace(options, checkpointing=checkpointing, precision=precision)
        values, adapter = bench_weights(config_name, cfg)
        graph = build_train_graph(cfg, values, options.batch, lora=adapter,
                                  max_logits_bytes=logits_bound(backend, checkpointing,
                                                                adapter is None),
                                  precision=precision)
        every = max(1, round(math.sqrt(n_layer)))
        graph.checkpoints = graph.checkpoints[every - 1::every]
        trainer = Trainer(cfg, values, backend, options,
                          RandomBatches(cfg.n_vocab, cfg.n_ctx, options.batch), graph=graph)
        m = trainer.plan.memory()
        row = {"n_layer": n_layer, "checkpointing": checkpointing, "precision": precision,
               "checkpoint_every": every if checkpointing else None, **m,
               "sum": sum(m[k] for k in MEMORY_ROLES)}
        if precision == "f16" and "f32" in precisions:
            row["f16_of_f32"] = m["planned"] / next(
                r["planned"] for r in rows if r["precision"] == "f32"
                and (r["n_layer"], r["checkpointing"]) == (n_layer, checkpointing))
        rows.append(row)
        yield row


# -- data-parallel ranks ---------------------------------------------------------------------

def measure_ranks(config_name: str, backend: Backend, world, steps: int) -> dict:
    """Time `steps` steps (after one warm-up) of this process's share of a data-parallel
    run (`world`: distributed.World, None for one process) in which every rank trains the
    config's batch (weak scaling): tokens/s, and the gradient allreduce's seconds per step
    within the steps and alone (every rank there at once: the transfer itself)."""
    from .models import init_parameters
    from .training import Trainer
    size = world.size if world else 1
    cfg, options = bench_model(config_name)
    options = dataclasses.replace(options, batch=options.batch * size)
    trainer = Trainer(cfg, init_parameters(cfg, 0), backend, options,
                      RandomBatches(cfg.n_vocab, cfg.n_ctx, options.batch), world=world)
    trainer.train_step()
    reduced = world.allreduce_seconds if world else 0.0
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    seconds = (time.perf_counter() - start) / steps
    allreduce = ((world.allreduce_seconds - reduced) / steps) if world else 0.0
    alone = 0.0
    if world:
        buffer = np.zeros(trainer.exchange.n + 3, np.float32)
        world.comm.Barrier()
        start = time.perf_counter()
        for _ in range(steps):
            world.allreduce(buffer)
        alone = (time.perf_counter() - start) / steps
    return {"ranks": size, "tokens_per_step": options.batch * cfg.n_ctx,
            "seconds_per_step": seconds, "tokens_per_s": options.batch * cfg.n_ctx / seconds,
            "allreduce_seconds_per_step": allreduce, "allreduce_share": allreduce / seconds,
            "allreduce_alone_seconds": alone,
            "allreduce_bytes": 4 * trainer.exchange.n if trainer.exchange else 0}
