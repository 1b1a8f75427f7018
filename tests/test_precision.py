"""Half precision (--precision f16): the llama's graph on f16 activations with f32 master
weights, its gradients against the f32 graph's, both backends against each other, training
and LoRA finetuning that follow f32, the decoder's halves, the memory they save, and the
commands' option."""
import dataclasses
import json

import numpy as np
import pytest

from ggwgpu import data
from ggwgpu.backends import Backend, precision_for
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.generate import Decoder
from ggwgpu.graph import build_backward, topo_order
from ggwgpu.lora import init_adapter, lora_ranks
from ggwgpu.models import ModelConfig, build_train_graph, init_parameters
from ggwgpu.quant import quantize
from ggwgpu.tensor import ShapeError
from ggwgpu.testing import nmse
from ggwgpu.tokenizer import ByteTokenizer
from ggwgpu.training import Trainer, TrainOptions

from test_cli import invoke

# a 1-layer llama with what published models have: GQA, tied embeddings, rope factors
ONE_LAYER = ModelConfig(n_vocab=96, n_embd=32, n_head=4, n_head_kv=2, n_layer=1, n_ff=48,
                        n_ctx=16, tied_embeddings=True, rope_freqs=True)
# the same 256 wide, as block types need (rows of whole blocks)
ONE_LAYER_256 = dataclasses.replace(ONE_LAYER, n_vocab=256, n_embd=256, n_head=4, n_ff=256,
                                    rope_freqs=False)
GRAD_NMSE = 1e-4        # f16 graph against the f32 one (measured 3e-6)
BACKENDS_NMSE = 1e-5    # the f16 graph on wgpu against NumPy's f16 storage (measured 1.5e-7)


def one_layer_values():
    values = init_parameters(ONE_LAYER, 1)
    values["rope_freqs.weight"] = np.linspace(1, 4, ONE_LAYER.rot // 2).astype(np.float32)
    return values


def loss_and_grads(backend, precision, flash=False, packed=False):
    cfg, rng = ONE_LAYER, np.random.default_rng(0)
    g = build_train_graph(cfg, one_layer_values(), 2, precision=precision, flash=flash,
                          packed=packed)
    grads = build_backward(g.loss, list(g.params.values()))
    plan = backend.plan([g.loss, *grads.values()])
    tokens, targets = (rng.integers(0, cfg.n_vocab, (2, cfg.n_ctx)) for _ in range(2))
    if packed:
        plan.run(g.feeds(tokens, targets, np.repeat(np.arange(4), 8).reshape(2, 16)))
    else:
        plan.write(g.positions, np.arange(cfg.n_ctx, dtype=np.int32))
        plan.run(g.feeds(tokens, targets))
    return plan.read(g.loss)[0], {p.name: plan.read(gr) for p, gr in grads.items()}


class DeclaredDevice(Backend):
    """A backend that declares a device's capabilities and makes no plans."""
    name = "wgpu"
    emulates_f16 = False

    def __init__(self, has_f16: bool):
        self.has_f16, self.info = has_f16, {"device": "old GPU"}


def test_auto_picks_f16_where_the_device_has_it():
    assert precision_for(NumpyBackend(), "auto") == "f32"
    assert precision_for(NumpyBackend(), "f16") == "f16"      # halves emulated, to compare
    assert precision_for(DeclaredDevice(has_f16=True), "auto") == "f16"
    lacking = DeclaredDevice(has_f16=False)
    assert precision_for(lacking, "auto") == "f32"
    with pytest.raises(ShapeError, match="shader-f16.*old GPU"):
        precision_for(lacking, "f16")
    with pytest.raises(ValueError, match="bf16"):
        precision_for(NumpyBackend(), "bf16")


def test_lavapipe_has_shader_f16(wgpu):
    """CI proves the f16 path on lavapipe, which has the feature: auto takes it there."""
    assert precision_for(wgpu, "auto") == "f16"


@pytest.mark.parametrize("packed,flash", [(False, False), (False, True), (True, False),
                                          (True, True)])
def test_the_f16_graph_is_halves_but_its_loss_and_master_weights(packed, flash):
    g = build_train_graph(ONE_LAYER, one_layer_values(), 2, precision="f16", flash=flash,
                          packed=packed)
    params = list(g.params.values())
    grads = build_backward(g.loss, params)
    nodes = [n for n in topo_order([g.loss, *grads.values()]) if n.op is not None]
    f32 = {n.op for n in nodes if n.dtype == "f32"}
    # the loss terms and their sum; the target weights' view; the params' f32 gradients
    # (casts back from the halves' gradients, summed where a weight is read twice)
    assert f32 <= {"cross_entropy_ids", "add", "reshape", "cast"}, f32
    assert all(n.dtype == "f16" for n in nodes
               if n.op in ("mul_mat", "mul_mat_acc", "rms_norm_mul", "rope_ff", "swiglu",
                           "get_rows", "soft_max_ext", "soft_max", "flash_attn", "flash_attn_ext",
                           "cross_entropy_ids_back", "out_prod"))
    assert all(p.dtype == "f32" and grads[p].dtype == "f32" for p in params)
    halves = [n for n in nodes if n.op == "cast" and n.srcs[0].is_param]
    assert len(halves) == len(params)               # each master is cast once per step


@pytest.mark.parametrize("base_type", ["f16", "q8_0", "q4_0"])
def test_a_lora_graph_on_a_block_type_base_is_halves(base_type):
    """The rows of a frozen block-type embedding come out f32 and are cast: every activation
    after them is f16, and the frozen weights stay in their type."""
    base = {name: quantize(v, base_type) if v.ndim == 2 else v
            for name, v in init_parameters(ONE_LAYER_256, 1).items()}
    adapter = init_adapter(ONE_LAYER_256, lora_ranks(ONE_LAYER_256, r=2), 4.0, seed=2)
    g = build_train_graph(ONE_LAYER_256, base, 2, lora=adapter, precision="f16")
    grads = build_backward(g.loss, list(g.params.values()))
    nodes = [n for n in topo_order([g.loss, *grads.values()]) if n.op is not None]
    assert {n.op for n in nodes if n.dtype == "f32"} <= {"cross_entropy_ids", "add", "reshape",
                                                          "cast", "get_rows_q"}
    assert all(n.dtype == "f16" for n in nodes if n.op in ("mul_mat_q", "mul_mat_q_back",
                                                           "rms_norm_mul", "swiglu"))
    assert all(n.srcs[0].dtype == base_type for n in nodes if n.op == "mul_mat_q")


@pytest.mark.parametrize("flash,packed", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("backend_name", ["numpy", "wgpu"])
def test_f16_gradients_follow_the_f32_graph(backend_name, flash, packed, request):
    backend = NumpyBackend() if backend_name == "numpy" else request.getfixturevalue("wgpu")
    loss32, grads32 = loss_and_grads(backend, "f32", flash, packed)
    loss16, grads16 = loss_and_grads(backend, "f16", flash, packed)
    assert abs(loss16 - loss32) <= 1e-3 * loss32
    for name, g in grads32.items():
        assert nmse(grads16[name], g) < GRAD_NMSE, name


def test_the_device_f16_graph_equals_numpys_halves(wgpu):
    """NumPy stores f16 tensors as halves too, so it is the f16 graph's reference."""
    loss_np, grads_np = loss_and_grads(NumpyBackend(), "f16")
    loss_dev, grads_dev = loss_and_grads(wgpu, "f16")
    assert abs(loss_dev - loss_np) <= 1e-5 * loss_np
    for name, g in grads_np.items():
        assert nmse(grads_dev[name], g) < BACKENDS_NMSE, name


TINY = dict(n_embd=32, n_head=4, n_head_kv=2, n_layer=2, n_ff=64, n_ctx=32)
TEXT = data.bundled_corpus()[:30000]


def trainer(backend, precision, lora=False, base=None, steps_options=None):
    tok = ByteTokenizer()
    cfg = ModelConfig(n_vocab=tok.n_vocab, **TINY)
    o = TrainOptions(batch=4, lr=3e-3, warmup=5, precision=precision, **(steps_options or {}))
    samples = data.Samples(tok.encode(TEXT), cfg.n_ctx, o.batch, o.seed, tok.bos_id)
    values = base or init_parameters(cfg, seed=1)
    adapter = init_adapter(cfg, lora_ranks(cfg, r=4), 8.0, seed=2) if lora else None
    return Trainer(cfg, values, backend, o, samples, lora=adapter)


def final_loss(t: Trainer, steps: int) -> float:
    return float(np.mean([t.train_step()["loss"] for _ in range(steps)][-5:]))


def test_f16_training_follows_f32_with_dynamic_loss_scaling(wgpu):
    t32, t16 = trainer(wgpu, "f32"), trainer(wgpu, "f16")
    assert t32.scaler is None and t16.scaler.scale == 2.0 ** 16
    l32, l16 = final_loss(t32, 40), final_loss(t16, 40)
    assert abs(l16 - l32) <= 0.01 * l32, (l16, l32)
    assert l16 < 4.5            # it learnt (ln 256 = 5.5 at the start)
    # master weights stay f32 and the moments too
    assert all(v.dtype == np.float32 for v in t16.parameters().values())
    assert all(m.dtype == np.float32 for pair in t16.optimizer_state().values()
               for m in pair)


@pytest.mark.parametrize("base_type", ["f16", "q8_0"])
def test_lora_on_a_frozen_base_follows_f32(wgpu, base_type):
    """A LoRA finetune on a base stored as halves (a published F16 file) or in blocks."""
    tok = ByteTokenizer()
    cfg = ModelConfig(n_vocab=tok.n_vocab, **TINY)
    base = {name: quantize(v, base_type) if v.ndim == 2 else v
            for name, v in init_parameters(cfg, seed=1).items()}
    t32 = trainer(wgpu, "f32", lora=True, base=base)
    # a scale that never overflows here: then no step is skipped (2^16 skips one of the 30,
    # and the run trails f32's by a step)
    t16 = trainer(wgpu, "f16", lora=True, base=base,
                  steps_options=dict(loss_scale_init=2.0 ** 12))
    l32, l16 = final_loss(t32, 30), final_loss(t16, 30)
    assert t16.scaler.skipped_steps == 0
    assert abs(l16 - l32) <= 0.01 * l32, (l16, l32)
    assert set(t16.parameters()) == set(t32.parameters())     # the adapter alone


def test_an_overflow_in_halves_skips_the_step_and_backs_off(wgpu):
    """f16 gradients overflow at 65504: a scale far too large makes every first step
    overflow until the backoff brings it down, without a change to the weights."""
    t = trainer(wgpu, "f16", steps_options=dict(loss_scale_init=2.0 ** 40))
    before = t.parameters()
    record = t.train_step()
    assert record["overflow"] and t.scaler.scale == 2.0 ** 39
    assert all(np.array_equal(v, before[k]) for k, v in t.parameters().items())
    for _ in range(40):
        record = t.train_step()
        if not record["overflow"]:
            break
    assert not record["overflow"] and np.isfinite(record["loss"])


def test_f16_decoder_gives_the_f32_logits_in_half_the_memory(wgpu):
    cfg = ONE_LAYER
    values = one_layer_values()
    d32 = Decoder(wgpu, cfg, values, precision="f32")
    d16 = Decoder(wgpu, cfg, values, precision="f16")
    prompt = [3, 14, 15, 92, 65, 35]
    a, b = d32.prefill(prompt), d16.prefill(prompt)
    assert nmse(b, a) < 1e-5
    assert nmse(d16.step(8), d32.step(8)) < 1e-5
    # weights shared by the two plans, cache and activations: all halves
    assert d16.memory() <= 0.55 * d32.memory()


def test_f16_halves_a_training_steps_activations():
    """Planned memory by role (NumPy stores f16 tensors as halves too): the activations of
    the tiny bench config's step in f16 take at most 0.6 of f32's, the f32 masters,
    gradients and moments the same."""
    from ggwgpu_cli.bench import RandomBatches, bench_model
    cfg, options = bench_model("tiny")
    memory = {}
    for precision in ("f32", "f16"):
        o = dataclasses.replace(options, precision=precision)
        t = Trainer(cfg, init_parameters(cfg), NumpyBackend(), o,
                    RandomBatches(cfg.n_vocab, cfg.n_ctx, o.batch))
        memory[precision] = t.plan.memory()
    assert memory["f16"]["activations"] <= 0.6 * memory["f32"]["activations"]
    assert memory["f16"]["weights"] == memory["f32"]["weights"]
    # the moments; f16's backward seed is the loss scale, an input, not a 4-byte constant
    assert memory["f16"]["state"] == memory["f32"]["state"] - 4


def test_the_commands_take_precision(tmp_path, wgpu):
    out, log = tmp_path / "m.gguf", tmp_path / "log.jsonl"
    ckpt = tmp_path / "m.checkpoint.gguf"
    r = invoke("--backend", "wgpu", "train", "--steps", "3", "--n-layer", "1", "--n-embd",
                "32", "--n-ff", "64", "--batch", "2", "--precision", "f16", "--out", str(out),
                "--log", str(log), "--checkpoint-out", str(ckpt), "--save-every", "3")
    assert r.exit_code == 0, r.output
    assert "f16 activations, f32 master weights, dynamic loss scale from 2^16" in r.output
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(rec.get("loss_scale") == 2.0 ** 16 for rec in records if "step" in rec)
    # precision may change on resume: the master weights and moments are f32 either way
    r = invoke("--backend", "wgpu", "train", "--steps", "4", "--checkpoint-in", str(ckpt),
                "--precision", "f32", "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "resuming with --precision f32 instead of the checkpoint's f16" in r.output
    for command in (["eval", str(out), "--samples", "4"],
                    ["generate", str(out), "-n", "4", "--temp", "0"]):
        r = invoke("--backend", "wgpu", *command, "--precision", "f16")
        assert r.exit_code == 0, r.output
        assert " in f16" in r.output
    r = invoke("--backend", "numpy", "eval", str(out), "--samples", "4", "--precision", "bf16")
    assert r.exit_code == 2 and "bf16" in r.output
