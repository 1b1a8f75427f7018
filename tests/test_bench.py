"""`bench train`'s published shapes: they build and plan, the memory report's minimum, the
LoRA-on-q4_0 budget, dispatches per layer. Planned at reduced depth, never timed."""
import dataclasses
import json
import math
from collections import Counter
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from ggwgpu import kernels
from ggwgpu.backends import ENV_VAR, NumpyBackend
from ggwgpu.models import parameter_shapes
from ggwgpu.ops.registry import OPS
from ggwgpu_cli import bench as cli_bench
from ggwgpu_cli import main as cli_main

# one block of a small LoRA finetune on a q4_0 base: small enough to count by hand
HAND = cli_bench.BenchConfig(dict(n_vocab=64, n_embd=64, n_head=4, n_head_kv=2, n_layer=1,
                                  n_ff=128, n_ctx=8, tied_embeddings=True),
                             batch=2, base="q4_0", lora_rank=4, checkpointing=True)


@pytest.fixture
def hand_config(monkeypatch):
    monkeypatch.setitem(cli_bench.BENCH_TRAIN_CONFIGS, "hand", HAND)
    return "hand"


def trainer(name, backend=None, **changes):
    cfg, options = cli_bench.bench_model(name, **changes)
    return cli_bench.bench_trainer(name, backend or NumpyBackend(), cfg, options,
                                   cli_bench.bench_weights(name, cfg))


@pytest.mark.parametrize("name, n_params", [("smollm-135m", 134_515_008),
                                            ("smollm-360m", 361_821_120)])
def test_the_published_shapes_have_the_published_parameter_counts(name, n_params):
    cfg, options = cli_bench.bench_model(name)
    assert sum(math.prod(s) for s in parameter_shapes(cfg).values()) == n_params
    assert cfg.head_dim == 64 and cfg.tied_embeddings and cfg.n_vocab == 49152
    assert options.checkpointing and cli_bench.BENCH_TRAIN_CONFIGS[name].lora


@pytest.mark.parametrize("name", [n for n in cli_bench.BENCH_TRAIN_CONFIGS
                                  if n.startswith("smollm")])
def test_every_published_shape_builds_and_plans_at_two_layers(name):
    """The step is built, differentiated and its dispatches enumerated (no storage); the
    vocabulary cut to 2048 for speed (the one above checks the shapes' own)."""
    config = cli_bench.BENCH_TRAIN_CONFIGS[name]
    plan = trainer(name, cli_bench.DispatchCounter(), n_layer=2, n_vocab=2048).plan
    # a pair (2 tensors) on each of a block's 7 matrices; or 9 tensors a block, the
    # embedding and the output norm (tied: no output matrix)
    assert plan.counts["opt_step_adamw"] == (2 * 7 * 2 if config.lora else 9 * 2 + 2)
    assert ("mul_mat_q" in plan.counts) == config.quantized_base


def test_the_memory_minimum_of_a_small_lora_step_is_counted_by_hand(hand_config):
    t = trainer(hand_config)
    r = cli_bench.memory_against_minimum(t, HAND)
    # q4_0: 18 bytes per 32 values; embd 64, q 64, k/v 32 rows, ff 128; f32 norms
    base = 18 * (64 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64) // 32 + 3 * 64 * 4
    # rank 4 pairs, (4 x n_in) + (n_out x 4) floats, on q, k, v, o, gate, up, down
    trained = 4 * 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64) + 3 * (64 + 128))
    # tokens, targets, target weights (2 x 8 each), positions (8), AdamW's 7 hyper-parameters
    inputs = 4 * (3 * 16 + 8 + 7)
    m = t.plan.memory()
    assert r["minimum"] == {"base weights": base, "trained weights": trained,
                            "optimizer moments": 2 * trained, "inputs": inputs,
                            "gradients": trained, "activations at the peak": m["activations"]}
    assert (base, trained) == (23_808, 16_384)
    assert r["minimum_bytes"] == base + 4 * trained + inputs + m["activations"]
    assert r["planned_bytes"] == m["planned"] == sum(r["planned"].values())
    assert r["ratio"] == m["planned"] / r["minimum_bytes"] and r["kind"] == "lora"


def test_a_lora_finetune_of_the_135m_shape_on_q4_0_plans_within_1_5x_the_minimum():
    r = cli_bench.memory_against_minimum(trainer("smollm-135m", n_layer=4),
                                         cli_bench.BENCH_TRAIN_CONFIGS["smollm-135m"])
    assert r["ratio"] <= cli_bench.MEMORY_BUDGET["lora"] == 1.5
    assert r["minimum"]["base weights"] > 10 * r["minimum"]["trained weights"] > 0


def test_dispatches_per_layer_add_up_to_the_step_exactly(hand_config, wgpu):
    """rest + n * per layer is the step's count, per op, for the wgpu plan at 2, 3 and 4
    layers; a LoRA layer has no scale (the pairs' and attention's are products' alphas),
    one input gradient through each of its 7 frozen matrices, and mul_mat_acc nodes for
    its 7 pairs' B products (forward; 6 recomputed: the block's output is a checkpoint) and
    7 gradient sums (a pair's A product takes the sum of the terms before it)."""
    cfg, _ = cli_bench.bench_model(hand_config, n_layer=4)
    d = cli_bench.dispatches_per_layer(hand_config, wgpu, cfg)
    assert "scale" not in d["per_layer"] and d["per_layer"]["mul_mat_q_back"] == 7
    nodes = {n: Counter(t.op for t in trainer(hand_config, n_layer=n).plan.nodes)
             for n in (2, 3)}
    assert nodes[3]["mul_mat_acc"] - nodes[2]["mul_mat_acc"] == 7 + 6 + 7
    for n_layer in (2, 3, 4):
        plan = trainer(hand_config, wgpu, n_layer=n_layer).plan
        counted = {op: d["rest"].get(op, 0) + n_layer * d["per_layer"].get(op, 0)
                   for op in set(d["rest"]) | set(d["per_layer"])}
        assert Counter(plan.dispatch_ops) == Counter({op: n for op, n in counted.items() if n})


def test_bench_train_of_a_lora_shape_says_why_torch_has_no_peer(tmp_path, monkeypatch):
    """The command on the 135M shape's LoRA step, at 2 layers and (for speed) a vocabulary
    of 2048 and 32 tokens a row, on NumPy."""
    config = cli_bench.BENCH_TRAIN_CONFIGS["smollm-135m"]
    monkeypatch.setitem(cli_bench.BENCH_TRAIN_CONFIGS, "smollm-135m", dataclasses.replace(
        config, model={**config.model, "n_vocab": 2048, "n_ctx": 32}))
    out = tmp_path / "train.json"
    result = CliRunner().invoke(cli_main.cli, ["--backend", "numpy", "bench", "train",
                                               "--config", "smollm-135m", "--layers", "2",
                                               "--json", str(out)], env={ENV_VAR: None})
    assert result.exit_code == 0, result.output
    assert "2 layers" in result.output and "1 warm-up + 1 timed step per backend" in result.output
    assert "(no peer: PyTorch has no q4_0 matmul" in result.output
    assert "planned / minimum" in result.output and "within the lora budget 1.5" in result.output
    report = json.loads(out.read_text())
    assert report["n_layer"] == 2 and report["tokens_per_s"]["numpy"] > 0
    memory = report["memory"]
    # the minimum adds up roles that need not peak together (the gradients come late); best
    # fit leaves up to 3 % above the peak (1.032 here since gradient sums fold into products:
    # 11.90 MB planned of a 11.53 MB peak, where an add per sum planned 12.10 of 11.99)
    assert memory["peak_bytes"] <= memory["planned_bytes"] <= 1.04 * memory["peak_bytes"]
    assert 0.9 <= memory["ratio"] <= 1.5


# -- the PyTorch peer trains only what it represents -------------------------------------------

def test_the_torch_peer_represents_llamas_with_gqa_and_tied_embeddings_only():
    from ggwgpu.bench import torch_peer, torch_peer_refusal
    from ggwgpu.models import ModelConfig
    llama = ModelConfig(**cli_bench.BENCH_TRAIN_CONFIGS["smollm-135m"].model)
    assert llama.kv_heads < llama.n_head and llama.tied_embeddings
    assert torch_peer_refusal(llama) is None
    assert torch_peer_refusal(llama, "q4_0") == \
        "PyTorch has no q4_0 matmul, and an f32 base would time other work"
    assert torch_peer_refusal(llama, "f32") is None      # LoRA on an f32 base
    qwen2 = dataclasses.replace(llama, arch="qwen2")
    assert "a llama (GQA, tied embeddings), not qwen2" in torch_peer_refusal(qwen2)
    factors = dataclasses.replace(llama, rope_freqs=True, final_logit_softcap=30.0)
    assert "without rope_freqs, final_logit_softcap" in torch_peer_refusal(factors)
    _, options = cli_bench.bench_model("tiny")
    with pytest.raises(ValueError, match="not qwen2"):     # before torch is imported
        torch_peer(qwen2, options, 1)


def test_bench_train_of_another_family_says_why_torch_has_no_peer(tmp_path, monkeypatch):
    """tiny as qwen2 (Q/K/V biases): NumPy trains it, the peer is not run, and its row
    says why."""
    config = cli_bench.BENCH_TRAIN_CONFIGS["tiny"]
    monkeypatch.setitem(cli_bench.BENCH_TRAIN_CONFIGS, "tiny", dataclasses.replace(
        config, model={**config.model, "arch": "qwen2", "n_layer": 2}))
    monkeypatch.setattr(cli_bench, "torch_peer", lambda *args: pytest.fail("peer ran"))
    out = tmp_path / "train.json"
    result = CliRunner().invoke(cli_main.cli, ["--backend", "numpy", "bench", "train",
                                               "--steps", "1", "--json", str(out)],
                                env={ENV_VAR: None})
    assert result.exit_code == 0, result.output
    torch_row = next(line for line in result.output.splitlines() if line.startswith("torch "))
    assert torch_row.split()[1] == "-"
    assert "(no peer: the PyTorch peer is a llama (GQA, tied embeddings), not qwen2: it " \
           "would time another model)" in torch_row
    report = json.loads(out.read_text())
    assert "torch" not in report["tokens_per_s"] and report["tokens_per_s"]["numpy"] > 0


def test_on_a_gpus_kernels_no_product_of_the_lora_f32_step_copies_an_operand():
    """The tiled kernel reads the backward products' transposed views as they lie: none of
    the step's products is preceded by a copy dispatch (lavapipe's subgroup kernel still
    copies the mixed layouts of W^T d y)."""
    gpu = SimpleNamespace(info={"adapter_type": "DiscreteGPU", "vendor": "nvidia"})
    variants = kernels.choose_variants(gpu, SimpleNamespace(features=set()))
    plan = trainer("smollm-135m-lora-f32", cli_bench.DispatchCounter(), n_layer=2,
                   n_vocab=2048).plan
    products = [n for n in plan.nodes if n.op in ("mul_mat", "mul_mat_acc", "out_prod")]
    def copies(variants):
        return sum(d.entry == "cpy" for n in products
                   for d in OPS[n.op].dispatches_on(n, variants))
    assert len(products) > 100 and variants["matmul"] == "tiled"
    assert copies(variants) == 0
    assert copies({**variants, "matmul": "subgroup"}) > 0


def test_a_lora_step_adds_its_pairs_squares_three_at_a_time_block_by_block():
    """The clip's sum of squares over a block's 14 pair gradients: 4 add_sum_sqr3 and 2
    add_sum_sqr a block (14 before), the same with every block, so that rest + n * per layer
    still counts the step."""
    counts = {n: trainer("smollm-135m-lora-f32", cli_bench.DispatchCounter(), n_layer=n,
                         n_vocab=2048).plan.counts for n in (2, 3)}
    per_layer = {op: counts[3][op] - counts[2][op] for op in ("add_sum_sqr3", "add_sum_sqr")}
    assert per_layer == {"add_sum_sqr3": 4, "add_sum_sqr": 2}
    assert counts[2]["add_sum_sqr3"] == 2 * 4 and counts[2]["sum_sqr"] == 1
