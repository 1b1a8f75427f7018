"""Preference losses (training/preference.py): the graph's DPO, IPO, ORPO, CPO, SimPO and
KTO losses and their gradients against TRL's formulas computed in float64 from the reference
logits of each sequence (testing.reference_logits), for LoRA and full finetuning, in one
logits chunk and in several."""
import re

import numpy as np
import pytest

from ggwgpu.backends import NumpyBackend
from ggwgpu.graph import build_backward
from ggwgpu.lora import init_adapter, lora_ranks
from ggwgpu.models import ModelConfig, build_train_graph, init_parameters
from ggwgpu import testing
from ggwgpu.testing import reference_logits
from ggwgpu.training.preference import (PreferenceLoss, kto_loss, preference_terms,
                                        reference_loss)

CFG = ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_layer=2, n_ff=12, n_ctx=7)
PAIRS = 2
LOSSES = [PreferenceLoss("dpo", beta=0.5), PreferenceLoss("dpo", beta=0.3, label_smoothing=0.2),
          PreferenceLoss("ipo", beta=0.4), PreferenceLoss("orpo", orpo_lambda=0.7),
          PreferenceLoss("cpo", beta=0.3, label_smoothing=0.1),
          PreferenceLoss("simpo", beta=2.0, simpo_gamma=1.0),
          PreferenceLoss("kto", beta=0.5, undesirable_weight=1.3),
          PreferenceLoss("simpo", beta=2.5, simpo_gamma=0.5, cpo_alpha=0.5)]
LABELS = [True, False]      # KTO's, of the PAIRS examples


def loss_id(loss) -> str:
    return (f"{loss.kind}-{loss.label_smoothing}"
            + (f"-alpha{loss.cpo_alpha}" if loss.cpo_alpha is not None else ""))


def batch(seed=0):
    """Pairs of sequences sharing a prompt: (inputs, targets) rows, prompt targets -1, and
    each sequence's answer length; chosen and rejected answers of different lengths."""
    rng = np.random.default_rng(seed)
    seqs = rng.integers(0, CFG.n_vocab, (2 * PAIRS, CFG.n_ctx + 1)).astype(np.int32)
    targets = np.full((2 * PAIRS, CFG.n_ctx), -1, np.int32)
    for pair in range(PAIRS):
        prompt = 2 + pair
        seqs[2 * pair + 1, :prompt] = seqs[2 * pair, :prompt]
        for row, answer in ((2 * pair, CFG.n_ctx + 1 - prompt), (2 * pair + 1, 3 - pair)):
            targets[row, prompt - 1:prompt - 1 + answer] = seqs[row, prompt:prompt + answer]
    return seqs[:, :-1], targets, (targets >= 0).sum(axis=1)


def reference_logps(values, inputs, targets) -> np.ndarray:
    """Each row's sum of log p(target) over its counted positions, in float64."""
    out = []
    for row, target in zip(inputs, targets):
        logits = reference_logits(CFG, values, row)
        logsm = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        counted = target >= 0
        out.append(logsm[np.flatnonzero(counted), target[counted]].sum())
    return np.array(out)


def trl_loss(logp, lengths, reference, loss, kl_at=None) -> float:
    """reference_loss's loss; KTO's of LABELS, its KL estimate that of `kl_at` (the
    log-probabilities before a move: the graph's gradient takes it as a constant)."""
    if loss.kind != "kto":
        return reference_loss(logp, lengths, reference, loss)["loss"]
    kl = kto_loss(logp if kl_at is None else kl_at, reference, LABELS, loss)["kl"]
    return kto_loss(logp, reference, LABELS, loss, kl)["loss"]


def graph_loss(values, loss, lora=None, max_logits_bytes=1 << 20, backend=None,
               precision="f32"):
    g = build_train_graph(CFG, values, 2 * PAIRS, lora=lora, sequences=2 * PAIRS,
                          max_logits_bytes=max_logits_bytes, precision=precision)
    terms = preference_terms(g.sequence_nll, PAIRS, loss)
    grads = build_backward(terms.loss, list(g.params.values()))
    backend = backend or NumpyBackend(np.float64)
    plan = backend.plan([terms.loss, g.sequence_nll, *grads.values()])
    inputs, targets, lengths = batch()
    feeds = g.feeds(inputs, targets)
    feeds[g.weights] = (targets >= 0).astype(np.float32)
    if terms.inv_lengths is not None:
        feeds[terms.inv_lengths] = (1.0 / lengths)[None].astype(np.float32)
    # any reference log-probabilities; per token exact in float32, as the graph takes them
    # (KTO's: its mismatched answers' log-ratios above 0, so the KL estimate is not 0)
    reference = -lengths * np.array([1.5, 4.0, 2.0, 4.0] if loss.kind == "kto" else
                                    [1.5, 1.25, 2.0, 0.75])[:2 * PAIRS]
    if terms.reference is not None:
        feeds[terms.reference] = ((reference / lengths if loss.per_token else reference)
                                  [None].astype(np.float32))
    if terms.chosen_weights is not None:
        w = np.zeros(2 * PAIRS)
        w[0::2] = 1 / lengths[0::2].sum()
        feeds[terms.chosen_weights] = w[None].astype(np.float32)
    if terms.signs is not None:
        feeds[terms.signs] = np.where(LABELS, 1.0, -1.0)[None].astype(np.float32)
        feeds[terms.kl_weights] = np.tile([0.0, 1 / PAIRS], PAIRS)[None].astype(np.float32)
        feeds[terms.pair_weights] = (np.where(LABELS, loss.desirable_weight,
                                              loss.undesirable_weight) / PAIRS
                                     )[None].astype(np.float32)
    plan.write(g.positions, np.arange(CFG.n_ctx, dtype=np.int32))
    plan.run(feeds)
    return (float(plan.read(terms.loss)[0]), -plan.read(g.sequence_nll)[0],
            {p.name: plan.read(grad) for p, grad in grads.items()}, reference)


@pytest.mark.parametrize("loss", LOSSES, ids=loss_id)
@pytest.mark.parametrize("chunked", [False, True], ids=["one chunk", "chunks of 3 rows"])
def test_full_finetune_loss_and_gradient_equal_trls_formulas_in_float64(loss, chunked):
    values = {k: v.astype(np.float64) for k, v in init_parameters(CFG, seed=3).items()}
    got, logp, grads, reference = graph_loss(values, loss,
                                             max_logits_bytes=3 * 4 * CFG.n_vocab if chunked
                                             else 1 << 20)
    inputs, targets, lengths = batch()
    want_logp = reference_logps(values, inputs, targets)
    np.testing.assert_allclose(logp, want_logp, rtol=1e-9)
    want = trl_loss(want_logp, lengths, reference, loss)
    assert got == pytest.approx(want, rel=2e-7)     # 1 / length is an f32 input
    # the gradient along random directions against central differences of the reference
    rng = np.random.default_rng(1)
    for name in ["token_embd.weight", "blk.1.attn_q.weight", "blk.0.ffn_down.weight"]:
        v = rng.standard_normal(values[name].shape)
        h = 1e-5

        def at(t):
            moved = {**values, name: values[name] + t * v}
            return trl_loss(reference_logps(moved, inputs, targets), lengths, reference, loss,
                            want_logp)
        numeric = (at(h) - at(-h)) / (2 * h)
        assert (grads[name] * v).sum() == pytest.approx(numeric, rel=1e-5, abs=1e-9), name


@pytest.mark.parametrize("loss", LOSSES[::2], ids=loss_id)
def test_lora_finetune_gradient_equals_the_references(loss):
    base = {k: v.astype(np.float64) for k, v in init_parameters(CFG, seed=3).items()}
    adapter = init_adapter(CFG, lora_ranks(CFG, 2), alpha=4.0, seed=2)
    adapter.tensors = {k: (v + 0.1).astype(np.float64) for k, v in adapter.tensors.items()}
    got, logp, grads, reference = graph_loss(base, loss, lora=adapter)
    inputs, targets, lengths = batch()

    def merged(tensors):        # W + alpha / r * B A in float64 (lora.merge rounds to f32)
        from ggwgpu.lora import LORA_A, LORA_B, Adapter
        pairs, out = Adapter(adapter.alpha, tensors), dict(base)
        for weight in pairs.weights():
            a, b = tensors[weight + LORA_A], tensors[weight + LORA_B]
            out[weight] = base[weight] + pairs.scale(weight) * (
                a @ b.T if weight == "token_embd.weight" else b @ a)
        return out
    want_logp = reference_logps(merged(adapter.tensors), inputs, targets)
    np.testing.assert_allclose(logp, want_logp, rtol=1e-9)
    assert got == pytest.approx(trl_loss(want_logp, lengths, reference, loss), rel=2e-7)
    rng = np.random.default_rng(4)
    name = "blk.0.attn_v.weight.lora_b"
    v = rng.standard_normal(adapter.tensors[name].shape)
    h = 1e-5

    def at(t):
        tensors = {**adapter.tensors, name: adapter.tensors[name] + t * v}
        return trl_loss(reference_logps(merged(tensors), inputs, targets), lengths,
                        reference, loss, want_logp)
    assert (grads[name] * v).sum() == pytest.approx((at(h) - at(-h)) / (2 * h), rel=1e-5)


def test_cpo_and_simpo_follow_trls_cpo_trainer():
    """TRL's CPOTrainer: CPO's sigmoid loss of beta (logp_c - logp_r) plus alpha times the
    chosen answers' mean token NLL; SimPO's of beta (avg_c - avg_r) - gamma, per-token means,
    no NLL unless alpha is given (CPO-SimPO); rewards beta logp (SimPO's of the means)."""
    logp, lengths = [-3.0, -5.0, -4.0, -2.0], [2, 4, 2, 1]
    cpo = reference_loss(logp, lengths, None, PreferenceLoss("cpo", beta=0.5))
    nll = (3.0 + 4.0) / (2 + 2)
    sp = np.logaddexp(0, [-1.0, 1.0])             # softplus(-beta d), d = 2 and -2
    assert cpo["loss"] == pytest.approx(sp.mean() + nll)
    np.testing.assert_allclose(cpo["chosen"], [-1.5, -2.0])
    assert PreferenceLoss("cpo").nll_weight == 1 and PreferenceLoss("simpo").nll_weight == 0
    simpo = PreferenceLoss("simpo", beta=2.0, simpo_gamma=0.5)
    avg = np.array(logp) / lengths                # -1.5, -1.25, -2, -2
    z = 2.0 * (avg[0::2] - avg[1::2]) - 0.5
    r = reference_loss(logp, lengths, None, simpo)
    assert r["loss"] == pytest.approx(np.logaddexp(0, -z).mean())
    np.testing.assert_allclose(r["margin"], 2.0 * (avg[0::2] - avg[1::2]))
    both = reference_loss(logp, lengths, None, PreferenceLoss("simpo", beta=2.0, cpo_alpha=0.3))
    assert both["loss"] == pytest.approx(r["loss"] + 0.3 * nll)


def test_the_rewards_and_accuracy_follow_trl():
    loss = PreferenceLoss("dpo", beta=0.5)
    r = reference_loss([-3.0, -5.0, -4.0, -2.0], [2, 2, 2, 2], [-4.0, -4.0, -4.0, -4.0], loss)
    np.testing.assert_allclose(r["chosen"], [0.5, 0.0])
    np.testing.assert_allclose(r["rejected"], [-0.5, 1.0])
    np.testing.assert_allclose(r["margin"], [1.0, -1.0])
    assert r["accuracy"] == 0.5
    # d = 2 and -2: softplus(-1) and softplus(1), averaged
    assert r["loss"] == pytest.approx((np.log1p(np.exp(-1)) + np.log1p(np.exp(1))) / 2)


def test_bad_constants_are_refused_by_name():
    for kw, word in [({"kind": "rso"}, "one of dpo, ipo, orpo"), ({"beta": 0}, "beta"),
                     ({"label_smoothing": 0.5}, "label smoothing"),
                     ({"orpo_lambda": -1}, "lambda"), ({"simpo_gamma": -1}, "gamma"),
                     ({"kind": "cpo", "cpo_alpha": -0.5}, "alpha"),
                     ({"kind": "kto", "undesirable_weight": 0}, "KTO's weights")]:
        with pytest.raises(ValueError, match=word):
            PreferenceLoss(**kw)


def assert_float32_alike(got, want):
    """(loss, log-probabilities, gradients) of the device against NumPy's: float32 sums in
    another order."""
    (loss, logp, grads), (want_loss, want_logp, want_grads) = got, want
    assert loss == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(logp, want_logp, rtol=1e-5)
    scale = max(np.abs(g).max() for g in want_grads.values())
    for name, grad in want_grads.items():
        np.testing.assert_allclose(grads[name], grad, rtol=1e-4, atol=1e-5 * scale,
                                   err_msg=name)


@pytest.mark.parametrize("loss", LOSSES, ids=loss_id)
def test_the_device_computes_the_loss_and_gradients_numpy_does(wgpu, loss):
    values = init_parameters(CFG, seed=3)
    adapter = init_adapter(CFG, lora_ranks(CFG, 2), alpha=4.0, seed=2)
    adapter.tensors = {k: v + np.float32(0.1) for k, v in adapter.tensors.items()}
    for lora in (None, adapter):
        want, want_logp, want_grads, _ = graph_loss(values, loss, lora, 3 * 4 * CFG.n_vocab,
                                                    NumpyBackend())
        got, logp, grads, _ = graph_loss(values, loss, lora, 3 * 4 * CFG.n_vocab, wgpu)
        assert_float32_alike((got, logp, grads), (want, want_logp, want_grads))


def test_a_step_that_starts_at_the_reference_has_a_gradient():
    """A LoRA finetune starts as its base, so DPO's first d is exactly 0: softplus's
    derivative there is 1/2 (relu(x) + log(1 + exp(-|x|)) gives 0 at x = 0)."""
    import ggwgpu.ops as O
    from ggwgpu.tensor import param
    from ggwgpu.training.preference import softplus
    x = param(np.array([0.0, -30.0, 30.0, 1.5]), name="x")
    y = O.sum(softplus(x))
    grad = build_backward(y, [x])[x]
    plan = NumpyBackend(np.float64).plan([y, grad])
    plan.run({})
    want = 1 / (1 + np.exp(-np.array([0.0, -30.0, 30.0, 1.5])))
    np.testing.assert_allclose(plan.read(grad), want, rtol=1e-12)
    assert plan.read(y)[0] == pytest.approx(np.logaddexp(0, [0.0, -30.0, 30.0, 1.5]).sum())


# -- the finetune command and the Python API ---------------------------------------------------

PAIRS_JSONL = [{"prompt": f"{a}+{b}?", "chosen": str(a + b), "rejected": str(a + b + 1)}
               for a in range(4) for b in range(3)]


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    import json

    import ggwgpu
    from ggwgpu.training.run import Reporter
    d = tmp_path_factory.mktemp("prefs")
    ggwgpu.train(out=str(d / "base.gguf"), steps=2, n_embd=16, n_head=2, n_layer=1, n_ff=32,
                 n_ctx=96, batch=2, backend="numpy", reporter=Reporter())
    (d / "pairs").mkdir()
    for split, rows in (("train", PAIRS_JSONL[:9]), ("valid", PAIRS_JSONL[9:])):
        (d / "pairs" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def finetune_cli(d, *args):
    from click.testing import CliRunner

    from ggwgpu_cli.main import cli
    return CliRunner().invoke(cli, ["--backend", "numpy", "finetune", str(d / "base.gguf"),
                                    "--data", str(d / "pairs"), "--batch", "2", "--lr", "1e-2",
                                    "--warmup", "1", *args])


@pytest.mark.parametrize("packing", ["padded", "packed"])
@pytest.mark.parametrize("objective", ["dpo", "ipo", "orpo", "simpo", "kto"])
def test_a_stopped_preference_finetune_resumes_exactly(tiny_base, tmp_path, objective, packing):
    """Packed at n_ctx 200: three pairs (of about 66 bytes a sequence) to each two rows."""
    import json
    d = tiny_base
    out, log = tmp_path / "straight.gguf", tmp_path / "straight.jsonl"
    n_ctx = ["--n-ctx", "200"] if packing == "packed" else []
    r = finetune_cli(d, "--objective", objective, "--steps", "4", "--out", str(out),
                     "--log", str(log), *n_ctx)
    assert r.exit_code == 0, r.output
    unit = "examples" if objective == "kto" else "pairs"
    assert (f"4 steps of 2 {unit} (4 x 96 tokens, {objective})" if packing == "padded" else
            f"4 steps of 2 packed pairs of rows (4 x 200 tokens, {objective})") in r.output
    packed = ("packed into 3 pairs of rows of 200 (3.0 pairs each)" if objective != "kto" else
              "packed into 6 pairs of rows of 200 (3.0 examples each)")
    assert (packed in r.output) == (packing == "packed")
    ckpt = tmp_path / "ckpt.gguf"
    r = finetune_cli(d, "--objective", objective, "--steps", "2", "--out", str(tmp_path / "a"),
                     "--checkpoint-out", str(ckpt), "--log", str(tmp_path / "log.jsonl"),
                     *n_ctx)
    assert r.exit_code == 0, r.output
    r = finetune_cli(d, "--steps", "2", "--checkpoint-in", str(ckpt), "--out",
                     str(tmp_path / "resumed.gguf"), "--log", str(tmp_path / "log.jsonl"))
    assert r.exit_code == 0, r.output
    assert "reference log-probabilities" not in r.output      # kept, not computed again
    assert out.read_bytes() == (tmp_path / "resumed.gguf").read_bytes()

    def records(path):      # the stopped run validated at its end, step 2, too
        return [{k: v for k, v in json.loads(line).items()
                 if k != "tokens_per_s" and not k.startswith("val_")}
                for line in path.read_text().splitlines()]
    assert records(log) == records(tmp_path / "log.jsonl")
    assert {"rewards_chosen", "rewards_rejected", "margin", "accuracy"} <= set(records(log)[0])
    last = json.loads(log.read_text().splitlines()[-1])     # validated at the end
    assert {"val_loss", "val_accuracy", "val_margin"} <= set(last)
    if objective == "dpo":
        from click.testing import CliRunner

        from ggwgpu_cli.main import cli
        r = CliRunner().invoke(cli, ["plot", str(log), "--out", str(tmp_path / "p.png")])
        assert r.exit_code == 0, r.output
        assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_preference_finetuning_refuses_what_it_cannot_train(tiny_base, tmp_path):
    d = tiny_base
    from click.testing import CliRunner

    from ggwgpu_cli.main import cli
    r = CliRunner().invoke(cli, ["--backend", "numpy", "finetune", str(d / "base.gguf"),
                                 "--objective", "dpo", "--steps", "1"])
    assert r.exit_code == 2 and "trains on preference pairs: give --data" in r.output
    r = finetune_cli(d, "--objective", "dpo", "--optimizer", "lbfgs", "--steps", "1")
    assert r.exit_code == 2 and "does not work with optimizer lbfgs" in r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
                   '{"prompt": "a", "chosen": "b"}\n')
    r = finetune_cli(d, "--objective", "orpo", "--steps", "1", "--data", str(bad))
    assert r.exit_code == 2 and f"{bad}:2: a preference pair has 'chosen' and 'rejected'" \
        in r.output
    bad.write_text('{"prompt": [{"role": "user", "content": "a"}], "chosen": "b", '
                   '"rejected": "c"}\n')
    r = finetune_cli(d, "--objective", "orpo", "--steps", "1", "--data", str(bad))
    assert r.exit_code == 2 and f"{bad}:1: a pair's prompt, chosen and rejected are all " \
        "strings, or all lists of messages" in r.output


def test_dpo_through_the_python_api_raises_the_preference_accuracy(tiny_base):
    """The model is a random 1-layer llama: DPO on the training pairs moves each chosen
    answer ahead of its rejected one."""
    import ggwgpu
    from ggwgpu.training.run import Reporter

    class Records(Reporter):
        def __init__(self):
            self.records = []

        def step(self, record, line):
            self.records.append(record)
    seen = Records()
    d = tiny_base
    run = ggwgpu.finetune(str(d / "base.gguf"), data=str(d / "pairs"), out=str(d / "dpo.gguf"),
                          objective="dpo", beta=0.5, steps=24, batch=3, lr=3e-2, warmup=2,
                          lora_r=4, val_every=24, backend="numpy", reporter=seen)
    assert run.best_val_loss is not None
    assert seen.records[0]["loss"] == pytest.approx(np.log(2), rel=1e-6)   # at the reference
    assert np.mean([r["accuracy"] for r in seen.records[-3:]]) == 1.0
    assert np.mean([r["loss"] for r in seen.records[-3:]]) < 0.3


@pytest.mark.parametrize("objective", ["cpo", "simpo"])
def test_reference_free_objectives_raise_the_preference_accuracy(tiny_base, tmp_path,
                                                                  objective):
    """CPO and SimPO need no reference pass; on the training pairs the chosen answers move
    ahead and the loss falls."""
    import json
    log = tmp_path / "log.jsonl"
    beta = "2.0" if objective == "simpo" else "0.5"
    r = finetune_cli(tiny_base, "--objective", objective, "--beta", beta, "--steps", "24",
                     "--lr", "3e-2", "--warmup", "2", "--batch", "3", "--out",
                     str(tmp_path / "a.gguf"), "--log", str(log))
    assert r.exit_code == 0, r.output
    assert "reference log-probabilities" not in r.output
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert np.mean([r["accuracy"] for r in records[-3:]]) == 1.0
    assert (np.mean([r["loss"] for r in records[-3:]])
            < 0.8 * np.mean([r["loss"] for r in records[:3]]))


@pytest.mark.parametrize("loss", LOSSES[::2], ids=loss_id)
def test_an_f16_graph_gives_the_f32_loss_and_gradients_within_halves(wgpu, loss):
    if not wgpu.has_f16:
        pytest.skip("the adapter has no shader-f16")
    values = init_parameters(CFG, seed=3)
    want, want_logp, want_grads, _ = graph_loss(values, loss, None, 1 << 20, wgpu)
    g = build_train_graph(CFG, values, 2 * PAIRS, sequences=2 * PAIRS, precision="f16")
    assert g.logits[0].dtype == "f16"
    got, logp, grads, _ = graph_loss(values, loss, None, 1 << 20, wgpu, precision="f16")
    assert got == pytest.approx(want, rel=1e-2)
    np.testing.assert_allclose(logp, want_logp, rtol=1e-2)
    for name, grad in want_grads.items():
        cos = (grads[name] * grad).sum() / (np.linalg.norm(grads[name]) * np.linalg.norm(grad))
        assert cos > 0.999, name


# -- packed pairs: several to each two rows ----------------------------------------------------

PACKED = ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_layer=2, n_ff=12, n_ctx=16)
# a delta-net before an attention layer, rows of two chunks: packed sequences keep apart
# in the recurrent state too
PACKED_QWEN35 = ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=6, n_rot=2,
                            n_layer=2, n_ff=12, n_ctx=32, recurrent_layers=(0,), conv_kernel=3,
                            ssm_state=3, ssm_heads=4, ssm_groups=2, rope_sections=(1, 0, 0, 0),
                            arch="qwen35")


def example_pairs(n=4, seed=5):
    """Pairs of chat.Example sharing a prompt (2-4 tokens), answers of different lengths
    (1-5 tokens)."""
    return testing.example_pairs(n, PACKED.n_vocab, (2, 5), (1, 6), seed)


def pairs_loss(batches, values, loss, lora=None, backend=None, spare=0, cfg=PACKED):
    """The preference graph's loss and gradients on the one batch that holds all of
    `batches`' pairs (pairs.PairBatches), `spare` more pair slots per unit than it needs."""
    from ggwgpu.training.preference import PreferenceGraph
    batches.unit_pairs += spare
    if loss.kind == "kto" and batches.labels is None:
        batches.labels = np.arange(batches.n_pairs) % 3 != 1
    lengths = batches.lengths()
    batches.reference = (-lengths * np.resize([1.5, 1.25, 2.0, 0.75], len(lengths))
                         ).reshape(-1, 2)
    g = build_train_graph(cfg, values, 2 * batches.batch, lora=lora, packed=batches.packed,
                          sequences=2 * batches.pair_slots(batches.batch))
    pg = PreferenceGraph(g, loss)
    grads = build_backward(pg.loss, list(g.params.values()))
    plan = (backend or NumpyBackend(np.float64)).plan([pg.loss, g.sequence_nll,
                                                       *grads.values()])
    if not g.packed:
        plan.write(g.positions, np.arange(cfg.n_ctx, dtype=np.int32))
    (batch,) = batches.in_order()
    plan.run(pg.feeds(*batch))
    logp = -plan.read(g.sequence_nll)[0][:2 * len(batch[2])].reshape(-1, 2)
    by_pair = np.zeros_like(logp)
    by_pair[batch[2]] = logp
    return (float(plan.read(pg.loss)[0]), by_pair,
            {p.name: plan.read(grad) for p, grad in grads.items()})


def padded_and_packed(pairs, n_ctx=PACKED.n_ctx):
    from ggwgpu.pairs import PairBatches
    padded = PairBatches(pairs, n_ctx, len(pairs), seed=0)
    packed = PairBatches(pairs, n_ctx, 1, seed=0, pack=True)
    packed = PairBatches(pairs, n_ctx, packed.n_samples, seed=0, pack=True)
    assert not padded.packed and packed.packed and packed.n_samples < len(pairs)
    return padded, packed


def test_pairs_pack_two_rows_at_a_time_and_keep_their_lengths():
    from ggwgpu.pairs import PairBatches, pack_pairs
    # (2, 6) does not fit beside (5, 3): the rejected row of that unit has 5 left
    assert pack_pairs([(5, 3), (2, 6), (4, 4), (3, 1)], 8) == [[0, 3], [1], [2]]
    pairs = example_pairs(7)
    padded, packed = padded_and_packed(pairs)
    np.testing.assert_array_equal(packed.lengths(), padded.lengths())
    np.testing.assert_array_equal(padded.lengths(), [e.trained[1:].sum() for p in pairs
                                                     for e in p])
    inputs, targets, got, _, sequences, _ = next(packed.in_order())
    assert sorted(got) == list(range(7))
    for i, pair in enumerate(got):        # each sequence in its unit's first or second row
        for side in (0, 1):
            rows, cols = np.nonzero(sequences == 2 * i + side)
            assert (rows % 2 == side).all() and len(set(rows)) == 1
            np.testing.assert_array_equal(inputs[rows, cols], pairs[pair][side].ids[:-1])
    with pytest.raises(ValueError, match="pack must be"):
        PairBatches(pairs, PACKED.n_ctx, 1, 0, pack="yes")


@pytest.mark.parametrize("cfg", [PACKED, PACKED_QWEN35], ids=["llama", "qwen35"])
@pytest.mark.parametrize("loss", LOSSES, ids=loss_id)
def test_packed_pairs_give_the_padded_loss_and_gradients_in_float64(loss, cfg):
    """The same pairs, one sequence a row or several pairs to two rows (with spare pair
    slots, filled and weighted 0): the loss of TRL's formulas and the same gradients (4
    pairs: the weights 1/4, an f32 input, are exact; qwen35's 8 fill rows past one chunk)."""
    values = {k: v.astype(np.float64) for k, v in init_parameters(cfg, seed=3).items()}
    adapter = init_adapter(cfg, lora_ranks(cfg, 2), alpha=4.0, seed=2)
    adapter.tensors = {k: (v + 0.1).astype(np.float64) for k, v in adapter.tensors.items()}
    pairs = example_pairs(8 if cfg is PACKED_QWEN35 else 4)     # 1/8 is exact too
    for lora in (None, adapter):
        padded, packed = padded_and_packed(pairs, cfg.n_ctx)
        want, want_logp, want_grads = pairs_loss(padded, values, loss, lora, cfg=cfg)
        got, logp, grads = pairs_loss(packed, values, loss, lora, spare=1, cfg=cfg)
        assert got == pytest.approx(want, rel=1e-12)
        np.testing.assert_allclose(logp, want_logp, rtol=1e-12)
        for name, grad in want_grads.items():
            np.testing.assert_allclose(grads[name], grad, rtol=1e-9, atol=1e-13, err_msg=name)
    # and the loss is TRL's of each sequence's log-probability on its own
    lengths = padded.lengths()
    reference = padded.reference.reshape(-1)
    inputs, targets = padded.inputs, padded.targets
    own = []
    for row, target in zip(inputs, targets):
        logits = reference_logits(cfg, values, row)
        logsm = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        own.append(logsm[np.flatnonzero(target >= 0), target[target >= 0]].sum())
    np.testing.assert_allclose(
        pairs_loss(packed, values, loss, cfg=cfg)[1].reshape(-1), own, rtol=1e-12)
    want = reference_loss(own, lengths, reference, loss, padded.labels)["loss"]
    assert pairs_loss(packed, values, loss, cfg=cfg)[0] == pytest.approx(want, rel=2e-7)


@pytest.mark.parametrize("loss", LOSSES[::2], ids=loss_id)
def test_the_device_gives_packed_pairs_the_padded_loss_and_gradients(wgpu, loss):
    values = init_parameters(PACKED, seed=3)
    adapter = init_adapter(PACKED, lora_ranks(PACKED, 2), alpha=4.0, seed=2)
    adapter.tensors = {k: v + np.float32(0.1) for k, v in adapter.tensors.items()}
    pairs = example_pairs()
    for lora in (None, adapter):
        padded, packed = padded_and_packed(pairs)
        want, want_logp, want_grads = pairs_loss(padded, values, loss, lora, NumpyBackend())
        got, logp, grads = pairs_loss(packed, values, loss, lora, wgpu, spare=1)
        assert_float32_alike((got, logp, grads), (want, want_logp, want_grads))


def test_a_conversational_pair_may_offer_tools_that_its_answers_call():
    from ggwgpu.chat import ChatTemplate
    from ggwgpu.data import DataError
    from ggwgpu.pairs import check_pair, encode_pair
    from test_chat import CALLING, QWEN25, WEATHER, Vocab, _text
    pair = {"prompt": CALLING[:1], "chosen": CALLING[1:2],
            "rejected": [{"role": "assistant", "content": "I cannot know."}],
            "tools": [WEATHER]}
    check_pair(pair)
    vocab = Vocab()
    chosen, rejected = encode_pair(pair, vocab, ChatTemplate(QWEN25))
    assert "# Tools" in _text(vocab, chosen.ids) and "# Tools" in _text(vocab, rejected.ids)
    assert _text(vocab, chosen.ids[chosen.trained]).startswith("<tool_call>\n")
    with pytest.raises(DataError, match="'tools' goes with a conversational pair"):
        check_pair({"prompt": "p", "chosen": "a", "rejected": "b", "tools": [WEATHER]})
    with pytest.raises(DataError, match="'chosen' message 0, tool call 0 must be"):
        check_pair({**pair, "chosen": [{"role": "assistant", "tool_calls": [{"x": 1}]}]})


# -- KTO: unpaired examples --------------------------------------------------------------------

def test_kto_examples_are_checked_unpaired_and_given_mismatched_answers():
    from ggwgpu.data import DataError
    from ggwgpu.pairs import check_unpaired, kto_pairs, unpaired
    good = {"prompt": "1+1?", "completion": "2", "label": True}
    check_unpaired(good)
    check_unpaired({"prompt": "p", "chosen": "a", "rejected": "b"})      # a pair
    chat = {"prompt": [{"role": "user", "content": "hi"}],
            "completion": [{"role": "assistant", "content": "hello"}], "label": False}
    check_unpaired(chat)
    for bad, words in [({**good, "label": 1}, "'label' is true"),
                       ({"prompt": "p", "completion": "c"}, "has 'prompt', 'completion' and "
                                                            "'label'"),
                       ({**good, "prompt": []}, "both strings or both lists"),
                       ({**good, "prompt": ""}, "prompt must not be empty"),
                       ({**chat, "completion": [{"role": "user", "content": "x"}]},
                        "'completion' has no assistant message"),
                       ({**good, "tools": [{"name": "f"}]}, "'tools' goes with a conversational")]:
        with pytest.raises(DataError, match=words):
            check_unpaired(bad)
    conversational_pair = {"chosen": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a"}],
                           "rejected": [{"role": "user", "content": "q"},
                                        {"role": "assistant", "content": "b"}]}
    examples = unpaired([good, conversational_pair])
    assert examples[0] is good
    assert examples[1:] == [
        {"prompt": [{"role": "user", "content": "q"}],
         "completion": [{"role": "assistant", "content": "a"}], "label": True},
        {"prompt": [{"role": "user", "content": "q"}],
         "completion": [{"role": "assistant", "content": "b"}], "label": False}]
    five = [{"prompt": f"p{i}", "completion": f"c{i}", "label": i % 2 == 0} for i in range(5)]
    found, labels = kto_pairs(five, group=2)     # groups (0, 1), (2, 3), (4)
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in found] == [
        ("p0", "c0", "c1"), ("p1", "c1", "c0"), ("p2", "c2", "c3"), ("p3", "c3", "c2"),
        ("p4", "c4", "c4")]
    assert labels == [True, False, True, False, True]
    with pytest.raises(DataError, match="all strings or all conversations"):
        kto_pairs([good, chat], group=2)
    from ggwgpu.pairs import check_pair
    with pytest.raises(DataError, match=r"\(a KTO example: --objective kto\)"):
        check_pair(good)


def test_kto_raises_the_share_of_examples_on_their_labels_side(tiny_base, tmp_path):
    """Unpaired examples, the right sum good and "no idea" bad: after training the good
    ones' log-ratios are above the KL estimate and the bad ones' below, held-out examples'
    too. (A wrong sum as the bad answer is another prompt's right one, which a 1-layer
    model cannot tell apart: KTO, unlike DPO, asks each answer to move on its own.)"""
    import json
    data = tmp_path / "kto.jsonl"
    data.write_text("".join(json.dumps({"prompt": p["prompt"], "completion": answer,
                                        "label": answer != "no idea"}) + "\n"
                            for p in PAIRS_JSONL for answer in (p["chosen"], "no idea")))
    log = tmp_path / "log.jsonl"
    r = finetune_cli(tiny_base, "--data", str(data), "--objective", "kto", "--beta", "0.5",
                     "--steps", "24", "--lr", "3e-2", "--warmup", "2", "--batch", "4",
                     "--val-split", "0.25", "--out", str(tmp_path / "a.gguf"), "--log", str(log))
    assert r.exit_code == 0, r.output
    assert re.search(r"train: 18 examples \(\d+ good, \d+ bad\), each with a mismatched "
                     r"answer for the KL", r.output), r.output
    assert "the reference log-probabilities of 18 examples" in r.output
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {"rewards_chosen", "rewards_rejected", "margin", "accuracy", "kl"} <= set(records[0])
    assert records[0]["loss"] == pytest.approx(0.5, abs=1e-6)     # at the reference
    assert [r["accuracy"] for r in records[-4:]] == [1.0] * 4
    assert np.mean([r["loss"] for r in records[-4:]]) < 0.1
    assert records[-1]["val_accuracy"] == 1.0


def test_kto_runs_in_one_process():
    from types import SimpleNamespace
    from ggwgpu.training.preference import PreferenceGraph
    g = build_train_graph(CFG, init_parameters(CFG, seed=3), 2 * PAIRS, sequences=2 * PAIRS)
    with pytest.raises(ValueError, match="run KTO in one process"):
        PreferenceGraph(g, PreferenceLoss("kto"), world=SimpleNamespace(size=2, rank=0))
