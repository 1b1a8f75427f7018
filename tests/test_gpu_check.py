"""tests/gpu/check.py, the GPU check of a machine with a hardware adapter, proven in its
lavapipe mode: it finds the adapter, runs a slice of the op matrix, a bench train, a bench
matmul and a bench ops on it, and ends with its table and "result: ok"."""
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "gpu" / "check.py"


def test_the_gpu_check_runs_in_its_lavapipe_mode_and_ends_with_its_table(wgpu):
    done = subprocess.run([sys.executable, str(SCRIPT), "--lavapipe"], capture_output=True,
                          text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    table = out[out.index("GPU check (lavapipe mode):"):]
    matrix = next(line for line in table.splitlines() if "op matrix" in line)
    assert " passed" in matrix and "failed" not in matrix
    assert "bench tiny          wgpu " in table and "tok/s" in table
    assert "matmul 256x512x256  wgpu " in table and "GFLOP/s" in table
    ops = next(line for line in table.splitlines() if line.lstrip().startswith("ops tiny"))
    assert "ms a step, dispatch by dispatch (" in ops and ":mul_mat" in ops
    assert table.rstrip().endswith("result: ok")
