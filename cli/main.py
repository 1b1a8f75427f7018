"""The `ggwgpu` command: adapter info, the op test matrix, a matmul benchmark, a demo fit.

Only absolute imports of `ggwgpu` here: this module runs as `ggwgpu_cli.main` when installed
and as `cli.main` from a source checkout.
"""
from __future__ import annotations

import os
import sys
import textwrap
import time
import warnings

import click
import numpy as np

import ggwgpu
from ggwgpu import testing
from ggwgpu.backends import CHOICES, ENV_VAR, get_backend, shared_wgpu_backend
from ggwgpu.generate import Sampling

# (adapter limit, label, is a size in bytes)
LIMITS = (
    ("max-storage-buffer-binding-size", "max storage buffer binding size", True),
    ("max-buffer-size", "max buffer size", True),
    ("max-compute-workgroups-per-dimension", "max compute workgroups per dimension", False),
    ("max-compute-invocations-per-workgroup", "max invocations per workgroup", False),
    ("max-compute-workgroup-storage-size", "max workgroup storage size", True),
    ("min-storage-buffer-offset-alignment", "min storage buffer offset alignment", True),
    ("max-storage-buffers-per-shader-stage", "max storage buffers per shader stage", False),
)

# (M, N, K) for mul_mat(a [M, K], b [N, K]) -> [N, M]: the projections of a small llama
# layer (d_model 256, ffn 768, 512 tokens) and the classic cube.
BENCH_SIZES = ((256, 512, 256), (768, 512, 256), (256, 512, 768), (1024, 1024, 1024))
BENCH_MAX_REL_ERR = 1e-4


def wgpu_or_reason():
    """(the shared wgpu backend, None), or (None, why there is none)."""
    from ggwgpu.backends.wgpu_backend import NoAdapterError
    try:
        return shared_wgpu_backend(), None
    except NoAdapterError as e:
        return None, str(e)
    except Exception as e:  # an adapter but no device: report it, info must not crash
        return None, f"the WebGPU device failed to start: {type(e).__name__}: {e}"


def backend_choice(ctx) -> tuple[str, str]:
    """The backend name asked for (--backend, else $GGWGPU_BACKEND, else auto) and by whom."""
    if ctx.obj["backend"]:
        return ctx.obj["backend"].lower(), "--backend"
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR].lower(), f"${ENV_VAR}"
    return "auto", "default"


def select_backend(ctx):
    """The backend get_backend() picks for the --backend choice, as a click error if none."""
    from ggwgpu.backends.wgpu_backend import NoAdapterError
    name, by = backend_choice(ctx)
    try:
        # get_backend warns when auto falls back to NumPy: one plain line, not file:line
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backend = get_backend(name)
        for w in caught:
            click.echo(f"warning: {w.message}", err=True)
        return backend
    except NoAdapterError as e:
        raise click.ClickException(f"backend wgpu asked for by {by}, but {e}") from None
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def describe_backend(backend) -> str:
    if backend.name == "wgpu":
        info = backend.info
        return (f"wgpu ({info.get('device')}, {info.get('adapter_type')}, "
                f"{info.get('backend_type')})")
    return f"{backend.name} (the NumPy reference backend, no GPU)"


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n} ({n / size:.4g} {unit})"
    return str(n)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(ggwgpu.__version__, prog_name="ggwgpu")
@click.option("--backend", type=click.Choice(CHOICES, case_sensitive=False), default=None,
              help=f"Where graphs run. Default: ${ENV_VAR}, else auto (wgpu when an adapter "
                   "exists, else numpy).")
@click.pass_context
def cli(ctx, backend):
    """ggwgpu: ggml's training machinery as WGSL compute shaders on any WebGPU GPU."""
    ctx.obj = {"backend": backend}


# -- info -----------------------------------------------------------------------------------

@cli.command()
@click.pass_context
def info(ctx):
    """Show the WebGPU adapter and the backend ggwgpu will use.

    Adapter name, type and vendor, its key limits and features, where the WGSL shaders
    were found, and which backend graphs run on.
    """
    from ggwgpu.backends.wgpu_backend import shader_dir
    click.echo(f"ggwgpu {ggwgpu.__version__}")
    backend, why = wgpu_or_reason()
    if backend is None:
        click.echo(f"adapter: none ({why})")
    else:
        adapter, ai = backend.adapter, backend.info
        click.echo("adapter:")
        for label, value in (("device", ai.get("device")),
                             ("adapter type", ai.get("adapter_type")),
                             ("backend type", ai.get("backend_type")),
                             ("vendor", f"{ai.get('vendor') or '?'} "
                                        f"(id {ai.get('vendor_id', 0):#06x})"),
                             ("description", ai.get("description"))):
            click.echo(f"  {label:<14}{value}")
        click.echo("limits:")
        for key, label, is_bytes in LIMITS:
            value = adapter.limits.get(key)
            shown = human_bytes(value) if is_bytes and value is not None else value
            click.echo(f"  {label:<38}{shown}")
        features = sorted(str(f) for f in adapter.features)
        click.echo(f"features ({len(features)}):")
        click.echo(textwrap.fill(", ".join(features), width=88, initial_indent="  ",
                                 subsequent_indent="  ", break_on_hyphens=False))
    try:
        click.echo(f"shaders: {shader_dir()}")
    except FileNotFoundError as e:
        click.echo(f"shaders: not found ({e})")

    name, by = backend_choice(ctx)
    if name == "numpy":
        used = f"numpy (asked for by {by})"
    elif backend is not None:
        used = describe_backend(backend) + (f", asked for by {by}" if name == "wgpu" else "")
    elif name == "wgpu":
        used = f"none: wgpu asked for by {by}, but {why}"
    else:
        used = "numpy: no WebGPU adapter, so graphs run on the NumPy reference backend"
    click.echo(f"backend: {used}")


# -- ops test | grad ------------------------------------------------------------------------

def op_names(ctx, param, values) -> list[str]:
    names = []
    for value in values:
        name = value.lower()
        if name not in ggwgpu.OPS:
            raise click.BadParameter(f"unknown op {value!r}; valid ops: "
                                     f"{', '.join(sorted(ggwgpu.OPS))}")
        names.append(name)
    return names or list(ggwgpu.OPS)


op_option = click.option("--op", "names", multiple=True, callback=op_names, metavar="NAME",
                          help="Only this op (repeatable; RMS_NORM style accepted). "
                               "Default: every registered op.")


def run_cases(title: str, work) -> None:
    """Run `work` [(opdef, case, check)], print one line per case and a summary; exit 1 on
    any failure. A case that raises is a failure, not the end of the run."""
    descs = [testing.describe(case) for _, case, _ in work]
    op_w = max([len(opdef.name) for opdef, _, _ in work] + [2])
    case_w = min(36, max([len(d) for d in descs] + [4]))
    passed = failed = 0
    t0 = time.perf_counter()
    for (opdef, case, check), desc in zip(work, descs):
        try:
            result = check(opdef, case)
        except Exception as e:  # a broken kernel must not hide the other cases' results
            result = testing.Result(opdef.name, desc, False, f"{type(e).__name__}: {e}")
        passed, failed = passed + result.ok, failed + (not result.ok)
        status = "OK" if result.ok else click.style("FAIL", fg="red")
        click.echo(f"{result.op:<{op_w}}  {result.case:<{case_w}}  {status:<4}  {result.detail}")
    click.echo(f"{title}: {passed} passed, {failed} failed "
               f"({time.perf_counter() - t0:.1f} s)")
    if failed:
        raise SystemExit(1)


@cli.group()
def ops():
    """Check ops against their NumPy references.

    The op matrix of the test suite, as ggml's test-backend-ops: `ops test` for forward
    results, `ops grad` for gradients, optionally only for some ops (--op NAME).
    """


@ops.command("test")
@op_option
@click.pass_context
def ops_test(ctx, names):
    """Forward results of every case against the NumPy reference.

    Each case runs on the backend and is compared with the float64 NumPy reference: NaN and
    infinity placement, then normalized MSE; sentinels around every buffer catch stray writes.
    """
    backend = select_backend(ctx)
    work = [(ggwgpu.OPS[name], case, lambda o, c: testing.forward(o, c, backend))
            for name in names for case in testing.cases_of(name)]
    title = f"ops test on {describe_backend(backend)}"
    if backend.name != "wgpu":
        title += ": float32 references against float64 ones, no shader ran"
    run_cases(title, work)


def grad_check(backend):
    def check(opdef, case):
        fd = testing.finite_differences(opdef, case)
        if backend.name == "numpy":
            return fd
        dev = testing.backward_on(opdef, case, backend)
        return testing.Result(opdef.name, fd.case, fd.ok and dev.ok,
                              f"fd: {fd.detail}; {backend.name}: {dev.detail}")
    return check


@ops.command("grad")
@op_option
@click.pass_context
def ops_grad(ctx, names):
    """Backward of every gradient case against finite differences.

    The backward graph in float64 against central finite differences of the NumPy forward
    and, on a device backend, the device backward against the NumPy backward.
    """
    backend = select_backend(ctx)
    check = grad_check(backend)
    work = [(ggwgpu.OPS[name], case, check)
            for name in names for case in testing.cases_of(name, grad_only=True)]
    if backend.name == "numpy":
        title = "ops grad: finite differences only (numpy backend, no device backward)"
    else:
        title = f"ops grad: finite differences and backward on {describe_backend(backend)}"
    run_cases(title, work)


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


@cli.group()
def bench():
    """Benchmarks of the wgpu kernels against NumPy."""


@bench.command("matmul")
@click.option("--sizes", multiple=True, callback=parse_sizes, metavar="MxNxK[,...]",
              help="mul_mat(a [M,K], b [N,K]) -> [N,M] shapes (repeatable or comma-separated). "
                   f"Default: {','.join('x'.join(map(str, s)) for s in BENCH_SIZES)}.")
@click.option("--repeat", default=5, show_default=True, type=click.IntRange(min=1),
              help="Timed runs per shape, after one warm-up run.")
@click.pass_context
def bench_matmul(ctx, sizes, repeat):
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
               f"{'wgpu/numpy':>10}  {'max rel err':>11}")
    rng = np.random.default_rng(0)
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

        flop = 2.0 * m * n * k
        g_wgpu, g_numpy = flop / t_wgpu / 1e9, flop / t_numpy / 1e9
        click.echo(f"{m:>5} {n:>5} {k:>5}  {g_wgpu:>12.2f}  {g_numpy:>13.2f}  "
                   f"{g_wgpu / g_numpy:>10.3f}  {rel:>11.1e}")


# -- bench train ----------------------------------------------------------------------------

# The configs: model shapes and samples per batch.
BENCH_TRAIN_CONFIGS = {
    "tiny": dict(n_vocab=256, n_embd=128, n_head=4, n_layer=4, n_ff=352, n_ctx=64, batch=8),
    "small": dict(n_vocab=2048, n_embd=256, n_head=8, n_layer=8, n_ff=704, n_ctx=128, batch=8),
}
BENCH_TRAIN_MAX_REL_ERR = 1e-3


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


def timed_steps(step, n: int) -> tuple[float, float]:
    """(the loss of one warm-up step, mean seconds of the next n steps)."""
    loss = step()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return loss, (time.perf_counter() - t0) / n


def torch_llama_step(cfg, options, values: dict, batches):
    """One AdamW training step of the same llama in PyTorch on the CPU, as a function that
    returns the loss; None when torch is not importable (it is no dependency of ggwgpu)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    params = {name: torch.tensor(v, requires_grad=True) for name, v in values.items()}
    groups = [{"params": [p for p in params.values() if p.ndim >= 2],
               "weight_decay": options.weight_decay},
              {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=options.lr, betas=(options.beta1, options.beta2),
                            eps=options.eps)
    t, rot = cfg.n_ctx, cfg.rot
    inv_freq = cfg.rope_freq_scale * cfg.rope_freq_base ** (-2.0 * np.arange(rot // 2) / rot)
    theta = np.arange(t)[:, None] * inv_freq                       # (ctx, rot / 2)
    cos = torch.tensor(np.cos(theta), dtype=torch.float32)[:, None, :]
    sin = torch.tensor(np.sin(theta), dtype=torch.float32)[:, None, :]
    mask = torch.full((t, t), float("-inf")).triu(1)
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
        x = params["token_embd.weight"][torch.from_numpy(inputs).long()]
        for i in range(cfg.n_layer):
            w = {name[len(f"blk.{i}."):-len(".weight")]: p for name, p in params.items()
                 if name.startswith(f"blk.{i}.")}
            h = rms_norm(x, w["attn_norm"])
            q, k, v = (F.linear(h, w[f"attn_{n}"]).view(b, t, cfg.n_head, cfg.head_dim)
                       for n in "qkv")
            q, k, v = (y.transpose(1, 2) for y in (rope(q), rope(k), v))
            att = torch.softmax(q @ k.transpose(-1, -2) * scale + mask, -1) @ v
            x = x + F.linear(att.transpose(1, 2).reshape(b, t, cfg.n_embd), w["attn_output"])
            h = rms_norm(x, w["ffn_norm"])
            x = x + F.linear(F.silu(F.linear(h, w["ffn_gate"])) * F.linear(h, w["ffn_up"]),
                             w["ffn_down"])
        logits = F.linear(rms_norm(x, params["output_norm.weight"]), params["output.weight"])
        loss = F.cross_entropy(logits.reshape(-1, cfg.n_vocab),
                               torch.from_numpy(targets).long().reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if options.grad_clip:
            torch.nn.utils.clip_grad_norm_(list(params.values()), options.grad_clip)
        opt.step()
        return float(loss)

    return step


@bench.command("train")
@click.option("--config", "config_name", default="tiny", show_default=True,
              type=click.Choice(sorted(BENCH_TRAIN_CONFIGS)),
              help="tiny: vocab 256, embd 128, 4 heads, 4 layers, ff 352, ctx 64; small: vocab "
                   "2048, embd 256, 8 heads, 8 layers, ff 704, ctx 128; batch 8 for both.")
@click.option("--steps", default=5, show_default=True, type=click.IntRange(min=1),
              help="Timed training steps per backend, after one warm-up step.")
@click.option("--torch/--no-torch", "use_torch", default=True, show_default=True,
              help="Also time PyTorch CPU training of the same llama, when torch is importable.")
@click.pass_context
def bench_train(ctx, config_name, steps, use_torch):
    """Training tokens/s of a llama on wgpu, NumPy and (when importable) PyTorch CPU.

    Every backend trains the same model (same initial weights, AdamW, lr 1e-3) on the same
    random tokens: one warm-up step, then --steps timed steps, each with its loss read back.
    The wgpu and NumPy losses of the warm-up step must agree before any number is printed.
    For wgpu also: dispatches per step, host µs per dispatch (recording and submitting a
    step), device ms per step (from its submit until it is done) and the planned memory.
    """
    from ggwgpu.backends import NumpyBackend
    from ggwgpu.models.llama import LlamaConfig, init_parameters
    from ggwgpu.train import Trainer, TrainOptions

    shapes = dict(BENCH_TRAIN_CONFIGS[config_name])
    batch = shapes.pop("batch")
    cfg, options = LlamaConfig(**shapes), TrainOptions(batch=batch, lr=1e-3)
    name, by = backend_choice(ctx)
    wgpu_backend, why = (None, f"numpy asked for by {by}") if name == "numpy" \
        else wgpu_or_reason()
    if wgpu_backend is None and name == "wgpu":
        raise click.ClickException(f"backend wgpu asked for by {by}, but {why}")

    def trainer_on(backend):
        return Trainer(cfg, init_parameters(cfg, 0), backend, options,
                       RandomBatches(cfg.n_vocab, cfg.n_ctx, batch))

    n_params = sum(v.size for v in init_parameters(cfg, 0).values())
    tokens = batch * cfg.n_ctx
    click.echo(f"bench train {config_name}: {n_params / 1e6:.2f} M parameters (vocab "
               f"{cfg.n_vocab}, embd {cfg.n_embd}, {cfg.n_head} heads, {cfg.n_layer} layers, "
               f"ff {cfg.n_ff}), {batch} x {cfg.n_ctx} tokens per step, AdamW; 1 warm-up + "
               f"{steps} timed steps per backend")
    click.echo("wgpu: " + (describe_backend(wgpu_backend) if wgpu_backend else f"none ({why})"))

    # Correctness first: the warm-up steps, same weights and batch, before any timing.
    trainers = {"numpy": trainer_on(NumpyBackend())}
    if wgpu_backend is not None:
        trainers["wgpu"] = trainer_on(wgpu_backend)
    warm = {key: tr.train_step()["loss"] for key, tr in trainers.items()}
    if wgpu_backend is not None:
        rel = abs(warm["wgpu"] - warm["numpy"]) / max(abs(warm["numpy"]), 1e-30)
        if not rel <= BENCH_TRAIN_MAX_REL_ERR:  # also catches NaN
            raise click.ClickException(
                f"wgpu training is wrong: warm-up loss {warm['wgpu']:.6f}, NumPy's "
                f"{warm['numpy']:.6f} (relative difference {rel:.2e} > "
                f"{BENCH_TRAIN_MAX_REL_ERR:.0e}); no timing reported")

    # NumPy and torch before wgpu: lavapipe's threads stay busy for a while after its runs.
    loss, seconds = {}, {}
    _, seconds["numpy"] = timed_steps(lambda: trainers["numpy"].train_step()["loss"], steps)
    loss["numpy"] = warm["numpy"]
    torch_why = "--no-torch"
    if use_torch:
        torch_step = torch_llama_step(cfg, options, init_parameters(cfg, 0),
                                      RandomBatches(cfg.n_vocab, cfg.n_ctx, batch))
        torch_why = "not importable"
        if torch_step is not None:
            loss["torch"], seconds["torch"] = timed_steps(torch_step, steps)
    if wgpu_backend is not None:
        _, seconds["wgpu"] = timed_steps(lambda: trainers["wgpu"].train_step()["loss"], steps)
        loss["wgpu"] = warm["wgpu"]

    rate = {key: tokens / s for key, s in seconds.items()}
    click.echo(f"{'backend':<8} {'tokens/s':>10} {'ms/step':>9} {'warm-up loss':>13} "
               f"{'x torch':>8}")
    for key in ("wgpu", "numpy", "torch"):
        if key not in rate:
            shown = why if key == "wgpu" else torch_why
            click.echo(f"{key:<8} {'-':>10} {'-':>9} {'-':>13} {'-':>8}  ({shown})")
            continue
        ratio = f"{rate[key] / rate['torch']:.3f}" if "torch" in rate else "-"
        click.echo(f"{key:<8} {rate[key]:>10.0f} {1e3 * seconds[key]:>9.1f} "
                   f"{loss[key]:>13.6f} {ratio:>8}")
    if "torch" in rate:
        click.echo("ratios: " + ", ".join(f"{key}/torch {rate[key] / rate['torch']:.3f}"
                                          for key in ("wgpu", "numpy") if key in rate))
    if "wgpu" in rate:
        click.echo(f"ratio: wgpu/numpy {rate['wgpu'] / rate['numpy']:.3f}")
    if wgpu_backend is None:
        return

    # One planned step, inputs already written: recording + submitting, then the device.
    plan = trainers["wgpu"].plan
    n_dispatch = len(plan.recorded)
    host, device = [], []
    for _ in range(steps):
        plan.sync()
        t0 = time.perf_counter()
        plan.run()
        t1 = time.perf_counter()
        plan.sync()
        host.append(t1 - t0)
        device.append(time.perf_counter() - t1)
    profile = plan.profile()
    by_kernel = {}
    for kernel, s in profile:
        by_kernel[kernel] = by_kernel.get(kernel, 0.0) + s
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:3]
    click.echo(f"wgpu step: {n_dispatch} dispatches, host {1e6 * np.median(host) / n_dispatch:.2f}"
               f" µs/dispatch ({1e3 * np.median(host):.2f} ms to record and submit), device "
               f"{1e3 * np.median(device):.1f} ms/step (submit to done, wall clock)")
    click.echo(f"wgpu profile (each dispatch waited on alone): "
               f"{1e3 * sum(s for _, s in profile):.1f} ms; most: " +
               ", ".join(f"{k} {1e3 * s:.1f} ms" for k, s in top))
    layout = plan.layout
    state = 4 * 4 * n_params    # weights, gradients, 2 AdamW moments; float32
    click.echo(f"wgpu memory (planned): peak {human_bytes(layout.peak_bytes)}, buffers "
               f"{human_bytes(layout.total_bytes)} ({layout.total_bytes / layout.peak_bytes:.3f}"
               f" x peak); weights+grads+moments {human_bytes(state)}, peak = "
               f"{layout.peak_bytes / state:.3f} x that")


# -- demo -----------------------------------------------------------------------------------

@cli.command()
@click.option("--steps", default=300, show_default=True, type=click.IntRange(min=1),
              help="Full-batch AdamW steps.")
@click.option("--lr", default=0.02, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="AdamW learning rate.")
@click.option("--seed", default=0, show_default=True, type=int, help="Data and init seed.")
@click.pass_context
def demo(ctx, steps, lr, seed):
    """Fit a tiny MLP through the autodiff graph; the loss must fall.

    A 2-layer MLP regresses a fixed nonlinear function of random inputs. The graph
    (mul_mat, bias add, silu, mul_mat, mean squared error, its backward and an AdamW update
    of every parameter) is built and planned once; every step is one submission.
    """
    from ggwgpu.demo import fit_demo
    backend = select_backend(ctx)
    click.echo(f"demo on {describe_backend(backend)}: {steps} steps, lr {lr}, seed {seed}")
    t0 = time.perf_counter()
    history = fit_demo(backend, steps=steps, lr=lr, seed=seed, log=click.echo)
    first, last = history[0], history[-1]
    if not (np.isfinite(last) and last < first):
        raise click.ClickException(f"loss did not fall: {first:.6g} -> {last:.6g} "
                                   f"(try a smaller --lr)")
    click.echo(f"loss fell from {first:.6f} to {last:.6f} ({first / last:.0f}x) in {steps} "
               f"steps, {time.perf_counter() - t0:.1f} s")


# -- plot -----------------------------------------------------------------------------------

@cli.command()
@click.argument("log", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", type=click.Path(dir_okay=False),
              help="The PNG to write. Default: the log's name with .png.")
def plot(log, out):
    """Plot the loss (and learning rate) of a `train --log` JSONL file as a PNG.

    Needs matplotlib: pip install 'ggwgpu[plot]'.
    """
    import json
    from pathlib import Path
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("plot needs matplotlib: pip install 'ggwgpu[plot]'") from None
    records = []
    for number, line in enumerate(Path(log).read_text().splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise click.ClickException(f"{log}, line {number}: not JSON ({e})") from None
    if not records or not all("step" in r and "loss" in r for r in records):
        raise click.ClickException(f"{log} has no training records (step and loss)")
    out = out or str(Path(log).with_suffix(".png"))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    if all("lr" in r for r in records):
        lr_ax = ax.twinx()
        lr_ax.plot([r["step"] for r in records], [r["lr"] for r in records], color="gray",
                   linewidth=0.8, label="learning rate")
        lr_ax.set_ylabel("learning rate")
    ax.set_title(Path(log).name)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    click.echo(f"wrote {out}")


# -- train ----------------------------------------------------------------------------------

def positive(kind=int):
    return click.IntRange(min=1) if kind is int else click.FloatRange(min=0, min_open=True)


def training_loop(trainer, steps: int, log_path, save_every: int, save_checkpoint):
    """Run `steps` optimizer steps under a progress bar: a JSON line per step to `log_path`,
    `save_checkpoint()` every `save_every` steps (0: never) and once at the end. Returns the
    first and last loss and the seconds taken. The train and finetune commands share it."""
    import json
    start = trainer.step
    log = open(log_path, "a") if log_path else None
    first = last = None
    t0, shown = time.perf_counter(), {}
    try:
        with click.progressbar(length=steps, label="training", show_eta=True,
                               item_show_func=lambda _: shown.get("text")) as bar:
            for _ in range(steps):
                record = trainer.train_step()
                elapsed = time.perf_counter() - t0
                record["tokens_per_s"] = trainer.step_tokens * (record["step"] - start) / elapsed
                first = record["loss"] if first is None else first
                last = record["loss"]
                shown["text"] = (f"step {record['step']} loss {last:.3f} "
                                 f"{record['tokens_per_s']:.0f} tok/s lr {record['lr']:.2e}")
                if log:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                if save_every and record["step"] % save_every == 0:
                    save_checkpoint()
                bar.update(1)
    finally:
        if log:
            log.close()
    if save_every:
        save_checkpoint()
    return first, last, time.perf_counter() - t0


@cli.command()
@click.argument("texts", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--out", default="model.gguf", show_default=True, type=click.Path(dir_okay=False),
              help="The trained model, a llama GGUF.")
@click.option("--vocab-model", type=click.Path(exists=True, dir_okay=False),
              help="Use the vocabulary of this llama GGUF (default: bytes, no file needed).")
@click.option("--n-embd", default=128, show_default=True, type=positive())
@click.option("--n-head", default=4, show_default=True, type=positive())
@click.option("--n-layer", default=4, show_default=True, type=positive())
@click.option("--n-ff", default=352, show_default=True, type=positive())
@click.option("--n-ctx", default=64, show_default=True, type=positive(), help="Tokens per sample.")
@click.option("--n-rot", type=positive(), help="Rotated dims per head. Default: the head dim (llama.cpp requires that).")
@click.option("--rope-freq-base", default=10000.0, show_default=True, type=positive(float))
@click.option("--rope-freq-scale", default=1.0, show_default=True, type=positive(float))
@click.option("--norm-eps", default=1e-5, show_default=True, type=positive(float))
@click.option("--batch", default=8, show_default=True, type=positive(),
              help="Samples per micro-batch.")
@click.option("--grad-accum", default=1, show_default=True, type=positive(),
              help="Micro-batches whose gradients add up to one optimizer step.")
@click.option("--samples-after-nl", is_flag=True, help="Start samples only after newlines.")
@click.option("--steps", default=300, show_default=True, type=positive(), help="Optimizer steps.")
@click.option("--epochs", type=positive(float), help="Train this many epochs instead of --steps.")
@click.option("--optimizer", default="adamw", show_default=True,
              type=click.Choice(["adamw", "sgd"]))
@click.option("--lr", default=1e-3, show_default=True, type=positive(float))
@click.option("--beta1", default=0.9, show_default=True, type=click.FloatRange(0, 1, max_open=True))
@click.option("--beta2", default=0.999, show_default=True, type=click.FloatRange(0, 1, max_open=True))
@click.option("--adam-eps", default=1e-8, show_default=True, type=positive(float))
@click.option("--weight-decay", default=0.1, show_default=True, type=click.FloatRange(min=0),
              help="AdamW decay, relative to the learning rate, on tensors with >= 2 dims.")
@click.option("--grad-clip", default=1.0, show_default=True, type=click.FloatRange(min=0),
              help="Clip gradients to this global norm (0: off).")
@click.option("--warmup", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--cos-decay-steps", default=1000, show_default=True, type=positive())
@click.option("--cos-decay-min", default=0.1, show_default=True, type=click.FloatRange(0, 1))
@click.option("--cos-decay-restart", default=1.1, show_default=True, type=click.FloatRange(min=1))
@click.option("--restarts/--no-restarts", default=False, show_default=True)
@click.option("--flash-attn", is_flag=True, help="Fused attention (same results, less memory).")
@click.option("--checkpointing", is_flag=True,
              help="Gradient checkpointing: recompute activations, keep block outputs only.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--checkpoint-in", type=click.Path(exists=True, dir_okay=False),
              help="Resume from this checkpoint (model, optimizer, data order, options).")
@click.option("--checkpoint-out", type=click.Path(dir_okay=False),
              help="Write a checkpoint here (atomically) every --save-every steps and at the end.")
@click.option("--save-every", default=100, show_default=True, type=positive())
@click.option("--log", "log_path", type=click.Path(dir_okay=False),
              help="Append a JSON line per step here.")
@click.option("--predict", default=0, show_default=True, type=click.IntRange(min=0),
              help="At the end, sample this many tokens from the trained model (prompt: the "
                   "text's first line; generate's default sampling, --seed).")
@click.pass_context
def train(ctx, texts, out, vocab_model, n_embd, n_head, n_layer, n_ff, n_ctx, n_rot,
          rope_freq_base, rope_freq_scale, norm_eps, batch, grad_accum, samples_after_nl, steps,
          epochs, optimizer, lr, beta1, beta2, adam_eps, weight_decay, grad_clip, warmup,
          cos_decay_steps, cos_decay_min, cos_decay_restart, restarts, flash_attn,
          checkpointing, seed, checkpoint_in, checkpoint_out, save_every, log_path,
          predict):
    """Train a llama from scratch on text files (default: the bundled Shakespeare corpus).

    The model is exported as a llama GGUF that llama.cpp loads. Defaults are a small model
    that trains in minutes on a CPU; llama.cpp's train-text-from-scratch used --n-embd 256
    --n-head 8 --n-layer 16 --n-ff 768 --n-ctx 128.
    """
    from ggwgpu import data, gguf_io, tokenizer as tok
    from ggwgpu.models.llama import LlamaConfig, init_parameters
    from ggwgpu.tensor import ShapeError
    from ggwgpu.train import Trainer, TrainOptions, token_digest, unigram_entropy

    try:
        text = data.read_texts(texts) if texts else data.bundled_corpus()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    source = ", ".join(texts) if texts else "the bundled corpus (Shakespeare)"

    if checkpoint_in:
        try:
            cfg, values, tokenizer, opt_state, state = gguf_io.load_checkpoint(checkpoint_in)
        except gguf_io.GGUFError as e:
            raise click.ClickException(str(e)) from None
        options = TrainOptions(**state["options"])
        step = state["step"]
    else:
        tokenizer = tok.load_vocab(vocab_model) if vocab_model else tok.ByteTokenizer()
        try:
            cfg = LlamaConfig(n_vocab=tokenizer.n_vocab, n_embd=n_embd, n_head=n_head,
                              n_layer=n_layer, n_ff=n_ff, n_ctx=n_ctx, n_rot=n_rot,
                              norm_eps=norm_eps, rope_freq_base=rope_freq_base,
                              rope_freq_scale=rope_freq_scale)
        except ShapeError as e:
            raise click.UsageError(str(e)) from None
        options = TrainOptions(optimizer=optimizer, batch=batch, grad_accum=grad_accum, lr=lr,
                               beta1=beta1,
                               beta2=beta2, eps=adam_eps,
                               weight_decay=weight_decay, grad_clip=grad_clip, warmup=warmup,
                               cos_decay_steps=cos_decay_steps, cos_decay_min=cos_decay_min,
                               cos_decay_restart=cos_decay_restart, restarts=restarts,
                               flash_attn=flash_attn, checkpointing=checkpointing, seed=seed)
        values, opt_state, state, step = init_parameters(cfg, seed), None, None, 0

    tokens = tokenizer.encode(text)
    digest = token_digest(tokens)
    if state is not None and state.get("tokens_digest") != digest:
        raise click.UsageError(f"{checkpoint_in} was trained on other text (tokens "
                               f"{state.get('tokens_digest')}, these are {digest}): pass "
                               "the same text files to resume")
    try:
        samples = data.Samples(tokens, cfg.n_ctx, options.batch, options.seed, tokenizer.bos_id,
                               after_newline=samples_after_nl,
                               newline_ids=tokenizer.newline_ids)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if state is not None:
        samples.load_state(state["data"])
    if epochs:
        steps = max(1, round(epochs * samples.n_samples / (options.batch * options.grad_accum)))

    backend = select_backend(ctx)
    trainer = Trainer(cfg, values, backend, options, samples, opt_state, step)
    entropy = unigram_entropy(tokens)
    click.echo(f"train on {describe_backend(backend)}")
    click.echo(f"data: {source}: {len(tokens)} tokens, {samples.n_samples} samples of "
               f"{cfg.n_ctx}; unigram entropy {entropy:.3f} nats/token")
    n_params = sum(v.size for v in values.values())
    click.echo(f"model: {n_params / 1e6:.2f} M parameters, {cfg.n_layer} layers, embd "
               f"{cfg.n_embd}, {cfg.n_head} heads, ff {cfg.n_ff}; {steps} steps of "
               f"{options.batch * options.grad_accum} x {cfg.n_ctx} tokens" +
               (f", resuming at step {step}" if step else ""))

    def save_checkpoint():
        state = {**trainer.state(), "tokens_digest": digest}
        gguf_io.save_checkpoint(checkpoint_out, cfg, trainer.parameters(), tokenizer,
                                trainer.optimizer_state(), state)

    first, last, seconds = training_loop(trainer, steps, log_path,
                                         save_every if checkpoint_out else 0,
                                         save_checkpoint)
    gguf_io.save_model(out, cfg, trainer.parameters(), tokenizer)
    click.echo(f"loss {first:.3f} -> {last:.3f} nats/token (unigram entropy {entropy:.3f}) "
               f"in {seconds:.0f} s; model written to {out}")
    if predict:
        prompt = text.split("\n", 1)[0]
        click.echo(f"sample of {predict} tokens:")
        stream_sample(backend, cfg, trainer.parameters(), tokenizer, prompt, predict,
                      Sampling(), seed)


# -- generate -------------------------------------------------------------------------------

def stream_sample(backend, cfg, values, tokenizer, prompt, n, sampling, seed):
    """Print the prompt, then the continuation as it comes (flushed piece by piece), then a
    timing line on stderr."""
    from ggwgpu.generate import Decoder, TextStream, generate_tokens, prompt_tokens
    t0 = time.perf_counter()
    decoder = Decoder(backend, cfg, values)
    ids = prompt_tokens(tokenizer, prompt)
    stream = TextStream(tokenizer, ids)
    click.echo(stream.push(), nl=False)
    t1, count = time.perf_counter(), 0
    for token in generate_tokens(decoder, ids, n, sampling, seed, tokenizer.bos_id,
                                 tokenizer.eos_id):
        count += 1
        piece = stream.push(token)
        if piece:
            click.echo(piece, nl=False)
            sys.stdout.flush()
    click.echo(stream.finish())
    t2 = time.perf_counter()
    click.echo(f"{count} tokens in {t2 - t1:.2f} s ({count / (t2 - t1):.1f} tokens/s, the prompt "
               f"pass of {len(ids)} tokens included; planning {t1 - t0:.2f} s)", err=True)


@cli.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.option("--prompt", "-p", default="", help="Text to continue (BOS is put before it).")
@click.option("--n-predict", "-n", default=200, show_default=True, type=click.IntRange(min=0),
              help="Tokens to generate at most (it stops earlier at EOS).")
@click.option("--temp", default=Sampling.temperature, show_default=True,
              type=click.FloatRange(min=0), help="Temperature; 0 is greedy (the most likely "
                                                 "token, whatever the seed).")
@click.option("--top-k", default=Sampling.top_k, show_default=True, type=int,
              help="Keep the k most likely tokens (<= 0: all).")
@click.option("--top-p", default=Sampling.top_p, show_default=True,
              type=click.FloatRange(0, 1, min_open=True),
              help="Then keep the most likely tokens up to this probability mass (1: all).")
@click.option("--repeat-penalty", default=Sampling.repeat_penalty, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="Make the tokens of the last --repeat-last-n less likely (1: off).")
@click.option("--repeat-last-n", default=Sampling.repeat_last_n, show_default=True,
              type=click.IntRange(min=0), help="Context tokens the repeat penalty looks at.")
@click.option("--seed", default=0, show_default=True, type=int, help="Sampling seed.")
@click.pass_context
def generate(ctx, model, prompt, n_predict, temp, top_k, top_p, repeat_penalty, repeat_last_n,
             seed):
    """Continue a prompt with a llama GGUF model (ours or llama.cpp's f32/f16 llama files).

    The model runs with a KV cache on the chosen backend and the host samples as llama.cpp
    does: repeat penalty, top-k, top-p, temperature. When the model's context (n_ctx) is
    full, the window slides to BOS plus its last half and is recomputed.
    """
    from ggwgpu import gguf_io
    try:
        cfg, values, tokenizer = gguf_io.load_model(model)
    except gguf_io.GGUFError as e:
        raise click.ClickException(str(e)) from None
    if not prompt and tokenizer.bos_id is None:
        raise click.UsageError(f"{model}'s vocabulary has no BOS token: give a --prompt")
    backend = select_backend(ctx)
    click.echo(f"generate on {describe_backend(backend)}: {model}, n_ctx {cfg.n_ctx}, "
               f"seed {seed}", err=True)
    sampling = Sampling(temp, top_k, top_p, repeat_penalty, repeat_last_n)
    stream_sample(backend, cfg, values, tokenizer, prompt, n_predict, sampling, seed)


if __name__ == "__main__":
    cli()
