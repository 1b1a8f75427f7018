"""The GPU check: on a machine with a hardware adapter, in one run of a few minutes, what
ggwgpu does there — the adapters seen, the op matrix (every op, kernel variant, f32 and
f16) forced onto the hardware adapter, `bench train` of the tiny, small and SmolLM2-135M
shapes on wgpu (f32, f16) next to PyTorch on the same GPU (CUDA, eager, the same model,
batch and optimizer), the step's largest product against the card's measured f32 rate
(cuBLAS on a 4096 cube, TF32 off), and where the 135M LoRA step's time goes by kernel
(timestamp queries) — ending with one table. `--lavapipe` is its mode for a
machine without a GPU (Mesa's software Vulkan, small configs, no CUDA peer): the test suite
runs it, so the script is proven before a GPU is at hand (tests/test_gpu_check.py).

On the GPU machine (which reaches no package registry), after tests/gpu/prepare.sh filled
.gl/ and .whl/ here, with .gl and .whl carried along, `bash tests/gpu/run.sh LOG` does all
of this:

    for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
    python3 -m pip install -q --no-deps --no-build-isolation .      # ggwgpu itself
    python3 tests/gpu/check.py

If Vulkan finds no driver: VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json.
`--budget SECONDS` fits the check into a time limit: the issue's targets run first, a step
gets what is left, and the table prints anyway. `--reports FILE` keeps every bench's JSON
report in one JSON file, by step ("bench ops smollm-135m-lora-f32": each kernel's time, not
just the table's top ones), written anew after each. Exit code 0 when every step passed;
the table says which did not.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (config, bench train options): the shapes of issue 31 on a GPU, a small one on lavapipe
# (those the targets name first; the others after bench matmul and bench ops)
# (the 135M LoRA steps once more with no product timed on the device: what tuning gains)
UNTUNED = {"GGWGPU_TUNE": "0"}
GPU_BENCHES = [("tiny", []), ("small", []), ("smollm-135m-lora-f32", ["--steps", "3"])]
GPU_MORE_BENCHES = [("smollm-135m-lora-f32", ["--steps", "3"], UNTUNED),
                    ("smollm-135m-full", ["--steps", "3"]), ("smollm-135m", ["--steps", "3"]),
                    ("smollm-135m", ["--steps", "3"], UNTUNED)]
LAVAPIPE_BENCHES = [("tiny", ["--layers", "2", "--steps", "1"])]
# bench matmul: the 135M step's largest product (the output head: vocab x tokens x embd, the
# first), its gradient's product (embd x tokens over the vocabulary: K cut into chunks side by
# side), its most common one (a 576 x 576 weight over 512 tokens: 72 tiles of 64 x 64), and a
# cube whose cuBLAS f32 rate is the card's measured f32 rate
GPU_MATMUL = "49152x512x576,576x512x49152,576x512x576,4096x4096x4096"
CARD_RATE_SHAPE = "4096x4096x4096"
LAVAPIPE_MATMUL = "256x512x256"
OPS_CONFIG = {False: "smollm-135m-lora-f32", True: "tiny"}    # bench ops, by --lavapipe
TOP_KERNELS = 6
# --budget: when the check must end (time.monotonic()); a step gets what is left of it, less
# the seconds kept to print the table, and none is started with less than MIN_STEP left
deadline = None
KEEP, MIN_STEP = 10, 20
reports = None          # --reports: the file that keeps each bench's JSON report, by step
OUT_OF_TIME = 125       # the exit code of a step not started: the budget ran out


def run(args: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    """(exit code, output, seconds) of `args`, output echoed as it comes; OUT_OF_TIME and
    nothing run where --budget leaves too little, cut at its end."""
    start = time.perf_counter()
    if deadline is not None:
        left = deadline - time.monotonic() - KEEP
        if left < MIN_STEP:
            print(f"$ {' '.join(args)}: not run, --budget ran out", flush=True)
            return OUT_OF_TIME, "", 0.0
        timeout = min(timeout, left)
    print(f"$ {' '.join(args)}", flush=True)
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, **(env or {})})
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, out = 124, f"{e.stdout or ''}{e.stderr or ''}\n(cut after {timeout:g} s)"
    print(out, flush=True)
    return code, out, time.perf_counter() - start


def ggwgpu(*args: str, timeout: float = 600, env: dict | None = None) -> tuple[int, str, float]:
    return run([sys.executable, "-m", "ggwgpu_cli.main", "--backend", "wgpu", *args], timeout,
               env)


def adapters() -> list[str]:
    import wgpu
    found = []
    for a in wgpu.gpu.enumerate_adapters_sync():
        info = a.info
        features = sorted(f for f in a.features if f in ("shader-f16", "subgroup",
                                                          "timestamp-query"))
        found.append(f"{info['device']} ({info['adapter_type']}, {info['backend_type']}; "
                     f"{', '.join(features)})")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lavapipe", action="store_true",
                        help="the software-Vulkan mode: small configs, no CUDA peer")
    parser.add_argument("--budget", type=float, default=0,
                        help="seconds the whole check may take: steps that do not fit are "
                             "cut or left out, and the table still prints (0: no limit)")
    parser.add_argument("--reports", type=Path,
                        help="a JSON file to keep each bench's report in, by step")
    o = parser.parse_args(argv)
    global deadline, reports
    deadline = time.monotonic() + o.budget if o.budget > 0 else None
    reports = o.reports
    rows, failed = [], []
    seen = adapters()
    print("adapters:\n  " + "\n  ".join(seen or ["none"]), flush=True)
    hardware = [a for a in seen if "CPU" not in a]
    if not o.lavapipe and not hardware:
        failed.append("no hardware adapter")
    code, out, _ = ggwgpu("info", timeout=120)
    # the op matrix on the adapter the backend picks (the hardware one where there is one)
    matrix = ["tests/test_ops.py"] + (["-k", "add and not grad and not f16"] if o.lavapipe
                                      else [])
    code, out, seconds = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              *matrix], 900, {"GGWGPU_REQUIRE_ADAPTER": "1"})
    summary = next((line for line in reversed(out.splitlines()) if " passed" in line
                    or " failed" in line), "no summary")
    rows.append(("op matrix", summary.strip("= ") if code != OUT_OF_TIME else OUT_OF_TIME_CELL,
                 f"{seconds:.0f} s"))
    if code:
        failed.append("op matrix")
    rows += train_rows(LAVAPIPE_BENCHES if o.lavapipe else GPU_BENCHES, o.lavapipe, failed)
    rows += matmul_rows(o.lavapipe, failed) + kernel_rows(o.lavapipe, failed)
    rows += train_rows([] if o.lavapipe else GPU_MORE_BENCHES, o.lavapipe, failed)
    print("\nGPU check" + (" (lavapipe mode)" if o.lavapipe else "") + ": "
          + (hardware[0] if hardware else seen[0] if seen else "no adapter"))
    width = max(len(r[0]) for r in rows)
    for name, what, seconds in rows:
        print(f"  {name:<{width}}  {what}  ({seconds})")
    print("result: " + ("ok" if not failed else "FAILED: " + ", ".join(failed)))
    return 1 if failed else 0


OUT_OF_TIME_CELL = "not run: --budget ran out"


def why_not(failed: list) -> str:
    """The table's cell of the step that failed last."""
    return OUT_OF_TIME_CELL if failed[-1].endswith(" (out of time)") else "failed"


def train_rows(benches, lavapipe: bool, failed: list) -> list[tuple]:
    """bench train rows: tokens/s of each backend, wgpu against PyTorch CUDA."""
    rows = []
    torch = ["--no-torch"] if lavapipe else ["--torch-device", "cuda"]
    from ggwgpu.backends.tuning import summary as tuning_summary
    for config, options, *env in benches:
        env = env[0] if env else {}
        label = config + "".join(f" {k}={v}" for k, v in env.items())
        r, seconds = bench_json(failed, f"bench train {label}", "train", "--config", config,
                                *options, *torch, env=env)
        if r is None:
            rows.append((f"bench {label}", why_not(failed), seconds))
            continue
        rate = r["tokens_per_s"]
        cells = [f"{k} {rate[k]:.0f} tok/s" for k in ("wgpu", "wgpu f16", "numpy", "torch")
                 if k in rate]
        if "torch" in rate and "wgpu" in rate:
            cells.append(f"wgpu/torch {rate['wgpu'] / rate['torch']:.3f}")
        if r.get("wgpu") and r["wgpu"].get("device_ms") is not None:
            cells.append(f"device {r['wgpu']['device_ms']:.1f} ms/step")
        if r.get("tuned_products"):
            cells.append(tuning_summary(r["tuned_products"]))
        rows.append((f"bench {label}", "; ".join(cells), seconds))
    return rows


def bench_json(failed: list, name: str, *args: str, env: dict | None = None
               ) -> tuple[dict | None, str]:
    """`ggwgpu bench ARGS --json` (with `env` added to the environment): (its report,
    seconds as a cell), or (None, ...) with `name` added to `failed`."""
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "bench.json"
        code, _, seconds = ggwgpu("bench", *args, "--json", str(report), env=env)
        if code or not report.exists():
            failed.append(name + (" (out of time)" if code == OUT_OF_TIME else ""))
            return None, f"{seconds:.0f} s"
        result = json.loads(report.read_text())
        if reports:     # all of them so far, in case a later step is cut
            kept = json.loads(reports.read_text()) if reports.exists() else {}
            reports.write_text(json.dumps({**kept, name: result}, indent=1) + "\n")
        return result, f"{seconds:.0f} s"


def matmul_rows(lavapipe: bool, failed: list) -> list[tuple]:
    """bench matmul rows: each shape's wgpu GFLOP/s (and PyTorch's, on CUDA), and the
    largest product's fraction of the card's measured f32 rate."""
    torch = [] if lavapipe else ["--torch-device", "cuda"]
    r, seconds = bench_json(failed, "bench matmul", "matmul", "--sizes",
                            LAVAPIPE_MATMUL if lavapipe else GPU_MATMUL, *torch)
    if r is None:
        return [("bench matmul", why_not(failed), seconds)]
    rows, card = [], None
    for s in r["shapes"]:
        shape = f"{s['m']}x{s['n']}x{s['k']}"
        cells = [f"wgpu {s['gflops']['wgpu']:.0f} GFLOP/s"
                 + (f" ({s['tuned']['chosen']}, timed fastest)" if s.get("tuned") else "")]
        if "torch_gflops" in s:
            cells.append(f"torch {s['torch_gflops']:.0f} GFLOP/s, wgpu/torch "
                         f"{s['ratio_wgpu_torch']:.3f}")
            if shape == CARD_RATE_SHAPE:
                card = s["torch_gflops"]
        rows.append((f"matmul {shape}", "; ".join(cells), seconds))
    if card:
        largest = r["shapes"][0]
        rows.append(("largest product", f"{largest['gflops']['wgpu'] / card:.3f} of the card's "
                     f"measured f32 rate ({card:.0f} GFLOP/s, cuBLAS {CARD_RATE_SHAPE})",
                     seconds))
    # the same products on the 'wide' kernel (128 x 128 tiles), against the adapter's own
    from ggwgpu.kernels import MATMUL_ENV
    wide, seconds = bench_json(failed, "bench matmul wide", "matmul", "--sizes",
                               LAVAPIPE_MATMUL if lavapipe else GPU_MATMUL,
                               env={MATMUL_ENV: "wide"})
    if wide is None:
        return rows + [("matmul wide", why_not(failed), seconds)]
    for own, s in zip(r["shapes"], wide["shapes"]):
        rows.append((f"matmul {s['m']}x{s['n']}x{s['k']} wide",
                     f"wgpu {s['gflops']['wgpu']:.0f} GFLOP/s, "
                     f"{s['gflops']['wgpu'] / own['gflops']['wgpu']:.2f} x the default run's",
                     seconds))
    return rows


def kernel_rows(lavapipe: bool, failed: list) -> list[tuple]:
    """bench ops: where a training step's time goes, by kernel, as shares of the step."""
    config = OPS_CONFIG[lavapipe]
    r, seconds = bench_json(failed, f"bench ops {config}", "ops", "--config", config,
                            "--repeat", "1")
    if r is None:
        return [(f"ops {config}", why_not(failed), seconds)]
    total = r["total_ms"]["wgpu"]
    ranked = sorted(r["kernels"].items(), key=lambda kv: -kv[1]["wgpu_ms"])[:TOP_KERNELS]
    clock = "device" if r["wgpu_clock"] == "device" else "host: submit and wait"
    step = r["wgpu"]
    return [(f"ops {config}", f"{total:.1f} ms a step, dispatch by dispatch ({clock}); "
             + ", ".join(f"{k} {v['wgpu_ms'] / total:.0%}" for k, v in ranked)
             + f"; run whole: {step['step_ms']:.1f} ms in one submit, "
             f"{step['in_parts_ms']:.1f} ms submitted in parts", seconds)]


if __name__ == "__main__":
    sys.exit(main())
