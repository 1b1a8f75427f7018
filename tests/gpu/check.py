"""The GPU check: on a machine with a hardware adapter, in one run of a few minutes, what
ggwgpu does there — the adapters seen, the op matrix (every op, kernel variant, f32 and
f16) forced onto the hardware adapter, and `bench train` of the tiny, small and
SmolLM2-135M shapes on wgpu (f32, f16) next to PyTorch on the same GPU (CUDA, eager, the
same model, batch and optimizer) — ending with one table. `--lavapipe` is its mode for a
machine without a GPU (Mesa's software Vulkan, small configs, no CUDA peer): the test suite
runs it, so the script is proven before a GPU is at hand (tests/test_gpu_check.py).

On the GPU machine (which reaches no package registry), after tests/gpu/prepare.sh filled
.gl/ and .whl/ here, with .gl and .whl carried along:

    for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
    python3 -m pip install -q --no-deps --no-build-isolation .      # ggwgpu itself
    python3 tests/gpu/check.py

If Vulkan finds no driver: VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json.
Exit code 0 when every step passed; the table says which did not.
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
GPU_BENCHES = [("tiny", []), ("small", []), ("smollm-135m-full", ["--steps", "3"]),
               ("smollm-135m-lora-f32", ["--steps", "3"]), ("smollm-135m", ["--steps", "3"])]
LAVAPIPE_BENCHES = [("tiny", ["--layers", "2", "--steps", "1"])]


def run(args: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    """(exit code, output, seconds) of `args`, output echoed as it comes."""
    start = time.perf_counter()
    print(f"$ {' '.join(args)}", flush=True)
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, **(env or {})})
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        code, out = 124, f"{e.stdout or ''}{e.stderr or ''}\n(cut after {timeout:g} s)"
    print(out, flush=True)
    return code, out, time.perf_counter() - start


def ggwgpu(*args: str, timeout: float = 600) -> tuple[int, str, float]:
    return run([sys.executable, "-m", "ggwgpu_cli.main", "--backend", "wgpu", *args], timeout)


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
    o = parser.parse_args(argv)
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
    rows.append(("op matrix", summary.strip("= "), f"{seconds:.0f} s"))
    if code:
        failed.append("op matrix")
    torch = [] if o.lavapipe else ["--torch-device", "cuda"]
    for config, options in LAVAPIPE_BENCHES if o.lavapipe else GPU_BENCHES:
        with tempfile.TemporaryDirectory() as d:
            report = Path(d) / "bench.json"
            extra = ["--no-torch"] if o.lavapipe else torch
            code, out, seconds = ggwgpu("bench", "train", "--config", config, *options,
                                        *extra, "--json", str(report))
            if code or not report.exists():
                failed.append(f"bench train {config}")
                rows.append((f"bench {config}", "failed", f"{seconds:.0f} s"))
                continue
            r = json.loads(report.read_text())
        rate = r["tokens_per_s"]
        cells = [f"{k} {rate[k]:.0f} tok/s" for k in ("wgpu", "wgpu f16", "numpy", "torch")
                 if k in rate]
        if "torch" in rate and "wgpu" in rate:
            cells.append(f"wgpu/torch {rate['wgpu'] / rate['torch']:.3f}")
        if r.get("wgpu") and r["wgpu"].get("device_ms") is not None:
            cells.append(f"device {r['wgpu']['device_ms']:.1f} ms/step")
        rows.append((f"bench {config}", "; ".join(cells), f"{seconds:.0f} s"))
    print("\nGPU check" + (" (lavapipe mode)" if o.lavapipe else "") + ": "
          + (hardware[0] if hardware else seen[0] if seen else "no adapter"))
    width = max(len(r[0]) for r in rows)
    for name, what, seconds in rows:
        print(f"  {name:<{width}}  {what}  ({seconds})")
    print("result: " + ("ok" if not failed else "FAILED: " + ", ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
