"""Data-parallel training over MPI: processes started by mpiexec on this machine (loopback)
keep identical weights after every step, follow the trajectory of one process with their
batches together, stop together, and write checkpoints that resume under any number of
processes. Needs mpiexec and mpi4py (pip install 'ggwgpu[mpi]' mpich): without them these
tests skip, and fail in CI (CI=true) or with GGWGPU_REQUIRE_MPI=1."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ggwgpu import distributed, gguf_llama
from ggwgpu.training import checkpoint
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu_cli.main import cli

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from distributed_worker import TINY, make_trainer  # noqa: E402

REQUIRE_MPI = (os.environ.get("CI", "").lower() in ("true", "1")
               or os.environ.get("GGWGPU_REQUIRE_MPI") == "1")


@pytest.fixture(scope="module")
def mpiexec():
    """mpiexec_run(n, *argv) runs argv in n processes and returns the CompletedProcess."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    exe = shutil.which("mpiexec", path=path)
    problem = None if exe else "no mpiexec on PATH"
    try:
        import mpi4py  # noqa: F401  (importing the package does not start MPI)
    except ImportError:
        problem = "mpi4py is not installed"
    if problem:
        message = f"{problem}: pip install 'ggwgpu[mpi]' mpich"
        if REQUIRE_MPI:
            pytest.fail(f"CI needs MPI for the data-parallel tests, but {message}")
        pytest.skip(message)
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    for var in distributed.SIZE_VARS:   # a test run under mpirun itself starts clean ones
        env.pop(var, None)

    def argv(n, *args):
        return [exe, "-n", str(n), *map(str, args)]

    def run(n, *args):
        return subprocess.run(argv(n, *args), env=env, capture_output=True, text=True,
                              timeout=600)
    run.argv, run.env = argv, env
    return run


def run_worker(mpiexec, out, backend, batch, grad_accum, steps, ranks=2, loss_scale=None):
    r = mpiexec(ranks, sys.executable, HERE / "distributed_worker.py", out, backend, batch,
                grad_accum, steps, *([loss_scale] if loss_scale else []))
    assert r.returncode == 0, r.stdout + r.stderr
    return [np.load(out / f"rank{k}.npz") for k in range(ranks)]


@pytest.mark.parametrize("backend, grad_accum", [("numpy", 1), ("numpy-f64", 2)])
def test_two_ranks_train_as_one_process_with_both_batches(tmp_path, mpiexec, backend,
                                                         grad_accum):
    ranks = run_worker(mpiexec, tmp_path, backend, 4, grad_accum, 3)
    # the same weights on every rank after every step, bit for bit
    assert list(ranks[0]["digests"]) == list(ranks[1]["digests"])
    one = make_trainer(NumpyBackend(np.float64 if backend == "numpy-f64" else np.float32),
                       4, grad_accum, None)
    losses = [one.train_step()["loss"] for _ in range(3)]
    # the ranks' targets are weighted by the whole batch's count (some are ignored)
    tight = backend == "numpy-f64"
    np.testing.assert_allclose(ranks[0]["losses"], losses, rtol=1e-12 if tight else 1e-6)
    for name, value in one.parameters().items():
        np.testing.assert_allclose(ranks[0][name], value, rtol=0,
                                   atol=1e-12 if tight else 2e-5, err_msg=name)


def test_two_ranks_on_wgpu_keep_identical_weights(tmp_path, mpiexec, wgpu):
    ranks = run_worker(mpiexec, tmp_path, "wgpu", 4, 1, 2)
    assert list(ranks[0]["digests"]) == list(ranks[1]["digests"])
    one = make_trainer(wgpu, 4, 1, None)
    losses = [one.train_step()["loss"] for _ in range(2)]
    np.testing.assert_allclose(ranks[0]["losses"], losses, rtol=1e-5)
    for name, value in one.parameters().items():
        np.testing.assert_allclose(ranks[0][name], value, rtol=0, atol=1e-4, err_msg=name)


def test_an_error_on_one_rank_ends_every_rank(tmp_path, mpiexec):
    r = mpiexec(2, sys.executable, HERE / "distributed_worker.py", tmp_path, "fail")
    assert r.returncode != 0
    assert "rank 1 of 2: RuntimeError: rank 1 fails; ending all 2 processes" in r.stderr


def train_args(*args):
    size = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    return ["--backend", "numpy", "train", *size, "--warmup", "2", "--lr", "3e-3", *args]


def losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def test_a_checkpoint_of_two_ranks_resumes_under_one_and_under_two(tmp_path, mpiexec):
    ggwgpu = [sys.executable, "-m", "ggwgpu_cli.main"]
    r = CliRunner().invoke(cli, train_args("--batch", "4", "--steps", "4", "--log",
                                           tmp_path / "one.jsonl", "--out", tmp_path / "one.gguf"))
    assert r.exit_code == 0, r.output
    straight = losses(tmp_path / "one.jsonl")

    ckpt = tmp_path / "ckpt.gguf"
    r = mpiexec(2, *ggwgpu, *train_args("--batch", "2", "--steps", "2", "--checkpoint-out", ckpt,
                                        "--log", tmp_path / "two.jsonl", "--out",
                                        tmp_path / "two.gguf"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("model written to") == 1     # rank 0 alone writes and reports
    np.testing.assert_allclose(losses(tmp_path / "two.jsonl"), straight[:2], rtol=1e-6)
    state = checkpoint.load_checkpoint(ckpt)[4]
    assert state.options.batch == 4 and state.samples == 8   # the global batch

    r = CliRunner().invoke(cli, ["--backend", "numpy", "train", "--checkpoint-in", ckpt,
                                 "--steps", "2", "--log", tmp_path / "resumed1.jsonl",
                                 "--out", tmp_path / "resumed1.gguf"])
    assert r.exit_code == 0, r.output
    r = mpiexec(2, *ggwgpu, "--backend", "numpy", "train", "--checkpoint-in", ckpt,
                "--steps", "2", "--log", tmp_path / "resumed2.jsonl", "--out",
                tmp_path / "resumed2.gguf")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("resumed1", "resumed2"):
        np.testing.assert_allclose(losses(tmp_path / f"{name}.jsonl"), straight[2:], rtol=1e-5)
    one, two = (gguf_llama.load_model(tmp_path / f"resumed{k}.gguf")[1] for k in (1, 2))
    for name, value in one.items():
        np.testing.assert_allclose(two[name], value, rtol=0, atol=2e-5, err_msg=name)

    r = mpiexec(3, *ggwgpu, "--backend", "numpy", "train", "--checkpoint-in", ckpt,
                "--steps", "1", "--out", tmp_path / "three.gguf")
    assert r.returncode != 0 and "does not split evenly over 3 processes" in r.stderr


def test_without_mpi4py_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.setitem(sys.modules, "mpi4py", None)     # as if not installed
    distributed.world.cache_clear()
    try:
        r = CliRunner().invoke(cli, train_args("--steps", "1"))
    finally:
        distributed.world.cache_clear()
    assert r.exit_code == 1 and "pip install 'ggwgpu[mpi]'" in r.output, r.output


def one_and_two_ranks(tmp_path, mpiexec, args, packing):
    """The logs of `args` (a finetune) as one process with --batch 4 (one.gguf) and as two
    ranks with --batch 2 each (two.gguf): the records of each, one and two."""
    r = CliRunner().invoke(cli, [*args, "--batch", "4", "--log", str(tmp_path / "one.jsonl"),
                                 "--out", str(tmp_path / "one.gguf")])
    assert r.exit_code == 0, r.output
    assert ("packed into" in r.output) == (packing == "packed"), r.output
    r = mpiexec(2, sys.executable, "-m", "ggwgpu_cli.main", *args, "--batch", "2",
                "--log", tmp_path / "two.jsonl", "--out", tmp_path / "two.gguf")
    assert r.returncode == 0, r.stdout + r.stderr
    return ([json.loads(line) for line in (tmp_path / f"{k}.jsonl").read_text().splitlines()]
            for k in ("one", "two"))


@pytest.mark.parametrize("packing", ["padded", "packed"])
def test_a_lora_finetune_on_chat_data_over_two_ranks_matches_one_process(tmp_path, mpiexec,
                                                                         packing):
    base = tmp_path / "base.gguf"
    r = CliRunner().invoke(cli, train_args("--batch", "2", "--steps", "1", "--out", str(base)))
    assert r.exit_code == 0, r.output
    data, n_ctx = "chat-demo", "128"    # bytes: one conversation fills a row
    if packing == "packed":             # short sums, several to a row
        data, n_ctx = tmp_path / "sums.jsonl", "256"
        data.write_text("".join(json.dumps({"prompt": f"{i % 7}+{i % 3}=",
                                            "completion": str(i % 7 + i % 3) * (1 + i % 3)})
                                + "\n" for i in range(40)))
    # masked prompts: the ranks' rows count different numbers of targets
    args = ["--backend", "numpy", "finetune", str(base), "--data", str(data), "--mask-prompt",
            "--n-ctx", n_ctx, "--steps", "3", "--warmup", "2", "--lr", "1e-2", "--val-split",
            "0.25", "--val-every", "3"]
    one, two = one_and_two_ranks(tmp_path, mpiexec, args, packing)
    np.testing.assert_allclose([x["loss"] for x in two], [x["loss"] for x in one], rtol=1e-5)
    np.testing.assert_allclose(two[-1]["val_loss"], one[-1]["val_loss"], rtol=1e-5)
    assert one[-1]["loss"] != one[0]["loss"]


@pytest.mark.parametrize("objective, packing", [("dpo", "padded"), ("dpo", "packed"),
                                               ("orpo", "packed")])
def test_a_preference_finetune_over_two_ranks_matches_one_process(tmp_path, mpiexec, objective,
                                                                  packing):
    """Each rank trains its pairs of each batch; the loss, the TRL metrics of the step and of
    validation, and the adapter are one process's with the whole batch. Packed, the ranks'
    parts of a batch hold different numbers of pairs (answers of 1 to 3 repeats)."""
    base = tmp_path / "base.gguf"
    r = CliRunner().invoke(cli, train_args("--batch", "2", "--steps", "1", "--out", str(base)))
    assert r.exit_code == 0, r.output
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i % 7}+{i % 3}=",
                                        "chosen": str(i % 7 + i % 3) * (1 + i % 3),
                                        "rejected": str(i % 7 + i % 3 + 1) * (1 + i % 2)})
                            + "\n" for i in range(24)))
    args = ["--backend", "numpy", "finetune", str(base), "--data", str(data), "--objective",
            objective, "--beta", "0.5", "--n-ctx", "256" if packing == "packed" else "64",
            "--steps", "3", "--warmup", "2", "--lr", "1e-2", "--val-split", "0.25",
            "--val-every", "3"]
    one, two = one_and_two_ranks(tmp_path, mpiexec, args, packing)
    # rewards: beta (logp - ref), of log-probabilities of tens of nats summed in float32
    for key in ("loss", "rewards_chosen", "rewards_rejected", "margin"):
        np.testing.assert_allclose([x[key] for x in two], [x[key] for x in one], rtol=1e-5,
                                   atol=1e-5, err_msg=key)
    # DPO's first step has the policy at the reference: its rewards are float32 noise
    # around 0, and which answer of a pair has the larger noise (the accuracy) depends on
    # the summation order, which differs on two ranks; later steps decide it
    decided = 0
    if objective == "dpo":
        assert all(abs(x[k]) < 1e-4 for x in (one[0], two[0])
                   for k in ("rewards_chosen", "rewards_rejected"))
        decided = 1
    np.testing.assert_allclose([x["accuracy"] for x in two[decided:]],
                               [x["accuracy"] for x in one[decided:]], rtol=1e-5, atol=1e-5)
    for key in ("val_loss", "val_accuracy", "val_margin"):
        np.testing.assert_allclose(two[-1][key], one[-1][key], rtol=1e-5, atol=1e-5,
                                   err_msg=key)
    assert one[-1]["loss"] != one[0]["loss"]
    from ggwgpu.lora import load_adapter
    a, b = (load_adapter(tmp_path / f"{k}.gguf").tensors for k in ("one", "two"))
    for name, value in a.items():
        np.testing.assert_allclose(b[name], value, rtol=0, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("arch", ["gemma3", "phi3", "gemma4", "lfm2", "qwen35"])
def test_a_lora_finetune_of_another_family_over_two_ranks_matches_one_process(tmp_path, mpiexec,
                                                                              arch):
    """gemma3 (sliding windows, sandwich norms), phi3 (fused matrices, LongRoPE), gemma4
    (shared K/V, per-layer embeddings), lfm2 (short convolutions), qwen35 (delta-nets)."""
    from test_families import FAMILIES, family_file
    base = family_file(tmp_path / "base.gguf", FAMILIES[arch])
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40)
    args = ["--backend", "numpy", "finetune", str(base), str(text), "--n-ctx", "16", "--steps",
            "3", "--warmup", "2", "--lr", "1e-2"]
    r = CliRunner().invoke(cli, [*args, "--batch", "4", "--log", str(tmp_path / "one.jsonl"),
                                 "--out", str(tmp_path / "one.gguf")])
    assert r.exit_code == 0, r.output
    r = mpiexec(2, sys.executable, "-m", "ggwgpu_cli.main", *args, "--batch", "2",
                "--log", tmp_path / "two.jsonl", "--out", tmp_path / "two.gguf")
    assert r.returncode == 0, r.stdout + r.stderr
    one, two = ([json.loads(line)["loss"] for line in (tmp_path / f"{k}.jsonl").read_text()
                 .splitlines()] for k in ("one", "two"))
    np.testing.assert_allclose(two, one, rtol=1e-5)
    assert one[-1] != one[0]


def test_a_finetune_with_dropout_and_neftune_runs_over_two_ranks(tmp_path, mpiexec):
    """Each rank draws its own masks and noise (the rank is in the seed), as PyTorch's DDP
    ranks do; the weights stay one (the update reads the summed gradients)."""
    base = tmp_path / "base.gguf"
    r = CliRunner().invoke(cli, train_args("--batch", "2", "--steps", "1", "--out", str(base)))
    assert r.exit_code == 0, r.output
    r = mpiexec(2, sys.executable, "-m", "ggwgpu_cli.main", "--backend", "numpy", "finetune",
                base, "--steps", "3", "--batch", "2", "--lr", "1e-2", "--lora-dropout", "0.3",
                "--neftune-alpha", "5", "--log", tmp_path / "two.jsonl", "--out",
                tmp_path / "two.gguf")
    assert r.returncode == 0, r.stdout + r.stderr
    records = [json.loads(line) for line in (tmp_path / "two.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records] == [1, 2, 3]
    assert all(np.isfinite(x["loss"]) for x in records) and (tmp_path / "two.gguf").exists()


def test_processes_on_a_machine_take_one_gpu_each():
    from ggwgpu.backends import adapter_for_rank

    def adapter(name, kind):
        return type("Adapter", (), {"info": {"device": name, "adapter_type": kind}})()
    gpus = [adapter("llvmpipe", "CPU"), adapter("A", "DiscreteGPU"), adapter("B", "DiscreteGPU")]
    assert [adapter_for_rank(gpus, k).info["device"] for k in range(3)] == ["A", "B", "A"]
    assert adapter_for_rank(gpus[:2], 1) is None        # one GPU: every process takes it


def test_ctrl_c_on_mpiexec_stops_every_rank_after_one_step_and_saves_once(tmp_path, mpiexec):
    import signal
    import time
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt.gguf"
    argv = mpiexec.argv(2, sys.executable, "-m", "ggwgpu_cli.main",
                        *train_args("--batch", "2", "--steps", "100000", "--log", log,
                                    "--checkpoint-out", ckpt, "--save-every", "100000",
                                    "--out", tmp_path / "m.gguf"))
    proc = subprocess.Popen(argv, env=mpiexec.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (log.exists() and log.read_text().count("\n") >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)     # what Ctrl-C in its terminal sends
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode in (128 + signal.SIGINT, 128 + signal.SIGTERM), out + err
    assert err.count("saved to") == 1, err
    steps = len(log.read_text().splitlines())
    assert checkpoint.load_checkpoint(ckpt)[4].step == steps


def test_bench_ranks_reports_the_scaling_and_the_allreduce(tmp_path, mpiexec):
    report = tmp_path / "ranks.json"
    r = subprocess.run([sys.executable, "-m", "ggwgpu_cli.main", "--backend", "numpy", "bench",
                        "ranks", "--ranks", "1,2", "--steps", "1", "--mpiexec",
                        mpiexec.argv(1)[0], "--json", str(report)],
                       env=mpiexec.env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = json.loads(report.read_text())["runs"]
    assert [x["ranks"] for x in runs] == [1, 2]
    assert runs[0]["allreduce_seconds_per_step"] == 0 < runs[1]["allreduce_seconds_per_step"]
    assert runs[1]["tokens_per_step"] == 2 * runs[0]["tokens_per_step"]
    assert "allreduce" in r.stdout
