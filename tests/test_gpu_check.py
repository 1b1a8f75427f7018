"""tests/gpu/check.py, the GPU check of a machine with a hardware adapter, proven in its
lavapipe mode: it finds the adapter, runs a slice of the op matrix, a bench train, a bench
matmul (the adapter's kernel and the 'wide' one) and a bench ops on it, and ends with its
table and "result: ok"."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "gpu" / "check.py"


def test_the_gpu_check_runs_in_its_lavapipe_mode_and_ends_with_its_table(wgpu, tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--lavapipe", "--reports",
                           str(tmp_path / "reports.json")], capture_output=True, text=True,
                          timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    table = out[out.index("GPU check (lavapipe mode):"):]
    matrix = next(line for line in table.splitlines() if "op matrix" in line)
    assert " passed" in matrix and "failed" not in matrix
    assert re.search(r"\n  bench tiny +wgpu \d+ tok/s", table)
    assert re.search(r"\n  matmul 256x512x256 +wgpu \d+ GFLOP/s", table)
    assert re.search(r"\n  matmul 256x512x256 wide +wgpu \d+ GFLOP/s, [\d.]+ x the default", table)
    ops = next(line for line in table.splitlines() if line.lstrip().startswith("ops tiny"))
    assert "ms a step, dispatch by dispatch (" in ops and ":mul_mat" in ops
    assert table.rstrip().endswith("result: ok")
    # every bench's whole report kept: each kernel's time, not only the table's top ones
    kept = json.loads((tmp_path / "reports.json").read_text())
    assert set(kept) == {"bench train tiny", "bench matmul", "bench matmul wide",
                         "bench ops tiny"}
    assert len(kept["bench ops tiny"]["kernels"]) > check_module().TOP_KERNELS


def check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_mode_s_rows_from_reports_with_cuda_peers(monkeypatch):
    """What only a GPU run prints, from reports shaped as bench matmul --torch-device cuda
    and bench ops write them: each product beside cuBLAS, the largest one's fraction of the
    cube's cuBLAS rate, and the step's time by kernel."""
    check = check_module()
    reports = {
        "matmul": {"shapes": [
            {"m": 49152, "n": 512, "k": 576, "gflops": {"wgpu": 6000.0},
             "torch_gflops": 30000.0, "ratio_wgpu_torch": 0.2,
             "tuned": {"chosen": "wide", "ms": {"tiled": 6.0, "wide": 4.8}}},
            {"m": 4096, "n": 4096, "k": 4096, "gflops": {"wgpu": 8000.0},
             "torch_gflops": 48000.0, "ratio_wgpu_torch": 1 / 6}]},
        "wide": {"shapes": [
            {"m": 49152, "n": 512, "k": 576, "gflops": {"wgpu": 9000.0}},
            {"m": 4096, "n": 4096, "k": 4096, "gflops": {"wgpu": 6000.0}}]},
        "ops": {"total_ms": {"wgpu": 40.0}, "wgpu_clock": "device", "kernels": {
            "matmul:mul_mat_tiled": {"dispatches": 900, "wgpu_ms": 30.0},
            "optim:opt_step_adamw": {"dispatches": 420, "wgpu_ms": 4.0},
            "norm_workgroup:rms_norm_mul": {"dispatches": 61, "wgpu_ms": 6.0}},
                "wgpu": {"step_ms": 52.0, "in_parts_ms": 45.5}}}
    asked = []

    def bench_json(failed, name, *args, env=None):
        asked.append(args + ((env,) if env else ()))
        return reports["wide" if env else args[0]], "7 s"
    monkeypatch.setattr(check, "bench_json", bench_json)
    rows = check.matmul_rows(False, []) + check.kernel_rows(False, [])
    assert asked[0] == ("matmul", "--sizes", check.GPU_MATMUL, "--torch-device", "cuda")
    assert asked[1] == ("matmul", "--sizes", check.GPU_MATMUL, {"GGWGPU_MATMUL": "wide"})
    assert asked[2] == ("ops", "--config", "smollm-135m-lora-f32", "--repeat", "1")
    assert rows == [
        ("matmul 49152x512x576", "wgpu 6000 GFLOP/s (wide, timed fastest); torch 30000 "
         "GFLOP/s, wgpu/torch 0.200", "7 s"),
        ("matmul 4096x4096x4096", "wgpu 8000 GFLOP/s; torch 48000 GFLOP/s, wgpu/torch 0.167",
         "7 s"),
        ("largest product", "0.125 of the card's measured f32 rate (48000 GFLOP/s, cuBLAS "
         "4096x4096x4096)", "7 s"),
        ("matmul 49152x512x576 wide", "wgpu 9000 GFLOP/s, 1.50 x the default run's", "7 s"),
        ("matmul 4096x4096x4096 wide", "wgpu 6000 GFLOP/s, 0.75 x the default run's", "7 s"),
        ("ops smollm-135m-lora-f32", "40.0 ms a step, dispatch by dispatch (device); "
         "matmul:mul_mat_tiled 75%, norm_workgroup:rms_norm_mul 15%, optim:opt_step_adamw "
         "10%; run whole: 52.0 ms in one submit, 45.5 ms submitted in parts", "7 s")]
    failed = []
    monkeypatch.setattr(check, "bench_json", lambda failed_, name, *a: (
        failed_.append(name), (None, "1 s"))[1])
    assert check.matmul_rows(False, failed) == [("bench matmul", "failed", "1 s")]
    assert failed == ["bench matmul"]


def test_the_gpu_mode_s_train_rows_name_the_tuning_and_its_choices(monkeypatch):
    """A bench train row beside PyTorch CUDA, with the products timed on the device; the
    135M LoRA step again with tuning off, its row named by the setting."""
    check = check_module()
    report = {"tokens_per_s": {"wgpu": 3000.0, "torch": 5000.0},
              "wgpu": {"device_ms": 40.0},
              "tuned_products": [{"chosen": "tiled in 2 chunks"}, {"chosen": "wide"},
                                 {"chosen": "tiled in 2 chunks"}]}
    asked = []

    def bench_json(failed, name, *args, env=None):
        asked.append((name, args, env))
        return {**report, "tuned_products": []} if env else report, "9 s"
    monkeypatch.setattr(check, "bench_json", bench_json)
    rows = check.train_rows(check.GPU_BENCHES[2:] + check.GPU_MORE_BENCHES[:1], False, [])
    assert [a[0] for a in asked] == ["bench train smollm-135m-lora-f32",
                                     "bench train smollm-135m-lora-f32 GGWGPU_TUNE=0"]
    assert asked[1][1][-2:] == ("--torch-device", "cuda") and asked[1][2] == {"GGWGPU_TUNE": "0"}
    assert rows == [
        ("bench smollm-135m-lora-f32", "wgpu 3000 tok/s; torch 5000 tok/s; wgpu/torch 0.600; "
         "device 40.0 ms/step; 3 products timed on the device, kept: tiled in 2 chunks 2, "
         "wide 1", "9 s"),
        ("bench smollm-135m-lora-f32 GGWGPU_TUNE=0", "wgpu 3000 tok/s; torch 5000 tok/s; "
         "wgpu/torch 0.600; device 40.0 ms/step", "9 s")]


def test_a_check_out_of_budget_still_prints_its_table():
    """--budget too short for any step: each is left out and named so, and the table and the
    result line still come."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--lavapipe", "--budget", "5"],
                          capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    table = out[out.index("GPU check (lavapipe mode):"):]
    lines = table.splitlines()
    assert "op matrix" in lines[1] and "not run: --budget ran out" in lines[1]
    assert sum("not run: --budget ran out" in line for line in lines) == 4   # every step
    assert lines[-1].startswith("result: FAILED: op matrix, bench train tiny (out of time)")
