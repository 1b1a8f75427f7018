"""The composed llama: the gradient of a 1-layer model's loss w.r.t. every parameter, on the
device against the NumPy backward and against finite differences, with and without flash
attention and gradient checkpointing."""
import dataclasses
import math

import numpy as np
import pytest

import ggwgpu as gg
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.models import (ModelConfig, build_train_graph, init_parameters, parameter_shapes,
                           vector_like)
from ggwgpu.testing import directional_check_gradients, reference_logits

TINY = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_layer=1, n_ff=12, n_ctx=5, n_rot=4)
# grouped-query attention (4 query heads over 2 K/V heads) with tied embeddings, and heads
# wider than n_embd / n_head (key_length as stored) over a single K/V head
GQA_TIED = ModelConfig(n_vocab=11, n_embd=8, n_head=4, n_head_kv=2, n_layer=1, n_ff=12, n_ctx=5,
                       tied_embeddings=True)
GQA_WIDE = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=6, n_layer=1,
                       n_ff=12, n_ctx=5)
# Llama 3: per-pair rope frequency factors (rope_freqs.weight, random here) and a large base
LLAMA3 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_layer=1, n_ff=12, n_ctx=5,
                     rope_freqs=True, rope_freq_base=500000.0)
# Qwen2 (llama.cpp's arch "qwen2"): Q/K/V biases (random, non-zero here) and neox rope, with
# grouped-query attention and tied embeddings as Qwen2.5-0.5B has them
QWEN2 = ModelConfig(n_vocab=11, n_embd=16, n_head=4, n_head_kv=2, n_layer=1, n_ff=12, n_ctx=5,
                    tied_embeddings=True, arch="qwen2")
# Qwen3: each head of Q and K RMS-normed before neox rope, heads wider than n_embd / n_head
QWEN3 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=6, n_layer=1,
                    n_ff=12, n_ctx=5, tied_embeddings=True, arch="qwen3")
# Gemma 3: sqrt(n_embd) input scale, QK norms, sandwich norms, GeGLU, a softcap; six layers:
# five with a sliding window of 3 and their own rope base, the sixth global
GEMMA3 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=6, n_layer=6,
                     n_ff=12, n_ctx=5, tied_embeddings=True, sliding_window=3,
                     rope_freq_base=1e6, rope_freq_base_swa=1e4, final_logit_softcap=2.0,
                     arch="gemma3")
# Gemma 2: gemma3's block without QK norms, the scores and the logits soft-capped (caps
# small enough to bend this model's values), a sliding window of 3 on the even layers
GEMMA2 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=6, n_layer=4,
                     n_ff=12, n_ctx=5, tied_embeddings=True, sliding_window=3,
                     attn_logit_softcap=0.5, final_logit_softcap=2.0, arch="gemma2")
# OLMo 2: no pre-norms, Q and K normed over their whole width, post-norms; OLMo 3: a sliding
# window of 3 on three layers of four, roped with scale 1
OLMO2 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_layer=2, n_ff=12, n_ctx=5,
                    rope_freq_scale=0.5, arch="olmo2")
OLMO3 = dataclasses.replace(OLMO2, n_layer=4, sliding_window=3)
# YaRN (Qwen3's for long contexts; OLMo 3's, on its global layers only, is test_generate's
# and test_families'): at base 10 and an original context of 64 the ramp spans every pair;
# with a rope.scaling.attn_factor
YARN = dict(rope_scaling="yarn", rope_freq_scale=0.25, rope_orig_ctx=64, rope_freq_base=10.0)
# ERNIE 4.5 0.3B: llama's block with heads wider than n_embd / n_head
ERNIE = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=6, n_layer=2,
                    n_ff=12, n_ctx=5, tied_embeddings=True, arch="ernie4_5")
# EXAONE 4.0 1.2B: olmo2's block with per-head QK norms and rope frequency factors, tied
EXAONE4 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_layer=2, n_ff=12, n_ctx=5,
                      tied_embeddings=True, rope_freqs=True, arch="exaone4")
# Ministral 3: YaRN with its own betas and log multiplier, and from position 2 (its original
# context here) Q times the attention temperature
MISTRAL3 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=6, n_layer=2,
                       n_ff=12, n_ctx=5, rope_freqs=True, rope_scaling="yarn",
                       rope_freq_scale=0.25, rope_orig_ctx=2, rope_freq_base=10.0,
                       yarn_beta_fast=0.5, yarn_beta_slow=0.25, yarn_log_mul=0.5,
                       attn_temp_scale=0.4, arch="mistral3")
# Hunyuan dense: per-head QK norms after neox rope, heads wider than n_embd / n_head
HUNYUAN = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=6, n_layer=2,
                      n_ff=12, n_ctx=5, tied_embeddings=True,
                      arch="hunyuan-dense")
# MiniCPM4: granite's scales, LongRoPE (the long factors past an original context of 4)
MINICPM = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_layer=2, n_ff=12, n_ctx=5,
                      tied_embeddings=True, longrope=True, rope_scaling="longrope",
                      rope_orig_ctx=4, embedding_scale=12.0, residual_scale=0.99,
                      logit_scale=0.03125, arch="minicpm")
# AFM-4.5B: relu(ffn_up h)^2 with no gate, rope factors, YaRN as its file has it
ARCEE = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_layer=2, n_ff=12, n_ctx=5,
                    rope_freqs=True, arch="arcee", **{**YARN, "rope_orig_ctx": 16})
# GLM-4-0414: Q/K/V biases, half the head roped (normal), a norm after each branch too, the
# gate and up as one product
GLM4 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_rot=2, n_layer=2, n_ff=12,
                   n_ctx=5, arch="glm4")
# Granite 4.0 H: Mamba2 layers 0 and 2 (4 heads of 4 over 2 groups of B and C, state 3,
# convolution of 4) around an attention layer without rope; granite's scales
GRANITEH = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_layer=3, n_ff=12,
                       n_ctx=5, recurrent_layers=(0, 2), conv_kernel=4, ssm_state=3,
                       ssm_heads=4, ssm_groups=2, embedding_scale=3.0, residual_scale=0.5,
                       logit_scale=2.0, no_rope=True, arch="granitehybrid")
# Nemotron-H: single-mixer blocks, Mamba2 (an inner size of its own, 6 heads over 3 groups),
# a feed-forward relu(up)^2, attention without rope
NEMOTRON = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_layer=4, n_ff=12,
                       n_ctx=5, recurrent_layers=(0, 2), mlp_layers=(1,), conv_kernel=3,
                       ssm_state=3, ssm_heads=6, ssm_groups=3, ssm_inner=12,
                       arch="nemotron_h")
# Falcon-H1: attention (neox rope, heads wider than n_embd / n_head) and a Mamba2 (without
# ssm_norm, as some files) side by side in every block
FALCON_H1 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=6, n_layer=2,
                        n_ff=12, n_ctx=5, recurrent_layers=(0, 1), conv_kernel=3, ssm_state=3,
                        ssm_heads=4, ssm_groups=1, ssm_inner=8, mamba_norm=False,
                        arch="falcon-h1")
# SmolLM3: the fourth layer without rope
SMOLLM3 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_layer=4, n_ff=12, n_ctx=5,
                      arch="smollm3")
# Granite: embedding, residual, attention and logit scales
GRANITE = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_layer=1, n_ff=12, n_ctx=5,
                      embedding_scale=3.0, residual_scale=0.5, attention_scale=0.25,
                      logit_scale=2.0, arch="granite")
# Phi-4-mini: fused Q/K/V and gate/up, partial neox rope, LongRoPE: n_ctx 5 past the original
# context of 4 takes the long factors, and the rotated dims times the attn_factor
PHI3 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_rot=2, n_layer=1, n_ff=12,
                   n_ctx=5, tied_embeddings=True, longrope=True, rope_orig_ctx=4,
                   rope_attn_factor=1.25, arch="phi3")
# LFM2: short-convolution blocks (kernel 3) around an attention block with QK norms
LFM2 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_layer=3, n_ff=12, n_ctx=5,
                   tied_embeddings=True, conv_layers=(0, 2), conv_kernel=3, arch="lfm2")
# Gemma 4: sliding layers 0, 1, 3 with heads of 4 over 1 K/V head, global ones with heads of
# 6 over 2, proportional rope factors; layers 3 and 4 on the K/V of layers 1 and 2 with a
# double-wide feed-forward; per-layer embeddings of 3; layer output scales; a softcap
GEMMA4 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_embd_head=6, n_layer=5, n_ff=24,
                     n_ff_layers=(12, 12, 12, 24, 24), n_head_kv_layers=(1, 1, 2, 1, 2), n_ctx=5,
                     swa_layers=(0, 1, 3), head_dim_swa=4, n_rot_swa=4, sliding_window=3,
                     shared_kv_layers=2, n_embd_per_layer=3, layer_output_scale=True,
                     rope_freqs=True, tied_embeddings=True, rope_freq_base=1e6,
                     rope_freq_base_swa=1e4, final_logit_softcap=2.0, arch="gemma4")
# Qwen3.5: two gated delta-net layers (two query/key heads for four value heads) before a
# gated attention layer with partial rope
QWEN35 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=6, n_rot=2,
                     n_layer=3, n_ff=12, n_ctx=5, recurrent_layers=(0, 1), conv_kernel=3,
                     ssm_state=3, ssm_heads=4, ssm_groups=2, rope_sections=(1, 0, 0, 0),
                     tied_embeddings=True, arch="qwen35")
# Qwen3-30B-A3B: 4 experts, 2 taken, their weights normalized, per-head QK norms;
# Qwen1.5-MoE: unnormalized, with a shared expert behind a sigmoid gate, Q/K/V biases
QWEN3MOE = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_layer=2, n_ff=12, n_ctx=5,
                       n_expert=4, n_expert_used=2, n_ff_exp=6, arch="qwen3moe")
QWEN2MOE = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_layer=1, n_ff=12, n_ctx=5,
                       n_expert=3, n_expert_used=2, n_ff_exp=4, n_ff_shexp=10,
                       tied_embeddings=True, arch="qwen2moe")
# LFM2-8B-A1B: sigmoid gating, a ranking bias, the first block dense
LFM2MOE = dataclasses.replace(LFM2, arch="lfm2moe", n_expert=3, n_expert_used=2, n_ff_exp=4,
                              expert_gating=2, n_dense_lead=1)
# Gemma 4 26B-A4B: the dense GeGLU beside GeGLU experts, gate | up one stack, scaled
GEMMA4MOE = dataclasses.replace(GEMMA4, n_expert=3, n_expert_used=2, n_ff_exp=4,
                                fused_gate_up=True)
# Phi-2: LayerNorm blocks with biases, side by side, partial rope, an output bias
PHI2 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_rot=2, n_layer=2, n_ff=12, n_ctx=5,
                   arch="phi2")
# gpt-oss: biases everywhere (the experts' stacks of them too), sinks, the even layer
# windowed, YaRN, the taken logits' softmax as weights, swiglu_oai
GPT_OSS = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=6, n_layer=2,
                      n_ff=12, n_ctx=5, sliding_window=3, n_expert=3, n_expert_used=2,
                      n_ff_exp=4, **YARN, arch="gpt-oss")
# DeepSeek-V2: latent attention with queries through a normed rank, the first block dense,
# experts by sigmoids ranked with a bias, normalized and scaled, a shared expert, YaRN
DEEPSEEK2 = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_embd_head=10, n_rot=4,
                        n_layer=2, n_ff=12, n_ctx=5, n_expert=3, n_expert_used=2, n_ff_exp=4,
                        n_ff_shexp=4, n_dense_lead=1, expert_gating=2, expert_bias=True,
                        expert_weights_norm=True, expert_weights_scale=2.5, q_lora_rank=6,
                        mla_key_length=8, mla_value_length=6, yarn_log_mul=0.5, **YARN,
                        arch="deepseek2")
CONFIGS = {"mha": TINY, "gqa-tied": GQA_TIED, "gqa-wide": GQA_WIDE, "llama3-rope": LLAMA3,
           "qwen2": QWEN2, "qwen3": QWEN3, "gemma2": GEMMA2, "gemma3": GEMMA3,
           "olmo2": OLMO2, "olmo3": OLMO3, "ernie4_5": ERNIE, "exaone4": EXAONE4,
           "exaone": dataclasses.replace(EXAONE4, arch="exaone"),
           "qwen3-yarn": dataclasses.replace(QWEN3, **YARN, rope_attn_factor=0.8),
           "mistral3": MISTRAL3, "hunyuan-dense": HUNYUAN,
           "hunyuan-moe": dataclasses.replace(HUNYUAN, arch="hunyuan-moe", n_expert=3,
                                              n_expert_used=2, n_ff_exp=12),
           "arcee": ARCEE, "glm4": GLM4,
           "granitehybrid": GRANITEH, "nemotron_h": NEMOTRON, "falcon-h1": FALCON_H1,
           "granitehybrid-rope": dataclasses.replace(GRANITEH, no_rope=False, ssm_groups=4),
           "minicpm": MINICPM,
           "minicpm3": ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_embd_head=6, n_rot=2,
                                   n_layer=2, n_ff=12, n_ctx=5, mla_value_length=4,
                                   q_lora_rank=4, kv_lora_rank=3, longrope=True,
                                   rope_scaling="longrope", rope_orig_ctx=4, arch="minicpm3"),
           "smollm3": SMOLLM3,
           "granite": GRANITE, "phi3": PHI3,
           "phi3-short": dataclasses.replace(PHI3, rope_orig_ctx=8, n_rot=None), "lfm2": LFM2,
           "lfm2-window": dataclasses.replace(LFM2, conv_layers=(0,), sliding_window=2),
           "gemma4": GEMMA4, "qwen35": QWEN35, "qwen3moe": QWEN3MOE, "qwen2moe": QWEN2MOE,
           "lfm2moe": LFM2MOE, "gemma4-moe": GEMMA4MOE, "phi2": PHI2,
           "starcoder2": dataclasses.replace(PHI2, arch="starcoder2", n_rot=None, n_head_kv=1,
                                             tied_embeddings=True),
           "stablelm": dataclasses.replace(PHI2, arch="stablelm", qkv_bias=True),
           "nemotron": dataclasses.replace(PHI2, arch="nemotron"),
           "gpt-oss": GPT_OSS, "deepseek2": DEEPSEEK2,
           "mistral4": dataclasses.replace(DEEPSEEK2, arch="mistral4", fused_gate_up=True),
           "phimoe": ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_layer=2, n_ff=12, n_ctx=5,
                                 n_expert=3, n_expert_used=2, qkv_bias=True, longrope=True,
                                 rope_scaling="longrope", rope_orig_ctx=4, arch="phimoe"),
           "bailingmoe2": ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_rot=2, n_layer=2,
                                      n_ff=12, n_ctx=5, n_expert=3, n_expert_used=2,
                                      n_ff_exp=4, n_ff_shexp=4, n_dense_lead=1,
                                      expert_gating=2, expert_bias=True,
                                      expert_weights_norm=True, expert_weights_scale=2.5,
                                      arch="bailingmoe2"),
           "afmoe": ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_layer=4, n_ff=12,
                                n_ctx=5, n_expert=3, n_expert_used=2, n_ff_exp=4,
                                n_ff_shexp=4, n_dense_lead=1, expert_gating=2,
                                expert_weights_norm=True, expert_weights_scale=2.5,
                                sliding_window=3, rope_freq_base_swa=1e4, arch="afmoe"),
           "smallthinker": ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_layer=2,
                                       n_ff=12, n_ctx=5, n_expert=3, n_expert_used=2,
                                       n_ff_exp=4, sliding_window=4096, arch="smallthinker"),
           "seed_oss": dataclasses.replace(QWEN2, arch="seed_oss", qkv_bias=True,
                                           tied_embeddings=False),
           "glm4moe": ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_rot=2,
                                  n_layer=2, n_ff=12, n_ctx=5, n_expert=3, n_expert_used=2,
                                  n_ff_exp=4, n_ff_shexp=4, n_dense_lead=1, expert_gating=2,
                                  expert_weights_norm=True, expert_weights_scale=2.5,
                                  qkv_bias=True, qk_norm=True, arch="glm4moe"),
           "cohere2": ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_layer=4, n_ff=12,
                                  n_ctx=5, sliding_window=3, logit_scale=0.5,
                                  tied_embeddings=True, arch="cohere2"),
           "gpt2": dataclasses.replace(PHI2, arch="gpt2", n_rot=None, n_positions=7),
           "gptneox": dataclasses.replace(PHI2, arch="gptneox", parallel_residual=True),
           "gptneox-sequential": dataclasses.replace(PHI2, arch="gptneox"),
           "qwen2-fused-qkv": dataclasses.replace(QWEN2, fused_qkv=True),
           "ernie4_5-moe": dataclasses.replace(ERNIE, arch="ernie4_5-moe", n_expert=3,
                                               n_expert_used=2, n_ff_exp=4, n_ff_shexp=6,
                                               n_dense_lead=1, expert_bias=True),
           "nemotron_h_moe": dataclasses.replace(NEMOTRON, arch="nemotron_h_moe", n_expert=3,
                                                 n_expert_used=2, n_ff_exp=4, n_ff_shexp=6,
                                                 expert_weights_norm=True,
                                                 expert_weights_scale=1.5)}
BATCH = 2


def model_values(cfg):
    rng = np.random.default_rng(3)
    values = init_parameters(cfg, seed=1)
    # random norm weights and biases too (init makes them 1 and 0), so their gradients
    # are generic
    # (qwen35's ssm_a negative, as -exp(A_log) is)
    return {k: v if not (vector_like(k, v.shape) or k.endswith(".bias")) else
            rng.uniform(*(-0.5, 0.5) if k.endswith(".bias") else
                        (-1.5, -0.5) if k.endswith("ssm_a") else (0.5, 1.5),
                        v.shape).astype(np.float32)
            for k, v in values.items()}


def setup(flash=False, checkpoint=False, cfg=TINY, chunk_rows=None, ignored=()):
    """The graph, gradients and feeds of one batch; chunk_rows: logits in row chunks of
    that many rows; ignored: (batch, position)s whose target id is -1."""
    rng = np.random.default_rng(3)
    values = model_values(cfg)
    bound = 4 * cfg.n_vocab * (chunk_rows or BATCH * cfg.n_ctx)
    g = build_train_graph(cfg, values, BATCH, flash=flash, max_logits_bytes=bound)
    grads = gg.build_backward(g.loss, list(g.params.values()),
                              checkpoints=g.checkpoints if checkpoint else None,
                              recompute=g.recompute)
    tokens = rng.integers(0, cfg.n_vocab, (BATCH, cfg.n_ctx + 1))
    targets = tokens[:, 1:].copy()
    for i in ignored:
        targets[i] = -1
    feeds = {**g.feeds(tokens[:, :-1], targets),
             g.positions: np.arange(cfg.n_ctx, dtype=np.int32)}
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


# unfused and uncheckpointed, or flash attention's backward on a checkpointed graph: the
# mixed two add no rule of their own (the device test above runs all four)
@pytest.mark.parametrize("flash, checkpoint", [(False, False), (True, True)],
                         ids=["unfused", "flash-checkpointed"])
@pytest.mark.parametrize("model", CONFIGS)
def test_llama_gradients_match_finite_differences(flash, checkpoint, model):
    g, grads, feeds = setup(flash, checkpoint, CONFIGS[model])
    backend = NumpyBackend(np.float64)
    _, analytic = run(backend, g, grads, feeds)
    directional_check_gradients(g.loss, {p: analytic[p.name] for p in grads}, feeds)


@pytest.mark.parametrize("where", ["first", "last"])
def test_the_directional_check_finds_one_wrong_element_of_a_gradient(where):
    """A backward rule wrong at a single element of a matrix (an edge case: the first
    position, the last head) moves each random projection of it: the check names it."""
    g, grads, feeds = setup()
    _, analytic = run(NumpyBackend(np.float64), g, grads, feeds)
    wrong = {p: analytic[p.name].copy() for p in grads}
    param = next(p for p in wrong if p.name == "blk.0.attn_k.weight")
    wrong[param][(0, 0) if where == "first" else (-1, -1)] += 1e-2
    with pytest.raises(AssertionError, match="blk.0.attn_k.weight along direction"):
        directional_check_gradients(g.loss, wrong, feeds)


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
    from ggwgpu.training import Trainer, TrainOptions
    cfg = ModelConfig(n_vocab=32, n_embd=32, n_head=2, n_layer=9, n_ff=64, n_ctx=32)
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



def test_a_checkpointed_lora_step_adds_only_a_block_output_per_layer():
    """LoRA on a frozen q4_0 base, a checkpoint after every block: 4 more layers add to the
    activations live at the peak their 4 block outputs and nothing else. The pairs' small
    products (A x) and weight gradients run as soon as their sources have, not when the
    optimizer asks for them: left for it, they kept each layer's recomputed norm and gate
    outputs and its output gradient alive to the end of the step (3.9 block outputs per
    layer here; on the SmolLM2-135M shape, 1.46x the planned memory)."""
    from ggwgpu.lora import init_adapter, lora_ranks
    from ggwgpu.quant import quantize_model
    from ggwgpu.training import Trainer, TrainOptions

    class NoBatches:
        def next_batch(self):
            raise AssertionError("planned, not run")

    activations = {}
    for n_layer in (2, 6):
        cfg = ModelConfig(n_vocab=64, n_embd=64, n_head=4, n_head_kv=2, n_layer=n_layer,
                          n_ff=128, n_ctx=16, tied_embeddings=True)
        values = quantize_model(init_parameters(cfg, seed=1), "q4_0")
        adapter = init_adapter(cfg, lora_ranks(cfg, 4), 4.0, seed=1)
        options = TrainOptions(batch=4, checkpointing=True)
        plan = Trainer(cfg, values, NumpyBackend(), options, NoBatches(), lora=adapter).plan
        activations[n_layer] = plan.memory()["activations"]
    block_output = 4 * options.batch * cfg.n_ctx * cfg.n_embd
    assert activations[6] - activations[2] == 4 * block_output



def test_checkpointing_recomputes_nothing_after_the_last_checkpoint():
    """The backward starts with the head (final norm, logits, loss) right after the forward
    made it: with a checkpoint after the last block, the logits product (a 49k vocabulary's
    is the largest of the step) runs once, while each block's products run twice."""
    cfg = ModelConfig(n_vocab=40, n_embd=16, n_head=2, n_layer=2, n_ff=24, n_ctx=8)
    g = build_train_graph(cfg, init_parameters(cfg, seed=1), BATCH)
    grads = gg.build_backward(g.loss, list(g.params.values()), checkpoints=g.checkpoints)
    nodes = NumpyBackend().plan([g.loss, *grads.values()]).nodes
    products = [n for n in nodes if n.op == "mul_mat"]
    logits = [n for n in products if n.shape == (BATCH * cfg.n_ctx, cfg.n_vocab)]
    ffn_wide = [n for n in products if n.shape == (BATCH, cfg.n_ctx, cfg.n_ff)]
    # per block: gate and up, in the forward and recomputed; the gradient of down's input
    assert len(logits) == 1 and len(ffn_wide) == (2 * 2 + 1) * cfg.n_layer


IGNORED = [(0, 1), (1, 4), (1, 0)]


@pytest.mark.parametrize("backend", ["numpy", "wgpu"])
def test_logits_in_row_chunks_give_the_loss_and_gradients_of_whole_logits(request, backend):
    """4 chunks of 2, 3, 2 and 3 rows against one of 10 rows, with ignored targets: the same
    loss and gradients (float64 NumPy: to rounding; the device: to float32 noise), and the
    loss is the mean over the counted targets of -log_softmax(logits)[target]."""
    be = NumpyBackend(np.float64) if backend == "numpy" else request.getfixturevalue("wgpu")
    tol = 1e-12 if backend == "numpy" else 2e-6
    whole, chunked = setup(ignored=IGNORED), setup(chunk_rows=3, ignored=IGNORED)
    assert [t.shape for t in chunked[0].logits] == [(2, 11), (3, 11), (2, 11), (3, 11)]
    assert len(chunked[0].recompute) == 4 and whole[0].recompute == []
    loss0, grads0 = run(be, *whole)
    loss1, grads1 = run(be, *chunked)
    assert abs(loss1 - loss0) <= tol * abs(loss0)
    for name, g in grads0.items():
        np.testing.assert_allclose(grads1[name], g, rtol=tol * 100, atol=tol * 1e-3,
                                   err_msg=name)
    g, _, feeds = whole
    plan = be.plan(g.logits)
    plan.run({t: feeds[t] for t in (g.tokens, g.positions)})
    logits = g.read_logits(plan).reshape(-1, TINY.n_vocab).astype(np.float64)
    targets = feeds[g.targets].reshape(-1)
    counted = targets >= 0
    assert counted.sum() == BATCH * TINY.n_ctx - len(IGNORED)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = -log_probs[counted, targets[counted]].mean()
    assert abs(loss0 - want) <= 1e-5 * want


def test_chunked_logits_with_ignored_targets_match_finite_differences():
    g, grads, feeds = setup(chunk_rows=3, ignored=IGNORED)
    _, analytic = run(NumpyBackend(np.float64), g, grads, feeds)
    directional_check_gradients(g.loss, {p: analytic[p.name] for p in grads}, feeds)


def test_target_ids_are_checked_and_all_ignored_gives_zero():
    g, grads, feeds = setup()
    with pytest.raises(ValueError, match="target id 11 out of range"):
        g.feeds(feeds[g.tokens], np.full((BATCH, TINY.n_ctx), 11))
    none = g.feeds(feeds[g.tokens], np.full((BATCH, TINY.n_ctx), -1))
    assert not none[g.weights].any()
    loss, dev = run(NumpyBackend(), g, grads, {**feeds, **none})
    assert loss == 0 and all(not d.any() for d in dev.values())


def test_a_logits_bound_keeps_every_tensor_under_it_and_lowers_the_planned_bytes():
    """A 49 152-token vocabulary, 1024 rows: whole logits are 192 MiB. Under a bound every
    tensor of the planned training step stays within it, and the step plans in far fewer
    bytes: each chunk's logits and their gradient die before the next chunk's exist."""
    from ggwgpu.training import Trainer, TrainOptions
    cfg = ModelConfig(n_vocab=49152, n_embd=64, n_head=2, n_layer=2, n_ff=128, n_ctx=128)
    values = init_parameters(cfg, seed=0)

    class NoBatches:
        def next_batch(self):
            raise AssertionError("planned, not run")

    options, planned = TrainOptions(batch=8), {}
    for bound in (2 ** 40, 128 << 20, 32 << 20):
        graph = build_train_graph(cfg, values, options.batch, max_logits_bytes=bound)
        plan = Trainer(cfg, values, NumpyBackend(), options, NoBatches(), graph=graph).plan
        assert max(plan.nbytes(r) for r in plan.roots) <= min(bound, 192 << 20)
        planned[bound] = plan.memory()["planned"]
    # measured: 478, 287 and 164 MiB
    assert planned[128 << 20] < 0.65 * planned[2 ** 40]
    assert planned[32 << 20] < 0.4 * planned[2 ** 40]


# -- against the llama as llama.cpp computes it ------------------------------------------------

@pytest.mark.parametrize("backend_name", ["numpy", "wgpu"])
@pytest.mark.parametrize("model", CONFIGS)
def test_logits_equal_the_float64_reference(model, backend_name, request):
    cfg = CONFIGS[model]
    backend = request.getfixturevalue("wgpu") if backend_name == "wgpu" else NumpyBackend()
    g, _, feeds = setup(cfg=cfg)
    plan = backend.plan(g.logits)
    plan.run({g.tokens: feeds[g.tokens], g.positions: feeds[g.positions]})
    got = g.read_logits(plan)
    for row, tokens in enumerate(feeds[g.tokens]):
        want = reference_logits(cfg, model_values(cfg), tokens)
        np.testing.assert_allclose(got[row], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("changes", [{}, {"tied_embeddings": True}, {"n_head_kv": 1},
                                     {"rope_freqs": True}, {"n_layer": 0}, {"n_embd_head": 6},
                                     {"arch": "qwen2"}])
def test_the_memory_estimate_counts_the_parameters_without_listing_every_layer(changes):
    from ggwgpu import memory
    cfg = ModelConfig(**{**dict(n_vocab=11, n_embd=8, n_head=2, n_layer=3, n_ff=12, n_ctx=5),
                         **changes})
    assert memory.parameter_count(cfg) == sum(math.prod(s) for s in parameter_shapes(cfg).values())
    huge = dataclasses.replace(cfg, n_layer=10 ** 9)        # counted, not listed
    per_layer = memory.parameter_count(dataclasses.replace(cfg, n_layer=1)) - \
        memory.parameter_count(dataclasses.replace(cfg, n_layer=0))
    assert memory.parameter_count(huge) == memory.parameter_count(
        dataclasses.replace(cfg, n_layer=0)) + 10 ** 9 * per_layer


def test_the_memory_estimate_counts_two_bytes_per_f16_activation_and_cache_value():
    from ggwgpu import memory
    cfg = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_layer=3, n_ff=12, n_ctx=5)
    f32 = memory.estimate(cfg, batch=2, trained=7, decoder=True)
    f16 = memory.estimate(cfg, batch=2, trained=7, decoder=True, value_bytes=memory.F16)
    assert f16["activations"] * 2 == f32["activations"]
    assert f16["KV cache"] * 2 == f32["KV cache"]
    assert f32["prefill attention scores"] == 4 * 2 * 5 * 5      # heads x chunk x window
    long = memory.estimate(dataclasses.replace(cfg, n_ctx=4096), decoder=True)
    assert long["prefill attention scores"] == 4 * 2 * memory.PREFILL_CHUNK * 4096
    assert f16["weights"] == f32["weights"]
    assert f16["gradients and optimizer moments"] == f32["gradients and optimizer moments"]
    # gemma2's capped scores: three score-sized tensors, unfused even with flash attention
    capped = dataclasses.replace(GEMMA2, n_ctx=64)
    plain = dataclasses.replace(capped, attn_logit_softcap=0.0)
    scores = 2 * capped.n_head * 64 * 64 * memory.F32
    assert memory.estimate(capped, batch=2, flash_attn=True)["activations"] == \
        memory.estimate(plain, batch=2, flash_attn=True)["activations"] + 3 * scores
    assert memory.estimate(capped, decoder=True)["prefill attention scores"] == \
        3 * memory.estimate(plain, decoder=True)["prefill attention scores"]


def test_the_memory_estimate_of_gemma4_counts_each_layer_and_only_its_own_kv_cache():
    """Layers of different widths are listed, not multiplied; shared-KV layers add no cache."""
    from ggwgpu import memory
    assert memory.parameter_count(GEMMA4) == sum(math.prod(s) for s in
                                                 parameter_shapes(GEMMA4).values())
    widths = [4, 4, 12]     # layers 0, 1 (one K/V head of 4), 2 (two of 6); 3, 4 share
    assert memory.estimate(GEMMA4, decoder=True)["KV cache"] == 2 * 4 * GEMMA4.n_ctx * sum(widths)


def test_the_memory_estimate_of_qwen35_counts_caches_of_what_each_layer_keeps():
    """An attention layer's K/V, a delta-net's convolution inputs (by position) and state."""
    from ggwgpu import memory
    need = memory.estimate(QWEN35, decoder=True)
    conv = 2 * 3 * 2 + 3 * 4        # q | k | v of the two delta-net layers
    assert need["KV cache"] == 4 * QWEN35.n_ctx * (2 * 6 + 2 * conv)
    assert need["recurrent states"] == 4 * 2 * 4 * 3 * 3
    assert memory.parameter_count(QWEN35) == sum(math.prod(s) for s in
                                                 parameter_shapes(QWEN35).values())
