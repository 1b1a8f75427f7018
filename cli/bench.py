"""`ggwgpu bench matmul|ops|train|memory`: speed and memory of the wgpu backend against NumPy
(and PyTorch CPU when importable). Registered on the `ggwgpu` group by main.py.

Every bench checks the wgpu results against NumPy before it prints a number, prints for wgpu
the dispatches per step, host µs per dispatch (recording and submitting a planned step,
divided by its dispatches), device ms per step (timestamp queries, where the adapter has
them) and the planned memory, and writes what it printed as JSON with --json PATH.

Only absolute imports of `ggwgpu` here (see main.py).
"""
from __future__ import annotations

import json
import math

import click
import numpy as np

from ggwgpu.bench import (BENCH_MAX_REL_ERR, BENCH_SIZES, BENCH_TRAIN_CONFIGS,
                          BENCH_TRAIN_MAX_REL_ERR, F16_KEY, HOST_SHARE_BUDGET, MEMORY_BUDGET,
                          BenchConfig, BenchError, DispatchCounter, RandomBatches, bench_model,
                          bench_trainer, bench_weights, checked_trainers, describe_config,
                          dispatches_per_layer, f16_trainer, in_own_process, matmul_row,
                          memory_against_minimum, op_times, planned_memory, rate_ratios,
                          step_stats, timed_steps, timed_wgpu_steps, torch_matmul, torch_peer,
                          torch_peer_refusal, train_step_stats)
from ggwgpu.backends.tuning import summary as tuning_summary, tuning_report

from .common import (backend_choice, check_memory, describe_backend, human_bytes, positive_ints,
                     wgpu_or_reason)
from .outputs import check_writable

# The library's bench machinery, named here too for the tests and bench_ranks: the configs,
# their model and trainer, the checks' bounds, the dispatch counter, the memory accounting
# and the PyTorch peer (which bench train calls by this module's name).
__all__ = ["BENCH_MAX_REL_ERR", "BENCH_TRAIN_CONFIGS", "BENCH_TRAIN_MAX_REL_ERR",
           "MEMORY_BUDGET", "BenchConfig", "DispatchCounter", "RandomBatches", "bench_model",
           "bench_trainer", "bench_weights", "dispatches_per_layer", "in_own_process",
           "memory_against_minimum", "torch_peer", "bench", "config_option", "json_option",
           "write_json"]

CONFIG_HELP = ("tiny: vocab 256, embd 128, 4 heads, 4 layers, ff 352, ctx 64; small: vocab "
               "2048, embd 256, 8 heads, 8 layers, ff 704, ctx 128; batch 8 for both. "
               "smollm-135m, smollm-360m: SmolLM2's shapes (30 layers, embd 576, 9/3 heads, ff "
               "1536; 32 layers, embd 960, 15/5 heads, ff 2560; vocab 49152, tied), a rank-4 "
               "LoRA on a frozen q4_0 base (smollm-135m-q8: q8_0; smollm-135m-full: every "
               "weight in f32), 4 x 128 tokens, checkpointing; smollm-135m-lora-f32: the "
               "LoRA on an f32 base without checkpointing, as the PyTorch peer trains it.")

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


def echo_step_stats(s: dict):
    device = ("no timestamp queries on this adapter" if s["device_ms"] is None
              else f"{s['device_ms']:.2f} ms/step (timestamp queries)")
    click.echo(f"wgpu step: {s['dispatches']} dispatches, host {s['host_us_per_dispatch']:.2f} "
               f"µs/dispatch ({s['host_ms']:.2f} ms to record and submit), device {device}, "
               f"{s['wall_ms']:.1f} ms submit to done; the whole step {s['step_ms']:.1f} ms in "
               f"one submit, {s['in_parts_ms']:.1f} ms submitted in parts")
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
@click.option("--torch-device", type=click.Choice(["cpu", "cuda"]),
              help="Also time PyTorch's f32 matmul there (TF32 off), in a process of its own.")
@json_option
@click.pass_context
def bench_matmul(ctx, sizes, repeat, torch_device, json_path):
    """GFLOP/s of the wgpu mul_mat and of NumPy's matmul on the same shapes.

    wgpu: the mean time of back-to-back runs of a planned graph (one submit each) up to the
    GPU finishing. NumPy: the median time of `b @ a.T` in float32. Each shape's wgpu result
    is checked against float64 NumPy before any number is printed. With --torch-device,
    PyTorch's `b @ a.T` in f32 as well, timed as wgpu is: on a CUDA GPU, cuBLAS's f32 rate
    on a large shape is the card's measured f32 rate.
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
        try:
            row = matmul_row(backend, m, n, k, repeat, rng)
        except BenchError as e:
            raise click.ClickException(str(e)) from None
        device = "-" if row["device_ms"] is None else f"{row['device_ms']:.3f}"
        click.echo(f"{m:>5} {n:>5} {k:>5}  {row['gflops']['wgpu']:>12.2f}  "
                   f"{row['gflops']['numpy']:>13.2f}  {row['ratio_wgpu_numpy']:>10.3f}  "
                   f"{row['max_rel_err']:>11.1e}  {row['dispatches']:>10}  "
                   f"{row['host_us_per_dispatch']:>12.2f}  {device:>9}  "
                   f"{row['memory']['planned']:>13}")
        if row["tuned"]:
            click.echo("  timed on the device: " + ", ".join(
                f"{name} {ms:.3f} ms" for name, ms in row["tuned"]["ms"].items())
                + f"; runs {row['tuned']['chosen']}")
        rows.append(row)
    if torch_device:
        rates, failed = in_own_process(torch_matmul, sizes, repeat, torch_device)
        if rates is None:
            click.echo(f"torch {torch_device}: " + (f"failed: {failed}" if failed
                                                    else "not importable"))
        for row in rows if rates else []:
            row["torch_gflops"] = rate = rates[f"{row['m']}x{row['n']}x{row['k']}"]
            row["ratio_wgpu_torch"] = row["gflops"]["wgpu"] / rate
            click.echo(f"torch {torch_device} {row['m']}x{row['n']}x{row['k']}: {rate:.2f} "
                       f"GFLOP/s f32, wgpu/torch {row['ratio_wgpu_torch']:.3f}")
    write_json(json_path, {"bench": "matmul", "device": describe_backend(backend),
                           "torch_device": torch_device, "shapes": rows})


# -- bench train -----------------------------------------------------------------------------

def checked(make, *args, **kwargs):
    """make(*args, **kwargs), a BenchError (wrong results: no timing) as a click error."""
    try:
        return make(*args, **kwargs)
    except BenchError as e:
        raise click.ClickException(str(e)) from None


def precision_list(ctx, param, value) -> list[str]:
    """--precision of bench memory: f32 and/or f16, comma-separated, f32 first."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in ("f32", "f16")]
    if unknown or not names:
        raise click.BadParameter(f"{value!r}: give f32, f16 or f32,f16")
    return sorted(set(names), key=("f32", "f16").index)


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
    # before any weight exists: a huge --layers is refused, not built until memory runs out
    from ggwgpu import memory
    check_memory(ctx, f"bench train --config {config_name}", cfg, batch=options.batch,
                 trained=0 if config.lora else memory.parameter_count(cfg))
    wgpu_backend, why = wgpu_for(ctx, "bench train")
    click.echo(f"bench train {describe_config(config_name, **changes)}; 1 warm-up + {steps} "
               f"timed step{'s' if steps > 1 else ''} per backend")
    click.echo("wgpu: " + (describe_backend(wgpu_backend) if wgpu_backend else f"none ({why})"))
    trainers, warm, plan_seconds = checked(checked_trainers, config_name, wgpu_backend,
                                           **changes)
    click.echo("planning (graph, backward, storage plan, upload): " + ", ".join(
        f"{key} {s:.1f} s" for key, s in plan_seconds.items()))

    # NumPy and torch before wgpu: lavapipe's threads stay busy for a while after its runs.
    loss, seconds = {}, {}
    _, seconds["numpy"] = timed_steps(lambda: trainers["numpy"].train_step()["loss"], steps)
    loss["numpy"] = warm["numpy"]
    refusal = torch_peer_refusal(cfg, config.base)
    torch_why = "--no-torch"
    if refusal:
        torch_why = f"no peer: {refusal}"
    elif use_torch:
        peer, failed = in_own_process(torch_peer, cfg, options, steps, torch_device,
                                      config.lora_rank if config.lora else 0)
        torch_why = f"failed: {failed}" if failed else "not importable"
        if peer is not None:
            loss["torch"], seconds["torch"] = peer["loss"], peer["seconds"]
    if wgpu_backend is not None:
        plan = trainers["wgpu"].plan
        seconds["wgpu"], host = timed_wgpu_steps(trainers["wgpu"], steps)
        loss["wgpu"] = warm["wgpu"]
    half = None
    if wgpu_backend is not None and wgpu_backend.has_f16:
        half = checked(f16_trainer, config_name, wgpu_backend, warm["numpy"], **changes)
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
        report["dispatches"] = counts = checked(dispatches_per_layer, config_name,
                                                wgpu_backend, cfg, plan)
        echo_dispatches(counts)
        nodes = plan.nodes + (half.plan.nodes if half is not None else [])
        report["tuned_products"] = tuned = tuning_report(wgpu_backend, nodes)
        if tuned:
            click.echo(f"wgpu: {tuning_summary(tuned)} (--json has each one's times)")
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
    ratios = rate_ratios(rate)
    if ratios:
        click.echo("ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return ratios


def echo_train_step_stats(s: dict):
    verdict = "within" if s["host_share"] <= HOST_SHARE_BUDGET else "over"
    click.echo(f"wgpu step: {s['dispatches']} dispatches, host {s['host_us_per_dispatch']:.2f} "
               f"µs/dispatch; host work {s['host_ms']:.2f} ms of the {s['step_ms']:.0f} ms "
               f"step = {100 * s['host_share']:.3f} % ({verdict} the "
               f"{100 * HOST_SHARE_BUDGET:.0f} % budget)")


# -- dispatches per layer -------------------------------------------------------------------

# Ops a layer dispatches that a fused kernel could absorb next, and into what (printed for
# those a layer has, most dispatches first).
FUSION_HINTS = (
    (("add",), "residual and gradient sums beside a frozen weight's product: an epilogue in "
               "mul_mat_q and mul_mat_q_back; the residual stream's gradient sums"),
    (("scale",), "a factor left outside a product (mul_mat takes alpha)"),
    (("soft_max", "soft_max_back"), "the causal softmax: flash attention fuses it with both "
                                    "products"),
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
    once op by op: on wgpu each dispatch is timed alone (WgpuPlan.profile): on the device by
    timestamp queries where the adapter has them, else submitted and waited on, so that the
    times include a submit and a wait each; NumPy times each node. Then the wgpu time by
    kernel (shader and entry point), the kernel variants the adapter was given included.
    """
    wgpu_backend, why = wgpu_for(ctx, "bench ops")
    if wgpu_backend is None:
        raise click.ClickException(f"bench ops times the wgpu backend against NumPy: {why}")
    click.echo(f"bench ops {describe_config(config_name)}")
    click.echo("wgpu: " + describe_backend(wgpu_backend))
    trainers, _, _ = checked(checked_trainers, config_name, wgpu_backend)
    times = op_times(trainers)
    ops, total = times["ops"], times["total_ms"]
    ranked = sorted(ops.items(), key=lambda kv: -kv[1]["wgpu_ms"])
    click.echo(f"{'op':<24} {'nodes':>5} {'disp':>5} {'wgpu ms':>9} {'numpy ms':>9} "
               f"{'wgpu/numpy':>10}")
    for op, r in ranked[:top]:
        speed = r["numpy_ms"] / r["wgpu_ms"] if r["wgpu_ms"] else math.inf
        click.echo(f"{op:<24} {r['nodes']:>5} {r['dispatches']:>5} {r['wgpu_ms']:>9.2f} "
                   f"{r['numpy_ms']:>9.2f} {speed:>10.3f}")
    click.echo(f"{'all':<24} {times['nodes']:>5} {times['dispatches']:>5} "
               f"{total['wgpu']:>9.2f} {total['numpy']:>9.2f} "
               f"{total['numpy'] / total['wgpu']:>10.3f}  "
               "(wgpu/numpy: speed ratio, numpy ms / wgpu ms)")
    click.echo("wgpu ms: " + ("device time, from timestamp queries around each dispatch"
                              if times["wgpu_clock"] == "device" else
                              "host time of a submit and a wait per dispatch (this adapter "
                              "has no timestamp queries)"))
    kernels = sorted(times["kernels"].items(), key=lambda kv: -kv[1]["wgpu_ms"])
    click.echo(f"{'kernel':<48} {'disp':>5} {'wgpu ms':>9} {'share':>6}")
    for kernel, r in kernels[:top]:
        click.echo(f"{kernel:<48} {r['dispatches']:>5} {r['wgpu_ms']:>9.2f} "
                   f"{r['wgpu_ms'] / total['wgpu']:>6.1%}")
    stats = step_stats(trainers["wgpu"].plan, repeat)
    echo_step_stats(stats)
    write_json(json_path, {"bench": "ops", "config": config_name, "ops": ops,
                           "kernels": times["kernels"], "wgpu_clock": times["wgpu_clock"],
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
    backend, _ = wgpu_for(ctx, "bench memory")
    backend = backend or NumpyBackend()
    click.echo(f"bench memory {describe_config(config_name)}; planned on "
               f"{describe_backend(backend)}; MiB")
    click.echo(f"{'layers':>6} {'ckpt':>5} {'prec':>4} {'weights':>8} {'grads':>8} "
               f"{'state':>8} {'inputs':>8} {'activ':>8} {'sum':>8} {'planned':>8} "
               f"{'planned/sum':>11}" + (f" {'f16/f32':>7}" if len(precisions) > 1 else ""))
    rows = []
    for row in planned_memory(config_name, backend, layers, precisions):
        rows.append(row)
        mib = [row[k] / 2**20 for k in ("weights", "gradients", "state", "inputs",
                                        "activations")]
        click.echo(f"{row['n_layer']:>6} {'yes' if row['checkpointing'] else 'no':>5} "
                   f"{row['precision']:>4} " + " ".join(f"{v:>8.2f}" for v in mib) +
                   f" {row['sum'] / 2**20:>8.2f} {row['planned'] / 2**20:>8.2f} "
                   f"{row['planned'] / row['sum']:>11.3f}" +
                   (f" {row['f16_of_f32']:>7.3f}" if "f16_of_f32" in row else ""))
    write_json(json_path, {"bench": "memory", "config": config_name, "rows": rows})
