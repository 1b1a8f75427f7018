"""The `ggwgpu` command through click's CliRunner.

Tests marked "default backend" run wherever get_backend() sends them (wgpu when an adapter
exists, else NumPy); without an adapter they still run, but fail under
GGWGPU_REQUIRE_ADAPTER=1 (CI must not pass on the NumPy fallback).
"""
import os
import re

import pytest
from click.testing import CliRunner

import ggwgpu
from ggwgpu import testing
from ggwgpu.backends import ENV_VAR
from ggwgpu_cli import main as cli_main

REQUIRE_ADAPTER = os.environ.get("GGWGPU_REQUIRE_ADAPTER") == "1"


def invoke(*args, env=None):
    # $GGWGPU_BACKEND unset: each test chooses its backend with --backend or gets the default.
    return CliRunner().invoke(cli_main.cli, list(args), env={ENV_VAR: None, **(env or {})})


def has_adapter() -> bool:
    """Whether a WebGPU adapter exists; its absence fails the test when CI requires one."""
    backend, why = cli_main.wgpu_or_reason()
    if backend is None and REQUIRE_ADAPTER:
        pytest.fail(f"GGWGPU_REQUIRE_ADAPTER=1 but {why}")
    return backend is not None


def case_lines(output: str, op: str) -> list[str]:
    return [line for line in output.splitlines() if line.split(" ", 1)[0] == op]


def test_version_comes_from_the_package():
    result = invoke("--version")
    assert result.exit_code == 0
    assert ggwgpu.__version__ in result.output


def test_info_shows_the_adapter_or_says_numpy_will_be_used():
    adapter = has_adapter()
    result = invoke("info")
    assert result.exit_code == 0, result.output
    assert "shaders: " in result.output
    if adapter:
        assert "adapter type" in result.output
        assert "max storage buffer binding size" in result.output
        assert "features (" in result.output
        assert "backend: wgpu (" in result.output
    else:
        assert "adapter: none" in result.output
        assert "backend: numpy" in result.output


def test_info_without_an_adapter_says_so_and_exits_0(monkeypatch):
    monkeypatch.setattr(cli_main, "wgpu_or_reason", lambda: (None, "no WebGPU adapter: test"))
    result = invoke("info")
    assert result.exit_code == 0, result.output
    assert "adapter: none (no WebGPU adapter: test)" in result.output
    assert "NumPy reference backend" in result.output


def test_ops_test_add_passes_with_one_line_per_case():
    has_adapter()
    result = invoke("ops", "test", "--op", "add")
    assert result.exit_code == 0, result.output
    n = len(testing.cases_of("add"))
    lines = case_lines(result.output, "add")
    assert len(lines) == n and all("  OK  " in line for line in lines), result.output
    assert f"{n} passed, 0 failed" in result.output


def test_ops_grad_mul_mat_passes_with_one_line_per_case():
    has_adapter()
    result = invoke("ops", "grad", "--op", "mul_mat")
    assert result.exit_code == 0, result.output
    n = len(testing.cases_of("mul_mat", grad_only=True))
    lines = case_lines(result.output, "mul_mat")
    assert len(lines) == n and all("  OK  " in line for line in lines), result.output
    assert f"{n} passed, 0 failed" in result.output


def test_ops_names_in_upper_case_are_accepted_and_numpy_says_so():
    result = invoke("--backend", "numpy", "ops", "test", "--op", "SUM_ROWS")
    assert result.exit_code == 0, result.output
    assert len(case_lines(result.output, "sum_rows")) == len(testing.cases_of("sum_rows"))
    assert "ops test on numpy" in result.output


def test_unknown_op_is_a_usage_error_listing_the_valid_ones():
    result = invoke("ops", "test", "--op", "rms_nrom")
    assert result.exit_code == 2
    assert "unknown op 'rms_nrom'" in result.output
    assert "mul_mat" in result.output


def test_failing_and_raising_cases_are_reported_and_exit_1(monkeypatch):
    calls = []

    def fake_forward(opdef, case, backend):
        calls.append(case)
        if len(calls) == 1:
            raise RuntimeError("shader exploded")
        return testing.Result(opdef.name, testing.describe(case), False, "nmse=1 (bound 1e-07)")

    monkeypatch.setattr(testing, "forward", fake_forward)
    result = invoke("--backend", "numpy", "ops", "test", "--op", "neg")
    assert result.exit_code == 1
    n = len(testing.cases_of("neg"))
    assert len(calls) == n  # the exception did not end the run
    assert "RuntimeError: shader exploded" in result.output
    assert f"0 passed, {n} failed" in result.output


def final_losses(output: str) -> tuple[float, float]:
    match = re.search(r"loss fell from ([\d.e+-]+) to ([\d.e+-]+)", output)
    assert match, output
    return float(match[1]), float(match[2])


def test_demo_loss_falls_tenfold_on_numpy():
    result = invoke("--backend", "numpy", "demo", "--steps", "60")
    assert result.exit_code == 0, result.output
    first, last = final_losses(result.output)
    assert last < first / 10


def test_demo_loss_falls_tenfold_on_the_default_backend():
    adapter = has_adapter()
    result = invoke("demo", "--steps", "60")
    assert result.exit_code == 0, result.output
    assert ("demo on wgpu" if adapter else "demo on numpy") in result.output
    first, last = final_losses(result.output)
    assert last < first / 10


def test_bench_matmul_prints_a_ratio_per_shape():
    if not has_adapter():
        result = invoke("bench", "matmul", "--sizes", "64x64x64", "--repeat", "2")
        assert result.exit_code == 1
        assert "needs a WebGPU adapter" in result.output
        return
    result = invoke("bench", "matmul", "--sizes", "64x64x64,16x8x4", "--repeat", "2")
    assert result.exit_code == 0, result.output
    assert "wgpu/numpy" in result.output
    rows = [line.split() for line in result.output.splitlines()
            if re.match(r"\s*(64\s+64\s+64|16\s+8\s+4)\s", line)]
    assert len(rows) == 2, result.output
    for row in rows:
        wgpu_gflops, numpy_gflops, ratio, rel_err = map(float, row[3:])
        assert ratio > 0 and rel_err <= cli_main.BENCH_MAX_REL_ERR


def test_bench_matmul_reports_no_numbers_from_a_wrong_kernel(monkeypatch):
    if not has_adapter():
        pytest.skip("needs a WebGPU adapter")
    mul_mat = ggwgpu.mul_mat
    monkeypatch.setattr(ggwgpu, "mul_mat", lambda a, b: ggwgpu.scale(mul_mat(a, b), 1.001))
    result = invoke("bench", "matmul", "--sizes", "16x8x4", "--repeat", "1")
    assert result.exit_code == 1
    assert "wgpu mul_mat is wrong for M=16 N=8 K=4" in result.output
    assert "GFLOP/s" not in result.output.splitlines()[-1]


@pytest.mark.parametrize("args", [("--sizes", "64x64"), ("--sizes", "0x4x4"),
                                  ("--repeat", "0")])
def test_bench_matmul_rejects_bad_arguments(args):
    result = invoke("bench", "matmul", *args)
    assert result.exit_code == 2, result.output


def test_bench_matmul_refuses_the_numpy_backend():
    result = invoke("--backend", "numpy", "bench", "matmul")
    assert result.exit_code == 2
    assert "nothing to time" in result.output


def test_bench_train_checks_the_losses_and_prints_tokens_per_s():
    adapter = has_adapter()
    result = invoke("bench", "train", "--config", "tiny", "--steps", "1", "--no-torch")
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split() for line in result.output.splitlines()
            if re.match(r"(wgpu|numpy|torch)\s+([\d.]+|-)\s", line)}
    assert float(rows["numpy"][1]) > 0                      # tokens/s
    assert "(--no-torch)" in result.output
    if adapter:
        wgpu_loss, numpy_loss = float(rows["wgpu"][3]), float(rows["numpy"][3])
        assert abs(wgpu_loss - numpy_loss) <= cli_main.BENCH_TRAIN_MAX_REL_ERR * numpy_loss
        assert "ratio: wgpu/numpy" in result.output
        assert re.search(r"wgpu step: \d+ dispatches, host [\d.]+ µs/dispatch", result.output)
        assert "wgpu memory (planned): peak" in result.output
