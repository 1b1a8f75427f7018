"""The bench's PyTorch peer (ggwgpu.bench.torch_llama_step) trains what ggwgpu trains: for
each config named (default: tiny, small, and the SmolLM2-135M shapes' full and f32-LoRA
steps cut to 2 layers and a 512-token vocabulary), both take the same weights and batches
and run 4 AdamW steps, and their losses are printed side by side. The later steps' losses
agree only if the gradients and updates did, LoRA pairs included. ggwgpu runs on its NumPy
backend in f32, with no warmup and no checkpointing (the peer's constant learning rate and
kept activations; the cosine schedule's factor at step 3 of 1000 is 1 - 9e-6).

`bench train --torch-device cuda` compares tokens/s with that peer on a GPU
(tests/gpu/check.py); this is why its numbers compare like with like.

Not a test (pytest does not collect it): it needs torch in a throwaway venv, e.g.

    python3 -m venv /tmp/torchref
    /tmp/torchref/bin/pip install torch numpy gguf 'wgpu>=0.32,<0.33' click regex jinja2
    PYTHONPATH=. /tmp/torchref/bin/python tests/referee_torch_peer.py [CONFIG ...]

It exits 1 when a loss differs by more than 1e-6 (relative).
"""
import dataclasses
import sys

from ggwgpu import bench
from ggwgpu.backends import NumpyBackend
from ggwgpu.models import init_parameters

STEPS = 4
MAX_REL = 1e-6
DEFAULT = ("tiny", "small", "smollm-135m-full", "smollm-135m-lora-f32")


def losses(name: str) -> tuple[list, list]:
    """(ggwgpu's NumPy losses, the peer's) of STEPS steps of bench config `name`."""
    config = bench.BENCH_TRAIN_CONFIGS[name]
    changes = dict(n_layer=2, n_vocab=512) if config.shape_of else {}
    cfg, options = bench.bench_model(name, **changes)
    options = dataclasses.replace(options, warmup=0, checkpointing=False)
    trainer = bench.bench_trainer(name, NumpyBackend(), cfg, options,
                                  bench.bench_weights(name, cfg))
    ours = [trainer.train_step()["loss"] for _ in range(STEPS)]
    adapter = bench.bench_adapter(cfg, config.lora_rank) if config.lora else None
    step = bench.torch_llama_step(cfg, options, init_parameters(cfg, 0),
                                  bench.RandomBatches(cfg.n_vocab, cfg.n_ctx, options.batch),
                                  "cpu", adapter)
    return ours, [step() for _ in range(STEPS)]


def main(names) -> int:
    worst = 0.0
    for name in names or DEFAULT:
        refusal = bench.torch_peer_refusal(
            bench.bench_model(name)[0], bench.BENCH_TRAIN_CONFIGS[name].base)
        if refusal:
            print(f"{name}: no peer ({refusal})")
            continue
        ours, theirs = losses(name)
        rel = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
        worst = max(worst, rel)
        print(f"{name:<22} ggwgpu " + " ".join(f"{x:.7f}" for x in ours))
        print(f"{'':<22} torch  " + " ".join(f"{x:.7f}" for x in theirs)
              + f"   largest relative difference {rel:.1e}")
    return 0 if worst <= MAX_REL else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
