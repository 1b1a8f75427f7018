"""Generation: the KV-cache graphs give the training graph's logits (NumPy float64 and wgpu),
the sampler chain on hand-made logits, greedy generation (window sliding included) against
a plain recomputation, seeds, and the `generate` and `train --predict` commands."""
import dataclasses
import re
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from ggwgpu import gguf_llama
from ggwgpu.backends import ENV_VAR
from ggwgpu.backends.base import same_storage
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.generate import (Decoder, Sampling, apply_repeat_penalty, generate, generate_tokens,
                             min_p_filter, prompt_tokens, sample_token, top_k_filter,
                             top_p_filter, window)
from ggwgpu.models import (ModelConfig, build_decode_graph, build_train_graph,
                                 init_parameters)
from ggwgpu.tensor import ShapeError
from ggwgpu.tokenizer import ByteTokenizer
from ggwgpu_cli.main import cli

TINY = ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_layer=2, n_ff=12, n_ctx=8, n_rot=4)
BYTES = ModelConfig(n_vocab=ByteTokenizer.n_vocab, n_embd=16, n_head=2, n_layer=2, n_ff=24,
                    n_ctx=12)


def tiny_values(cfg=TINY, seed=1):
    """Random parameters, norm weights too, and a sharper output so logits differ clearly."""
    rng = np.random.default_rng(seed)
    values = init_parameters(cfg, seed=seed)
    values = {k: v if v.ndim > 1 else rng.uniform(0.5, 1.5, v.shape).astype(np.float32)
              * (-1 if k.endswith("ssm_a") else 1) for k, v in values.items()}
    values["output.weight" if "output.weight" in values else "token_embd.weight"] *= 8
    return values


class TrainingForward:
    """Reference logits: the training graph (batch 1, padded to n_ctx) of a whole window."""

    def __init__(self, backend, cfg, values):
        self.cfg, self.g = cfg, build_train_graph(cfg, values, 1)
        self.plan = backend.plan(self.g.logits)
        self.plan.write(self.g.positions, np.arange(cfg.n_ctx, dtype=np.int32))

    def __call__(self, tokens) -> np.ndarray:
        """Logits (len(tokens), n_vocab) of every position."""
        padded = np.zeros((1, self.cfg.n_ctx), np.int32)
        padded[0, :len(tokens)] = tokens
        self.plan.run({self.g.tokens: padded})
        return self.g.read_logits(self.plan)[0, :len(tokens)]


def decoded_logits(backend, cfg, values, tokens, n_prompt):
    """Logits of positions n_prompt - 1 .. len(tokens) - 1: a prefill, then one step each."""
    d = Decoder(backend, cfg, values)
    out = [d.prefill(tokens[:n_prompt])]
    out += [d.step(t) for t in tokens[n_prompt:]]
    return np.array(out)


# grouped-query attention (a cache of 1 K/V head for 2 query heads) and tied embeddings
GQA = dataclasses.replace(TINY, n_head_kv=1, tied_embeddings=True)
# the same as llama.cpp's qwen2: Q/K/V biases (random here) and neox rope, cached after rope
QWEN2 = dataclasses.replace(GQA, arch="qwen2")
# qwen3: per-head Q/K norms before rope, heads wider than n_embd / n_head
QWEN3 = dataclasses.replace(GQA, arch="qwen3", n_embd_head=6, n_rot=None)
# gemma3: six layers, five with a sliding window of 3 (shorter than the prompts), a softcap
GEMMA3 = dataclasses.replace(QWEN3, arch="gemma3", n_layer=6, sliding_window=3,
                             rope_freq_base_swa=1e4, final_logit_softcap=5.0)
# gemma2: capped scores, a window of 3 on the even layers, a softcap
GEMMA2 = dataclasses.replace(QWEN3, arch="gemma2", n_layer=4, sliding_window=3,
                             attn_logit_softcap=0.5, final_logit_softcap=5.0)
# olmo2: post-norms only, whole-width Q/K norms; olmo3: windows of 3 on three layers of four
OLMO2 = dataclasses.replace(GQA, arch="olmo2", n_rot=None, tied_embeddings=False)
OLMO3 = dataclasses.replace(OLMO2, n_layer=4, sliding_window=3)
# YaRN on OLMo 3's global layers (a ramp over every pair) and a rope.scaling.attn_factor
OLMO3_YARN = dataclasses.replace(OLMO3, rope_scaling="yarn", rope_freq_scale=0.25,
                                 rope_orig_ctx=64, rope_freq_base=10.0, rope_attn_factor=1.1)
# mistral3: YaRN with its own betas and log multiplier; Q times the attention temperature
# from position 3 on
MISTRAL3 = dataclasses.replace(QWEN3, arch="mistral3", rope_scaling="yarn",
                               rope_freq_scale=0.25, rope_orig_ctx=3, rope_freq_base=10.0,
                               yarn_beta_fast=2.0, yarn_beta_slow=0.5, yarn_log_mul=0.5,
                               attn_temp_scale=0.4)
# hunyuan-dense: per-head QK norms after rope (the cache holds normed K)
HUNYUAN = dataclasses.replace(QWEN3, arch="hunyuan-dense")
# minicpm: granite's scales, LongRoPE's long factors
MINICPM = dataclasses.replace(GQA, arch="minicpm", n_rot=None, longrope=True,
                              rope_scaling="longrope", rope_orig_ctx=4, embedding_scale=12.0,
                              residual_scale=0.99, logit_scale=0.5)
# arcee: relu(ffn_up h)^2 with no gate
ARCEE = dataclasses.replace(GQA, arch="arcee", n_rot=None, rope_freqs=True)
# glm4: Q/K/V biases, partial rope, sandwich norms, fused gate | up
GLM4 = dataclasses.replace(GQA, arch="glm4", n_rot=2)
# granitehybrid: Mamba2 layers (their states kept from run to run, their convolutions'
# inputs cached by position) around attention layers without rope; granite's scales
GRANITEH = ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_head_kv=1, n_layer=4, n_ff=12, n_ctx=8,
                       recurrent_layers=(0, 1, 3), conv_kernel=4, ssm_state=3, ssm_heads=4,
                       ssm_groups=2, embedding_scale=3.0, residual_scale=0.5, logit_scale=2.0,
                       no_rope=True, tied_embeddings=True, arch="granitehybrid")
# nemotron_h: Mamba2, feed-forward and attention blocks, each its mixer alone
NEMOTRON = ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_head_kv=1, n_layer=5, n_ff=12, n_ctx=8,
                       recurrent_layers=(0, 2, 4), mlp_layers=(1,), conv_kernel=4, ssm_state=3,
                       ssm_heads=4, ssm_groups=1, ssm_inner=12, arch="nemotron_h")
# falcon-h1: attention and a Mamba2 side by side in every block (a KV cache and a state each)
FALCON_H1 = ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_head_kv=1, n_layer=3, n_ff=12, n_ctx=8,
                        recurrent_layers=(0, 1, 2), conv_kernel=4, ssm_state=3, ssm_heads=4,
                        ssm_groups=2, ssm_inner=16, arch="falcon-h1")
# exaone4: post-norms only, per-head QK norms, rope factors
EXAONE4 = dataclasses.replace(GQA, arch="exaone4", n_rot=None, rope_freqs=True)
# ernie4_5: llama's block, heads wider than n_embd / n_head
ERNIE = dataclasses.replace(QWEN3, arch="ernie4_5")
# smollm3: the fourth layer without rope; granite: its four scales
SMOLLM3 = dataclasses.replace(GQA, arch="smollm3", n_layer=4, n_rot=None)
GRANITE = dataclasses.replace(TINY, arch="granite", n_rot=None, embedding_scale=3.0,
                              residual_scale=0.5, attention_scale=0.25, logit_scale=2.0)
# phi3: fused Q/K/V and gate/up, partial rope with LongRoPE's long factors and attn_factor
PHI3 = dataclasses.replace(GQA, arch="phi3", n_rot=2, longrope=True, rope_orig_ctx=4,
                           rope_attn_factor=1.25)
# lfm2: short convolutions (their inputs cached by position) around attention blocks
LFM2 = dataclasses.replace(GQA, arch="lfm2", n_layer=4, n_rot=None, conv_layers=(0, 1, 3),
                           conv_kernel=3)
# gemma4: sliding layers (window 3) with narrower heads and one K/V head, global ones with
# two; the last two layers on the K/V of layers 1 and 2 (no cache of their own); per-layer
# embeddings, layer output scales, proportional rope factors
GEMMA4 = ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_embd_head=6, n_layer=5, n_ff=12, n_ctx=8,
                     n_head_kv_layers=(1, 1, 2, 1, 2), swa_layers=(0, 1, 3), head_dim_swa=4,
                     n_rot_swa=4, sliding_window=3, shared_kv_layers=2, n_embd_per_layer=3,
                     layer_output_scale=True, rope_freqs=True, tied_embeddings=True,
                     rope_freq_base_swa=1e4, final_logit_softcap=5.0, arch="gemma4")
# qwen35: gated delta-nets (their states kept from run to run, their convolutions' inputs
# cached by position) before a gated attention layer
QWEN35 = ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=6, n_rot=2,
                     n_layer=4, n_ff=12, n_ctx=8, recurrent_layers=(0, 1, 2), conv_kernel=3,
                     ssm_state=3, ssm_heads=4, ssm_groups=2, rope_sections=(1, 0, 0, 0),
                     tied_embeddings=True, arch="qwen35")
# qwen3moe: each token through its 2 of 4 experts, in a prompt as one at a time
QWEN3MOE = ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_head_kv=1, n_layer=2, n_ff=12, n_ctx=8,
                       n_expert=4, n_expert_used=2, n_ff_exp=6, arch="qwen3moe")
FAMILIES = {"mha": TINY, "gqa-tied": GQA, "qwen2": QWEN2, "qwen3": QWEN3, "gemma2": GEMMA2,
            "gemma3": GEMMA3, "olmo2": OLMO2, "olmo3": OLMO3, "olmo3-yarn": OLMO3_YARN,
            "ernie4_5": ERNIE, "exaone4": EXAONE4, "mistral3": MISTRAL3,
            "hunyuan-dense": HUNYUAN, "minicpm": MINICPM,
            # minicpm3: each head's key and (zero-padded) value cached
            "minicpm3": ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_embd_head=6, n_rot=2,
                                    n_layer=2, n_ff=12, n_ctx=8, mla_value_length=4,
                                    q_lora_rank=4, kv_lora_rank=3, tied_embeddings=True,
                                    arch="minicpm3"),
            "arcee": ARCEE, "glm4": GLM4, "granitehybrid": GRANITEH,
            "nemotron_h": NEMOTRON, "falcon-h1": FALCON_H1,
            "smollm3": SMOLLM3, "granite": GRANITE, "phi3": PHI3, "lfm2": LFM2,
            "lfm2-window": dataclasses.replace(LFM2, sliding_window=3), "gemma4": GEMMA4,
            "qwen35": QWEN35, "qwen3moe": QWEN3MOE,
            "phi2": ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_rot=2, n_layer=2, n_ff=12,
                                n_ctx=8, arch="phi2"),
            "qwen35moe": dataclasses.replace(QWEN35, arch="qwen35moe", n_expert=3, n_expert_used=2,
                                             n_ff_exp=4, n_ff_shexp=6),
            # gpt-oss: sinks in the decoder's softmax, the even layers windowed
            "gpt-oss": ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=6,
                                   n_layer=2, n_ff=12, n_ctx=8, sliding_window=3, n_expert=3,
                                   n_expert_used=2, n_ff_exp=4, arch="gpt-oss"),
            "nemotron_h_moe": dataclasses.replace(NEMOTRON, arch="nemotron_h_moe", n_expert=3,
                                                  n_expert_used=2, n_ff_exp=4, n_ff_shexp=6),
            # gpt2: each position's learned row added at its position in the cache
            "gpt2": ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_layer=2, n_ff=12, n_ctx=8,
                                n_positions=10, tied_embeddings=True, arch="gpt2"),
            # cohere2: the windowed layers roped, the global one not
            "cohere2": ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_head_kv=1, n_layer=4,
                                   n_ff=12, n_ctx=8, sliding_window=3, logit_scale=0.5,
                                   tied_embeddings=True, arch="cohere2"),
            # a fused attn_qkv and its bias (the converter's --fuse-qkv)
            "qwen2-fused-qkv": dataclasses.replace(QWEN2, fused_qkv=True),
            # gptneox: partial rope, both branches on the block's input
            "gptneox": ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_rot=2, n_layer=2, n_ff=12,
                                   n_ctx=8, parallel_residual=True, arch="gptneox"),
            # deepseek2: the latent and the rope key cached, one K/V head
            # afmoe: windowed, unroped and gated layers in the cache
            "afmoe": ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_head_kv=1, n_layer=4, n_ff=12,
                                 n_ctx=8, n_expert=3, n_expert_used=2, n_ff_exp=4, n_ff_shexp=4,
                                 n_dense_lead=1, sliding_window=3, arch="afmoe"),
            "glm4moe": ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_head_kv=1, n_rot=2,
                                   n_layer=2, n_ff=12, n_ctx=8, n_expert=3, n_expert_used=2,
                                   n_ff_exp=4, n_ff_shexp=4, n_dense_lead=1, qkv_bias=True,
                                   qk_norm=True, arch="glm4moe"),
            "deepseek2": ModelConfig(n_vocab=13, n_embd=8, n_head=2, n_head_kv=1,
                                     n_embd_head=10, n_rot=4, n_layer=2, n_ff=12, n_ctx=8,
                                     n_expert=3, n_expert_used=2, n_ff_exp=4, n_ff_shexp=4,
                                     n_dense_lead=1, q_lora_rank=6, mla_key_length=8,
                                     mla_value_length=6, arch="deepseek2")}


@pytest.mark.parametrize("cfg", FAMILIES.values(), ids=FAMILIES)
@pytest.mark.parametrize("n_prompt", [1, 3, TINY.n_ctx])
def test_kv_cache_logits_equal_the_training_forward_in_float64(n_prompt, cfg):
    backend = NumpyBackend(np.float64)
    values = tiny_values(cfg)
    tokens = np.random.default_rng(n_prompt).integers(0, cfg.n_vocab, cfg.n_ctx)
    ref = TrainingForward(backend, cfg, values)(tokens)
    got = decoded_logits(backend, cfg, values, tokens, n_prompt)
    np.testing.assert_allclose(got, ref[n_prompt - 1:], rtol=0, atol=1e-12)


def test_kv_cache_takes_several_tokens_after_a_past():
    """A run that appends 3 tokens at positions 2..4 of a cache holding 0..1 (chunked
    prompt): the logits of its last token are the training graph's at position 4."""
    backend = NumpyBackend(np.float64)
    values = tiny_values()
    tokens = np.arange(2, 2 + TINY.n_ctx) % TINY.n_vocab
    g = build_decode_graph(TINY, values, 3)
    plan = backend.plan([g.logits])
    plan.run(g.feeds(tokens[:2], 0))
    plan.run(g.feeds(tokens[2:5], 2))
    ref = TrainingForward(backend, TINY, values)(tokens)
    np.testing.assert_allclose(plan.read(g.logits)[0], ref[4], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="do not fit"):
        g.feeds(tokens[:3], TINY.n_ctx - 2)
    # padding takes scratch rows after the cache: a graph of 4 tokens needs 3 of them
    with pytest.raises(ShapeError, match="2 scratch rows cannot take the padding of 4 tokens"):
        build_decode_graph(TINY, values, 4, scratch=2)
    g = build_decode_graph(TINY, values, 4, scratch=3)
    plan = backend.plan([g.logits], sentinel=4)     # guards: nothing written past the rows
    plan.run(g.feeds(tokens[:1], 0))
    plan.run(g.feeds(tokens[1:2], 1))
    np.testing.assert_allclose(plan.read(g.logits)[0], ref[1], rtol=0, atol=1e-12)
    assert plan.stray_writes() == []


def test_sync_keeps_the_shared_prefix_and_gives_a_fresh_prefill_s_logits():
    """A cache of [prompt, steps] synced to a sequence that leaves it after 4 tokens: only
    the rest is run (one append at position 4), and the logits are those of a prefill of the
    whole sequence; syncing to the same sequence again reruns only its last token."""
    backend = NumpyBackend(np.float64)
    values = tiny_values()
    d = Decoder(backend, TINY, values)
    d.prefill([1, 4, 7])
    for t in (2, 9):
        d.step(t)
    runs = []
    append = d.append
    d.append = lambda tokens: runs.append((d.past, list(tokens))) or append(tokens)
    target = [1, 4, 7, 2, 5, 6, 3]
    got = d.sync(target)
    assert runs == [(4, [5, 6, 3])] and d.tokens == target
    np.testing.assert_allclose(got, Decoder(backend, TINY, values).prefill(target),
                               rtol=0, atol=1e-12)
    np.testing.assert_allclose(d.sync(target), got, rtol=0, atol=1e-12)
    assert runs[-1] == (6, [3])
    np.testing.assert_allclose(d.sync(target[:2]), TrainingForward(backend, TINY, values)(
        target)[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["mha", "gqa-tied", "lfm2-window", "gemma4", "qwen35"])
def test_runs_take_the_smallest_graph_that_holds_them_or_run_in_chunks(name, monkeypatch):
    """Prefill graphs of 4 and 8 tokens and spans of 8 and 24 rows in a context of 24: 19
    prompt tokens run as chunks of 8, 8 and 3 (in the graph of 4), the first reading 8 rows;
    an append of 3 in
    the graph of 4, a step; every run's logits are the training forward's (the caches,
    convolution inputs and recurrent states carried from chunk to chunk and graph to
    graph); a prefill that would pass the context is refused before any run."""
    generation = sys.modules[Decoder.__module__]    # ggwgpu.generate is also a function
    monkeypatch.setattr(generation, "PREFILL_SIZES", (8, 4))
    monkeypatch.setattr(generation, "FIRST_SPAN", 8)
    backend = NumpyBackend(np.float64)
    cfg = dataclasses.replace(FAMILIES[name], n_ctx=24)
    values = tiny_values(cfg)
    forward = TrainingForward(backend, cfg, values)
    d = Decoder(backend, cfg, values)
    assert d.spans == [8, 24] and list(d.steps) == [8] and not d.prefills
    runs = record_runs(d, monkeypatch)
    tokens = list(np.random.default_rng(5).integers(0, cfg.n_vocab, 24))
    np.testing.assert_allclose(d.prefill(tokens[:19]), forward(tokens[:19])[-1],
                               rtol=0, atol=1e-12)
    assert runs == [(8, 8), (8, 24), (4, 24)]
    np.testing.assert_allclose(d.append(tokens[19:22]), forward(tokens[:22])[-1],
                               rtol=0, atol=1e-12)
    np.testing.assert_allclose(d.step(tokens[22]), forward(tokens[:23])[-1],
                               rtol=0, atol=1e-12)
    assert runs[3:] == [(4, 24), (1, 24)] and d.tokens == tokens[:23]
    with pytest.raises(ShapeError, match="positions 23 .. 24 do not fit a cache of 24"):
        d.append([1, 2])
    assert runs[5:] == [] and d.tokens == tokens[:23]
    np.testing.assert_allclose(d.sync(tokens[:20] + [3, 3]), forward(tokens[:20] + [3, 3])[-1],
                               rtol=0, atol=1e-12)
    assert runs[5:] == ([(8, 8), (8, 24), (8, 24)] if name == "qwen35"   # a state goes back
                        else [(4, 24)])
    np.testing.assert_allclose(d.prefill(tokens[:3]), forward(tokens[:3])[-1],
                               rtol=0, atol=1e-12)
    for t in range(3, 9):
        np.testing.assert_allclose(d.step(tokens[t]), forward(tokens[:t + 1])[-1],
                                   rtol=0, atol=1e-12)
    assert runs[-7:] == [(4, 8)] + [(1, 8)] * 5 + [(1, 24)]
    # each plan made on its first run
    assert sorted(d.prefills) == [(4, 8), (4, 24), (8, 8), (8, 24)] and list(d.steps) == [8, 24]


def record_runs(d, monkeypatch) -> list:
    """The (tokens, span) of every plan the Decoder `d` runs from now on, in order (1 for a
    step's)."""
    runs, run = [], d._run

    def recorded(graph, plan, tokens, past):
        runs.append((graph.n_tokens, graph.span))
        return run(graph, plan, tokens, past)
    monkeypatch.setattr(d, "_run", recorded)
    return runs


def test_prefills_take_fewer_tokens_where_a_graph_would_pass_the_device_s_limits(monkeypatch):
    """A backend refusing tensors larger than the 4-token, 24-row prefill's biggest (as a
    device refuses one over its storage binding): the 8-token graph is planned for 8 rows
    only, longer spans run 4 tokens at a time, with the training forward's logits."""
    from ggwgpu.backends.base import DeviceLimitError
    generation = sys.modules[Decoder.__module__]
    monkeypatch.setattr(generation, "PREFILL_SIZES", (4, 8))
    monkeypatch.setattr(generation, "FIRST_SPAN", 8)
    cfg = dataclasses.replace(TINY, n_ctx=24)
    values = tiny_values(cfg)

    def biggest(plan):
        return max(node.nelements for node in plan.nodes)
    limit = biggest(NumpyBackend(np.float64).plan(
        build_decode_graph(cfg, values, 4, scratch=8).outputs))

    class Limited(NumpyBackend):
        def plan(self, outputs, sentinel=0, shared=()):
            plan = super().plan(outputs, sentinel, shared)
            if biggest(plan) > limit:
                raise DeviceLimitError(f"a tensor of {biggest(plan)} values")
            return plan
    d = Decoder(Limited(np.float64), cfg, values)
    runs = record_runs(d, monkeypatch)
    tokens = list(np.random.default_rng(7).integers(0, cfg.n_vocab, 19))
    np.testing.assert_allclose(d.prefill(tokens), TrainingForward(
        NumpyBackend(np.float64), cfg, values)(tokens)[-1], rtol=0, atol=1e-12)
    assert runs == [(8, 8), (4, 24), (4, 24), (4, 24)]
    assert sorted(d.prefills) == [(4, 24), (8, 8)] and d._too_big == {(8, 24)}


@pytest.mark.parametrize("backend_name", ["numpy", "wgpu"])
def test_a_recurrent_model_goes_back_to_the_snapshot_of_its_states_not_to_the_start(
        backend_name, monkeypatch, request):
    """qwen35's states after the first 6 tokens, kept as asked (the run ends there): a sync
    that shares only those goes on from 6, also after an interrupted append; one that shares
    fewer starts over and drops it. The logits are the training forward's throughout (the
    states restored where every plan reads them); a model without states keeps no
    snapshot."""
    generation = sys.modules[Decoder.__module__]
    monkeypatch.setattr(generation, "PREFILL_SIZES", (8, 4))
    monkeypatch.setattr(generation, "FIRST_SPAN", 8)
    backend = (NumpyBackend(np.float64) if backend_name == "numpy"
               else request.getfixturevalue("wgpu"))
    cfg = dataclasses.replace(QWEN35, n_ctx=24)
    values = tiny_values(cfg)
    forward = TrainingForward(NumpyBackend(np.float64), cfg, values)
    d = Decoder(backend, cfg, values)
    atol = 1e-12 if backend_name == "numpy" else 2e-5
    runs, run, interrupt = [], d._run, []

    def counted(graph, plan, tokens, past):
        runs.append((past, len(tokens)))
        run(graph, plan, tokens, past)
        if interrupt and len(runs) == interrupt[0]:
            raise KeyboardInterrupt     # after the run: its states have moved on
    monkeypatch.setattr(d, "_run", counted)
    rng = np.random.default_rng(8)
    a, b, c = (list(rng.integers(0, cfg.n_vocab, 12)) for _ in range(3))

    def check(tokens):
        np.testing.assert_allclose(d.sync(tokens), forward(tokens)[-1], rtol=0, atol=atol)
    d.keep_states_at(6)
    check(a[:10])
    assert runs == [(0, 6), (6, 4)] and d._snapshot[0] == a[:6]
    check(a[:6] + b[:5])                        # shares 6: from the snapshot
    assert runs[2:] == [(6, 5)]
    # restored in place: every plan still holds the states in common, none has a copy
    step_graph, step_plan = d.steps[8]
    for graph, plan in d.prefills.values():
        assert all(same_storage(plan, leaf, step_plan, other)
                   for leaf, other in zip(graph.states, step_graph.states, strict=True))
    interrupt.append(4)                         # Ctrl-C in the append's first run
    with pytest.raises(KeyboardInterrupt):
        d.sync(a[:6] + c[:3])
    assert runs[3:] == [(6, 3)] and d.tokens == []
    interrupt.clear()
    check(a[:6] + c[:7])
    assert runs[4:] == [(6, 7)]
    check(a[:4] + b[:3])                        # shares 4: starts over, the snapshot dropped
    assert runs[5:] == [(0, 7)] and d._snapshot is None
    plain = Decoder(backend, dataclasses.replace(TINY, n_ctx=24), tiny_values())
    plain.keep_states_at(3)
    plain.sync(a[:6])
    assert not plain.has_states and plain._snapshot is None


@pytest.mark.parametrize("name", ["mha", "lfm2", "qwen35"])
def test_an_interrupted_prefill_leaves_a_cache_the_next_sync_can_use(name, monkeypatch):
    """A prefill stopped in its second chunk (Ctrl-C): the tokens stay those the cache held
    before it, or none for a recurrent model whose states moved on; the next sync gives the
    training forward's logits. On a backend whose plans share nothing, the kept leaves are
    copied between plans instead, with the same logits."""
    generation = sys.modules[Decoder.__module__]
    monkeypatch.setattr(generation, "PREFILL_SIZES", (4,))
    backend = NumpyBackend(np.float64)
    cfg = dataclasses.replace(FAMILIES[name], n_ctx=16)
    values = tiny_values(cfg)
    forward = TrainingForward(backend, cfg, values)
    tokens = list(np.random.default_rng(6).integers(0, cfg.n_vocab, 16))
    d = Decoder(backend, cfg, values)
    d.prefill(tokens[:3])
    graph, plan = d.prefills[4, 16]
    run, calls = plan.run, []

    def interrupted(feeds, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return run(feeds, **kw)
    plan.run = interrupted
    with pytest.raises(KeyboardInterrupt):
        d.append(tokens[3:12])
    assert d.tokens == ([] if name == "qwen35" else tokens[:3])
    np.testing.assert_allclose(d.sync(tokens[:12]), forward(tokens[:12])[-1], rtol=0, atol=1e-12)
    monkeypatch.setattr(generation, "same_storage", lambda *args: False)
    copied = Decoder(backend, cfg, values)
    copied.prefill(tokens[:6])
    copied.step(tokens[6])
    np.testing.assert_allclose(copied.sync(tokens[:14]), forward(tokens[:14])[-1],
                               rtol=0, atol=1e-12)


def test_a_recurrent_decoder_starts_over_where_a_sync_goes_back():
    """A delta-net's state cannot go back: a sync that leaves the cached tokens runs the
    whole sequence again from position 0 (and a prefill after steps starts over too), with
    the training forward's logits; one that only appends runs what is new."""
    backend = NumpyBackend(np.float64)
    values = tiny_values(QWEN35)
    forward = TrainingForward(backend, QWEN35, values)
    d = Decoder(backend, QWEN35, values)
    d.prefill([1, 4, 7])
    d.step(2)
    runs = []
    append = d.append
    d.append = lambda tokens: runs.append((d.past, list(tokens))) or append(tokens)
    target = [1, 4, 7, 5, 6, 3]
    np.testing.assert_allclose(d.sync(target), forward(target)[-1], rtol=0, atol=1e-12)
    assert runs == [(0, target)]
    longer = target + [8, 2]
    np.testing.assert_allclose(d.sync(longer), forward(longer)[-1], rtol=0, atol=1e-12)
    assert runs[-1] == (6, [8, 2])
    np.testing.assert_allclose(d.prefill([3, 3]), forward([3, 3])[-1], rtol=0, atol=1e-12)


def test_sync_on_the_device_equals_the_training_forward(wgpu):
    values = tiny_values()
    tokens = [1, 4, 7, 2, 5, 6, 3, 8]
    ref = TrainingForward(NumpyBackend(np.float64), TINY, values)(tokens)
    d = Decoder(wgpu, TINY, values)
    d.prefill(tokens[:3])
    d.step(9)
    got = [d.sync(tokens[:6]), d.step(tokens[6]), d.sync(tokens)]
    assert np.abs(np.array(got) - ref[[5, 6, 7]]).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("cfg", FAMILIES.values(), ids=FAMILIES)
def test_kv_cache_logits_on_the_device_equal_the_training_forward(wgpu, cfg):
    values = tiny_values(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab, cfg.n_ctx)
    ref = TrainingForward(NumpyBackend(np.float64), cfg, values)(tokens)
    dev_ref = TrainingForward(wgpu, cfg, values)(tokens)
    got = decoded_logits(wgpu, cfg, values, tokens, 3)
    scale = np.abs(ref).max()
    assert np.abs(got - ref[2:]).max() <= 1e-5 * scale
    assert np.abs(got - dev_ref[2:]).max() <= 1e-5 * scale


@pytest.mark.parametrize("backend_name", ["numpy", "wgpu"])
def test_the_decoder_s_plans_hold_each_weight_once(backend_name, request):
    """The prefill and step plans share every weight's storage (q8_0 ones and, on NumPy,
    their dequantized values included) and their cache; the logits are the training
    forward's, also after the step plan alone is left; memory counts each once."""
    import gc
    from ggwgpu.quant import Quantized, dequantize, quantize
    backend = NumpyBackend() if backend_name == "numpy" else request.getfixturevalue("wgpu")
    cfg = dataclasses.replace(TINY, n_embd=32, n_ff=32)
    values = {k: quantize(v, "q8_0") if k.endswith("attn_q.weight") else v
              for k, v in tiny_values(cfg).items()}
    d = Decoder(backend, cfg, values)
    tokens = [1, 4, 7, 2, 5]
    got = [d.prefill(tokens[:3])]
    [(prefill_graph, prefill_plan)] = d.prefills.values()      # one size and span: 8
    [(step_graph, step_plan)] = d.steps.values()
    plans, graphs = (prefill_plan, step_plan), (prefill_graph, step_graph)
    storage = [plan.storage if backend_name == "numpy" else
               {key: place[0] for key, place in plan.places.items()} for plan in plans]
    for name in values:
        weights = [g.params[name].storage for g in graphs]
        assert storage[0][id(weights[0])] is storage[1][id(weights[1])], name
        assert {id(w) for w in weights} <= plans[0].constant_keys | plans[1].constant_keys
    assert len(graphs[0].caches) == 2 * cfg.n_layer       # K and V of each layer
    for cache, other in zip(graphs[0].caches, graphs[1].caches, strict=True):
        assert storage[0][id(cache)] is storage[1][id(other)]
    assert {id(s) for s in plans[0].constants.values()} == \
        {id(s) for s in plans[1].constants.values()}
    assert len(plans[0].constants) == len(values) + 2 * cfg.n_layer    # weights and caches
    if backend_name == "numpy":
        assert len(backend.constants) == len(values) + 2 * cfg.n_layer
        q = [id(g.params["blk.0.attn_q.weight"]) for g in graphs]
        assert plans[0].dense[q[0]] is plans[1].dense[q[1]]
    shared_bytes = sum(plans[0].nbytes(g) for g in [*graphs[0].params.values(),
                                                     *graphs[0].caches])
    m = [plan.memory() for plan in plans]
    assert m[0]["shared"] == m[1]["shared"] == shared_bytes
    assert d.memory() == m[0]["planned"] + m[1]["planned"] - shared_bytes
    dense = {k: dequantize(v) if isinstance(v, Quantized) else v for k, v in values.items()}
    ref = TrainingForward(NumpyBackend(np.float64), cfg, dense)(tokens)
    got += [d.step(t) for t in tokens[3:]]
    scale = np.abs(ref).max()
    assert np.abs(np.array(got) - ref[2:]).max() <= 1e-5 * scale
    d.prefills.clear()
    del prefill_plan, plans, storage     # the step plan alone keeps the weights
    gc.collect()
    d.tokens = d.tokens[:3]
    assert np.abs(d.step(tokens[3]) - ref[3]).max() <= 1e-5 * scale


# -- sampling on hand-made logits ----------------------------------------------------------

def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([2.0, -2.0, 1.0, 0.5])
    got = apply_repeat_penalty(logits, [0, 1, 1], 2.0)    # repeats count once
    np.testing.assert_array_equal(got, [1.0, -4.0, 1.0, 0.5])
    np.testing.assert_array_equal(apply_repeat_penalty(logits, [], 2.0), logits)
    np.testing.assert_array_equal(logits, [2.0, -2.0, 1.0, 0.5])   # input untouched


def test_top_k_keeps_the_k_largest_lower_ids_first_on_ties():
    logits = np.array([1.0, 3.0, 2.0, 3.0, 2.0])
    inf = -np.inf
    np.testing.assert_array_equal(top_k_filter(logits, 2), [inf, 3.0, inf, 3.0, inf])
    np.testing.assert_array_equal(top_k_filter(logits, 3), [inf, 3.0, 2.0, 3.0, inf])
    np.testing.assert_array_equal(top_k_filter(logits, 0), logits)
    np.testing.assert_array_equal(top_k_filter(logits, 9), logits)


def test_top_p_keeps_the_smallest_head_reaching_p():
    probs = np.array([0.15, 0.5, 0.05, 0.3])
    logits = np.log(probs)
    kept = lambda p: np.flatnonzero(np.isfinite(top_p_filter(logits, p))).tolist()  # noqa: E731
    assert kept(0.1) == [1]                   # at least the most likely one
    assert kept(0.6) == [1, 3]
    assert kept(0.81) == [0, 1, 3]
    assert kept(1.0) == [0, 1, 2, 3]
    np.testing.assert_allclose(top_p_filter(logits, 0.6)[[1, 3]], logits[[1, 3]])


def test_min_p_keeps_the_tokens_at_least_p_times_as_likely_as_the_best():
    probs = np.array([0.5, 0.2, 0.026, 0.024, 0.25])
    logits = np.log(probs) + 3.0                       # only ratios matter
    kept = lambda p: np.flatnonzero(np.isfinite(min_p_filter(logits, p))).tolist()  # noqa: E731
    assert kept(0.05) == [0, 1, 2, 4]                  # 0.026 >= 0.025 > 0.024
    assert kept(0.45) == [0, 4]
    assert kept(1.0) == [0]
    assert kept(0.0) == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(min_p_filter(logits, 0.45)[[0, 4]], logits[[0, 4]])


def test_sampling_defaults_are_llama_cpp_defaults():
    s = Sampling()
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repeat_penalty) == (
        0.8, 40, 0.95, 0.05, 1.0)


def test_min_p_applies_after_top_p_before_the_temperature():
    # top-p 0.85 keeps ids 0 and 1 (0.6 + 0.3); min-p 0.6 of the best (0.6) then drops id 1
    # (0.3 < 0.36): only id 0 can come out, at any temperature.
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    s = Sampling(temperature=5.0, top_k=0, top_p=0.85, min_p=0.6)
    rng = np.random.default_rng(0)
    assert {sample_token(logits, [], s, rng) for _ in range(200)} == {0}
    s = Sampling(temperature=5.0, top_k=0, top_p=0.85, min_p=0.0)
    assert {sample_token(logits, [], s, rng) for _ in range(200)} == {0, 1}


def test_sampling_draws_from_the_tempered_softmax_of_what_the_filters_keep():
    logits = np.array([1.0, 0.0, 2.0, -1.0, 0.5])
    s = Sampling(temperature=0.7, top_k=3, top_p=1.0, repeat_penalty=1.0)
    rng = np.random.default_rng(0)
    draws = np.bincount([sample_token(logits, [], s, rng) for _ in range(4000)], minlength=5)
    want = np.zeros(5)
    want[[0, 2, 4]] = np.exp(logits[[0, 2, 4]] / 0.7) / np.exp(logits[[0, 2, 4]] / 0.7).sum()
    np.testing.assert_allclose(draws / 4000, want, atol=0.03)


def test_temperature_zero_is_greedy_after_the_repeat_penalty():
    logits = np.array([3.0, 2.9, -1.0])
    greedy = Sampling(temperature=0.0, repeat_penalty=1.1)
    picks = {sample_token(logits, [0], greedy, np.random.default_rng(seed)) for seed in range(5)}
    assert picks == {1}                       # 3.0 / 1.1 < 2.9
    assert sample_token(logits, [0, 2], Sampling(0.0, repeat_last_n=1), None) == 0


# -- generation ------------------------------------------------------------------------------

def test_window_keeps_bos_and_the_last_half_when_full():
    assert window([1, 5, 6], 1, 4) == [1, 5, 6]
    assert window([1, 5, 6, 7, 8], 1, 4) == [1, 7, 8]
    assert window([5, 6, 7, 8, 9], None, 4) == [8, 9]


@pytest.mark.parametrize("cfg", [TINY, QWEN35], ids=["llama", "qwen35"])
def test_greedy_generation_past_the_context_equals_recomputing_every_window(cfg):
    """Greedy tokens against the training graph run on the whole window for every token
    (what the cache must compute): the window grows to n_ctx, then starts over as BOS and
    the last n_ctx // 2 tokens (here four times; a recurrent model runs each new window
    from its start)."""
    backend, bos = NumpyBackend(np.float64), 1
    values = tiny_values(cfg)
    s = Sampling(temperature=0.0, repeat_penalty=1.3, repeat_last_n=5)
    prompt = [bos, 4, 7]
    got = list(generate_tokens(Decoder(backend, cfg, values), prompt, 20, s, 0, bos, None))
    forward, context, win = TrainingForward(backend, cfg, values), list(prompt), list(prompt)
    for _ in range(20):
        logits = forward(win)[-1]
        token = int(np.argmax(apply_repeat_penalty(logits, context[-5:], 1.3)))
        context.append(token)
        full = len(win) == cfg.n_ctx
        win = [bos] + context[-(cfg.n_ctx // 2):] if full else win + [token]
    assert got == context[len(prompt):]


@pytest.fixture(scope="module")
def byte_model():
    return BYTES, tiny_values(BYTES, seed=2), ByteTokenizer()


def test_generate_is_deterministic_under_a_seed_and_differs_across_seeds(byte_model):
    cfg, values, tok = byte_model
    backend = NumpyBackend()
    d = Decoder(backend, cfg, values)
    run = lambda seed, **kw: generate(backend, cfg, values, tok, "ab", 30,  # noqa: E731
                                      seed=seed, decoder=d, **kw)
    assert run(1, temperature=1.5) == run(1, temperature=1.5)
    assert len({run(seed, temperature=1.5) for seed in range(4)}) > 1
    assert len({run(seed, temperature=0.0) for seed in range(4)}) == 1


def test_generate_on_the_device_is_deterministic_under_a_seed(wgpu, byte_model):
    cfg, values, tok = byte_model
    d = Decoder(wgpu, cfg, values)
    run = lambda seed: generate(wgpu, cfg, values, tok, "ab", 20,  # noqa: E731
                                temperature=1.5, seed=seed, decoder=d)
    first = run(3)
    assert first == run(3)
    # the seed decides: a device run with a seed repeats, and other seeds give other texts
    assert len({first, run(4), run(5)}) > 1


def test_generation_stops_at_eos():
    backend, values = NumpyBackend(), tiny_values()
    d = Decoder(backend, TINY, values)
    free = list(generate_tokens(d, [1, 2], 12, Sampling(temperature=2.0), 5, 1, None))
    eos = free[4]
    stopped = list(generate_tokens(d, [1, 2], 12, Sampling(temperature=2.0), 5, 1, eos))
    assert stopped == free[:free.index(eos)]


def test_generation_stops_at_every_end_of_generation_token():
    backend, values = NumpyBackend(), tiny_values()
    d = Decoder(backend, TINY, values)
    free = list(generate_tokens(d, [1, 2], 12, Sampling(temperature=2.0), 5, 1, ()))
    for stop in ({free[3], 12}, {free[6], free[9]}):
        stopped = list(generate_tokens(d, [1, 2], 12, Sampling(temperature=2.0), 5, 1, stop))
        first = min(free.index(t) for t in stop if t in free)
        assert stopped == free[:first]


def test_prompt_tokens_add_bos_as_the_vocabulary_says_and_parse_special_tokens():
    tok = ByteTokenizer()
    assert prompt_tokens(tok, "a</s>") == [1, 3 + ord("a"), 2]
    assert tok.encode("a</s>").tolist() == [3 + b for b in b"a</s>"]


# -- the commands ------------------------------------------------------------------------------

def invoke(*args):
    return CliRunner().invoke(cli, list(args), env={ENV_VAR: None})


def test_generate_command_prints_prompt_and_continuation(tmp_path, byte_model):
    cfg, values, tok = byte_model
    path = tmp_path / "model.gguf"
    gguf_llama.save_model(path, cfg, values, tok)
    args = ("generate", str(path), "--prompt", "To be", "-n", "16", "--seed", "4")
    first, again = invoke(*args), invoke(*args)
    assert first.exit_code == 0, first.output
    assert first.stdout.startswith("To be") and len(first.stdout) > len("To be\n")
    assert first.stdout == again.stdout
    stats = re.search(r"prompt: (\d+) tokens in [\d.]+ s \([\d.]+ tokens/s\); generation: "
                      r"(\d+) tokens in [\d.]+ s \(([\d.]+ tokens/s|-) after the first\)",
                      first.stderr)
    assert stats and stats[1] == str(len(prompt_tokens(ByteTokenizer(), "To be"))), first.stderr
    assert 1 <= int(stats[2]) <= 16
    greedy = {invoke(*args, "--temp", "0", "--seed", seed).stdout for seed in ("1", "2")}
    assert len(greedy) == 1


def test_train_predict_prints_a_sample(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("First line\n" + "some text to learn from. " * 20)
    size = [f"--{k.replace('_', '-')}={v}" for k, v in
            dict(n_embd=16, n_head=2, n_layer=1, n_ff=24, n_ctx=12).items()]
    r = invoke("--backend", "numpy", "train", str(text), *size, "--batch", "2", "--steps", "2",
               "--out", str(tmp_path / "m.gguf"), "--predict", "10")
    assert r.exit_code == 0, r.output
    assert "sample of 10 tokens:\nFirst line" in r.stdout


def test_a_resumed_train_predicts_with_the_checkpoints_seed(tmp_path):
    """Without --seed, a resumed run samples with the seed the checkpoint fixes, as the
    uninterrupted run did."""
    text = tmp_path / "text.txt"
    text.write_text("First line\n" + "some text to learn from. " * 20)
    size = [f"--{k.replace('_', '-')}={v}" for k, v in
            dict(n_embd=16, n_head=2, n_layer=1, n_ff=24, n_ctx=12).items()]
    ckpt = tmp_path / "c.gguf"
    first = invoke("--backend", "numpy", "train", str(text), *size, "--batch", "2", "--steps",
                   "2", "--seed", "5", "--checkpoint-out", str(ckpt), "--out",
                   str(tmp_path / "m.gguf"), "--predict", "12")
    resumed = invoke("--backend", "numpy", "train", str(text), "--steps", "0",    # no more
                     "--checkpoint-in", str(ckpt), "--out", str(tmp_path / "m2.gguf"),
                     "--predict", "12")
    assert first.exit_code == 0 and resumed.exit_code == 0, first.output + resumed.output
    sample = first.stdout.split("sample of 12 tokens:\n")[1]
    assert resumed.stdout.split("sample of 12 tokens:\n")[1] == sample


def test_generate_command_with_a_bpe_vocabulary(tmp_path):
    # a byte-level BPE vocabulary (the 256 byte characters, two merges, three control
    # tokens): the prompt's <|im_start|> is parsed (and not printed), <|im_end|> ends it
    from ggwgpu.tokenizer import _BYTE_CHARS, BPEVocab
    tokens = list(_BYTE_CHARS) + ["Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = BPEVocab(tokens, ["Ġ t", "h e"], [1] * 258 + [3] * 3, pre="qwen2", eos_id=258)
    assert sorted(vocab.eog_ids) == [258, 260] and not vocab.add_bos
    assert prompt_tokens(vocab, "<|im_start|>the") == [259, ord("t"), 257]
    cfg = ModelConfig(n_vocab=vocab.n_vocab, n_embd=16, n_head=2, n_layer=1, n_ff=24, n_ctx=16)
    path = tmp_path / "bpe.gguf"
    gguf_llama.save_model(path, cfg, init_parameters(cfg, seed=1), vocab)
    r = invoke("--backend", "numpy", "generate", str(path), "--prompt", "<|im_start|>the",
               "-n", "6", "--seed", "1")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("the")
