"""Run by tests/test_distributed.py under `mpiexec -n N`: trains a tiny llama as one rank of a
data-parallel run and saves, per rank, the loss and a digest of every weight after each step
and the final weights, to OUT/rank<r>.npz.

    mpiexec -n 2 python tests/distributed_worker.py OUT BACKEND BATCH GRAD_ACCUM STEPS [SCALE]
    (SCALE: dynamic loss scaling from this initial scale, growing every 2 steps; then the
    loss scale of each step is saved too)
    mpiexec -n 2 python tests/distributed_worker.py OUT fail    (rank 1 raises)
"""
import hashlib
import sys

import numpy as np

from ggwgpu import data, distributed
from ggwgpu.backends import get_backend
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.models import ModelConfig, init_parameters
from ggwgpu.tokenizer import ByteTokenizer
from ggwgpu.training import Trainer, TrainOptions

TINY = dict(n_embd=16, n_head=2, n_layer=2, n_ff=32, n_ctx=16)
TEXT = data.bundled_corpus()[:20000]


class MaskedSamples(data.Samples):
    """Text samples with some targets ignored, more in some rows than in others (as chat
    data has), so that the ranks' parts of a batch count different numbers of targets."""

    def next_batch(self):
        inputs, targets = super().next_batch()
        rows, cols = np.indices(targets.shape)
        targets = np.where(cols < (3 * rows + inputs[:, :1]) % self.n_ctx, -1, targets)
        return inputs, targets


def make_trainer(backend, batch, grad_accum, world, loss_scale=None):
    """A trainer of global batch `batch` (every rank's rows together)."""
    tok = ByteTokenizer()
    cfg = ModelConfig(n_vocab=tok.n_vocab, **TINY)
    scaling = dict(loss_scale="dynamic", loss_scale_init=loss_scale,
                   loss_scale_growth_interval=2) if loss_scale else {}
    options = TrainOptions(batch=batch, grad_accum=grad_accum, lr=3e-3, warmup=2, **scaling)
    samples = MaskedSamples(tok.encode(TEXT), cfg.n_ctx, options.batch, options.seed, tok.bos_id)
    return Trainer(cfg, init_parameters(cfg, seed=1), backend, options, samples, world=world)


def digest(params: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(np.ascontiguousarray(params[name]).tobytes())
    return h.hexdigest()


def fail():
    """Rank 1 raises while rank 0 waits in an allreduce: the guard must end both."""
    world = distributed.world()
    with distributed.RankGuard(world):
        if world.rank == 1:
            raise RuntimeError("rank 1 fails")
        world.allreduce(np.zeros(1))


def main(out, backend_name, batch=4, grad_accum=1, steps=1, loss_scale=None):
    if backend_name == "fail":
        return fail()
    world = distributed.world()
    backend = NumpyBackend(np.float64) if backend_name == "numpy-f64" else \
        get_backend(backend_name)
    t = make_trainer(backend, int(batch), int(grad_accum), world,
                     float(loss_scale) if loss_scale else None)
    losses, digests, scales = [], [], []
    for _ in range(int(steps)):
        record = t.train_step()
        losses.append(record["loss"])
        scales.append(record.get("loss_scale", 1.0))
        digests.append(digest(t.parameters()))
    np.savez(f"{out}/rank{world.rank}.npz", losses=losses, digests=digests, scales=scales,
             **t.parameters())


if __name__ == "__main__":
    main(*sys.argv[1:])
