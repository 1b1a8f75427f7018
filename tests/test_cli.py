"""The `ggwgpu` command through click's CliRunner.

Tests meant for the WebGPU backend ask for it (wgpu_args) whenever an adapter exists, so they
run on lavapipe too; without an adapter they still run on NumPy, but fail under
GGWGPU_REQUIRE_ADAPTER=1 (CI must not pass on the NumPy fallback). Tests of the default
backend check auto's rule: wgpu on a hardware adapter, NumPy on a software one or none.
"""
import json
import math
import os
import re
import sys

import click
import numpy as np
import pytest
from click.testing import CliRunner

import ggwgpu
from ggwgpu import gguf_llama, testing
from ggwgpu.backends import ENV_VAR
from ggwgpu_cli import bench as cli_bench
from ggwgpu_cli import info as cli_info
from ggwgpu_cli import main as cli_main

REQUIRE_ADAPTER = os.environ.get("GGWGPU_REQUIRE_ADAPTER") == "1"


def invoke(*args, env=None):
    # $GGWGPU_BACKEND unset: each test chooses its backend with --backend or gets the default.
    return CliRunner().invoke(cli_main.cli, list(args), env={ENV_VAR: None, **(env or {})})


def has_adapter() -> bool:
    """Whether a WebGPU adapter exists; its absence fails the test when CI requires one."""
    backend, why = cli_info.wgpu_or_reason()
    if backend is None and REQUIRE_ADAPTER:
        pytest.fail(f"GGWGPU_REQUIRE_ADAPTER=1 but {why}")
    return backend is not None


def wgpu_args() -> tuple[str, ...]:
    """--backend wgpu where an adapter exists (software ones included), else nothing."""
    return ("--backend", "wgpu") if has_adapter() else ()


def auto_pick() -> str:
    """The backend auto picks on this machine, by the rule it must follow."""
    from ggwgpu.backends import is_software_adapter
    backend, _ = cli_info.wgpu_or_reason()
    return "wgpu" if has_adapter() and not is_software_adapter(backend.info) else "numpy"


def case_lines(output: str, op: str) -> list[str]:
    return [line for line in output.splitlines() if line.split(" ", 1)[0] == op]


def test_version_comes_from_the_package():
    result = invoke("--version")
    assert result.exit_code == 0
    assert ggwgpu.__version__ in result.output


def test_info_shows_the_adapter_and_what_auto_picks_and_why():
    adapter, picked = has_adapter(), auto_pick()
    result = invoke("info")
    assert result.exit_code == 0, result.output
    assert "shaders: " in result.output
    assert f"backend: {picked}, picked by auto: " in result.output
    if adapter:
        assert "adapter type" in result.output
        assert "max storage buffer binding size" in result.output
        assert "features (" in result.output
        assert "kernels on it: matmul " in result.output
        result = invoke("--backend", "wgpu", "info")
        assert "backend: wgpu (" in result.output and "asked for by --backend" in result.output
    else:
        assert "adapter: none" in result.output


def test_info_says_whether_products_are_timed_on_the_device():
    from ggwgpu.kernels import TunedMatmul
    variants = {"matmul": "tiled", "norm": "workgroup"}
    assert cli_info.describe_kernels(variants) == (
        "matmul tiled, norm workgroup; products not timed (GGWGPU_TUNE=1: timed, "
        "GGWGPU_MATMUL forces a kernel)")
    assert cli_info.describe_kernels({**variants, "matmul": TunedMatmul("tiled")}) == (
        "matmul tiled, norm workgroup; each product's kernel and cut of K timed on the "
        "device as plans meet it (GGWGPU_TUNE=0: off)")


def test_info_on_a_software_adapter_says_auto_picks_numpy_and_why(adapter_as):
    adapter_as({"device": "llvmpipe (LLVM 15.0.6, 256 bits)", "adapter_type": "CPU",
                "backend_type": "OpenGL"})
    result = invoke("info")
    assert result.exit_code == 0, result.output
    line = [x for x in result.output.splitlines() if x.startswith("backend: ")]
    assert len(line) == 1 and "backend: numpy, picked by auto: the only WebGPU adapter is a " \
        "software one (llvmpipe (LLVM 15.0.6, 256 bits), CPU, OpenGL)" in line[0], result.output


def test_info_without_an_adapter_says_so_and_exits_0(monkeypatch, adapter_as):
    monkeypatch.setattr(cli_info, "wgpu_or_reason", lambda: (None, "no WebGPU adapter: test"))
    adapter_as(None)
    result = invoke("info")
    assert result.exit_code == 0, result.output
    assert "adapter: none (no WebGPU adapter: test)" in result.output
    assert "backend: numpy, picked by auto: no WebGPU adapter: test" in result.output


def test_ops_test_add_passes_with_one_line_per_case():
    result = invoke(*wgpu_args(), "ops", "test", "--op", "add")
    assert result.exit_code == 0, result.output
    n = len(testing.cases_of("add"))
    lines = case_lines(result.output, "add")
    assert len(lines) == n and all("  OK  " in line for line in lines), result.output
    assert f"{n} passed, 0 failed" in result.output


def test_ops_grad_mul_mat_passes_with_one_line_per_case():
    result = invoke(*wgpu_args(), "ops", "grad", "--op", "mul_mat")
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


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_demo_loss_falls_tenfold(backend):
    args = ("--backend", "numpy") if backend == "numpy" else wgpu_args()
    result = invoke(*args, "demo", "--steps", "60")
    assert result.exit_code == 0, result.output
    assert "picked by auto" not in result.output
    first, last = final_losses(result.output)
    assert last < first / 10


def test_the_default_backend_is_auto_and_says_which_and_why():
    picked = auto_pick()
    result = invoke("demo", "--steps", "2")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"backend: {picked}, picked by auto: "), result.output
    assert lines[1].startswith(f"demo on {picked} ("), result.output


def test_bench_matmul_prints_a_ratio_per_shape(tmp_path):
    if not has_adapter():
        result = invoke("bench", "matmul", "--sizes", "64x64x64", "--repeat", "2")
        assert result.exit_code == 1
        assert "needs a WebGPU adapter" in result.output
        return
    out = tmp_path / "matmul.json"
    result = invoke("bench", "matmul", "--sizes", "64x64x64,16x8x4", "--repeat", "2",
                    "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "wgpu/numpy" in result.output
    rows = [line.split() for line in result.output.splitlines()
            if re.match(r"\s*(64\s+64\s+64|16\s+8\s+4)\s", line)]
    assert len(rows) == 2, result.output
    shapes = json.loads(out.read_text())["shapes"]
    for row, r in zip(rows, shapes):
        wgpu_gflops, numpy_gflops, ratio, rel_err = map(float, row[3:7])
        # the printed ratio is the two speeds' quotient (it may print as 0.000 on a busy
        # machine, so its size is not asserted), both speeds are measured, the error bound
        assert r["gflops"]["wgpu"] > 0 and r["gflops"]["numpy"] > 0
        assert r["ratio_wgpu_numpy"] == pytest.approx(r["gflops"]["wgpu"] / r["gflops"]["numpy"])
        assert abs(ratio - r["ratio_wgpu_numpy"]) <= 5e-4 and rel_err == pytest.approx(
            r["max_rel_err"], rel=0.06) and rel_err <= cli_bench.BENCH_MAX_REL_ERR
        assert abs(wgpu_gflops - r["gflops"]["wgpu"]) <= 5e-3
        assert int(row[7]) >= 1                                 # dispatches
    assert [(r["m"], r["n"], r["k"]) for r in shapes] == [(64, 64, 64), (16, 8, 4)]
    assert all(r["memory"]["planned"] >= 4 * (r["m"] + r["n"]) * r["k"] for r in shapes)


def test_bench_matmul_reports_no_numbers_from_a_wrong_kernel(monkeypatch, wgpu):
    # the wgpu fixture: without an adapter this skips, or fails where CI requires one
    mul_mat = ggwgpu.mul_mat
    monkeypatch.setattr(ggwgpu, "mul_mat", lambda a, b: ggwgpu.scale(mul_mat(a, b), 1.001))
    result = invoke("bench", "matmul", "--sizes", "16x8x4", "--repeat", "1")
    assert result.exit_code == 1
    assert "wgpu mul_mat is wrong for M=16 N=8 K=4" in result.output
    assert "GFLOP/s" not in result.output.splitlines()[-1]


def matmul_in_a_child_process(sizes, repeat, device="cpu"):
    """A stand-in for PyTorch's matmul: 100 GFLOP/s a shape, on a CUDA device only, and
    only where multiprocessing started it."""
    import multiprocessing
    assert multiprocessing.parent_process() is not None and device == "cuda"
    return {f"{m}x{n}x{k}": 100.0 for m, n, k in sizes}


def test_bench_matmul_times_pytorch_s_matmul_in_its_own_process(monkeypatch, wgpu, tmp_path):
    monkeypatch.setattr(cli_bench, "torch_matmul", matmul_in_a_child_process)
    out = tmp_path / "matmul.json"
    result = invoke("bench", "matmul", "--sizes", "16x8x4,8x8x8", "--repeat", "1",
                    "--torch-device", "cuda", "--json", str(out))
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["torch_device"] == "cuda"
    for r in report["shapes"]:
        assert r["torch_gflops"] == 100.0
        assert r["ratio_wgpu_torch"] == pytest.approx(r["gflops"]["wgpu"] / 100)
        assert (f"torch cuda {r['m']}x{r['n']}x{r['k']}: 100.00 GFLOP/s f32, wgpu/torch "
                f"{r['ratio_wgpu_torch']:.3f}") in result.output
    monkeypatch.setattr(cli_bench, "torch_matmul", peer_that_raises)
    result = invoke("bench", "matmul", "--sizes", "8x8x8", "--repeat", "1",
                    "--torch-device", "cuda")
    assert result.exit_code == 0, result.output
    assert "torch cuda: failed: RuntimeError: no BLAS today" in result.output


@pytest.mark.parametrize("args", [("--sizes", "64x64"), ("--sizes", "0x4x4"),
                                  ("--repeat", "0"), ("--torch-device", "tpu")])
def test_bench_matmul_rejects_bad_arguments(args):
    result = invoke("bench", "matmul", *args)
    assert result.exit_code == 2, result.output


def test_bench_matmul_refuses_the_numpy_backend():
    result = invoke("--backend", "numpy", "bench", "matmul")
    assert result.exit_code == 2
    assert "nothing to time" in result.output


def test_bench_train_checks_the_losses_and_prints_tokens_per_s(tmp_path):
    adapter = has_adapter()
    out = tmp_path / "train.json"
    result = invoke("bench", "train", "--config", "tiny", "--steps", "1", "--no-torch",
                    "--json", str(out))
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split() for line in result.output.splitlines()
            if re.match(r"(wgpu|numpy|torch)\s+([\d.]+|-)\s", line)}
    assert float(rows["numpy"][1]) > 0                      # tokens/s
    assert "(--no-torch)" in result.output
    report = json.loads(out.read_text())
    assert report["tokens_per_s"]["numpy"] > 0 and "torch" not in report["tokens_per_s"]
    if adapter:
        wgpu_loss, numpy_loss = float(rows["wgpu"][3]), float(rows["numpy"][3])
        assert abs(wgpu_loss - numpy_loss) <= cli_bench.BENCH_TRAIN_MAX_REL_ERR * numpy_loss
        assert "wgpu/numpy" in result.output
        assert re.search(r"wgpu step: \d+ dispatches, host [\d.]+ µs/dispatch", result.output)
        assert re.search(r"planned / minimum [\d.]+ \(within the full budget 1.25\)",
                         result.output)
        assert re.search(r"dispatches per layer: \d+ \(mul_mat \d+", result.output)
        stats = report["wgpu"]
        assert stats["dispatches"] == int(re.search(r"(\d+) dispatches", result.output)[1])
        memory = stats["memory"]
        assert memory["weights"] == memory["gradients"] > 0
        assert memory["peak"] <= memory["planned"]


def peer_in_a_child_process(cfg, options, steps, device="cpu", lora_rank=0):
    """A stand-in for the PyTorch peer: fails unless multiprocessing started it."""
    import multiprocessing
    assert multiprocessing.parent_process() is not None, "the peer ran in the bench's process"
    return {"loss": 1.25, "seconds": cfg.n_ctx * options.batch / 1000}  # 1000 tokens/s


def peer_that_segfaults(cfg, options, steps, device="cpu", lora_rank=0):
    import signal
    os.kill(os.getpid(), signal.SIGSEGV)


def peer_that_raises(cfg, options, steps, device="cpu", lora_rank=0):
    raise RuntimeError("no BLAS today")


def bench_train_with_peer(monkeypatch, tmp_path, peer):
    monkeypatch.setattr(cli_bench, "torch_peer", peer)
    out = tmp_path / "train.json"
    result = invoke("--backend", "numpy", "bench", "train", "--steps", "1", "--json", str(out))
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.output.splitlines()
            if re.match(r"(wgpu|numpy|torch)\s+([\d.]+|-)\s", line)}
    return rows["torch"], json.loads(out.read_text())


def test_bench_train_runs_the_torch_peer_in_its_own_process(monkeypatch, tmp_path):
    torch_row, report = bench_train_with_peer(monkeypatch, tmp_path, peer_in_a_child_process)
    assert torch_row.split()[1:4] == ["1000", "512.0", "1.250000"], torch_row
    assert report["tokens_per_s"]["torch"] == pytest.approx(1000)
    assert report["ratios"]["numpy/torch"] > 0


def test_bench_train_survives_a_torch_peer_that_segfaults(monkeypatch, tmp_path):
    torch_row, report = bench_train_with_peer(monkeypatch, tmp_path, peer_that_segfaults)
    assert torch_row.split()[1] == "-", torch_row
    assert "(failed: its process died (killed by SIGSEGV))" in torch_row
    assert "torch" not in report["tokens_per_s"] and report["tokens_per_s"]["numpy"] > 0


def test_an_exception_in_its_own_process_comes_back_as_a_reason():
    cfg, options = cli_bench.bench_model("tiny")
    assert cli_bench.in_own_process(peer_that_raises, cfg, options, 1) == \
        (None, "RuntimeError: no BLAS today")


def test_the_torch_peer_says_none_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)      # import torch raises ImportError
    cfg, options = cli_bench.bench_model("tiny")
    assert cli_bench.torch_peer(cfg, options, 1) is None


def test_bench_ops_times_each_op_on_both_backends(tmp_path):
    if not has_adapter():
        result = invoke("bench", "ops")
        assert result.exit_code == 1
        return
    out = tmp_path / "ops.json"
    result = invoke("bench", "ops", "--top", "50", "--repeat", "1", "--json", str(out))
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    ops = report["ops"]
    # the fused llama ops: 2 norms per block and the output norm, a gate per block
    assert ops["rms_norm_mul"]["nodes"] == 2 * (2 * 4 + 1)   # forward, and in dw
    assert ops["swiglu"]["nodes"] == 2 * 4 and ops["swiglu_back"]["nodes"] == 4
    assert sum(r["dispatches"] for r in ops.values()) == report["wgpu"]["dispatches"]
    kernels = report["kernels"]
    assert sum(r["dispatches"] for r in kernels.values()) == report["wgpu"]["dispatches"]
    assert sum(r["wgpu_ms"] for r in kernels.values()) == pytest.approx(
        report["total_ms"]["wgpu"])
    assert report["wgpu_clock"] in ("device", "host")
    assert kernels["elementwise:swiglu"]["dispatches"] == 2 * 4
    assert all(r["numpy_ms"] > 0 for r in ops.values() if r["nodes"])
    shown = [line.split()[0] for line in result.output.splitlines()
             if line.split() and line.split()[0] in ops]
    assert set(shown) == set(ops)


def test_bench_memory_plans_with_and_without_checkpointing(tmp_path):
    out = tmp_path / "memory.json"
    result = invoke("bench", "memory", "--layers", "1,4", "--json", str(out))
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [(r["n_layer"], r["checkpointing"]) for r in rows] == \
        [(1, False), (1, True), (4, False), (4, True)]
    for r in rows:
        assert r["weights"] == r["gradients"] and r["state"] >= 2 * r["weights"]
        assert r["activations"] > 0 and r["peak"] <= r["planned"] <= 1.25 * r["sum"]
    assert rows[2]["weights"] > rows[0]["weights"]
    assert invoke("bench", "memory", "--layers", "0").exit_code == 2

# -- finetune, merge, generate --lora -------------------------------------------------------

def tiny_base(path, dtype=None, n_embd=16, n_ff=32, seed=1):
    """A byte-vocabulary llama GGUF at `path` (matrices in `dtype` when given)."""
    from ggwgpu import gguf_llama
    from ggwgpu.models import ModelConfig, init_parameters
    from ggwgpu.quant import quantize_model
    from ggwgpu.tokenizer import ByteTokenizer
    cfg = ModelConfig(n_vocab=ByteTokenizer().n_vocab, n_embd=n_embd, n_head=2, n_layer=2,
                      n_ff=n_ff, n_ctx=16)
    values = init_parameters(cfg, seed)
    gguf_llama.save_model(path, cfg, quantize_model(values, dtype) if dtype else values,
                       ByteTokenizer())
    return path


def finetune(tmp_path, base, *args, backend=("--backend", "numpy")):
    text = tmp_path / "text.txt"
    if not text.exists():
        text.write_text("To be, or not to be, that is the question.\n" * 40)
    return invoke(*backend, "finetune", str(base), str(text), "--batch", "2", "--lr", "1e-2",
                  "--warmup", "2", *args)


@pytest.mark.parametrize("length", [200, 235])
def test_an_out_name_too_long_once_written_is_refused_before_the_first_step(tmp_path, length):
    """NAME_MAX is 255 bytes; the write's temporary name adds 27 and more (and the default
    checkpoint's .checkpoint 11): a 235-byte --out trained the whole run and wrote nothing."""
    base = tiny_base(tmp_path / "base.gguf")
    out = tmp_path / ("a" * (length - 5) + ".gguf")
    r = finetune(tmp_path, base, "--steps", "1", "--n-ctx", "8", "--out", str(out))
    if length == 200:
        assert r.exit_code == 0 and out.exists(), r.output
    else:
        assert r.exit_code == 2 and "the name is too long" in r.output, r.output
        assert "training" not in r.output.split("Error")[0] and not out.exists()


def test_a_run_that_may_replace_an_earlier_default_checkpoint_says_so(tmp_path):
    base = tiny_base(tmp_path / "base.gguf")
    out = tmp_path / "a.gguf"
    earlier = tmp_path / "a.checkpoint.gguf"
    earlier.write_bytes(b"an earlier run's checkpoint")
    r = finetune(tmp_path, base, "--steps", "1", "--n-ctx", "8", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert f"warning: {earlier} exists" in r.output and "--checkpoint-in" in r.output
    r = finetune(tmp_path, base, "--steps", "1", "--n-ctx", "8", "--out", str(out),
                 "--checkpoint-out", str(tmp_path / "c.gguf"))
    assert "warning" not in r.output and earlier.read_bytes() == b"an earlier run's checkpoint"


def log_losses(path):
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_finetune_resumed_from_its_checkpoint_equals_an_uninterrupted_run(tmp_path):
    from ggwgpu.lora import load_adapter
    base = tiny_base(tmp_path / "base.gguf")
    lora = ("--lora-r", "2", "--rank-tok-embd", "3", "--rank-wk", "0", "--lora-layers", "1")
    r = finetune(tmp_path, base, *lora, "--steps", "4", "--out", str(tmp_path / "a.gguf"),
                 "--log", str(tmp_path / "straight.jsonl"))
    assert r.exit_code == 0, r.output
    assert "LoRA alpha 4 on 8 weights" in r.output       # token_embd, output, 6 in block 1
    ckpt, log = tmp_path / "ckpt.gguf", tmp_path / "log.jsonl"
    for args in (lora + ("--checkpoint-out", str(ckpt)), ("--checkpoint-in", str(ckpt))):
        r = finetune(tmp_path, base, *args, "--steps", "2", "--out", str(tmp_path / "b.gguf"),
                     "--log", str(log))
        assert r.exit_code == 0, r.output
    assert "resuming at step 2" in r.output
    assert log_losses(log) == log_losses(tmp_path / "straight.jsonl")
    straight, resumed = load_adapter(tmp_path / "a.gguf"), load_adapter(tmp_path / "b.gguf")
    assert "blk.1.attn_q.weight.lora_a" in straight.tensors
    assert "blk.1.attn_k.weight.lora_a" not in straight.tensors
    assert straight.tensors["token_embd.weight.lora_b"].shape == (16, 3)
    for name, value in straight.tensors.items():
        assert (resumed.tensors[name] == value).all(), name

    r = finetune(tmp_path, tiny_base(tmp_path / "other.gguf", seed=2), "--steps", "1",
                 "--checkpoint-in", str(ckpt))
    assert r.exit_code == 2 and "another base model" in r.output
    r = finetune(tmp_path, base, "--steps", "1", "--checkpoint-in", str(ckpt), "--full")
    assert r.exit_code == 2 and "drop --full" in r.output


def test_full_finetune_resumes_exactly_and_refuses_a_quantized_base(tmp_path):
    base = tiny_base(tmp_path / "base.gguf")
    straight = tmp_path / "straight.jsonl"
    assert finetune(tmp_path, base, "--full", "--steps", "4", "--log", str(straight),
                    "--out", str(tmp_path / "a.gguf")).exit_code == 0
    ckpt, log = tmp_path / "ckpt.gguf", tmp_path / "log.jsonl"
    for args in (("--checkpoint-out", str(ckpt)), ("--checkpoint-in", str(ckpt))):
        r = finetune(tmp_path, base, "--full", *args, "--steps", "2", "--log", str(log),
                     "--out", str(tmp_path / "b.gguf"))
        assert r.exit_code == 0, r.output
    assert log_losses(log) == log_losses(straight)
    r = finetune(tmp_path, tiny_base(tmp_path / "other.gguf", seed=2), "--full", "--steps",
                 "1", "--checkpoint-in", str(ckpt))
    assert r.exit_code == 2 and "another base model" in r.output
    r = finetune(tmp_path, tiny_base(tmp_path / "q8.gguf", "q8_0", 32, 64), "--full")
    assert r.exit_code == 2 and "q8_0" in r.output


def test_generate_with_lora_writes_what_the_merged_model_writes(tmp_path):
    base = tiny_base(tmp_path / "base.gguf")
    adapter, merged = tmp_path / "adapter.gguf", tmp_path / "merged.gguf"
    assert finetune(tmp_path, base, "--steps", "3", "--out", str(adapter)).exit_code == 0
    r = invoke("merge", str(base), str(adapter), "--out", str(merged))
    assert r.exit_code == 0, r.output
    sample = ("--backend", "numpy", "generate", "-p", "To be", "-n", "24", "--temp", "0")
    with_lora = invoke(*sample[:3], str(base), *sample[3:], "--lora", str(adapter))
    assert with_lora.exit_code == 0, with_lora.output
    assert with_lora.stdout == invoke(*sample[:3], str(merged), *sample[3:]).stdout
    r = invoke(*sample[:3], str(merged), *sample[3:], "--lora", str(base))
    assert r.exit_code == 1 and "general.type is 'model'" in r.output


def eval_loss(*args) -> float:
    r = invoke("--backend", "numpy", "eval", *args, "--samples", "16")
    assert r.exit_code == 0, r.output
    return float(re.search(r"loss (\S+) nats/token", r.output)[1])


def test_merge_over_a_quantized_base_keeps_its_types_unless_asked(tmp_path):
    """--type auto writes the changed weights in f16 and copies the rest (a q8_0 base gives a
    file far smaller than f32's), and evaluates as the adapter on the base does."""
    from gguf import GGUFReader
    base = tiny_base(tmp_path / "q8.gguf", "q8_0", 32, 64)
    adapter = tmp_path / "adapter.gguf"
    r = finetune(tmp_path, base, "--steps", "3", "--lr", "1e-2", "--out", str(adapter))
    assert r.exit_code == 0, r.output
    sizes, types = {}, {}
    for dtype in ("auto", "f32", "q8_0"):
        out = tmp_path / f"{dtype}.gguf"
        r = invoke("merge", str(base), str(adapter), "--out", str(out), "--type", dtype)
        assert r.exit_code == 0 and f"(--type {dtype}; weights" in r.output, r.output
        sizes[dtype] = out.stat().st_size
        types[dtype] = {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}
    assert types["auto"]["blk.0.attn_q.weight"] == "F16"        # a pair changed it
    assert types["auto"]["blk.0.ffn_norm.weight"] == "F32"
    assert set(types["f32"].values()) == {"F32"}
    assert types["q8_0"]["blk.0.attn_q.weight"] == "Q8_0"
    assert sizes["q8_0"] < sizes["auto"] < sizes["f32"]
    text = str(tmp_path / "text.txt")
    tuned = eval_loss(str(base), text, "--lora", str(adapter))
    assert abs(eval_loss(str(tmp_path / "auto.gguf"), text) - tuned) < 1e-3
    assert abs(eval_loss(str(tmp_path / "f32.gguf"), text) - tuned) < 1e-4
    r = invoke("merge", str(base), str(adapter), "--out", str(tmp_path / "x.gguf"),
               "--type", "q4_k")
    assert r.exit_code == 2 and "'q4_k' is not one of" in r.output


def test_eval_shows_the_finetuned_loss_below_the_base_and_equal_to_the_merge(tmp_path):
    base = tiny_base(tmp_path / "base.gguf")
    adapter, merged = tmp_path / "adapter.gguf", tmp_path / "merged.gguf"
    r = finetune(tmp_path, base, "--steps", "30", "--out", str(adapter))
    assert r.exit_code == 0, r.output
    assert invoke("merge", str(base), str(adapter), "--out", str(merged)).exit_code == 0
    text = str(tmp_path / "text.txt")
    base_loss = eval_loss(str(base), text)
    tuned = eval_loss(str(base), text, "--lora", str(adapter))
    assert tuned < base_loss - 0.5
    assert abs(eval_loss(str(merged), text) - tuned) < 1e-4
    r = invoke("--backend", "numpy", "eval", str(base), "--corpus", "tempest", "--samples", "8")
    assert "bundled corpus (tempest): 8 windows of 16 tokens" in r.output, r.output
    r = invoke("--backend", "numpy", "eval", str(base), "--corpus", "tempest", "--samples", "8",
               "--n-ctx", "6")
    assert "8 windows of 6 tokens" in r.output, r.output


def test_eval_takes_the_text_once_in_windows_that_do_not_overlap(tmp_path):
    """By default the windows are the text's consecutive n_ctx-token pieces, as llama.cpp's
    perplexity takes them: 100 byte tokens in 6 windows of 16. Those are the windows
    --samples 6 spreads over the 96 tokens they cover, and a last batch of fewer windows
    (filled up with rows that count no target) leaves the loss as it is."""
    base = tiny_base(tmp_path / "base.gguf")
    text = ("To be, or not to be, that is the question. " * 3)[:100]
    (tmp_path / "t.txt").write_text(text)
    (tmp_path / "t96.txt").write_text(text[:96])
    losses = []
    for args in ((tmp_path / "t.txt", "--batch", "4"), (tmp_path / "t.txt", "--batch", "6"),
                 (tmp_path / "t96.txt", "--samples", "6", "--batch", "3")):
        r = invoke("--backend", "numpy", "eval", str(base), *map(str, args))
        assert r.exit_code == 0, r.output
        assert "6 windows of 16 tokens" in r.stdout, r.stdout
        losses.append(float(re.search(r"loss (\S+) nats/token", r.stdout)[1]))
    assert losses[0] == losses[1] == losses[2], losses


def test_eval_shows_the_perplexity_so_far_on_stderr_and_only_results_on_stdout(tmp_path):
    base = tiny_base(tmp_path / "base.gguf")
    (tmp_path / "t.txt").write_text("To be, or not to be, that is the question.\n" * 4)
    r = invoke("--backend", "numpy", "eval", str(base), str(tmp_path / "t.txt"), "--batch", "4")
    assert r.exit_code == 0, r.output
    header, result = r.stdout.splitlines()     # 172 tokens: 10 windows, 3 batches
    assert header.endswith("t.txt: 10 windows of 16 tokens"), header
    so_far = re.findall(r"\[(\d+)/3\](\S+)", r.stderr)
    assert [int(done) for done, _ in so_far] == [1, 2, 3], r.stderr
    assert f"perplexity {float(so_far[-1][1]):.3f}" in result
    assert f"loading {base}" in r.stderr and "planning 4 x 16 tokens" in r.stderr


def test_eval_and_generate_of_a_model_that_overflows_float32_are_errors_not_nan(tmp_path):
    """Finite weights (the reader refuses others) can still overflow in the forward: eval
    and generate say so and exit 1, rather than printing perplexity nan (or an
    OverflowError) or sampling from NaN."""
    from ggwgpu.models import ModelConfig, init_parameters
    from ggwgpu.tokenizer import ByteTokenizer
    cfg = ModelConfig(n_vocab=ByteTokenizer().n_vocab, n_embd=16, n_head=2, n_layer=2,
                      n_ff=32, n_ctx=16)
    values = init_parameters(cfg, 1)
    values["output.weight"] = np.sign(values["output.weight"]) * np.float32(3e38)
    gguf_llama.save_model(tmp_path / "huge.gguf", cfg, values, ByteTokenizer())
    (tmp_path / "text.txt").write_text("To be, or not to be, that is the question.\n" * 20)
    r = invoke("--backend", "numpy", "eval", str(tmp_path / "huge.gguf"),
               str(tmp_path / "text.txt"), "--samples", "4")
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "overflow float32 in the forward pass" in r.output and "perplexity" not in r.stdout
    for sampling in (("--temp", "0"), ("--temp", "0.8")):      # greedy, and sampled
        r = invoke("--backend", "numpy", "generate", str(tmp_path / "huge.gguf"), "-p", "Hi",
                   "-n", "4", *sampling)
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        assert "logits are not finite: the model's values overflow float32" in r.output
    r = invoke("--backend", "numpy", "generate", str(tmp_path / "huge.gguf"), "-p", "Hi",
               "-n", "4", "--precision", "f16")          # the type it overflows is named
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "the model's values overflow halves (--precision f16)" in r.output


def test_finetune_windows_shorter_than_the_base_context_keep_the_base_context(tmp_path):
    """--n-ctx sets the samples' length; a --full model keeps the base's context_length."""
    base = tiny_base(tmp_path / "base.gguf")
    out = tmp_path / "full.gguf"
    r = finetune(tmp_path, base, "--steps", "1", "--n-ctx", "8", "--full", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "samples of 8" in r.output and "2 x 8 tokens" in r.output
    assert gguf_llama.load_model(out)[0].n_ctx == gguf_llama.load_model(base)[0].n_ctx == 16


def test_finetune_a_q4_0_base_on_wgpu(tmp_path):
    args = wgpu_args()
    base = tiny_base(tmp_path / "q4.gguf", "q4_0", 32, 64)
    adapter = tmp_path / "adapter.gguf"
    r = finetune(tmp_path, base, "--steps", "2", "--out", str(adapter), backend=args)
    assert r.exit_code == 0, r.output
    assert ("finetune on wgpu" if args else "finetune on numpy") in r.output
    r = invoke("generate", str(base), "--lora", str(adapter), "-p", "To", "-n", "8")
    assert r.exit_code == 0, r.output


TINY_TRAIN = ["--n-embd", "16", "--n-head", "2", "--n-layer", "1", "--n-ff", "32",
              "--n-ctx", "16", "--steps", "1"]


def test_train_writes_a_grouped_query_model_with_tied_embeddings(tmp_path):
    out = tmp_path / "gqa.gguf"
    result = invoke("--backend", "numpy", "train", *TINY_TRAIN, "--n-head-kv", "1",
                    "--tie-embeddings", "--out", str(out))
    assert result.exit_code == 0, result.output
    cfg, values, _ = gguf_llama.load_model(out)
    assert cfg.kv_heads == 1 and cfg.tied_embeddings and "output.weight" not in values
    assert values["blk.0.attn_k.weight"].shape == (8, 16)       # one head of 8
    # its LoRA finetune pairs no embedding unless asked, and says llama.cpp cannot apply those
    r = finetune(tmp_path, out, "--steps", "1", "--out", str(tmp_path / "a.gguf"))
    assert r.exit_code == 0 and "note:" not in r.output, r.output
    r = finetune(tmp_path, out, "--steps", "1", "--rank-out", "2",
                 "--out", str(tmp_path / "b.gguf"))
    assert r.exit_code == 0 and "llama.cpp cannot apply a LoRA pair" in r.output, r.output


@pytest.mark.parametrize("args,message", [
    (["--n-embd", "15", "--n-head", "4"], "n_embd 15 is not divisible by n_head 4"),
    (["--n-rot", "3"], "n_rot 3 must be even"),
    (["--n-embd", "16", "--n-head", "2", "--n-rot", "10"], "n_rot 10 must be even and <= "
                                                           "head_dim 8"),
    (["--n-embd", "16", "--n-head", "2", "--n-rot", "4"], "--n-rot 4 is not the head dim 8"),
    (["--n-head", "4", "--n-head-kv", "3"], "n_head 4 is not a multiple of n_head_kv 3"),
    (["--lr", "0"], "'--lr': 0.0 is not in the range x>0"),
    (["--lr", "-1e-3"], "'--lr'"),
    (["--batch", "0"], "'--batch': 0 is not in the range 1<=x<=65536"),
    (["--grad-accum", "0"], "'--grad-accum'"),
    (["--grad-accum", "1000000000"], "'--grad-accum'"),
    (["--cos-decay-steps", "0"], "'--cos-decay-steps'"),
    (["--steps", "0"], "--steps 0 writes OUT from a checkpoint: it needs --checkpoint-in"),
    (["--steps", "-1"], "'--steps'"),
    (["--save-every", "0"], "'--save-every'"),
    (["--beta1", "1"], "'--beta1'"),
    (["--seed", "-1"], "'--seed'"),
    (["--on-nan", "ignore"], "'--on-nan'"),
    (["--out", "no/such/dir/model.gguf"], "the directory of no/such/dir/model.gguf does not "
                                          "exist"),
    (["--checkpoint-out", "no/such/dir/ckpt.gguf"], "'--checkpoint-out'"),
])
def test_train_refuses_options_out_of_range_before_any_work(args, message):
    result = invoke("--backend", "numpy", "train", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "train on" not in result.output


@pytest.mark.parametrize("content,message", [
    (None, "is a directory"),
    (b"", "is empty"),
    (b"ok\ncaf\xe9\n", "not valid UTF-8 at byte offset 6 (line 2)"),
    (b"too short", "the text has 9 tokens, but n_ctx 16 needs at least 16"),
])
def test_train_refuses_unusable_text_with_a_usage_error(tmp_path, content, message):
    path = tmp_path / "text"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    result = invoke("--backend", "numpy", "train", str(path), *TINY_TRAIN,
                    "--out", str(tmp_path / "model.gguf"))
    assert result.exit_code == 2, result.output
    assert message in result.output and "train on" not in result.output
    assert not (tmp_path / "model.gguf").exists()


# -- finetuning on examples (--data) -----------------------------------------------------------

SHORT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}a:{% endif %}")


def finetune_on(base, *args):
    return invoke("--backend", "numpy", "finetune", str(base), "--batch", "2", "--lr", "1e-2",
                  "--warmup", "2", *args)


def chat_data(tmp_path):
    """A data directory of short sums (train and valid) and a compact template file."""
    directory = tmp_path / "sums"
    directory.mkdir()
    for split, n in (("train", 24), ("valid", 6)):
        lines = [json.dumps({"prompt": f"{i % 7}+{i % 3}=", "completion": str(i % 7 + i % 3)})
                 for i in range(n)]
        (directory / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    template = tmp_path / "template.jinja"
    template.write_text(SHORT_TEMPLATE)
    return directory, template


def test_finetune_on_chat_data_validates_and_keeps_the_best(tmp_path):
    base = tiny_base(tmp_path / "base.gguf")
    data, template = chat_data(tmp_path)
    out, log = tmp_path / "sums.gguf", tmp_path / "log.jsonl"
    args = ["--data", str(data), "--chat-template", str(template), "--mask-prompt",
            "--n-ctx", "24"]
    r = finetune_on(base, *args, "--steps", "6", "--val-every", "2", "--out", str(out),
                 "--log", str(log))
    assert r.exit_code == 0, r.output
    assert "train: 24 examples" in r.output and "validation: 6 examples" in r.output
    records = [json.loads(line) for line in log.read_text().splitlines()]
    val = {rec["step"]: rec["val_loss"] for rec in records if "val_loss" in rec}
    assert sorted(val) == [2, 4, 6]
    best = float(re.search(r"best validation loss ([0-9.]+)", r.output)[1])
    assert best == pytest.approx(min(val.values()), abs=1e-4)
    # eval over the same split with the kept adapter gives that loss
    r = invoke("--backend", "numpy", "eval", str(base), "--lora", str(tmp_path / "sums.best.gguf"),
               *args, "--split", "valid")
    assert r.exit_code == 0, r.output
    assert float(re.search(r"loss (\S+) nats", r.output)[1]) == pytest.approx(best, abs=1e-4)


def test_finetune_says_when_a_template_leaves_earlier_answers_untrained(tmp_path):
    """A template that renders earlier answers otherwise in a longer conversation (as
    Qwen3's drops their reasoning tags) trains each conversation's last answer, and says
    how many conversations had earlier ones."""
    from test_chat import REASONING
    base = tiny_base(tmp_path / "base.gguf")
    data = tmp_path / "turns.jsonl"
    turn = lambda role, text: {"role": role, "content": text}     # noqa: E731
    data.write_text("".join(json.dumps({"messages": [turn("user", f"{i}+1="),
                                                     turn("assistant", str(i + 1))]
                                        + [turn("user", "again"), turn("assistant", "ok")]
                                        * (i % 2)}) + "\n" for i in range(8)))
    template = tmp_path / "reasoning.jinja"
    template.write_text(REASONING)
    r = finetune_on(base, "--data", str(data), "--chat-template", str(template),
                    "--mask-prompt", "--n-ctx", "64", "--steps", "1",
                    "--out", str(tmp_path / "a.gguf"))
    assert r.exit_code == 0, r.output
    assert "4 conversations train their last answer only" in r.output, r.output


def test_finetune_stops_early_without_improvement(tmp_path):
    base = tiny_base(tmp_path / "base.gguf")
    data, template = chat_data(tmp_path)
    r = finetune_on(base, "--data", str(data / "train.jsonl"), "--val-split", "0.25",
                 "--chat-template", str(template), "--n-ctx", "24", "--lr", "1e-12",
                 "--steps", "20", "--val-every", "1", "--early-stop", "2",
                 "--out", str(tmp_path / "a.gguf"))
    assert r.exit_code == 0, r.output
    assert "train: 18 examples" in r.output and "validation: 6 examples" in r.output
    assert "early stop after step 3: 2 evaluations without a lower validation loss" in r.output


def test_finetune_on_the_bundled_chat_demo_by_name(tmp_path):
    base = tiny_base(tmp_path / "base.gguf")
    r = finetune_on(base, "--data", "chat-demo", "--mask-prompt", "--n-ctx", "128", "--steps",
                    "1", "--out", str(tmp_path / "a.gguf"))
    assert r.exit_code == 0, r.output
    assert re.search(r"data: chat-demo: train: \d+ examples.*\n *validation: \d+ examples",
                     r.output), r.output
    r = finetune_on(base, "--data", "no-such-set", "--steps", "1")
    assert r.exit_code == 2 and "nor a bundled dataset: chat-demo" in r.output


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "1+1="}', "train.jsonl:2: 'completion' must be a string"),
    ("not json", "train.jsonl:2: not valid JSON"),
])
def test_finetune_names_the_bad_line_of_its_data(tmp_path, line, message):
    base = tiny_base(tmp_path / "base.gguf")
    (tmp_path / "train.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    r = finetune_on(base, "--data", str(tmp_path / "train.jsonl"))
    assert r.exit_code == 2 and message in r.output, r.output
    r = finetune_on(base, "--data", str(tmp_path / "train.jsonl"), "--val-every", "1")
    assert r.exit_code == 2


@pytest.mark.parametrize("packing", ["packed", "padded", "packed-flash"])
def test_finetune_on_chat_data_resumes_exactly(tmp_path, packing):
    base = tiny_base(tmp_path / "base.gguf")
    data, template = chat_data(tmp_path)
    args = ["--data", str(data), "--chat-template", str(template), "--mask-prompt",
            "--n-ctx", "24"] + {"packed": [], "padded": ["--no-pack"],
                                "packed-flash": ["--flash-attn"]}[packing]
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    r = finetune_on(base, *args, "--steps", "4", "--out", str(tmp_path / "w.gguf"),
                    "--log", str(whole))
    assert r.exit_code == 0, r.output
    assert ("train: 24 examples, 48 trained tokens; packed into 12 rows of 24 (2.0 examples "
            "each), 92% of positions used (padding would use 46%)" if packing != "padded" else
            "train: 24 examples, 48 trained tokens; one per row of 24, padded, 46% of "
            "positions used") in r.output, r.output
    ckpt = tmp_path / "ckpt.gguf"
    r = finetune_on(base, *args, "--steps", "2", "--out", str(tmp_path / "p.gguf"),
                    "--checkpoint-out", str(ckpt), "--log", str(part))
    assert r.exit_code == 0, r.output
    r = finetune_on(base, *args, "--steps", "2", "--out", str(tmp_path / "p.gguf"),
                    "--checkpoint-in", str(ckpt), "--log", str(part))
    assert r.exit_code == 0, r.output
    assert log_losses(part) == log_losses(whole)
    r = finetune_on(base, "--data", str(data), "--n-ctx", "24", "--steps", "1",
                    "--out", str(tmp_path / "x.gguf"), "--checkpoint-in", str(ckpt))
    assert r.exit_code == 2 and "trained on other examples" in r.output, r.output
    # the same examples, packed the other way
    other = [a for a in args if a != "--no-pack"] + (["--no-pack"] if packing != "padded" else [])
    r = finetune_on(base, *other, "--steps", "1", "--out", str(tmp_path / "x.gguf"),
                    "--checkpoint-in", str(ckpt))
    assert r.exit_code == 2 and "same data, vocabulary, n_ctx and packing" in r.output, r.output


def test_eval_on_chat_data_gives_the_same_loss_packed_and_padded(tmp_path):
    base = tiny_base(tmp_path / "base.gguf")
    data, template = chat_data(tmp_path)
    args = ["--backend", "numpy", "eval", str(base), "--data", str(data), "--chat-template",
            str(template), "--n-ctx", "40", "--batch", "3", "--split", "train"]
    losses = {}
    for extra in ([], ["--no-pack"]):
        r = invoke(*args, *extra)
        assert r.exit_code == 0, r.output
        losses[bool(extra)] = float(re.search(r"loss (\S+) nats", r.output)[1])
        assert ("one per row of 40, padded" if extra else "(3.0 examples each)") in r.output
    assert losses[True] == pytest.approx(losses[False], abs=1e-4)


def float_options():
    """(command, option) for every float option of every ggwgpu command."""
    out = []
    for name, command in cli_main.cli.commands.items():
        for sub in getattr(command, "commands", {"": command}).values():
            for p in sub.params:
                if isinstance(p, click.Option) and isinstance(p.type, click.FloatRange):
                    out.append((name if sub is command else f"{name} {sub.name}", p.opts[0]))
    return out


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_no_float_option_takes_a_non_finite_value(value):
    options = float_options()
    assert ("train", "--lr") in options and ("generate", "--temp") in options
    for command, option in options:
        p = next(p for p in click_command(command).params if option in p.opts)
        with pytest.raises(click.BadParameter, match="not a finite number|not in the range"):
            p.type.convert(value, p, None)


def click_command(path):
    command = cli_main.cli
    for part in path.split():
        command = command.commands[part]
    return command


# -- hostile inputs: a message and exit code 1 or 2, never a traceback ------------------------

def no_traceback(result, code=None):
    """The result of a refused command: a message, no Python exception escaped."""
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in result.output
    assert result.exit_code in ((1, 2) if code is None else (code,)), result.output
    return result.output


def test_a_prompt_that_is_not_unicode_is_a_usage_error(tmp_path):
    """A lone surrogate: what Python makes of command-line bytes that are not UTF-8."""
    base = tiny_base(tmp_path / "base.gguf")
    for chat in ((), ("--chat",)):
        out = no_traceback(invoke("--backend", "numpy", "generate", str(base), "-n", "2",
                                  "-p", "a\udced", *chat), 2)
        assert "--prompt: cannot encode the text" in out and "lone surrogate U+DCED" in out


def test_a_chat_line_that_is_not_utf8_is_not_sent_and_the_chat_goes_on(tmp_path):
    """In a process of its own: CliRunner echoes input lines, which a terminal does not."""
    import subprocess
    base = tiny_base(tmp_path / "base.gguf")
    run = subprocess.run([sys.executable, "-m", "ggwgpu_cli.main", "--backend", "numpy",
                          "chat", str(base), "-n", "2"], input=b"a\xed\xb2\x80\nhello\n",
                         capture_output=True, env={**os.environ, "PYTHONIOENCODING": "utf-8"},
                         timeout=120)
    out = (run.stdout + run.stderr).decode("utf-8", "replace")
    assert run.returncode == 0 and "Traceback" not in out, out
    assert "that message was not sent" in out and out.count("> ") == 3, out


def test_a_vocabulary_without_byte_tokens_cannot_train_on_text_it_lacks(tmp_path):
    from ggwgpu.models import ModelConfig, init_parameters
    from ggwgpu.tokenizer import CONTROL, NORMAL, UNKNOWN, SentencePieceVocab
    vocab = SentencePieceVocab(["<unk>", "<s>", "</s>", "\u2581", "a", "b"], [0.0] * 6,
                               [UNKNOWN, CONTROL, CONTROL, NORMAL, NORMAL, NORMAL])
    cfg = ModelConfig(n_vocab=6, n_embd=16, n_head=2, n_layer=1, n_ff=32, n_ctx=16)
    gguf_llama.save_model(tmp_path / "v.gguf", cfg, init_parameters(cfg, 0), vocab)
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be\n" * 20)
    for args in (("train", str(text), "--vocab-model", str(tmp_path / "v.gguf"), "--steps",
                  "1", "--out", str(tmp_path / "o.gguf")),
                 ("finetune", str(tmp_path / "v.gguf"), str(text), "--steps", "1",
                  "--out", str(tmp_path / "o.gguf"))):
        out = no_traceback(invoke("--backend", "numpy", *args), 2)
        assert "vocabulary cannot tokenize the text" in out and "no byte token <0x54>" in out


def test_resuming_with_another_samples_after_nl_is_a_usage_error(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40)
    args = ("--backend", "numpy", "train", str(text), "--steps", "2", "--n-embd", "8",
            "--n-layer", "1", "--n-ff", "8", "--n-ctx", "8", "--batch", "2",
            "--out", str(tmp_path / "o.gguf"))
    assert invoke(*args, "--checkpoint-out", str(tmp_path / "c.gguf")).exit_code == 0
    out = no_traceback(invoke(*args, "--checkpoint-in", str(tmp_path / "c.gguf"),
                              "--samples-after-nl"), 2)
    assert "c.gguf" in out
    assert "resume with the same text, vocabulary, n_ctx and newline option" in out


@pytest.mark.parametrize("log, message", [
    ("/dev/full", "exists and is not a regular file"),
    ("/proc/version", "cannot write in /proc"),
    ("read-only", "cannot write in"),
])
def test_a_log_that_cannot_be_written(tmp_path, log, message):
    """--log where it cannot be written (a read-only place, a device) is refused before the
    first step; a disk that fills up later: tests/test_faults.py."""
    if log == "read-only":
        (tmp_path / "ro").mkdir()
        os.chmod(tmp_path / "ro", 0o500)
        log = str(tmp_path / "ro" / "log.jsonl")
        if os.access(tmp_path / "ro", os.W_OK):      # root writes anyway: a file in /proc
            log = "/proc/self/no-such-log"
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40)
    result = invoke("--backend", "numpy", "train", str(text), "--steps", "2", "--n-embd", "8",
                    "--n-layer", "1", "--n-ff", "8", "--n-ctx", "8", "--batch", "2",
                    "--out", str(tmp_path / "o.gguf"), "--log", log)
    assert message in result.output and "Traceback" not in result.output, result.output
    no_traceback(result, 2)
    assert not (tmp_path / "o.gguf").exists()


def test_unexpected_errors_are_one_line_or_the_traceback_when_asked(monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("oops")
    monkeypatch.setattr(cli_info, "wgpu_or_reason", broken)
    monkeypatch.delenv(cli_main.TRACEBACK_VAR, raising=False)
    out = no_traceback(invoke("info"), 1)
    assert "internal error, a bug in ggwgpu: KeyError: 'oops'" in out
    result = invoke("info", env={cli_main.TRACEBACK_VAR: "1"})
    assert isinstance(result.exception, KeyError)


@pytest.mark.parametrize("value", ["0", "many"])
def test_a_bad_numpy_thread_count_is_a_usage_error(value):
    out = no_traceback(invoke("--backend", "numpy", "bench", "train", "--no-torch",
                              env={"GGWGPU_NUMPY_THREADS": value}), 2)
    assert f"$GGWGPU_NUMPY_THREADS must be a positive number of threads, got '{value}'" in out


@pytest.mark.parametrize("args, words", [
    (("train", "--n-embd", "16384", "--n-ff", "65536"), ["this model", "weights 64 GiB"]),
    (("train", "--n-ff", "1000000000"), ["this model", "gradients and optimizer moments"]),
    (("train", "--n-layer", "1000000000"), ["this model"]),
    (("train", "--n-ctx", "100000"), ["this model", "activations"]),
    (("finetune", "BASE", "--n-ctx", "100000"), ["finetuning", "activations"]),
    (("finetune", "BASE", "--batch", "65536", "--n-ctx", "4096"), ["finetuning", "activations"]),
    (("finetune", "BASE", "--full", "--n-ctx", "100000"), ["finetuning"]),
    (("eval", "BASE", "--n-ctx", "60000", "--batch", "4"), ["evaluating", "activations"]),
    (("generate", "BASE", "--n-ctx", "2000000000"), ["generating with", "KV cache"]),
    (("chat", "BASE", "--n-ctx", "2000000000"), ["chatting with", "KV cache"]),
])
def test_sizes_are_refused_with_the_numbers_before_allocation(tmp_path, args, words):
    """Under a host limit of 1 GiB, each configuration is refused before it allocates
    (tracemalloc's peak stays small) with what it needs and the limit."""
    import tracemalloc
    base = str(tiny_base(tmp_path / "base.gguf"))
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 4000)
    args = [base if a == "BASE" else a for a in args]
    if args[0] in ("train", "finetune", "eval"):
        args.insert(2 if args[0] != "train" else 1, str(text))
    if args[0] in ("train", "finetune"):
        args += ["--steps", "1", "--out", str(tmp_path / "o.gguf")]
    tracemalloc.start()
    try:
        result = invoke("--backend", "numpy", *args, env={"GGWGPU_MAX_HOST_BYTES": str(2 ** 30)})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    out = no_traceback(result, 2)
    assert "of host memory" in out and "the limit is 1 GiB ($GGWGPU_MAX_HOST_BYTES)" in out, out
    for word in words:
        assert word in out, out
    assert peak < 256 * 2 ** 20, peak


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_the_memory_check_counts_the_weights_numpy_holds_dequantized(tmp_path, monkeypatch,
                                                                     backend):
    """NumPy's products read a block-type base as f32 values it keeps beside the blocks: its
    memory check counts them (4 bytes a value); a device reads the blocks themselves."""
    from ggwgpu import gguf_llama, memory
    from ggwgpu.quant import Quantized
    if backend == "wgpu" and not has_adapter():
        pytest.skip("no WebGPU adapter")
    needs = []
    monkeypatch.setattr(memory, "check", lambda need, what, device_is_host=True:
                        needs.append((need, device_is_host)))
    base = tiny_base(tmp_path / "base.gguf", "q8_0")
    result = finetune(tmp_path, base, "--steps", "1", "--out", str(tmp_path / "o.gguf"),
                      backend=("--backend", backend))
    assert result.exit_code == 0, result.output
    need, device_is_host = needs[0]
    _, values, _ = gguf_llama.load_model(base, keep_quantized=True)
    blocks = [v for v in values.values() if isinstance(v, Quantized)]
    assert blocks       # q8_0 takes the rows of 32: ffn_down's
    if backend == "numpy":
        assert device_is_host
        assert need["dequantized weights"] == 4 * sum(math.prod(v.shape) for v in blocks)
    else:
        assert not device_is_host and "dequantized weights" not in need


@pytest.mark.parametrize("option, message", [
    (("--lora-r", "1000000"), "rank 1000000 of tok_embd is more than token_embd.weight "
                              "(259 x 16) can use: at most 16"),
    (("--lora-layers", "0-999999999"), "layer 999999999 is beyond any llama's"),
    (("--lora-layers", "0-9"), "layer 2 does not exist"),
])
def test_lora_options_beyond_the_model_are_refused_before_allocation(tmp_path, option, message):
    base = tiny_base(tmp_path / "base.gguf")
    out = no_traceback(finetune(tmp_path, base, *option, "--steps", "1",
                                "--out", str(tmp_path / "o.gguf")), 2)
    assert message in out, out


@pytest.mark.parametrize("value", ["1e39", "-1e308", "1e-39"])
def test_no_float_option_takes_a_value_float32_cannot_hold(value):
    """ggwgpu computes and stores in float32: 1e308 would be infinity, 1e-39 lose its
    precision or be 0 (a norm eps of 0 in the written file, which then does not load)."""
    for command, option in float_options():
        p = next(p for p in click_command(command).params if option in p.opts)
        with pytest.raises(click.BadParameter, match="outside float32's range|not in the range"):
            p.type.convert(value, p, None)


def test_generating_from_a_model_with_a_one_token_context_is_a_usage_error(tmp_path):
    from ggwgpu.models import ModelConfig, init_parameters
    from ggwgpu.tokenizer import ByteTokenizer
    cfg = ModelConfig(n_vocab=259, n_embd=16, n_head=2, n_layer=1, n_ff=32, n_ctx=1)
    gguf_llama.save_model(tmp_path / "m.gguf", cfg, init_parameters(cfg, 0), ByteTokenizer())
    for command in ("generate", "chat"):
        out = no_traceback(invoke("--backend", "numpy", command, str(tmp_path / "m.gguf"),
                                  "-n", "3"), 2)
        assert "context length (llama.context_length) is 1" in out and "--n-ctx 2" in out
    result = invoke("--backend", "numpy", "generate", str(tmp_path / "m.gguf"), "-n", "3",
                    "--n-ctx", "2", "-p", "ab")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("name", ["d/" * 2100 + "x", "y" * 300])   # past PATH_MAX, NAME_MAX
def test_an_input_path_too_long_is_said_to_be_too_long_not_missing(tmp_path, name):
    r = invoke("--backend", "numpy", "eval", str(tmp_path / name))
    assert r.exit_code == 2 and "the name is too long for the file system" in r.output
    assert "does not exist" not in r.output
