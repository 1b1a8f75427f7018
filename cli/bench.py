"""`ggwgpu bench matmul|ops|train|memory`: speed and memory of the wgpu backend against NumPy
(and PyTorch CPU when importable). Registered on the `ggwgpu` group by main.py.

Every bench checks the wgpu results against NumPy before it prints a number, prints for wgpu
the dispatches per step, host µs per dispatch (recording and submitting a planned step,
divided by its dispatches), device ms per step (timestamp queries, where the adapter has
them) and the planned memory, and writes what it printed as JSON with --json PATH.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from collections import Counter
from dataclasses import dataclass

import click
import numpy as np

import ggwgpu

from .common import (backend_choice, describe_backend, human_bytes, positive_ints,
                     wgpu_or_reason)
from .outputs import check_writable

# (M, N, K) for mul_mat(a [M, K], b [N, K]) -> [N, M]: the projections of a small llama
# layer (d_model 256, ffn 768, 512 tokens) and the classic cube.
BENCH_SIZES = ((256, 512, 256), (768, 512, 256), (256, 512, 768), (1024, 1024, 1024))
BENCH_MAX_REL_ERR = 1e-4


@dataclass(frozen=True)
class BenchConfig:
    """A `bench train` config: a llama's shape, the samples per step and how it trains."""
    model: dict                 # ModelConfig fields
    batch: int
    base: str | None = None     # a block type: LoRA on a frozen base stored in it
    lora_rank: int = 4          # rank of every block matrix's pair (alpha = rank: scale 1)
    checkpointing: bool = False
    steps: int = 5              # timed steps unless --steps says otherwise
    shape_of: str = ""          # the published model it is shaped like

    @property
    def lora(self) -> bool:
        return self.base is not None


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
    "smollm-135m": BenchConfig(SMOLLM2_135M, base="q4_0", shape_of="SmolLM2-135M",
                               **PUBLISHED_FINETUNE),
    "smollm-135m-q8": BenchConfig(SMOLLM2_135M, base="q8_0", shape_of="SmolLM2-135M",
                                  **PUBLISHED_FINETUNE),
    "smollm-360m": BenchConfig(SMOLLM2_360M, base="q4_0", shape_of="SmolLM2-360M",
                               **PUBLISHED_FINETUNE),
    "smollm-135m-full": BenchConfig(SMOLLM2_135M, shape_of="SmolLM2-135M",
                                    **{**PUBLISHED_FINETUNE, "lora_rank": 0}),
}
BENCH_TRAIN_MAX_REL_ERR = 1e-3
F16_MAX_REL_ERR = 1e-2      # the same for the f16 step (activations rounded to halves)
# planned device memory against the minimum (memory_against_minimum): the budgets
MEMORY_BUDGET = {"lora": 1.5, "full": 1.25}
HOST_SHARE_BUDGET = 0.05    # host work per step, as a share of the step, on lavapipe
CONFIG_HELP = ("tiny: vocab 256, embd 128, 4 heads, 4 layers, ff 352, ctx 64; small: vocab "
               "2048, embd 256, 8 heads, 8 layers, ff 704, ctx 128; batch 8 for both. "
               "smollm-135m, smollm-360m: SmolLM2's shapes (30 layers, embd 576, 9/3 heads, ff "
               "1536; 32 layers, embd 960, 15/5 heads, ff 2560; vocab 49152, tied), a rank-4 "
               "LoRA on a frozen q4_0 base (smollm-135m-q8: q8_0; smollm-135m-full: every "
               "weight in f32), 4 x 128 tokens, checkpointing.")

json_option = click.option("--json", "json_path", type=click.Path(dir_okay=False),
                           callback=lambda ctx, param, path: path and (
                               check_writable("--json", path) or path),
                           help="Also write the numbers as JSON to this file.")
config_option = click.option("--config", "config_name", default="tiny", show_default=True,
                             type=click.Choice(sorted(BENCH_TRAIN_CONFIGS)), help=CONFIG_HELP)


def write_json(path, report: dict):
    if path:
        try:
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
                f.write("\n")
        except OSError as e:        # a missing directory, a full disk: the numbers were shown
            raise click.ClickException(f"--json {path}: not written ({e.strerror or e})") \
                from None


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


def step_stats(plan, repeat: int) -> dict:
    """What one planned wgpu step costs, inputs already written (medians of `repeat` runs):
    host µs per dispatch (recording, finishing and submitting the step while the device is
    idle, over its dispatches), device ms from timestamp queries (None without them), wall
    ms from submit to done, and the planned memory by role."""
    host, wall, device = [], [], []
    for _ in range(repeat):
        plan.sync()
        t0 = time.perf_counter()
        plan.run()
        t1 = time.perf_counter()
        plan.sync()
        host.append(t1 - t0)
        wall.append(time.perf_counter() - t1)
        device.append(plan.device_seconds())
    n = len(plan.recorded)
    return {"dispatches": n, "host_us_per_dispatch": 1e6 * float(np.median(host)) / max(n, 1),
            "host_ms": 1e3 * float(np.median(host)), "wall_ms": 1e3 * float(np.median(wall)),
            "device_ms": None if device[0] is None else 1e3 * float(np.median(device)),
            "memory": plan.memory()}


def echo_step_stats(s: dict):
    device = ("no timestamp queries on this adapter" if s["device_ms"] is None
              else f"{s['device_ms']:.2f} ms/step (timestamp queries)")
    click.echo(f"wgpu step: {s['dispatches']} dispatches, host {s['host_us_per_dispatch']:.2f} "
               f"µs/dispatch ({s['host_ms']:.2f} ms to record and submit), device {device}, "
               f"{s['wall_ms']:.1f} ms submit to done")
    m = s["memory"]
    click.echo(f"wgpu memory (planned): peak {human_bytes(m['peak'])}, buffers "
               f"{human_bytes(m['planned'])} ({m['planned'] / max(m['peak'], 1):.3f} x peak)")


def wgpu_for(ctx, what: str):
    """The wgpu backend a bench times, or (None, why) when NumPy was asked for or there is no
    adapter; a click error when wgpu was asked for and is missing."""
    name, by = backend_choice(ctx)
    if name == "numpy":
        return None, f"numpy asked for by {by}"
    backend, why = wgpu_or_reason()
    if backend is None and name == "wgpu":
        raise click.ClickException(f"{what}: backend wgpu asked for by {by}, but {why}")
    return backend, why


@click.group()
def bench():
    """Benchmarks of the wgpu backend against NumPy (and PyTorch CPU when importable)."""


# -- bench matmul ---------------------------------------------------------------------------

def parse_sizes(ctx, param, values) -> list[tuple[int, int, int]]:
    sizes = []
    for value in values:
        for item in value.split(","):
            parts = item.strip().lower().split("x")
            if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise click.BadParameter(f"{item!r} is not MxNxK with positive integers, "
                                         "e.g. 256x512x768")
            sizes.append(tuple(int(p) for p in parts))
    return sizes or list(BENCH_SIZES)


@bench.command("matmul")
@click.option("--sizes", multiple=True, callback=parse_sizes, metavar="MxNxK[,...]",
              help="mul_mat(a [M,K], b [N,K]) -> [N,M] shapes (repeatable or comma-separated). "
                   f"Default: {','.join('x'.join(map(str, s)) for s in BENCH_SIZES)}.")
@click.option("--repeat", default=5, show_default=True, type=click.IntRange(min=1),
              help="Timed runs per shape, after one warm-up run.")
@json_option
@click.pass_context
def bench_matmul(ctx, sizes, repeat, json_path):
    """GFLOP/s of the wgpu mul_mat and of NumPy's matmul on the same shapes.

    wgpu: the mean time of back-to-back runs of a planned graph (one submit each) up to the
    GPU finishing. NumPy: the median time of `b @ a.T` in float32. Each shape's wgpu result
    is checked against float64 NumPy before any number is printed.
    """
    name, by = backend_choice(ctx)
    if name == "numpy" and by == "--backend":
        raise click.UsageError("bench matmul times the wgpu backend against NumPy; "
                               "--backend numpy leaves nothing to time")
    backend, why = wgpu_or_reason()
    if backend is None:
        raise click.ClickException(f"bench matmul needs a WebGPU adapter: {why}")

    click.echo(f"bench matmul on {describe_backend(backend)}, {repeat} timed runs per shape")
    click.echo(f"{'M':>5} {'N':>5} {'K':>5}  {'wgpu GFLOP/s':>12}  {'numpy GFLOP/s':>13}  "
               f"{'wgpu/numpy':>10}  {'max rel err':>11}  {'dispatches':>10}  "
               f"{'host µs/disp':>12}  {'device ms':>9}  {'planned bytes':>13}")
    rng = np.random.default_rng(0)
    rows = []
    for m, n, k in sizes:
        a_val = rng.standard_normal((m, k), dtype=np.float32)
        b_val = rng.standard_normal((n, k), dtype=np.float32)
        a, b = ggwgpu.input_tensor((m, k), name="a"), ggwgpu.input_tensor((n, k), name="b")
        out = ggwgpu.mul_mat(a, b)
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
            raise click.ClickException(
                f"wgpu mul_mat is wrong for M={m} N={n} K={k}: max relative error {rel:.2e} "
                f"> {BENCH_MAX_REL_ERR:.0e}; no timing reported")

        # Runs queue up on the GPU in order: submit them back to back, wait once at the end.
        t0 = time.perf_counter()
        for _ in range(repeat):
            plan.run()
        plan.sync()
        t_wgpu = (time.perf_counter() - t0) / repeat
        stats = step_stats(plan, repeat)

        flop = 2.0 * m * n * k
        g_wgpu, g_numpy = flop / t_wgpu / 1e9, flop / t_numpy / 1e9
        device = "-" if stats["device_ms"] is None else f"{stats['device_ms']:.3f}"
        click.echo(f"{m:>5} {n:>5} {k:>5}  {g_wgpu:>12.2f}  {g_numpy:>13.2f}  "
                   f"{g_wgpu / g_numpy:>10.3f}  {rel:>11.1e}  {stats['dispatches']:>10}  "
                   f"{stats['host_us_per_dispatch']:>12.2f}  {device:>9}  "
                   f"{stats['memory']['planned']:>13}")
        rows.append({"m": m, "n": n, "k": k, "gflops": {"wgpu": g_wgpu, "numpy": g_numpy},
                     "ratio_wgpu_numpy": g_wgpu / g_numpy, "max_rel_err": rel, **stats})
    write_json(json_path, {"bench": "matmul", "device": describe_backend(backend),
                           "shapes": rows})


# -- training steps: bench train and bench ops ----------------------------------------------

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
    from ggwgpu.models import ModelConfig
    from ggwgpu.train import TrainOptions
    config = BENCH_TRAIN_CONFIGS[config_name]
    return (ModelConfig(**{**config.model, **changes}),
            TrainOptions(batch=config.batch, lr=1e-3, checkpointing=config.checkpointing))


def bench_weights(config_name: str, cfg):
    """(values, adapter) of a bench config: train-text-from-scratch's random init (seed 0);
    for a LoRA config its 2-D weights in the base's block type and a fresh adapter of
    lora_rank on every block matrix (what `ggwgpu finetune` trains), else adapter None."""
    from ggwgpu import lora
    from ggwgpu.models import init_parameters
    from ggwgpu.quant import quantize_model
    config = BENCH_TRAIN_CONFIGS[config_name]
    values = init_parameters(cfg, 0)
    if not config.lora:
        return values, None
    ranks = lora.lora_ranks(cfg, config.lora_rank)
    return (quantize_model(values, config.base),
            lora.init_adapter(cfg, ranks, alpha=config.lora_rank, seed=0))


def bench_trainer(config_name: str, backend, cfg, options, weights):
    """A Trainer of the config on `backend` over `weights` (bench_weights), on
    RandomBatches: the same batches on every backend."""
    from ggwgpu.train import Trainer
    values, adapter = weights
    return Trainer(cfg, values, backend, options,
                   RandomBatches(cfg.n_vocab, cfg.n_ctx, options.batch), lora=adapter)


def checked_trainers(config_name: str, wgpu_backend, **changes) -> tuple[dict, dict, dict]:
    """A Trainer per backend (NumPy, and wgpu when there is one) on the same weights and
    batches, each after one warm-up step; a click error unless their losses agree.
    Returns (trainers, warm-up losses, seconds each took to plan: graph, backward, storage
    plan and upload)."""
    from ggwgpu.backends import NumpyBackend
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
            raise click.ClickException(
                f"wgpu training is wrong: warm-up loss {warm['wgpu']:.6f}, NumPy's "
                f"{warm['numpy']:.6f} (relative difference {rel:.2e} > "
                f"{BENCH_TRAIN_MAX_REL_ERR:.0e}); no timing reported")
    return trainers, warm, plan_seconds


F16_KEY = "wgpu f16"


def f16_trainer(config_name: str, backend, numpy_loss: float, **changes):
    """The config's Trainer with --precision f16 on `backend`, after its warm-up step
    (`warm_loss`); a click error unless that loss is within F16_MAX_REL_ERR of NumPy's f32."""
    cfg, options = bench_model(config_name, **changes)
    trainer = bench_trainer(config_name, backend, cfg,
                            dataclasses.replace(options, precision="f16"),
                            bench_weights(config_name, cfg))
    trainer.warm_loss = trainer.train_step()["loss"]
    rel = abs(trainer.warm_loss - numpy_loss) / max(abs(numpy_loss), 1e-30)
    if not rel <= F16_MAX_REL_ERR:
        raise click.ClickException(
            f"wgpu f16 training is wrong: warm-up loss {trainer.warm_loss:.6f}, NumPy's f32 "
            f"{numpy_loss:.6f} (relative difference {rel:.2e} > {F16_MAX_REL_ERR:.0e})")
    return trainer


def precision_list(ctx, param, value) -> list[str]:
    """--precision of bench memory: f32 and/or f16, comma-separated, f32 first."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in ("f32", "f16")]
    if unknown or not names:
        raise click.BadParameter(f"{value!r}: give f32, f16 or f32,f16")
    return sorted(set(names), key=("f32", "f16").index)


def describe_config(config_name: str, **changes) -> str:
    from ggwgpu import lora
    from ggwgpu.models import parameter_shapes
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


def timed_steps(step, n: int) -> tuple[float, float]:
    """(the loss of one warm-up step, mean seconds of the next n steps)."""
    loss = step()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return loss, (time.perf_counter() - t0) / n


def torch_llama_step(cfg, options, values: dict, batches, device: str = "cpu"):
    """One AdamW training step of the same llama in PyTorch on `device` ("cpu", "cuda"), as a
    function that returns the loss (read back: each step waits for its kernels); None when
    torch is not importable (it is no dependency of ggwgpu). Call it only where no lavapipe
    device exists (torch_peer in its own process)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    params = {name: torch.tensor(v, device=device, requires_grad=True)
              for name, v in values.items()}
    groups = [{"params": [p for p in params.values() if p.ndim >= 2],
               "weight_decay": options.weight_decay},
              {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0}]
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

    def rope(x):  # (batch, ctx, head, dim), ggml's "normal" mode: pairs (2k, 2k + 1)
        x0, x1 = x[..., 0:rot:2], x[..., 1:rot:2]
        rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)
        return torch.cat((rotated, x[..., rot:]), -1)

    def step() -> float:
        inputs, targets = batches.next_batch()
        b = inputs.shape[0]
        x = params["token_embd.weight"][torch.from_numpy(inputs).long().to(device)]
        for i in range(cfg.n_layer):
            w = {name[len(f"blk.{i}."):-len(".weight")]: p for name, p in params.items()
                 if name.startswith(f"blk.{i}.")}
            h = rms_norm(x, w["attn_norm"])
            q, k, v = (F.linear(h, w[f"attn_{n}"]).view(b, t, heads, cfg.head_dim)
                       for n, heads in zip("qkv", (cfg.n_head, cfg.kv_heads, cfg.kv_heads)))
            q, k, v = (y.transpose(1, 2) for y in (rope(q), rope(k), v))
            # grouped-query attention: each K/V head serves n_head / n_head_kv query heads
            k, v = (y.repeat_interleave(cfg.n_head // cfg.kv_heads, dim=1) for y in (k, v))
            att = torch.softmax(q @ k.transpose(-1, -2) * scale + mask, -1) @ v
            x = x + F.linear(att.transpose(1, 2).reshape(b, t, cfg.q_dim), w["attn_output"])
            h = rms_norm(x, w["ffn_norm"])
            x = x + F.linear(F.silu(F.linear(h, w["ffn_gate"])) * F.linear(h, w["ffn_up"]),
                             w["ffn_down"])
        out = params.get("output.weight", params["token_embd.weight"])    # tied embeddings
        logits = F.linear(rms_norm(x, params["output_norm.weight"]), out)
        loss = F.cross_entropy(logits.reshape(-1, cfg.n_vocab),
                               torch.from_numpy(targets).long().reshape(-1).to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if options.grad_clip:
            torch.nn.utils.clip_grad_norm_(list(params.values()), options.grad_clip)
        opt.step()
        return loss.item()

    return step


def torch_peer(cfg, options, steps: int, device: str = "cpu") -> dict | None:
    """PyTorch training of a bench llama on `device` (same weights and batches as the other
    backends), meant for in_own_process(): {'loss': of the warm-up step, 'seconds': mean of
    `steps` timed steps}, or None when torch is not importable."""
    from ggwgpu.models import init_parameters
    step = torch_llama_step(cfg, options, init_parameters(cfg, 0),
                            RandomBatches(cfg.n_vocab, cfg.n_ctx, options.batch), device)
    if step is None:
        return None
    loss, seconds = timed_steps(step, steps)
    return {"loss": loss, "seconds": seconds}


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


@bench.command("train")
@config_option
@click.option("--steps", type=click.IntRange(min=1),
              help="Timed training steps per backend, after one warm-up step (default 5; 1 "
                   "for the published shapes, whose step takes minutes on lavapipe).")
@click.option("--layers", "n_layer", type=click.IntRange(min=2),
              help="n_layer of the model (default: the config's), the rest of its shape kept.")
@click.option("--torch/--no-torch", "use_torch", default=True, show_default=True,
              help="Also time PyTorch training of the same llama, when torch is "
                   "importable (in a process of its own).")
@click.option("--torch-device", type=click.Choice(["cpu", "cuda"]), default="cpu",
              show_default=True, help="Where PyTorch trains: the CPU, or a CUDA GPU (eager).")
@json_option
@click.pass_context
def bench_train(ctx, config_name, steps, n_layer, use_torch, torch_device, json_path):
    """Training tokens/s of a llama on wgpu, NumPy and (when importable) PyTorch, on the CPU or
    a CUDA GPU (--torch-device).

    Every backend trains the same model (same initial weights, AdamW, lr 1e-3) on the same
    random tokens: one warm-up step, then --steps timed steps, each with its loss read back.
    The wgpu and NumPy losses of the warm-up step must agree before any number is printed.
    Also: the seconds each backend took to plan the step, and for wgpu the dispatches per
    step, per layer and per op, the host's share of a step (inputs written, dispatches
    recorded and submitted) and the planned device memory by role against the least a step
    can hold. PyTorch trains in a process of its own: importing it where a lavapipe device
    exists can crash the process; it has no peer for LoRA on a block-type base.
    """
    config = BENCH_TRAIN_CONFIGS[config_name]
    changes = {"n_layer": n_layer} if n_layer else {}
    steps = steps or config.steps
    cfg, options = bench_model(config_name, **changes)
    wgpu_backend, why = wgpu_for(ctx, "bench train")
    click.echo(f"bench train {describe_config(config_name, **changes)}; 1 warm-up + {steps} "
               f"timed step{'s' if steps > 1 else ''} per backend")
    click.echo("wgpu: " + (describe_backend(wgpu_backend) if wgpu_backend else f"none ({why})"))
    trainers, warm, plan_seconds = checked_trainers(config_name, wgpu_backend, **changes)
    click.echo("planning (graph, backward, storage plan, upload): " + ", ".join(
        f"{key} {s:.1f} s" for key, s in plan_seconds.items()))

    # NumPy and torch before wgpu: lavapipe's threads stay busy for a while after its runs.
    loss, seconds = {}, {}
    _, seconds["numpy"] = timed_steps(lambda: trainers["numpy"].train_step()["loss"], steps)
    loss["numpy"] = warm["numpy"]
    torch_why = "--no-torch"
    if config.lora:
        torch_why = (f"no peer: PyTorch has no {config.base} matmul, and an f32 base would "
                     "time other work")
    elif use_torch:
        peer, failed = in_own_process(torch_peer, cfg, options, steps, torch_device)
        torch_why = f"failed: {failed}" if failed else "not importable"
        if peer is not None:
            loss["torch"], seconds["torch"] = peer["loss"], peer["seconds"]
    host = []
    if wgpu_backend is not None:
        plan = trainers["wgpu"].plan

        def wgpu_step():
            result = trainers["wgpu"].train_step()["loss"]
            host.append(plan.host_seconds)
            return result
        _, seconds["wgpu"] = timed_steps(wgpu_step, steps)
        loss["wgpu"] = warm["wgpu"]
        host = host[1:]         # the timed steps'
    half = None
    if wgpu_backend is not None and wgpu_backend.has_f16:
        half = f16_trainer(config_name, wgpu_backend, warm["numpy"], **changes)
        loss[F16_KEY] = half.warm_loss
        _, seconds[F16_KEY] = timed_steps(lambda: half.train_step()["loss"], steps)

    tokens = options.batch * cfg.n_ctx
    rate = {key: tokens / s for key, s in seconds.items()}
    ratios = echo_rates(rate, seconds, loss, {
        "wgpu": why, "torch": torch_why,
        F16_KEY: why if wgpu_backend is None else "the adapter has no shader-f16"})
    report = {"bench": "train", "config": config_name, "n_layer": cfg.n_layer, "steps": steps,
              "tokens_per_step": tokens, "tokens_per_s": rate, "warmup_loss": loss,
              "torch_device": torch_device if "torch" in rate else None,
              "ratios": ratios, "plan_seconds": plan_seconds, "wgpu": None}
    shown = trainers["wgpu" if wgpu_backend is not None else "numpy"]
    if wgpu_backend is not None:
        report["wgpu"] = stats = train_step_stats(plan, host, seconds["wgpu"])
        echo_train_step_stats(stats)
        report["dispatches"] = counts = dispatches_per_layer(config_name, wgpu_backend, cfg,
                                                             plan)
        echo_dispatches(counts)
    report["memory"] = memory = memory_against_minimum(shown, config)
    echo_memory_minimum(memory, "wgpu" if wgpu_backend is not None else "numpy")
    if half is not None:
        f16, f32 = half.plan.memory()["planned"], plan.memory()["planned"]
        report["f16_memory"] = {"planned_bytes": f16, "of_f32": f16 / f32}
        click.echo(f"wgpu f16 step: device memory planned {f16 / 2**20:.2f} MiB, "
                   f"{f16 / f32:.3f} x the f32 step's {f32 / 2**20:.2f} MiB")
    write_json(json_path, report)


def echo_rates(rate: dict, seconds: dict, loss: dict, why_not: dict) -> dict:
    """The tokens/s table of bench train; returns the ratios it prints."""
    click.echo(f"{'backend':<8} {'tokens/s':>10} {'ms/step':>9} {'warm-up loss':>13} "
               f"{'x torch':>8}")
    for key in ("wgpu", F16_KEY, "numpy", "torch"):
        if key not in rate:
            click.echo(f"{key:<8} {'-':>10} {'-':>9} {'-':>13} {'-':>8}  ({why_not[key]})")
            continue
        ratio = f"{rate[key] / rate['torch']:.3f}" if "torch" in rate else "-"
        shown = f"{rate[key]:.1f}" if rate[key] < 100 else f"{rate[key]:.0f}"
        click.echo(f"{key:<8} {shown:>10} {1e3 * seconds[key]:>9.1f} "
                   f"{loss[key]:>13.6f} {ratio:>8}")
    ratios = {}
    if "torch" in rate:
        ratios.update({f"{key}/torch": rate[key] / rate["torch"]
                       for key in ("wgpu", F16_KEY, "numpy") if key in rate})
    if "wgpu" in rate:
        ratios["wgpu/numpy"] = rate["wgpu"] / rate["numpy"]
    if F16_KEY in rate:
        ratios[f"{F16_KEY}/wgpu"] = rate[F16_KEY] / rate["wgpu"]
    if ratios:
        click.echo("ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return ratios


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


def echo_train_step_stats(s: dict):
    verdict = "within" if s["host_share"] <= HOST_SHARE_BUDGET else "over"
    click.echo(f"wgpu step: {s['dispatches']} dispatches, host {s['host_us_per_dispatch']:.2f} "
               f"µs/dispatch; host work {s['host_ms']:.2f} ms of the {s['step_ms']:.0f} ms "
               f"step = {100 * s['host_share']:.3f} % ({verdict} the "
               f"{100 * HOST_SHARE_BUDGET:.0f} % budget)")


# -- dispatches per layer -------------------------------------------------------------------

class DispatchCounter(ggwgpu.backends.Backend):
    """A backend that plans no storage: Trainer(..., DispatchCounter(backend), ...).plan.counts
    holds the dispatches per op that the step records on `backend` (its kernel variants and
    binding limits, which decide the logits chunks), or on the NumPy backend's terms."""
    name = "count"

    def __init__(self, backend: ggwgpu.backends.Backend | None = None):
        like = backend or ggwgpu.backends.NumpyBackend()
        self.has_f16, self.emulates_f16 = like.has_f16, like.emulates_f16
        self.storage_limits, self.kernel_variants = like.storage_limits, like.kernel_variants
        self.info = like.info

    def plan(self, outputs, sentinel=0):
        from ggwgpu.backends.base import Plan
        from ggwgpu.ops import OPS

        class CountedPlan(Plan):
            def write(self, t, value):      # no storage: nothing to write
                pass

        plan = CountedPlan(outputs)
        plan.counts = Counter({})
        for node in plan.nodes:
            plan.counts[node.op] += len(OPS[node.op].dispatches_on(node, self.kernel_variants))
        return plan


def dispatches_per_layer(config_name: str, backend, cfg, plan=None) -> dict:
    """Dispatches per op of one layer, exactly: the step of 3 layers less that of 2 (layer 0
    does less than the others: nothing below it takes a gradient), and those of the rest of
    the step (the first layer's difference included), such that the step of n layers
    records rest + n * per layer. With `plan` (a WgpuPlan of cfg), that identity is checked
    against the dispatches it records."""
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
            raise click.ClickException(f"dispatch count per layer is off: the plan records "
                                       f"{dict(recorded)}, the layers say {expected}")
    return report


# Ops a layer dispatches that a fused kernel could absorb next, and into what (printed for
# those a layer has, most dispatches first).
FUSION_HINTS = (
    (("add",), "residual and gradient sums beside a frozen weight's product: an epilogue in "
               "mul_mat_q and mul_mat_q_back; the residual stream's gradient sums"),
    (("scale",), "a factor left outside a product (mul_mat takes alpha)"),
    (("diag_mask_inf", "soft_max", "soft_max_back"), "the causal mask and softmax: flash "
                                                     "attention fuses them with both products"),
    (("cont",), "attention's output permuted to rows: written in row order by its product"),
)


def echo_dispatches(d: dict):
    per_layer, rest = d["per_layer"], d["rest"]
    total = sum(rest.values()) + d["n_layer"] * sum(per_layer.values())
    click.echo(f"dispatches per layer: {sum(per_layer.values())} ("
               + ", ".join(f"{op} {n}" for op, n in sorted(per_layer.items(),
                                                           key=lambda kv: (-kv[1], kv[0])))
               + f"); embedding and head, less what layer 0 needs not: {sum(rest.values())}; "
               f"{d['n_layer']} layers: {total}")
    hints = [(sum(per_layer.get(op, 0) for op in ops), ops, text)
             for ops, text in FUSION_HINTS]
    for n, ops, text in sorted((h for h in hints if h[0]), key=lambda h: -h[0]):
        click.echo(f"  could fuse next: {' + '.join(ops)} ({n} per layer): {text}")


# -- memory against the minimum ---------------------------------------------------------------

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
    from ggwgpu.models import parameter_shapes
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


def echo_memory_minimum(r: dict, where: str):
    click.echo(f"memory ({where} plan, MiB)          minimum    planned")
    for role in dict.fromkeys([*r["minimum"], *r["planned"]]):
        least, planned = (("-" if d.get(role) is None else f"{d[role] / 2**20:.2f}")
                          for d in (r["minimum"], r["planned"]))
        if role == "shared buffers":
            role = "shared: gradients, activ., slack"
        click.echo(f"  {role:<32} {least:>10} {planned:>10}")
    verdict = "within" if r["ratio"] <= r["budget"] else "over"
    click.echo(f"  {'live at once, at the peak':<32} {'':>10} {r['peak_bytes'] / 2**20:>10.2f}")
    click.echo(f"  {'total':<32} {r['minimum_bytes'] / 2**20:>10.2f} "
               f"{r['planned_bytes'] / 2**20:>10.2f}   planned / minimum {r['ratio']:.3f} "
               f"({verdict} the {r['kind']} budget {r['budget']})")


@bench.command("ops")
@config_option
@click.option("--top", default=20, show_default=True, type=click.IntRange(min=1),
              help="Ops shown, by wgpu time (all go to --json).")
@click.option("--repeat", default=3, show_default=True, type=click.IntRange(min=1),
              help="Whole-step runs for the host and device times.")
@json_option
@click.pass_context
def bench_ops(ctx, config_name, top, repeat, json_path):
    """Time per op of one training step, wgpu against NumPy.

    Both backends train the same llama step (checked by their warm-up losses), then run it
    once op by op: on wgpu each dispatch is submitted and waited on alone (WgpuPlan.profile),
    so the times include a submit and a wait per dispatch; NumPy times each node.
    """
    wgpu_backend, why = wgpu_for(ctx, "bench ops")
    if wgpu_backend is None:
        raise click.ClickException(f"bench ops times the wgpu backend against NumPy: {why}")
    click.echo(f"bench ops {describe_config(config_name)}")
    click.echo("wgpu: " + describe_backend(wgpu_backend))
    trainers, _, _ = checked_trainers(config_name, wgpu_backend)
    numpy_times = trainers["numpy"].plan.profile()
    plan = trainers["wgpu"].plan
    wgpu_times = [(op, s) for op, (_, s) in zip(plan.dispatch_ops, plan.profile())]
    ops = {}
    for backend, times in (("numpy", numpy_times), ("wgpu", wgpu_times)):
        for op, s in times:
            row = ops.setdefault(op, {"nodes": 0, "dispatches": 0, "wgpu_ms": 0.0,
                                      "numpy_ms": 0.0})
            row["nodes" if backend == "numpy" else "dispatches"] += 1
            row[f"{backend}_ms"] += 1e3 * s
    ranked = sorted(ops.items(), key=lambda kv: -kv[1]["wgpu_ms"])
    click.echo(f"{'op':<24} {'nodes':>5} {'disp':>5} {'wgpu ms':>9} {'numpy ms':>9} "
               f"{'wgpu/numpy':>10}")
    for op, r in ranked[:top]:
        speed = r["numpy_ms"] / r["wgpu_ms"] if r["wgpu_ms"] else math.inf
        click.echo(f"{op:<24} {r['nodes']:>5} {r['dispatches']:>5} {r['wgpu_ms']:>9.2f} "
                   f"{r['numpy_ms']:>9.2f} {speed:>10.3f}")
    total = {key: sum(r[f"{key}_ms"] for r in ops.values()) for key in ("wgpu", "numpy")}
    click.echo(f"{'all':<24} {len(numpy_times):>5} {len(wgpu_times):>5} {total['wgpu']:>9.2f} "
               f"{total['numpy']:>9.2f} {total['numpy'] / total['wgpu']:>10.3f}  "
               "(wgpu/numpy: speed ratio, numpy ms / wgpu ms)")
    stats = step_stats(plan, repeat)
    echo_step_stats(stats)
    write_json(json_path, {"bench": "ops", "config": config_name, "ops": ops,
                           "total_ms": total, "wgpu": stats})


# -- bench memory ---------------------------------------------------------------------------

@bench.command("memory")
@config_option
@click.option("--layers", default="4,8,16", show_default=True, callback=positive_ints("4,8,16"),
              help="n_layer values to plan (other shapes from --config).")
@click.option("--precision", "precisions", default="f32", show_default=True,
              callback=precision_list,
              help="Comma-separated precisions to plan (f32, f16); with both, each row's f16 "
                   "plan is also given as a share of its f32 plan.")
@json_option
@click.pass_context
def bench_memory(ctx, config_name, layers, precisions, json_path):
    """Planned memory of a training step by role, with and without gradient checkpointing.

    For each n_layer the step (forward, backward, clipping, AdamW) is planned, not run, on
    wgpu (NumPy without an adapter): weights, gradients, optimizer moments and constants,
    inputs, the activations live at the planner's peak, and the buffers it allocates.
    Checkpointing keeps every round(sqrt(n_layer))-th block output and recomputes the rest,
    so the activations at the peak grow like sqrt(n_layer). --precision f16 plans the f16
    step (activations in halves; trained weights, gradients of params and moments f32).
    """
    from ggwgpu.backends import NumpyBackend
    from ggwgpu.models import build_train_graph
    from ggwgpu.train import Trainer, logits_bound
    backend, _ = wgpu_for(ctx, "bench memory")
    backend = backend or NumpyBackend()
    click.echo(f"bench memory {describe_config(config_name)}; planned on "
               f"{describe_backend(backend)}; MiB")
    click.echo(f"{'layers':>6} {'ckpt':>5} {'prec':>4} {'weights':>8} {'grads':>8} "
               f"{'state':>8} {'inputs':>8} {'activ':>8} {'sum':>8} {'planned':>8} "
               f"{'planned/sum':>11}" + (f" {'f16/f32':>7}" if len(precisions) > 1 else ""))
    rows = []
    for n_layer, checkpointing, precision in itertools.product(layers, (False, True),
                                                               precisions):
        cfg, options = bench_model(config_name, n_layer=n_layer)
        options.checkpointing, options.precision = checkpointing, precision
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
        total = sum(m[k] for k in ("weights", "gradients", "state", "inputs",
                                   "activations"))
        mib = [m[k] / 2**20 for k in ("weights", "gradients", "state", "inputs",
                                      "activations")]
        row = {"n_layer": n_layer, "checkpointing": checkpointing, "precision": precision,
               "checkpoint_every": every if checkpointing else None, **m, "sum": total}
        if precision == "f16" and "f32" in precisions:
            row["f16_of_f32"] = m["planned"] / next(
                r["planned"] for r in rows if r["precision"] == "f32"
                and (r["n_layer"], r["checkpointing"]) == (n_layer, checkpointing))
        rows.append(row)
        click.echo(f"{n_layer:>6} {'yes' if checkpointing else 'no':>5} {precision:>4} " +
                   " ".join(f"{v:>8.2f}" for v in mib) +
                   f" {total / 2**20:>8.2f} {m['planned'] / 2**20:>8.2f} "
                   f"{m['planned'] / total:>11.3f}" +
                   (f" {row['f16_of_f32']:>7.3f}" if "f16_of_f32" in row else ""))
    write_json(json_path, {"bench": "memory", "config": config_name, "rows": rows})
