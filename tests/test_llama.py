"""The composed llama: the gradient of a 1-layer model's loss w.r.t. every parameter, on the
device against the NumPy backward and against finite differences, with and without flash
attention and gradient checkpointing."""
import numpy as np
import pytest

import ggwgpu as gg
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.models.llama import LlamaConfig, build_train_graph, init_parameters, one_hot
from ggwgpu.testing import spot_check_gradients

TINY = LlamaConfig(n_vocab=11, n_embd=8, n_head=2, n_layer=1, n_ff=12, n_ctx=5, n_rot=4)
# grouped-query attention (4 query heads over 2 K/V heads) with tied embeddings, and heads
# wider than n_embd / n_head (key_length as stored) over a single K/V head
GQA_TIED = LlamaConfig(n_vocab=11, n_embd=8, n_head=4, n_head_kv=2, n_layer=1, n_ff=12, n_ctx=5,
                       tied_embeddings=True)
GQA_WIDE = LlamaConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=6, n_layer=1,
                       n_ff=12, n_ctx=5)
CONFIGS = {"mha": TINY, "gqa-tied": GQA_TIED, "gqa-wide": GQA_WIDE}
BATCH = 2


def setup(flash=False, checkpoint=False, cfg=TINY):
    rng = np.random.default_rng(3)
    values = init_parameters(cfg, seed=1)
    # random norm weights too, so their gradients are generic
    values = {k: v if v.ndim > 1 else rng.uniform(0.5, 1.5, v.shape).astype(np.float32)
              for k, v in values.items()}
    g = build_train_graph(cfg, values, BATCH, flash=flash)
    grads = gg.build_backward(g.loss, list(g.params.values()),
                              checkpoints=g.checkpoints if checkpoint else None)
    tokens = rng.integers(0, cfg.n_vocab, (BATCH, cfg.n_ctx + 1))
    feeds = {g.tokens: tokens[:, :-1].astype(np.int32),
             g.positions: np.arange(cfg.n_ctx, dtype=np.int32),
             g.targets: one_hot(tokens[:, 1:], cfg.n_vocab)}
    return g, grads, feeds


def run(backend, g, grads, feeds):
    plan = backend.plan([g.loss, *grads.values()])
    plan.run(feeds)
    return plan.read(g.loss)[0], {p.name: plan.read(d) for p, d in grads.items()}


@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("model", CONFIGS)
def test_llama_gradients_on_the_device_match_numpy(wgpu, flash, checkpoint, model):
    g, grads, feeds = setup(flash, checkpoint, CONFIGS[model])
    ref_loss, ref = run(NumpyBackend(np.float64), g, grads, feeds)
    loss, dev = run(wgpu, g, grads, feeds)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for name in ref:
        err = np.sum((dev[name] - ref[name]) ** 2) / max(np.sum(ref[name] ** 2), 1e-30)
        assert err < 1e-8, f"{name}: nmse {err:.2e}"


@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("model", CONFIGS)
def test_llama_gradients_match_finite_differences(flash, checkpoint, model):
    g, grads, feeds = setup(flash, checkpoint, CONFIGS[model])
    backend = NumpyBackend(np.float64)
    _, analytic = run(backend, g, grads, feeds)
    spot_check_gradients(g.loss, {p: analytic[p.name] for p in grads}, feeds)


def test_flash_and_unfused_attention_agree_and_checkpointing_changes_nothing(wgpu):
    results = [run(wgpu, *setup(flash, ckpt)) for flash, ckpt in
               [(False, False), (True, False), (False, True), (True, True)]]
    loss0, grads0 = results[0]
    for loss, grads in results[1:]:
        assert abs(loss - loss0) <= 1e-5 * abs(loss0)
        for name, g in grads.items():
            np.testing.assert_allclose(g, grads0[name], rtol=2e-4, atol=1e-6)


def test_checkpointing_a_training_step_keeps_activations_near_sqrt_of_the_layers():
    """The planned peak of a whole training step (forward, backward, AdamW) of a 9-layer
    llama, checkpointing every 3rd block: activations live at the peak must fall well below
    those of the plain step, and the buffers the planner allocates stay within 5 % of it."""
    from ggwgpu.train import Trainer, TrainOptions
    cfg = LlamaConfig(n_vocab=32, n_embd=32, n_head=2, n_layer=9, n_ff=64, n_ctx=32)
    values = init_parameters(cfg, seed=1)

    class NoBatches:
        def next_batch(self):
            raise AssertionError("planned, not run")

    memory = {}
    for checkpointing in (False, True):
        options = TrainOptions(batch=4, checkpointing=checkpointing)
        graph = build_train_graph(cfg, values, options.batch)
        graph.checkpoints = graph.checkpoints[2::3]
        plan = Trainer(cfg, values, NumpyBackend(), options, NoBatches(), graph=graph).plan
        memory[checkpointing] = plan.memory()
        assert memory[checkpointing]["planned"] <= 1.05 * memory[checkpointing]["peak"]
    assert memory[True]["activations"] < 0.6 * memory[False]["activations"]
