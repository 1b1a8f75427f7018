"""Random draws while training: LoRA dropout and NEFTune's noise. The ops' draws (the same on
every backend, at the rate or magnitude asked, apart for each stream and seed), their place
in a training graph (what they change, their gradients, off), and training with them
(repeatable, resumable, evaluated without them)."""
import numpy as np
import pytest

import ggwgpu
from ggwgpu import ops as O
from ggwgpu import testing
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.graph import build_backward, topo_order
from ggwgpu.lora import init_adapter, lora_ranks
from ggwgpu.models import ModelConfig, build_train_graph, init_parameters
from ggwgpu.tensor import input_tensor
from ggwgpu.training import TrainOptions, Trainer
from ggwgpu.training.run import Reporter

TINY = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_layer=2, n_ff=12, n_ctx=5, n_rot=4)
BATCH = 2
ON, OFF = np.array([1234567, 1], np.int32), np.zeros(2, np.int32)


def drawn(op, backend, x, size, stream, control):
    """op (dropout or noise) of x at `size` (its rate or magnitude), on `backend`."""
    xt, ct = input_tensor(x.shape), input_tensor((2,), "i32")
    y = op(xt, ct, size, stream)
    plan = backend.plan([y])
    plan.run({xt: x, ct: np.asarray(control, np.int32)})
    return plan.read(y)


def dropped(*args):
    return drawn(O.dropout, *args)


def noised(*args):
    return drawn(O.noise, *args)


@pytest.mark.parametrize("rate,stream,seed", [(0.3, 5, 12345), (0.05, 2 ** 32 - 1, -7),
                                              (0.9, 0, 0)])
def test_the_draws_are_the_same_on_the_device_and_in_numpy(wgpu, rate, stream, seed):
    x = np.ones((300, 1000), np.float32)
    ref = dropped(NumpyBackend(), x, rate, stream, [seed, 1])
    np.testing.assert_array_equal(dropped(wgpu, x, rate, stream, [seed, 1]), ref)
    kept = ref != 0
    # a binomial count of 300 000 draws: within 5 standard deviations of the rate
    assert abs(kept.mean() - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / kept.size)
    # the kept ones times 1 / (1 - rate), from the float32 rate
    assert set(np.unique(ref[kept])) == {np.float32(1) / (np.float32(1) - np.float32(rate))}
    # neighbours are independent: both kept as often as two independent draws
    both = (kept[:, 1:] & kept[:, :-1]).mean()
    assert abs(both - (1 - rate) ** 2) < 5 * np.sqrt((1 - rate) ** 2 / kept.size)


def test_streams_and_seeds_draw_apart_and_off_is_the_identity():
    x = np.random.default_rng(0).uniform(-1, 1, (200, 500)).astype(np.float32)
    backend = NumpyBackend()
    base = dropped(backend, x, 0.5, 7, ON) != 0
    for stream, control in ((8, ON), (7, [1234568, 1]), (7 + 2 ** 31, ON)):
        other = dropped(backend, x, 0.5, stream, control) != 0
        assert abs((base == other).mean() - 0.5) < 0.01     # as two independent masks
    np.testing.assert_array_equal(dropped(backend, x, 0.5, 7, OFF), x)
    np.testing.assert_array_equal(dropped(backend, x, 0.0, 7, ON), x)


def test_noise_is_uniform_within_its_magnitude_and_the_same_on_the_device(wgpu):
    x = np.random.default_rng(1).uniform(-1, 1, (300, 1000)).astype(np.float32)
    ref = noised(NumpyBackend(), x, 0.25, 9, ON)
    # the same draws; the device may fuse the multiply-add (one rounding fewer)
    np.testing.assert_allclose(noised(wgpu, x, 0.25, 9, ON), ref, rtol=0, atol=3e-8)
    unit = (ref.astype(np.float64) - x) / 0.25
    assert -1 - 1e-6 <= unit.min() < -0.999 and 0.999 < unit.max() < 1 + 1e-6
    sd = np.sqrt(1 / 3 / unit.size)       # of the mean of uniform [-1, 1) draws
    assert abs(unit.mean()) < 5 * sd and abs((unit ** 2).mean() - 1 / 3) < 0.005
    assert abs(np.corrcoef(unit[:, 1:].ravel(), unit[:, :-1].ravel())[0, 1]) < 0.01
    other = (noised(NumpyBackend(), x, 0.25, 10, ON).astype(np.float64) - x) / 0.25
    assert abs(np.corrcoef(unit.ravel(), other.ravel())[0, 1]) < 0.01   # another stream
    np.testing.assert_array_equal(noised(NumpyBackend(), x, 0.25, 9, OFF), x)


def trained_adapter(seed=1):
    """An adapter with B not zero (as after some steps), so every pair adds to the loss."""
    adapter = init_adapter(TINY, lora_ranks(TINY, r=2), 2.0, seed)
    rng = np.random.default_rng(seed)
    for name, value in adapter.tensors.items():
        if name.endswith(".lora_b"):
            adapter.tensors[name] = rng.uniform(-0.5, 0.5, value.shape).astype(np.float32)
    return adapter


def lora_graph(rate, adapter=None, neftune_alpha=0.0):
    values = init_parameters(TINY, seed=2)
    return build_train_graph(TINY, values, BATCH, lora=adapter or trained_adapter(),
                             lora_dropout=rate, neftune_alpha=neftune_alpha)


def batch_feeds(g, control=None):
    tokens = np.random.default_rng(3).integers(0, TINY.n_vocab, (BATCH, TINY.n_ctx + 1))
    feeds = {**g.feeds(tokens[:, :-1], tokens[:, 1:]),
             g.positions: np.arange(TINY.n_ctx, dtype=np.int32)}
    if control is not None:
        feeds[g.draws] = control
    return feeds


def test_each_pair_reads_its_input_dropped_and_the_weight_reads_it_whole():
    g = lora_graph(0.25)
    nodes = topo_order([g.loss])
    drops = [n for n in nodes if n.op == "dropout"]
    a_products = [n for n in nodes
                  if n.op == "mul_mat" and (n.srcs[0].name or "").endswith(".lora_a")]
    # every pair but the token embedding's (a table lookup, which PEFT does not drop either)
    assert len(drops) == len(a_products) == len(g.params) // 2 - 1
    assert {id(n.srcs[1]) for n in a_products} == {id(d) for d in drops}
    assert len({d.params["stream"] for d in drops}) == len(drops)
    assert {d.params["rate"] for d in drops} == {0.25}
    weights = [n for n in nodes if n.op in ("mul_mat", "mul_mat_acc")
               and (n.srcs[0].name or "").startswith("blk.")
               and ".lora" not in n.srcs[0].name]
    assert weights and not any(n.srcs[1].op == "dropout" for n in weights)
    with pytest.raises(ValueError, match="LoRA finetune"):
        build_train_graph(TINY, init_parameters(TINY), BATCH, lora_dropout=0.1)


def test_the_noise_goes_on_the_embeddings_at_neftune_s_magnitude():
    g = build_train_graph(TINY, init_parameters(TINY), BATCH, neftune_alpha=5.0)
    (noise,) = [n for n in topo_order([g.loss]) if n.op == "noise"]
    assert noise.srcs[0].op == "get_rows" and noise.srcs[1] is g.draws
    assert noise.params["magnitude"] == pytest.approx(5.0 / np.sqrt(TINY.n_ctx * TINY.n_embd))
    assert not any(n.op == "dropout" for n in topo_order([g.loss]))


def test_lora_dropout_and_noise_gradients_match_finite_differences():
    g = lora_graph(0.5, neftune_alpha=5.0)
    grads = build_backward(g.loss, list(g.params.values()))
    feeds = batch_feeds(g, ON)
    plan = NumpyBackend(np.float64).plan([g.loss, *grads.values()])
    plan.run(feeds)
    analytic = {p: plan.read(grad) for p, grad in grads.items()}
    testing.spot_check_gradients(g.loss, analytic, feeds, samples=4)


def test_dropout_off_is_the_graph_without_it_and_on_changes_the_loss(wgpu):
    plain, drop = lora_graph(0.0), lora_graph(0.5)
    results = {}
    for name, backend in (("numpy", NumpyBackend()), ("wgpu", wgpu)):
        for g, control, key in ((plain, None, "plain"), (drop, OFF, "off"), (drop, ON, "on")):
            grads = build_backward(g.loss, list(g.params.values()))
            plan = backend.plan([g.loss, *grads.values()])
            plan.run(batch_feeds(g, control))
            results[name, key] = [plan.read(g.loss)] + [plan.read(grads[g.params[k]])
                                                        for k in sorted(g.params)]
    for name in ("numpy", "wgpu"):
        plain_loss, *plain_grads = results[name, "plain"]
        off_loss, *off_grads = results[name, "off"]
        assert off_loss == plain_loss
        for a, b in zip(off_grads, plain_grads):    # (the input's gradient adds up apart)
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
        assert results[name, "on"][0] != results[name, "plain"][0]
    for a, b in zip(results["numpy", "on"], results["wgpu", "on"]):   # the same draws
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)


class Batches:
    """The same random batch every step."""
    packed = False

    def next_batch(self):
        tokens = np.random.default_rng(4).integers(0, TINY.n_vocab, (BATCH, TINY.n_ctx + 1))
        return tokens[:, :-1], tokens[:, 1:]


def trainer(rate, backend=None, lora=True, **options):
    options = TrainOptions(batch=BATCH, warmup=0, lr=1e-2, lora_dropout=rate, **options)
    return Trainer(TINY, init_parameters(TINY, seed=2), backend or NumpyBackend(), options,
                   Batches(), lora=trained_adapter() if lora else None)


def test_a_step_draws_anew_for_each_micro_batch_and_step_and_evaluates_without_dropout():
    t = trainer(0.5, grad_accum=2)
    first = t.draws_feed(0)[t.graph.draws]
    assert first[1] == 1 and first[0] != t.draws_feed(1)[t.graph.draws][0]
    assert not t.draws_feed(None)[t.graph.draws].any()
    plain = trainer(0.0, grad_accum=2)
    assert not plain.draws_feed(0)
    batch = [Batches().next_batch()]
    assert t.evaluation(batch) == plain.evaluation(batch)
    losses = [t.train_step()["loss"] for _ in range(3)]
    assert losses != [plain.train_step()["loss"] for _ in range(3)]
    assert t.draws_feed(0)[t.graph.draws][0] != first[0]       # the step moved on
    again = trainer(0.5, grad_accum=2)
    assert [again.train_step()["loss"] for _ in range(3)] == losses


def test_neftune_trains_every_weight_too_and_evaluates_without_noise():
    noisy, plain = trainer(0.0, lora=False, neftune_alpha=5.0), trainer(0.0, lora=False)
    batch = [Batches().next_batch()]
    assert noisy.evaluation(batch) == plain.evaluation(batch)
    assert noisy.train_step()["loss"] != plain.train_step()["loss"]
    with pytest.raises(ValueError, match="neftune_alpha does not work with objective dpo"):
        TrainOptions(neftune_alpha=5.0, objective="dpo")
    assert TrainOptions(neftune_alpha=5.0, objective="orpo").neftune_alpha == 5.0
    with pytest.raises(ValueError, match="neftune_alpha does not work with optimizer lbfgs"):
        TrainOptions(neftune_alpha=5.0, optimizer="lbfgs")


def test_checkpointing_recomputes_the_same_draws():
    losses = [[t.train_step()["loss"] for _ in range(3)]
              for t in (trainer(0.5, neftune_alpha=5.0),
                        trainer(0.5, neftune_alpha=5.0, checkpointing=True))]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


def test_lora_dropout_is_refused_where_nothing_reads_it():
    with pytest.raises(ValueError, match="lora_dropout does not work with optimizer lbfgs"):
        TrainOptions(optimizer="lbfgs", lora_dropout=0.1)
    with pytest.raises(ValueError, match="must be in \\[0, 1\\)"):
        TrainOptions(lora_dropout=1.0)
    with pytest.raises(ValueError, match="trains every weight"):
        Trainer(TINY, init_parameters(TINY), NumpyBackend(), TrainOptions(lora_dropout=0.1),
                Batches())


def test_a_finetune_with_dropout_resumes_as_one_run(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("Full fathom five thy father lies;\nOf his bones are coral made;\n" * 24)
    quiet = Reporter()
    shape = dict(n_embd=32, n_head=2, n_layer=2, n_ff=64, n_ctx=32)
    ggwgpu.train([text], out=str(tmp_path / "base.gguf"), steps=3, batch=4, backend="numpy",
                 reporter=quiet, **shape)

    def finetune(steps, out, **kw):
        return ggwgpu.finetune(str(tmp_path / "base.gguf"), [text], steps=steps, batch=4,
                               lr=1e-2, warmup=2, lora_dropout=0.2, backend="numpy",
                               reporter=quiet, out=str(tmp_path / out), **kw)
    straight = finetune(6, "straight.gguf")
    finetune(3, "first.gguf", checkpoint=str(tmp_path / "ckpt.gguf"))
    resumed = ggwgpu.resume(str(tmp_path / "ckpt.gguf"), str(tmp_path / "base.gguf"), [text],
                            out=str(tmp_path / "resumed.gguf"), steps=3, backend="numpy",
                            reporter=quiet)
    assert resumed.last_loss == straight.last_loss
    without = ggwgpu.finetune(str(tmp_path / "base.gguf"), [text], steps=6, batch=4, lr=1e-2,
                              warmup=2, backend="numpy", reporter=quiet,
                              out=str(tmp_path / "plain.gguf"))
    assert without.last_loss != straight.last_loss
    with pytest.raises(ValueError, match="lora_dropout 0.2 \\(given: 0.3\\)"):
        ggwgpu.resume(str(tmp_path / "ckpt.gguf"), str(tmp_path / "base.gguf"), [text],
                      steps=1, lora_dropout=0.3, backend="numpy", reporter=quiet)


def test_finetune_takes_lora_dropout_and_neftune_and_says_so_and_train_does_not(tmp_path):
    from click.testing import CliRunner
    from ggwgpu_cli import main as cli_main
    text = tmp_path / "text.txt"
    text.write_text("Full fathom five thy father lies;\n" * 40)
    cli = cli_main.cli
    run = CliRunner().invoke(cli, ["--backend", "numpy", "train", str(text), "--steps", "1",
                                   "--n-embd", "16", "--n-layer", "1", "--n-head", "2",
                                   "--n-ff", "32", "--n-ctx", "16", "--lora-dropout", "0.1",
                                   "--out", str(tmp_path / "base.gguf")])
    assert run.exit_code == 2 and "No such option" in run.output
    assert "--lora-dropout" in run.output
    run = CliRunner().invoke(cli, ["--backend", "numpy", "train", str(text), "--steps", "1",
                                   "--n-embd", "16", "--n-layer", "1", "--n-head", "2",
                                   "--n-ff", "32", "--n-ctx", "16",
                                   "--out", str(tmp_path / "base.gguf")])
    assert run.exit_code == 0, run.output
    run = CliRunner().invoke(cli, ["--backend", "numpy", "finetune", str(tmp_path / "base.gguf"),
                                   str(text), "--steps", "2", "--batch", "2", "--lora-dropout",
                                   "0.1", "--neftune-alpha", "5", "--out",
                                   str(tmp_path / "a.gguf")])
    assert run.exit_code == 0, run.output
    assert ", dropout 0.1, NEFTune alpha 5:" in run.output and (tmp_path / "a.gguf").exists()
    run = CliRunner().invoke(cli, ["--backend", "numpy", "finetune", str(tmp_path / "base.gguf"),
                                   str(text), "--full", "--lora-dropout", "0.1"])
    assert run.exit_code != 0 and "trains every weight" in run.output
