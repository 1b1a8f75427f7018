"""Every model family beyond llama (models/<arch>.py) through the files and commands: its GGUF
keys and tensors as llama.cpp's converter writes them, read back exactly (and without
ggwgpu's config JSON), a missing tensor refused by name, checkpoints, a LoRA adapter whose
step 0 is the base, finetune (LoRA and --full), merge and quantize keeping the arch.
Logits against the float64 reference and gradients are in test_llama.py's matrix; the KV
cache against the training forward in test_generate.py."""
import dataclasses

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader, GGUFValueType

from ggwgpu import gguf_file, gguf_llama, lora
from ggwgpu.backends import ENV_VAR
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.graph import topo_order
from ggwgpu.training.checkpoint import load_checkpoint, save_checkpoint
from ggwgpu.gguf_file import GGUFError
from ggwgpu.tensor import ShapeError
from ggwgpu.gguf_llama import load_model, save_model
from ggwgpu.models import (ModelConfig, build_train_graph, init_parameters, parameter_shapes,
                           vector_like)
from ggwgpu.tokenizer import ByteTokenizer
from ggwgpu_cli.main import cli
from conftest import train_state

BYTES = dict(n_vocab=ByteTokenizer.n_vocab, n_embd=16, n_ff=32, n_ctx=16, norm_eps=1e-6)
# Tiny models shaped as each family's small published sizes.
FAMILIES = {
    # Llama 3.2: rope frequency factors (a frozen table a full finetune writes back)
    "llama3": ModelConfig(**BYTES, n_head=4, n_head_kv=2, n_layer=2, tied_embeddings=True,
                          rope_freqs=True, rope_freq_base=5e5),
    # Qwen2.5-0.5B: Q/K/V biases, tied
    "qwen2": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=2, tied_embeddings=True,
                         rope_freq_base=1e6, arch="qwen2"),
    # Qwen3-0.6B: 16 query heads of 128 over 8 K/V heads (wider than n_embd / n_head), tied
    "qwen3": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_embd_head=12, n_layer=2,
                         tied_embeddings=True, rope_freq_base=1e6, arch="qwen3"),
    # Gemma-3-270M: heads wider than n_embd / n_head, five sliding-window layers of six
    # with their own rope base, tied; a softcap as Gemma 2 files have it
    "gemma3": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_embd_head=12, n_layer=6,
                          tied_embeddings=True, rope_freq_base=1e6, sliding_window=4,
                          rope_freq_base_swa=1e4, final_logit_softcap=30.0, arch="gemma3"),
    # Gemma-2-2B: heads narrower than n_embd / n_head, a sliding window on the even layers,
    # the scores and the logits soft-capped as its file has them, tied
    "gemma2": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_embd_head=6, n_layer=4,
                          tied_embeddings=True, sliding_window=4, attn_logit_softcap=50.0,
                          final_logit_softcap=30.0, arch="gemma2"),
    # OLMo-2-0425-1B: no pre-norms, Q/K normed over their whole width, post-norms, untied;
    # OLMo 3: three sliding-window layers of four, YaRN (factor 8) on the fourth
    "olmo2": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=2, rope_freq_base=5e5,
                         arch="olmo2"),
    "olmo3": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=4, rope_freq_base=5e5,
                         sliding_window=4, rope_scaling="yarn", rope_freq_scale=0.125,
                         rope_orig_ctx=8, arch="olmo2"),
    # ERNIE-4.5-0.3B: llama's block, heads of 128 over an n_embd of 1024 (16 heads), tied
    "ernie4_5": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_embd_head=12, n_layer=2,
                            tied_embeddings=True, rope_freq_base=5e5, arch="ernie4_5"),
    # EXAONE-4.0-1.2B: post-norms only, per-head QK norms, rope frequency factors, tied
    # EXAONE 3.5 2.4B: llama's block with neox rope and rope factors, tied
    "exaone": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=2, tied_embeddings=True,
                          rope_freqs=True, rope_freq_base=1e6, arch="exaone"),
    # InternLM2.5 1.8B: llama's block, untied
    "internlm2": ModelConfig(**BYTES, n_head=4, n_head_kv=2, n_layer=2, rope_freq_base=1e6,
                             arch="internlm2"),
    "exaone4": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=2, tied_embeddings=True,
                           rope_freqs=True, rope_freq_base=1e6, arch="exaone4"),
    # Ministral-3-3B: heads wider than n_embd / n_head, YaRN (factor 16, its log multiplier),
    # the attention temperature past an original context of 8, tied
    "mistral3": ModelConfig(**BYTES, n_head=4, n_head_kv=2, n_embd_head=8, n_layer=2,
                            tied_embeddings=True, rope_freq_base=1e6, rope_scaling="yarn",
                            rope_freq_scale=0.0625, rope_orig_ctx=8, yarn_log_mul=1.0,
                            attn_temp_scale=0.1, arch="mistral3"),
    # Hunyuan-0.5B: QK norms after rope, a rope base scaled by its alpha, tied
    # Hunyuan-A13B: hunyuan-dense's attention, 4 experts of n_ff (2 taken) and a shared one
    "hunyuan-moe": ModelConfig(**BYTES, n_head=4, n_head_kv=2, n_layer=2, n_expert=4,
                               n_expert_used=2, n_ff_exp=32, n_ff_shexp=16,
                               rope_freq_base=1e6, arch="hunyuan-moe"),
    "hunyuan-dense": ModelConfig(**BYTES, n_head=4, n_head_kv=2, n_layer=2,
                                 tied_embeddings=True, rope_freq_base=1.1e7,
                                 arch="hunyuan-dense"),
    # MiniCPM4-0.5B: granite's scales (12, 1.4 / sqrt(n_layer), n_embd / 64), LongRoPE's
    # factors, tied
    # MiniCPM3-4B: latent attention (keys of 8 + 4 rope dims, values of 8 = n_embd / n_head,
    # queries through a rank of 8, a latent of 6), LongRoPE, its fixed scales, untied
    "minicpm3": ModelConfig(**BYTES, n_head=2, n_embd_head=12, n_rot=4, n_layer=2,
                            mla_value_length=8, q_lora_rank=8, kv_lora_rank=6, longrope=True,
                            rope_scaling="longrope", rope_orig_ctx=8, arch="minicpm3"),
    "minicpm": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=2, tied_embeddings=True,
                           longrope=True, rope_scaling="longrope", rope_orig_ctx=8,
                           embedding_scale=12.0, residual_scale=0.99, logit_scale=0.25,
                           arch="minicpm"),
    # AFM-4.5B: a feed-forward of relu(ffn_up h)^2, no gate; YaRN (factor 20), untied
    "arcee": ModelConfig(**BYTES, n_head=4, n_head_kv=1, n_layer=2, rope_scaling="yarn",
                         rope_freq_scale=0.05, rope_orig_ctx=8, arch="arcee"),
    # GLM-4-9B-0414: Q/K/V biases, half of each head roped, sandwich norms, gate | up fused,
    # untied
    "glm4": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_rot=4, n_layer=2, arch="glm4"),
    # Granite 4.0 H 1B: Mamba2 layers (8 heads over 1 group of B and C) with attention on the
    # third of four without rope; granite's scales, tied
    "granitehybrid": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=4,
                                 recurrent_layers=(0, 1, 3), conv_kernel=4, ssm_state=8,
                                 ssm_heads=8, ssm_groups=1, embedding_scale=12.0,
                                 residual_scale=0.25, attention_scale=0.0078125,
                                 logit_scale=4.0, no_rope=True, tied_embeddings=True,
                                 arch="granitehybrid"),
    # Nemotron Nano 9B v2: Mamba2 (8 heads of 4 over 2 groups), feed-forward and attention
    # blocks, each its mixer alone; untied
    "nemotron_h": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=4,
                              recurrent_layers=(0, 3), mlp_layers=(1,), conv_kernel=4,
                              ssm_state=4, ssm_heads=8, ssm_groups=2, ssm_inner=32,
                              arch="nemotron_h"),
    # Nemotron 3 Nano 30B-A3B: nemotron_h's blocks, the feed-forward ones experts of
    # relu(up)^2 by sigmoids ranked with a bias (4, 2 taken, normalized, times 2.5) and a
    # shared expert
    "nemotron_h_moe": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=4,
                                  recurrent_layers=(2,), mlp_layers=(0, 1), conv_kernel=4,
                                  ssm_state=4, ssm_heads=8, ssm_groups=2, ssm_inner=32,
                                  n_expert=4, n_expert_used=2, n_ff_exp=32, n_ff_shexp=48,
                                  expert_weights_norm=True, expert_weights_scale=2.5,
                                  arch="nemotron_h_moe"),
    # Falcon-H1-0.5B: attention and a Mamba2 in every block, the feed-forward's norm named
    # blk.N.ffn_norm, tied
    "falcon-h1": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=2, recurrent_layers=(0, 1),
                             conv_kernel=4, ssm_state=4, ssm_heads=4, ssm_groups=1,
                             ssm_inner=24, tied_embeddings=True, arch="falcon-h1"),
    # SmolLM3-3B: no rope on every fourth layer
    "smollm3": ModelConfig(**BYTES, n_head=4, n_head_kv=2, n_layer=4, tied_embeddings=True,
                           rope_freq_base=5e6, arch="smollm3"),
    # Phi-4-mini: fused Q/K/V and gate/up, partial rotary (3/4), LongRoPE factors (the long
    # ones past an original context of 8) and attn_factor, tied
    "phi3": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_rot=6, n_layer=2,
                        tied_embeddings=True, longrope=True, rope_orig_ctx=8,
                        rope_attn_factor=1.19, arch="phi3"),
    # LFM2-350M: short convolutions (kernel 3) with attention blocks between, tied
    "lfm2": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=4, tied_embeddings=True,
                        conv_layers=(0, 1, 3), conv_kernel=3, rope_freq_base=1e6, arch="lfm2"),
    # Gemma 4 E2B: sliding layers (4 of 6) with narrower heads and fewer K/V heads than the
    # global ones, the last two layers on an earlier layer's K/V with a double-wide
    # feed-forward, per-layer embeddings, layer output scales (frozen, as the rope factors),
    # proportional rope factors
    "gemma4": ModelConfig(**{**BYTES, "n_ff": 64}, n_head=2, n_embd_head=12, n_layer=6,
                          n_ff_layers=(32, 32, 32, 32, 64, 64), n_head_kv_layers=(1, 1, 1, 2, 1, 2),
                          swa_layers=(0, 1, 2, 4), head_dim_swa=8, n_rot_swa=8, sliding_window=4,
                          shared_kv_layers=2, n_embd_per_layer=4, layer_output_scale=True,
                          rope_freqs=True, tied_embeddings=True, rope_freq_base=1e6,
                          rope_freq_base_swa=1e4, final_logit_softcap=30.0, arch="gemma4"),
    # Qwen3.5-0.8B: three gated delta-net layers of every four (fewer query/key heads than
    # value heads, as the 9B), gated attention with heads wider than n_embd / n_head and
    # partial rotary (1/4 there), tied
    "qwen35": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_embd_head=12, n_rot=4, n_layer=4,
                          recurrent_layers=(0, 1, 2), conv_kernel=4, ssm_state=4, ssm_heads=4,
                          ssm_groups=2, rope_sections=(1, 1, 0, 0), tied_embeddings=True,
                          rope_freq_base=1e7, arch="qwen35"),
    # Qwen3-30B-A3B: a mixture of experts (4, 2 taken, weights normalized) after qwen3's
    # attention, untied
    "qwen3moe": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_embd_head=12, n_layer=2,
                            n_expert=4, n_expert_used=2, n_ff_exp=32, rope_freq_base=1e6,
                            arch="qwen3moe"),
    # Qwen1.5-MoE-A2.7B: qwen2's biases, experts unnormalized and a gated shared expert
    "qwen2moe": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=2, n_expert=4,
                            n_expert_used=2, n_ff_exp=32, n_ff_shexp=24, tied_embeddings=True,
                            arch="qwen2moe"),
    # OLMoE-1B-7B: olmo2's full-width QK norms with pre-norms, unnormalized experts, untied
    "olmoe": ModelConfig(**BYTES, n_head=2, n_layer=2, n_expert=4, n_expert_used=2,
                         arch="olmoe"),
    # Mixtral: a llama whose file has expert_count (8 experts, 2 taken)
    "mixtral": ModelConfig(**BYTES, n_head=4, n_head_kv=2, n_layer=2, n_expert=8,
                           n_expert_used=2, rope_freq_base=1e6),
    # LFM2-8B-A1B: lfm2's blocks, the first feed-forward dense, then experts chosen by
    # sigmoids ranked with a balancing bias, tied
    "lfm2moe": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=3, conv_layers=(0, 1),
                           conv_kernel=3, n_expert=4, n_expert_used=2, n_ff_exp=32,
                           expert_gating=2, n_dense_lead=1, tied_embeddings=True,
                           arch="lfm2moe"),
    # Granite 3.1 1B-A400M: granite's scales, experts and a shared expert, tied
    "granitemoe": ModelConfig(**BYTES, n_head=4, n_head_kv=2, n_layer=2, n_expert=4,
                              n_expert_used=2, n_ff_shexp=32, embedding_scale=12.0,
                              residual_scale=0.22, attention_scale=0.015625, logit_scale=8.0,
                              tied_embeddings=True, arch="granitemoe"),
    # Qwen3.5-35B-A3B: qwen35's blocks, 4 experts (2 taken) and a gated shared expert, tied
    "qwen35moe": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_embd_head=12, n_rot=4, n_layer=2,
                             recurrent_layers=(0,), conv_kernel=4, ssm_state=4, ssm_heads=4,
                             ssm_groups=2, rope_sections=(1, 1, 0, 0), n_expert=4,
                             n_expert_used=2, n_ff_exp=32, n_ff_shexp=16, tied_embeddings=True,
                             rope_freq_base=1e7, arch="qwen35moe"),
    # Gemma 4 26B-A4B: the dense GeGLU beside GeGLU experts (gate | up one stack, 4 experts,
    # 2 taken) with the router's and the experts' scales, sliding layers, tied
    "gemma4-moe": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_embd_head=12, n_layer=3,
                              swa_layers=(0, 1), head_dim_swa=8, n_rot_swa=8, sliding_window=4,
                              n_expert=4, n_expert_used=2, n_ff_exp=32, fused_gate_up=True,
                              rope_freqs=True, tied_embeddings=True, rope_freq_base=1e6,
                              rope_freq_base_swa=1e4, final_logit_softcap=30.0, arch="gemma4"),
    # Phi-2: LayerNorm blocks with biases, attention and feed-forward side by side, partial
    # neox rope, an output bias
    "phi2": ModelConfig(**BYTES, n_head=2, n_rot=4, n_layer=2, arch="phi2"),
    # Qwen2.5 converted with --fuse-qkv: Q, K, V and their biases as one attn_qkv
    "qwen2-fused-qkv": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=2, fused_qkv=True,
                                   tied_embeddings=True, rope_freq_base=1e6, arch="qwen2"),
    # Pythia: LayerNorm blocks with biases, a fused attn_qkv, partial neox rope, attention
    # and feed-forward each on its own LayerNorm of the block's input
    "gptneox": ModelConfig(**BYTES, n_head=2, n_rot=4, n_layer=2, parallel_residual=True,
                           arch="gptneox"),
    # Minitron-4B: stablelm's LayerNorm blocks with relu(up)^2 and no biases, half the head
    # roped
    "nemotron": ModelConfig(**BYTES, n_head=2, n_rot=4, n_layer=2, arch="nemotron"),
    # StableLM 2 1.6B: LayerNorms, Q/K/V biases (read from the file), partial rope, SwiGLU
    "stablelm": ModelConfig(**BYTES, n_head=2, n_rot=4, n_layer=2, qkv_bias=True,
                            arch="stablelm"),
    # StarCoder2-3B: the same one branch after the other, grouped-query attention, tied
    "starcoder2": ModelConfig(**BYTES, n_head=4, n_head_kv=2, n_layer=2, tied_embeddings=True,
                              arch="starcoder2"),
    # gpt-oss-20b: Q/K/V and output biases, heads wider than n_embd / n_head, the even
    # layers windowed, attention sinks, YaRN (factor 32 there), experts with biases whose
    # weights are the softmax of the taken logits, swiglu_oai, untied
    "gpt-oss": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_embd_head=12, n_layer=2,
                           sliding_window=4, rope_freq_base=1.5e5, rope_scaling="yarn",
                           rope_freq_scale=0.125, rope_orig_ctx=8, n_expert=4, n_expert_used=2,
                           n_ff_exp=32, arch="gpt-oss"),
    # DeepSeek-V2-Lite: latent attention (queries from attn_q, a latent of 16 and 4 rope
    # dims, heads of 12 + 4 in and 8 out), the first block dense, then 4 experts (2 taken,
    # softmax, not normalized, times 2) and 2 shared experts, YaRN with its log multiplier
    "deepseek2": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_embd_head=20, n_rot=4,
                             n_layer=2, n_expert=4, n_expert_used=2, n_ff_exp=16,
                             n_ff_shexp=32, n_dense_lead=1, expert_weights_scale=2.0,
                             mla_key_length=16, mla_value_length=8, rope_scaling="yarn",
                             rope_freq_scale=0.25, rope_orig_ctx=8, yarn_log_mul=0.5,
                             arch="deepseek2"),
    # GLM-4.5: Q/K/V biases and QK norms, half of each head roped, the first block dense,
    # then 4 experts (2 taken, sigmoids ranked with a bias, normalized, times 2.5) and a
    # shared expert; the Air: neither QK norms nor a dense block, one more layer
    "glm4moe": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=2, n_rot=4, n_expert=4,
                           n_expert_used=2, n_ff_exp=16, n_ff_shexp=16, n_dense_lead=1,
                           expert_gating=2, expert_weights_norm=True, expert_weights_scale=2.5,
                           qkv_bias=True, qk_norm=True, arch="glm4moe"),
    # Phi-3.5-MoE: biased RMS norms, Q/K/V and output biases, 4 experts (2 taken), LongRoPE
    "phimoe": ModelConfig(**BYTES, n_head=2, n_layer=2, n_expert=4, n_expert_used=2,
                          qkv_bias=True, longrope=True, rope_scaling="longrope",
                          rope_orig_ctx=8, arch="phimoe"),
    # Ling-mini-2.0: one attn_qkv, QK norms, half of each head roped, the first block dense,
    # then 4 experts of 32 (2 taken by sigmoids ranked with a bias, normalized, times 2.5)
    # and a shared expert of 32
    "bailingmoe2": ModelConfig(**BYTES, n_head=2, n_layer=2, n_rot=4, n_expert=4,
                               n_expert_used=2, n_ff_exp=32, n_ff_shexp=32, n_dense_lead=1,
                               expert_gating=2, expert_bias=True, expert_weights_norm=True,
                               expert_weights_scale=2.5, arch="bailingmoe2"),
    # Trinity Nano: inputs times sqrt(n_embd), sandwich norms, gated attention, QK norms,
    # three layers of four in a window of 4 (the fourth unroped), the first block dense, then
    # 4 experts of 32 (2 taken by sigmoids ranked with a bias, normalized, times 2.5) and a
    # shared expert
    "afmoe": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=4, n_expert=4,
                         n_expert_used=2, n_ff_exp=32, n_ff_shexp=32, n_dense_lead=1,
                         expert_gating=2, expert_weights_norm=True, expert_weights_scale=2.5,
                         sliding_window=4, rope_freq_base_swa=1e4, rope_freq_base=1e6,
                         tied_embeddings=True, arch="afmoe"),
    # SmallThinker-4B-A0.6B: 4 ReGLU experts of 32 (2 taken by sigmoids, normalized) routed
    # by each block's input; windows (4096: wider than these contexts) on three layers of
    # four, the first of each four unroped
    "smallthinker": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=2, n_expert=4,
                                n_expert_used=2, n_ff_exp=32, expert_gating=2,
                                sliding_window=4096, rope_freq_base=1.5e6,
                                rope_freq_base_swa=1e4, tied_embeddings=True,
                                arch="smallthinker"),
    # Seed-OSS-36B: Q/K/V biases, the feed-forward's norm post_attention_norm, untied
    "seed_oss": ModelConfig(**BYTES, n_head=4, n_head_kv=2, n_layer=2, qkv_bias=True,
                            arch="seed_oss"),
    "glm4moe-air": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_layer=3, n_rot=4, n_expert=4,
                               n_expert_used=2, n_ff_exp=32, n_ff_shexp=32, expert_gating=2,
                               expert_weights_norm=True, qkv_bias=True, tied_embeddings=True,
                               arch="glm4moe"),
    # Mistral Large 3: deepseek2's latent attention (queries through a normed rank of 12) and
    # experts (gate | up one stack, sigmoids ranked with a bias, normalized) and a shared one
    "mistral4": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_embd_head=20, n_rot=4,
                            n_layer=2, n_expert=4, n_expert_used=2, n_ff_exp=32,
                            n_ff_shexp=32, expert_gating=2, expert_bias=True,
                            expert_weights_norm=True, fused_gate_up=True, q_lora_rank=12,
                            mla_key_length=16, mla_value_length=8, arch="mistral4"),
    # GLM-4.7-Flash: queries through a normed rank of 12, sigmoid gating ranked with a bias,
    # weights normalized, one shared expert
    "deepseek2-glm": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_embd_head=20, n_rot=4,
                                 n_layer=2, n_expert=4, n_expert_used=2, n_ff_exp=32,
                                 n_ff_shexp=32, expert_gating=2, expert_bias=True,
                                 expert_weights_norm=True, expert_weights_scale=1.8,
                                 q_lora_rank=12, mla_key_length=16, mla_value_length=8,
                                 arch="deepseek2"),
    # ERNIE-4.5-21B-A3B: ernie4_5's blocks, the first dense, then 4 experts (2 taken,
    # softmax, normalized) ranked with a bias, and a shared expert, tied
    "ernie4_5-moe": ModelConfig(**BYTES, n_head=2, n_head_kv=1, n_embd_head=12, n_layer=3,
                                n_expert=4, n_expert_used=2, n_ff_exp=32, n_ff_shexp=64,
                                n_dense_lead=1, expert_bias=True, tied_embeddings=True,
                                rope_freq_base=5e5, arch="ernie4_5-moe"),
    # GPT-2: learned positions (a table of the context's 16; finetunes take 8 of them),
    # LayerNorms and biases, one fused attn_qkv, no rope, tied
    "gpt2": ModelConfig(**BYTES, n_head=2, n_layer=2, n_positions=16, tied_embeddings=True,
                        arch="gpt2"),
    # Aya Expanse 8B (command-r): parallel blocks on one LayerNorm without bias, logits times
    # logit_scale, tied
    "command-r": ModelConfig(**BYTES, n_head=4, n_head_kv=2, n_layer=2, logit_scale=0.125,
                             tied_embeddings=True, rope_freq_base=4e6, arch="command-r"),
    # Command R7B (cohere2): those blocks, three layers of four windowed and roped, the fourth
    # global without rope
    "cohere2": ModelConfig(**BYTES, n_head=4, n_head_kv=2, n_layer=4, sliding_window=4,
                           logit_scale=0.25, tied_embeddings=True, rope_freq_base=5e4,
                           arch="cohere2"),
    # Granite 3.x: the four scales, untied
    "granite": ModelConfig(**BYTES, n_head=4, n_head_kv=2, n_layer=2, embedding_scale=12.0,
                           residual_scale=0.22, attention_scale=0.015625, logit_scale=8.0,
                           arch="granite"),
}
# the tensors only that family has (a file without one is refused)
OWN_TENSORS = {"qwen2": "attn_q.bias", "glm4": "post_ffw_norm.weight",
               "granitehybrid": "ssm_in.weight", "qwen3": "attn_k_norm.weight",
               "gemma3": "post_ffw_norm.weight",
               "phi3": "attn_qkv.weight", "lfm2": "shortconv.conv.weight",
               "gemma4": "inp_gate.weight", "qwen35": "ssm_conv1d.weight",
               "qwen3moe": "ffn_down_exps.weight", "qwen2moe": "ffn_gate_inp_shexp.weight",
               "olmoe": "ffn_gate_inp.weight", "mixtral": "ffn_up_exps.weight",
               "lfm2moe": "shortconv.in_proj.weight", "granitemoe": "ffn_up_shexp.weight",
               "qwen35moe": "ffn_gate_inp_shexp.weight", "gemma4-moe": "ffn_gate_up_exps.weight",
               "phi2": "attn_norm.bias", "starcoder2": "ffn_norm.bias",
               "stablelm": "attn_k.bias", "gpt-oss": "attn_sinks.weight",
               "deepseek2": "attn_kv_a_mqa.weight", "deepseek2-glm": "attn_q_a_norm.weight",
               "glm4moe": "attn_k_norm.weight", "seed_oss": "post_attention_norm.weight",
               "phimoe": "ffn_norm.bias", "bailingmoe2": "attn_qkv.weight",
               "afmoe": "attn_gate.weight", "mistral4": "ffn_gate_up_exps.weight",
               "smallthinker": "ffn_gate_inp.weight",
               "glm4moe-air": "post_attention_norm.weight",
               "nemotron_h_moe": "ffn_up_shexp.weight", "ernie4_5-moe": "attn_q.weight",
               "gpt2": "attn_qkv.bias", "gptneox": "ffn_norm.bias"}
TABLES = {"llama3": "rope_freqs.weight", "phi3": "rope_factors_long.weight",
          "minicpm": "rope_factors_long.weight", "minicpm3": "rope_factors_short.weight",
          "gemma4": "rope_freqs.weight", "lfm2moe": "blk.1.exp_probs_b.bias",
          "glm4moe-air": "blk.1.exp_probs_b.bias", "phimoe": "rope_factors_short.weight",
          "gemma4-moe": "rope_freqs.weight"}


def family_values(cfg, seed=1):
    """init_parameters with random norm weights and biases (init makes them 1 and 0; gpt-oss's
    stacks of the experts' biases too), and qwen35's ssm_a negative, as -exp(A_log) is."""
    rng = np.random.default_rng(seed)
    return {k: v if not (vector_like(k, v.shape) or k.endswith(".bias")) else
            rng.uniform(0.5, 1.5, v.shape).astype(np.float32) * (-1 if k.endswith("ssm_a") else 1)
            for k, v in init_parameters(cfg, seed).items()}


def trained_adapter(cfg, ranks, alpha):
    """A fresh adapter (seed 3) with random B (uniform in [-0.3, 0.3)) in place of zeros, as
    a trained one has: its pairs move the logits."""
    adapter = lora.init_adapter(cfg, ranks, alpha, seed=3)
    rng = np.random.default_rng(4)
    adapter.tensors = {n: t if n.endswith(".lora_a") else
                       rng.uniform(-0.3, 0.3, t.shape).astype(np.float32)
                       for n, t in adapter.tensors.items()}
    return adapter


def family_file(path, cfg, values=None, config_json=True):
    """A model file of `cfg`; without config_json as llama.cpp's converter writes it."""
    values = family_values(cfg) if values is None else values
    if config_json:
        save_model(path, cfg, values, ByteTokenizer())
    else:
        meta = gguf_llama.model_metadata(path, cfg, ByteTokenizer(), None)
        del meta[gguf_llama.K_CONFIG_JSON]
        gguf_file.write_gguf(path, meta, values)
    return path


def float64_logits(cfg, values, tokens, **options):
    """The logits (1, n_ctx, n_vocab) of one row of `tokens` at positions 0.. in float64
    NumPy, from a frozen graph of cfg on `values` (build_train_graph's `options`)."""
    g = build_train_graph(cfg, values, 1, frozen=True, **options)
    plan = NumpyBackend(np.float64).plan(g.logits)
    plan.run({g.tokens: tokens, g.positions: np.arange(cfg.n_ctx, dtype=np.int32)})
    return g.read_logits(plan)


def invoke(*args):
    return CliRunner().invoke(cli, ["--backend", "numpy", *args], env={ENV_VAR: None})


def float32_fields(cfg):
    """cfg's fields with floats as the file's float32 keys hold them (n_rot as a number)."""
    return {k: np.float32(v) if isinstance(v, float) else v
            for k, v in dataclasses.asdict(dataclasses.replace(cfg, n_rot=cfg.rot)).items()}


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_family_file_has_its_keys_and_tensors_and_reads_back_exactly(arch, tmp_path):
    cfg = FAMILIES[arch]
    values = family_values(cfg)
    path = family_file(tmp_path / "m.gguf", cfg, values)
    reader = GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == cfg.arch
    keys = set(reader.fields)
    assert f"{cfg.arch}.embedding_length" in keys
    assert cfg.arch == "llama" or "llama.embedding_length" not in keys
    defaults = ModelConfig()
    for field, template in cfg.family.keys.items():     # every one set here is written
        if getattr(cfg, field) != getattr(defaults, field) or field in cfg.family.required \
                or field in cfg.family.absent:
            assert template.format(arch=cfg.arch) in keys, field
    assert {t.name for t in reader.tensors} == set(parameter_shapes(cfg))
    got_cfg, got, _ = load_model(path)
    assert got_cfg == cfg and got.keys() == values.keys()
    for name, value in values.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    # as llama.cpp's converter writes it: the <arch>.* keys say it all (floats as float32)
    plain, _, _ = load_model(family_file(tmp_path / "plain.gguf", cfg, values, False))
    assert float32_fields(plain) == float32_fields(cfg)


@pytest.mark.parametrize("arch", OWN_TENSORS)
def test_a_family_file_without_its_own_tensor_is_refused_naming_it(arch, tmp_path):
    cfg = FAMILIES[arch]
    name = f"blk.1.{OWN_TENSORS[arch]}"
    values = {k: v for k, v in family_values(cfg).items() if k != name}
    meta = gguf_llama.model_metadata(tmp_path / "m.gguf", cfg, ByteTokenizer(), None)
    gguf_file.write_gguf(tmp_path / "m.gguf", meta, values)
    with pytest.raises(GGUFError, match=f"tensor {name} is missing"):
        load_model(tmp_path / "m.gguf")


def test_a_granite_file_without_its_logit_scale_is_refused_as_llama_cpp_refuses_it(tmp_path):
    cfg = FAMILIES["granite"]
    meta = gguf_llama.model_metadata(tmp_path / "m.gguf", cfg, ByteTokenizer(), None)
    del meta["granite.logit_scale"], meta[gguf_llama.K_CONFIG_JSON]
    gguf_file.write_gguf(tmp_path / "m.gguf", meta, family_values(cfg))
    with pytest.raises(GGUFError, match="required key granite.logit_scale is missing"):
        load_model(tmp_path / "m.gguf")
    # a scale of 0 is unset, as llama.cpp reads it: the logits are not divided
    meta["granite.logit_scale"] = (0.0, meta["granite.residual_scale"][1])
    gguf_file.write_gguf(tmp_path / "m.gguf", meta, family_values(cfg))
    assert load_model(tmp_path / "m.gguf")[0].logit_scale == 1.0


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_family_checkpoint_round_trips(arch, tmp_path):
    cfg = FAMILIES[arch]
    values = family_values(cfg)
    moments = {name: (np.full_like(v, 0.5), np.full_like(v, 0.25)) for name, v in values.items()}
    save_checkpoint(tmp_path / "c.gguf", cfg, values, ByteTokenizer(), moments, train_state(3))
    got_cfg, got, _, opt_state, state = load_checkpoint(tmp_path / "c.gguf")
    assert got_cfg == cfg and state.step == 3 and got.keys() == values.keys()
    for name in values:
        np.testing.assert_array_equal(got[name], values[name], err_msg=name)
        np.testing.assert_array_equal(opt_state[name][1], moments[name][1], err_msg=name)


@pytest.mark.parametrize("backend_name", ["numpy", "wgpu"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_a_fresh_lora_adapter_leaves_every_family_s_logits_as_the_base_s(arch, backend_name,
                                                                         request):
    backend = request.getfixturevalue("wgpu") if backend_name == "wgpu" else NumpyBackend()
    cfg = dataclasses.replace(FAMILIES[arch], n_ctx=8)
    values = family_values(cfg)
    adapter = lora.init_adapter(cfg, lora.lora_ranks(cfg, 2), 4.0)
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab, (2, cfg.n_ctx))
    logits = []
    for kw in ({}, {"lora": adapter}):
        g = build_train_graph(cfg, values, 2, **kw)
        plan = backend.plan(g.logits)
        plan.run({g.tokens: tokens, g.positions: np.arange(cfg.n_ctx, dtype=np.int32)})
        logits.append(g.read_logits(plan))
    np.testing.assert_array_equal(logits[1], logits[0])


def finetune(tmp_path, cfg, out, *options):
    """A 2-step finetune of a base of `cfg` written in tmp_path; the base's path."""
    base = family_file(tmp_path / "base.gguf", cfg)
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40)
    r = invoke("finetune", str(base), str(text), "--batch", "2", "--lr", "1e-2", "--warmup", "2",
               "--steps", "2", "--n-ctx", "8", *options, "--out", str(out))
    assert r.exit_code == 0, r.output
    return base


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_family_finetunes_with_lora_and_merges_and_quantizes_keeping_its_arch(arch, tmp_path):
    cfg = FAMILIES[arch]
    adapter = tmp_path / "adapter.gguf"
    base = finetune(tmp_path, cfg, adapter)
    assert GGUFReader(adapter).fields["general.architecture"].contents() == cfg.arch
    loaded = lora.load_adapter(adapter, cfg)
    assert any(np.abs(t).max() > 0 for n, t in loaded.tensors.items() if n.endswith(".lora_b"))
    assert not any(n.endswith(".bias.lora_a") for n in loaded.tensors)   # matrices only
    # llama.cpp refuses it as well
    other = ("qwen3moe" if cfg.n_expert else "qwen3") if cfg.arch == "llama" else "llama"
    with pytest.raises(GGUFError, match=f"is '{cfg.arch}', but the base model is a '{other}'"):
        lora.load_adapter(adapter, dataclasses.replace(cfg, arch=other))
    merged = tmp_path / "merged.gguf"
    r = invoke("merge", str(base), str(adapter), "--out", str(merged))
    assert r.exit_code == 0, r.output
    merged_cfg, values, _ = load_model(merged)
    _, base_values, _ = load_model(base)
    assert merged_cfg == cfg
    for name, value in base_values.items():      # norms are frozen: not adapted, not changed
        if value.ndim == 1:
            np.testing.assert_array_equal(values[name], value, err_msg=name)
    quantized = tmp_path / "q8.gguf"
    r = invoke("quantize", str(merged), str(quantized), "--type", "q8_0")
    assert r.exit_code == 0, r.output
    q_cfg, q_values, _ = load_model(quantized, keep_quantized=True)
    down = next(n for n in q_values if "ffn_down" in n)          # or the experts' stack
    assert q_cfg == cfg and q_values[down].dtype == "q8_0"   # rows of 32


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_full_finetune_of_a_family_trains_its_own_weights(arch, tmp_path):
    cfg = FAMILIES[arch]
    out = tmp_path / "full.gguf"
    base = finetune(tmp_path, cfg, out, "--full")
    got_cfg, values, _ = load_model(out)
    _, before, _ = load_model(base)
    assert got_cfg == cfg
    for name in (f"blk.0.{OWN_TENSORS[arch]}",) if arch in OWN_TENSORS else ():
        assert np.abs(values[name] - before[name]).max() > 1e-4, name
    if arch in TABLES:      # frozen rope factors come back unchanged
        np.testing.assert_array_equal(values[TABLES[arch]], before[TABLES[arch]])


def test_gemma_3_s_262144_token_q8_0_embedding_finetunes_on_the_device_as_on_numpy(wgpu):
    """Gemma-3-270M's tied embedding, 262 144 x 640 in q8_0 (178 MB: more than one 128 MiB
    binding, read in parts), under a LoRA step: logits in chunks, the loss and every
    gradient as the NumPy backend's (the output product's backward sums 262 144 rows, more
    than one lavapipe loop runs: ops/quant.py cuts it)."""
    import ggwgpu as gg
    from ggwgpu.quant import quantize
    cfg = ModelConfig(n_vocab=262144, n_embd=640, n_head=1, n_head_kv=1, n_embd_head=64,
                      n_layer=1, n_ff=64, n_ctx=4, tied_embeddings=True, sliding_window=512,
                      arch="gemma3")
    rng = np.random.default_rng(0)
    values = {n: quantize((rng.standard_normal(s) * 0.02).astype(np.float32), "q8_0")
              if len(s) == 2 else rng.uniform(0.5, 1.5, s).astype(np.float32)
              for n, s in parameter_shapes(cfg).items()}
    adapter = lora.init_adapter(cfg, lora.lora_ranks(cfg, 2), 4.0)
    for name, t in adapter.tensors.items():
        if name.endswith(".lora_b"):
            adapter.tensors[name] = rng.uniform(-0.01, 0.01, t.shape).astype(np.float32)
    tokens, targets = rng.integers(0, cfg.n_vocab, (2, 1, cfg.n_ctx))
    results = []
    for backend in (NumpyBackend(), wgpu):
        g = build_train_graph(cfg, values, 1, lora=adapter,
                              max_logits_bytes=4 * cfg.n_vocab * 2)
        grads = gg.build_backward(g.loss, list(g.params.values()), recompute=g.recompute)
        plan = backend.plan([g.loss, *grads.values()])
        plan.run({**g.feeds(tokens, targets), g.positions: np.arange(cfg.n_ctx, dtype=np.int32)})
        results.append((plan.read(g.loss)[0], {p.name: plan.read(d) for p, d in grads.items()}))
    (loss, ref), (dev_loss, dev) = results
    assert len(g.logits) == 2 and abs(dev_loss - loss) <= 1e-5 * loss
    for name in ref:
        err = np.sum((dev[name] - ref[name]) ** 2) / np.sum(ref[name] ** 2)
        assert err < 1e-8, f"{name}: nmse {err:.2e}"


def family_loss_and_grads(backend, cfg, precision, packed):
    import ggwgpu as gg
    rng = np.random.default_rng(0)
    g = build_train_graph(cfg, family_values(cfg), 2, precision=precision, packed=packed)
    grads = gg.build_backward(g.loss, list(g.params.values()))
    plan = backend.plan([g.loss, *grads.values()])
    tokens, targets = (rng.integers(0, cfg.n_vocab, (2, cfg.n_ctx)) for _ in range(2))
    if packed:      # 3 sequences a row: gemma3's window (4) cuts the longest
        plan.run(g.feeds(tokens, targets, np.repeat([0, 1, 2, 3, 3, 4], [3, 7, 6, 5, 5, 6])
                         .reshape(2, cfg.n_ctx)))
    else:
        plan.write(g.positions, np.arange(cfg.n_ctx, dtype=np.int32))
        plan.run(g.feeds(tokens, targets))
    return plan.read(g.loss)[0], {p.name: plan.read(d) for p, d in grads.items()}


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_trains_on_the_device_as_on_numpy_in_f32_and_f16_rows_and_packed(
        arch, packed, wgpu):
    """The device against NumPy in f32 (gradients to 1e-8) and in f16, where NumPy stores
    halves as the device does (the rounding of halves grows through gemma3's six layers:
    6.5e-5 measured, 1e-6 elsewhere); f16's loss follows f32's. (f16's gradients against
    f32's depend on the random model's conditioning: granite's 1/64 attention scale makes
    attn_k's gradient a near-cancellation, 2e-2 off in halves on both backends alike.)"""
    from ggwgpu.testing import nmse
    cfg = FAMILIES[arch]
    loss32, grads32 = family_loss_and_grads(NumpyBackend(), cfg, "f32", packed)
    loss_dev, grads_dev = family_loss_and_grads(wgpu, cfg, "f32", packed)
    loss16, grads16 = family_loss_and_grads(NumpyBackend(), cfg, "f16", packed)
    loss16_dev, grads16_dev = family_loss_and_grads(wgpu, cfg, "f16", packed)
    assert abs(loss_dev - loss32) <= 1e-5 * loss32
    assert abs(loss16 - loss32) <= 1e-3 * loss32 and abs(loss16_dev - loss16) <= 1e-4 * loss16
    for name, g in grads32.items():
        assert nmse(grads_dev[name], g) < 1e-8, name
        assert nmse(grads16_dev[name], grads16[name]) < 1e-3, name


@pytest.mark.parametrize("arch, base_type", [("qwen3moe", "q8_0"), ("qwen3moe", "q4_0"),
                                             ("gpt-oss", "mxfp4")])
def test_lora_on_quantized_experts_trains_on_the_device_as_on_numpy(wgpu, arch, base_type):
    """A LoRA step on a mixture of experts whose stacks stay in their block type (as
    `finetune` loads a quantized base; gpt-oss's published MXFP4): the experts' products
    read the blocks in the kernel (mul_mat_id_q), their inputs' gradients too
    (mul_mat_id_q_back), on both backends."""
    import ggwgpu as gg
    from ggwgpu.quant import quantize_model
    from ggwgpu.testing import nmse
    cfg = ModelConfig(**{**BYTES, "n_embd": 32}, n_head=2, n_layer=1 if arch == "qwen3moe" else 2,
                      n_expert=4, n_expert_used=2, n_ff_exp=32, arch=arch,
                      sliding_window=4 if arch == "gpt-oss" else 0)
    base = quantize_model(family_values(cfg), base_type)
    assert base["blk.0.ffn_up_exps.weight"].dtype == base_type
    adapter = lora.init_adapter(cfg, lora.lora_ranks(cfg, 2), 4.0, seed=3)
    rng = np.random.default_rng(4)      # lora_b not 0
    adapter.tensors = {n: t + rng.uniform(-0.1, 0.1, t.shape).astype(np.float32)
                       for n, t in adapter.tensors.items()}
    results = []
    for backend in (NumpyBackend(), wgpu):
        g = build_train_graph(cfg, base, 2, lora=adapter)
        grads = gg.build_backward(g.loss, list(g.params.values()))
        assert {"mul_mat_id_q", "mul_mat_id_q_back"} <= {
            n.op for n in topo_order(list(grads.values()))}
        plan = backend.plan([g.loss, *grads.values()])
        tokens = np.random.default_rng(0).integers(0, cfg.n_vocab, (2, cfg.n_ctx + 1))
        plan.write(g.positions, np.arange(cfg.n_ctx, dtype=np.int32))
        plan.run(g.feeds(tokens[:, :-1], tokens[:, 1:]))
        results.append((plan.read(g.loss)[0], {p.name: plan.read(d) for p, d in grads.items()}))
    (loss, grads), (loss_dev, grads_dev) = results
    assert abs(loss_dev - loss) <= 1e-5 * loss
    for name, g in grads.items():
        assert nmse(grads_dev[name], g) < 1e-8, name


@pytest.mark.parametrize("changes, words", [
    ({"n_expert_used": 5}, "n_expert_used 5 must be 1 .. n_expert 4"),
    ({"n_expert_used": 0}, "n_expert_used 0 must be 1 .. n_expert 4"),
    ({"expert_gating": 3}, "expert_gating 3 is not one of"),
    ({"arch": "qwen3"}, "llama.cpp's qwen3 has no mixture of experts"),
    ({"n_expert": 0, "n_expert_used": 0}, "qwen3moe needs n_expert > 0")])
def test_expert_hyper_parameters_that_make_no_model_are_refused(changes, words):
    with pytest.raises(ShapeError, match=words):
        dataclasses.replace(FAMILIES["qwen3moe"], **changes)


def test_a_mixture_of_experts_file_without_its_expert_count_is_refused(tmp_path):
    cfg = FAMILIES["qwen3moe"]
    meta = gguf_llama.model_metadata(tmp_path / "m.gguf", cfg, ByteTokenizer(), None)
    del meta[gguf_llama.K_CONFIG_JSON], meta["qwen3moe.expert_count"]
    gguf_file.write_gguf(tmp_path / "m.gguf", meta, family_values(cfg))
    with pytest.raises(GGUFError, match="qwen3moe.expert_count"):
        load_model(tmp_path / "m.gguf")


def test_fused_gate_and_up_expert_stacks_read_as_the_two_they_hold(tmp_path):
    """A file whose experts' gate and up are one stack (gemma4's, the converter's
    --fuse-gate-up-exps) reads as such (fused_gate_up) and gives the logits of the file
    with the two stacks; one with both kinds is refused."""
    from ggwgpu.testing import reference_logits
    cfg = dataclasses.replace(FAMILIES["qwen3moe"], n_ctx=8)
    values = family_values(cfg)
    fused = dict(values)
    for i in range(cfg.n_layer):
        b = f"blk.{i}."
        fused[b + "ffn_gate_up_exps.weight"] = np.concatenate(
            [fused.pop(b + "ffn_gate_exps.weight"), fused.pop(b + "ffn_up_exps.weight")], axis=1)
    fused_cfg = dataclasses.replace(cfg, fused_gate_up=True)
    got_cfg, got, _ = load_model(write_tensors(tmp_path / "m.gguf", fused_cfg, fused))
    assert float32_fields(got_cfg) == float32_fields(fused_cfg) and got.keys() == fused.keys()
    tokens = np.random.default_rng(2).integers(0, cfg.n_vocab, (1, cfg.n_ctx))
    np.testing.assert_allclose(float64_logits(got_cfg, got, tokens)[0],
                               reference_logits(cfg, values, tokens[0]), rtol=1e-6, atol=1e-7)
    fused["blk.1.ffn_gate_exps.weight"] = values["blk.1.ffn_gate_exps.weight"]
    with pytest.raises(GGUFError, match="unexpected tensor blk.1.ffn_gate_exps.weight"):
        load_model(write_tensors(tmp_path / "both.gguf", fused_cfg, fused))


@pytest.mark.parametrize("config", ["llama3", "qwen2", "phi2", "lfm2", "granitehybrid"])
def test_a_fused_attn_qkv_reads_as_the_three_it_holds(config, tmp_path):
    """A file whose Q, K and V (and their biases) are one attn_qkv (the converter's
    --fuse-qkv; Phi-2's older checkpoints) reads as such (fused_qkv), gives the logits of the
    file with the three, finetunes with a pair on attn_qkv, and writes it back fused; one with
    both kinds is refused, as a family llama.cpp reads no fused attn_qkv of."""
    from ggwgpu.testing import reference_logits
    cfg = dataclasses.replace(FAMILIES[config], n_ctx=8)
    values = family_values(cfg)
    fused = dict(values)
    for i in range(cfg.n_layer):
        for kind in ("weight", "bias"):
            parts = [f"blk.{i}.attn_{m}.{kind}" for m in "qkv"]
            if parts[0] in values:
                fused[f"blk.{i}.attn_qkv.{kind}"] = np.concatenate([fused.pop(n) for n in parts])
    fused_cfg = dataclasses.replace(cfg, fused_qkv=True)
    got_cfg, got, _ = load_model(write_tensors(tmp_path / "m.gguf", fused_cfg, fused))
    assert float32_fields(got_cfg) == float32_fields(fused_cfg) and got.keys() == fused.keys()
    tokens = np.random.default_rng(2).integers(0, cfg.n_vocab, (1, cfg.n_ctx))
    np.testing.assert_allclose(float64_logits(got_cfg, got, tokens)[0],
                               reference_logits(cfg, values, tokens[0]), rtol=1e-6, atol=1e-7)
    assert "blk.0.attn_qkv.weight" in lora.lora_ranks(got_cfg, 2) or config in ("lfm2",
                                                                              "granitehybrid")
    attention = next(i for i in range(cfg.n_layer) if cfg.family.attends(cfg, i))
    both = fused | {f"blk.{attention}.attn_q.weight": values[f"blk.{attention}.attn_q.weight"]}
    with pytest.raises(GGUFError, match=f"unexpected tensor blk.{attention}.attn_q.weight"):
        load_model(write_tensors(tmp_path / "both.gguf", fused_cfg, both))
    with pytest.raises(ShapeError, match="ggwgpu's hunyuan-dense reads no fused attn_qkv"):
        dataclasses.replace(FAMILIES["hunyuan-dense"], fused_qkv=True)
    hunyuan = FAMILIES["hunyuan-dense"]
    path = write_tensors(tmp_path / "hunyuan.gguf", hunyuan, family_values(hunyuan) | {
        "blk.0.attn_qkv.weight": np.ones((32, 16), np.float32)})
    with pytest.raises(GGUFError, match="tensor blk.0.attn_qkv.weight: ggwgpu's hunyuan-dense "
                                        "reads no fused attn_qkv, as llama.cpp's reads none"):
        load_model(path)


@pytest.mark.parametrize("arch", FAMILIES)
def test_packed_sequences_each_get_the_reference_logits_of_their_own(arch):
    """Two sequences in one packed row (each at positions from 0, seeing only itself; gemma3's
    window of 4 counted within the sequence) give the float64 reference's logits of each."""
    from ggwgpu.testing import reference_logits
    cfg = FAMILIES[arch]
    values = family_values(cfg)
    tokens = np.random.default_rng(2).integers(0, cfg.n_vocab, (1, cfg.n_ctx))
    segments = np.repeat([0, 1], [7, cfg.n_ctx - 7])[None]
    g = build_train_graph(cfg, values, 1, packed=True, frozen=True)
    plan = NumpyBackend(np.float64).plan(g.logits)
    plan.run({k: v for k, v in g.feeds(tokens, tokens, segments).items()
              if k is not g.targets and k is not g.weights})
    got = g.read_logits(plan)[0]
    for part in (slice(0, 7), slice(7, cfg.n_ctx)):     # (phi3's factors: by n_ctx, not
        want = reference_logits(cfg, values, tokens[0, part])   # by the sequence's length)
        np.testing.assert_allclose(got[part], want, rtol=1e-6, atol=1e-7)   # phi3: an f32 1.19


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("flash", [False, True], ids=["unfused", "flash"])
def test_attention_sinks_give_the_reference_logits_fused_or_not(flash, packed):
    """gpt-oss's sinks: a first column of the scores (unfused), or a first key that only
    each head's sink, put in an extra element of q, reaches (fused); windowed layers and
    packed sequences keep it in sight."""
    from ggwgpu.testing import reference_logits
    cfg = FAMILIES["gpt-oss"]
    values = family_values(cfg)
    tokens = np.random.default_rng(2).integers(0, cfg.n_vocab, (1, cfg.n_ctx))
    g = build_train_graph(cfg, values, 1, flash=flash, packed=packed, frozen=True)
    plan = NumpyBackend(np.float64).plan(g.logits)
    segments = np.repeat([0, 1], [7, cfg.n_ctx - 7])[None] if packed else None
    feeds = g.feeds(tokens, tokens, segments)
    if not packed:
        feeds[g.positions] = np.arange(cfg.n_ctx, dtype=np.int32)
    plan.run({k: v for k, v in feeds.items() if k is not g.targets and k is not g.weights})
    got = g.read_logits(plan)[0]
    for part in (slice(0, 7), slice(7, cfg.n_ctx)) if packed else (slice(0, cfg.n_ctx),):
        np.testing.assert_allclose(got[part], reference_logits(cfg, values, tokens[0, part]),
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
@pytest.mark.parametrize("arch", ["llama3", "gemma3", "phi3"])
def test_a_family_finetune_resumed_from_its_checkpoint_equals_an_uninterrupted_run(
        arch, full, tmp_path):
    """Checkpoints keep the run (a full one's frozen rope tables included)."""
    import json
    cfg = FAMILIES[arch]
    base = family_file(tmp_path / "base.gguf", cfg)
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 40)
    options = ["finetune", str(base), str(text), "--batch", "2", "--lr", "1e-2", "--warmup",
               "2", "--n-ctx", "8", *(["--full"] if full else [])]

    def losses(log):
        return [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    r = invoke(*options, "--steps", "4", "--log", str(tmp_path / "straight.jsonl"),
               "--out", str(tmp_path / "a.gguf"))
    assert r.exit_code == 0, r.output
    ckpt, log = tmp_path / "ckpt.gguf", tmp_path / "log.jsonl"
    for args in (("--checkpoint-out", str(ckpt)), ("--checkpoint-in", str(ckpt))):
        r = invoke(*options, *args, "--steps", "2", "--log", str(log),
                   "--out", str(tmp_path / "b.gguf"))
        assert r.exit_code == 0, r.output
    assert losses(log) == losses(tmp_path / "straight.jsonl")


def test_lora_targets_are_the_matrices_each_block_has():
    """lfm2's convolution blocks get pairs on in_proj and out_proj (conv_in, conv_out), its
    attention blocks on Q, K, V and the output; phi3 on its fused attn_qkv; a target a
    family lacks is refused by name."""
    ranks = lora.lora_ranks(FAMILIES["lfm2"], 2)
    assert {n for n in ranks if n.startswith("blk.1.")} == {
        f"blk.1.{w}.weight" for w in ("shortconv.in_proj", "shortconv.out_proj", "ffn_gate",
                                      "ffn_down", "ffn_up")}
    assert {n for n in ranks if n.startswith("blk.2.attn")} == {
        f"blk.2.attn_{w}.weight" for w in ("q", "k", "v", "output")}
    assert "blk.0.attn_qkv.weight" in lora.lora_ranks(FAMILIES["phi3"], 2)
    with pytest.raises(ValueError, match="a phi3 has no attn_q.weight for a LoRA pair"):
        lora.lora_ranks(FAMILIES["phi3"], 2, {"wq": 4})
    # deepseek2: llama.cpp adapts attn_output and the feed-forwards, not attn_q (nor the
    # latent attention's other products, no target) or the output matrix
    deepseek2 = lora.lora_ranks(FAMILIES["deepseek2"], 2)
    assert {n for n in deepseek2 if n.startswith("blk.1.")} == {
        f"blk.1.{w}.weight" for w in ("attn_output", "ffn_gate_exps", "ffn_down_exps",
                                      "ffn_up_exps", "ffn_gate_shexp", "ffn_down_shexp",
                                      "ffn_up_shexp")}
    assert "output.weight" not in deepseek2 and "blk.0.ffn_gate.weight" in deepseek2
    with pytest.raises(ValueError, match="llama.cpp's deepseek2 applies no LoRA pair to "
                                         "output.weight"):
        lora.lora_ranks(FAMILIES["deepseek2"], 2, {"out": 4})
    gemma4 = lora.lora_ranks(FAMILIES["gemma4"], 2)
    assert {"blk.0.inp_gate.weight", "blk.0.proj.weight", "blk.3.attn_k.weight"} <= set(gemma4)
    assert "blk.4.attn_k.weight" not in gemma4 and "blk.5.attn_v.weight" not in gemma4
    qwen35 = lora.lora_ranks(FAMILIES["qwen35"], 2)
    assert {n for n in qwen35 if n.startswith("blk.0.")} == {
        f"blk.0.{w}.weight" for w in ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta",
                                       "ssm_out", "ffn_gate", "ffn_down", "ffn_up")}
    assert {n for n in qwen35 if n.startswith("blk.3.")} == {
        f"blk.3.{w}.weight" for w in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                       "ffn_down", "ffn_up")}


def test_lora_pairs_on_the_experts_add_alpha_over_r_times_b_a_to_each_expert():
    """The experts' stacks take a pair per expert (llama.cpp's build_lora_mm_id), the router
    none; a token through expert e computes W[e] x + alpha / r * B[e] (A[e] x): the logits
    of the base whose stacks hold W[e] + alpha / r * B[e] A[e], computed here by hand."""
    from ggwgpu.testing import reference_logits
    cfg = dataclasses.replace(FAMILIES["qwen2moe"], n_ctx=8)
    ranks = lora.lora_ranks(cfg, 2)
    assert {n for n in ranks if n.startswith("blk.0.ffn")} == {
        f"blk.0.ffn_{w}.weight" for w in ("gate_exps", "up_exps", "down_exps", "gate_shexp",
                                          "up_shexp", "down_shexp")}
    adapter = trained_adapter(cfg, ranks, 6.0)
    a, b = (adapter.tensors["blk.1.ffn_down_exps.weight" + s] for s in (".lora_a", ".lora_b"))
    assert a.shape == (4, 2, 32) and b.shape == (4, 16, 2)      # (experts, r, in), (.., out, r)
    values = family_values(cfg)
    by_hand = {n: v + 3.0 * np.matmul(adapter.tensors[n + ".lora_b"],
                                      adapter.tensors[n + ".lora_a"])
               if n + ".lora_a" in adapter.tensors else v for n, v in values.items()}
    tokens = np.random.default_rng(2).integers(0, cfg.n_vocab, (1, cfg.n_ctx))
    np.testing.assert_allclose(float64_logits(cfg, values, tokens, adapters=(adapter,))[0],
                               reference_logits(cfg, by_hand, tokens[0]), rtol=1e-6, atol=1e-7)


def test_a_merge_gives_the_adapted_logits_where_experts_scale_their_outputs():
    """gemma4's experts' outputs are times ffn_down_exps.scale, which a pair's term escapes
    (llama.cpp's order): merged, the change is divided by it, so the merged model computes
    what the adapter does."""
    cfg = dataclasses.replace(FAMILIES["gemma4-moe"], n_ctx=8)
    values = family_values(cfg)
    assert not np.allclose(values["blk.0.ffn_down_exps.scale"], 1.0)
    adapter = trained_adapter(cfg, lora.lora_ranks(cfg, 2), 4.0)
    tokens = np.random.default_rng(2).integers(0, cfg.n_vocab, (1, cfg.n_ctx))
    logits = [float64_logits(c, v, tokens, adapters=adapters)[0] for c, v, adapters in
              ((cfg, values, (adapter,)), (*lora.merge(cfg, values, [adapter]), ()))]
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-6)


def test_a_stablelm_file_says_by_its_tensors_whether_q_k_v_have_biases(tmp_path):
    """StableLM 2's files have attn_q/k/v.bias, StableLM 3B's not: either reads as written
    (ModelConfig.qkv_bias), with and without ggwgpu's own key; the per-head QK LayerNorms of
    StableLM 2 12B are refused by name."""
    for biased in (True, False):
        cfg = dataclasses.replace(FAMILIES["stablelm"], qkv_bias=biased)
        values = family_values(cfg)
        assert ("blk.0.attn_q.bias" in values) == biased
        for config_json in (True, False):
            got_cfg, got, _ = load_model(family_file(tmp_path / f"{biased}{config_json}.gguf",
                                                     cfg, values, config_json))
            assert got_cfg.qkv_bias == biased and got.keys() == values.keys()
    norms = values | {"blk.0.attn_q_norm.weight": np.ones((2, 8), np.float32)}
    with pytest.raises(GGUFError, match="per-head LayerNorms of Q and K"):
        load_model(write_tensors(tmp_path / "norms.gguf", cfg, norms))


def write_tensors(path, cfg, values):
    meta = gguf_llama.model_metadata(path, cfg, ByteTokenizer(), None)
    del meta[gguf_llama.K_CONFIG_JSON]
    gguf_file.write_gguf(path, meta, values)
    return path


def test_a_gemma4_file_s_unused_shared_kv_weights_are_dropped_and_its_fused_qkv_refused(
        tmp_path):
    """A shared-KV layer's own attn_k / attn_v / attn_k_norm (llama.cpp loads them where a
    file has them, and never reads them) are left out; a fused attn_qkv is refused by name,
    an expert's tensor in a file without expert_count as one the model lacks."""
    cfg = FAMILIES["gemma4"]
    values = family_values(cfg)
    unused = {f"blk.5.attn_{n}.weight": np.ones(s, np.float32)
              for n, s in (("k", (24, 16)), ("v", (24, 16)), ("k_norm", (12,)))}
    got_cfg, got, _ = load_model(write_tensors(tmp_path / "m.gguf", cfg, values | unused))
    assert float32_fields(got_cfg) == float32_fields(cfg) and got.keys() == values.keys()
    for name, what in (("ffn_gate_inp", "unexpected tensor blk.1.ffn_gate_inp.weight: a gemma4 "
                                         "with these hyper-parameters has no such parameter"),
                       ("attn_qkv", "tensor blk.1.attn_qkv.weight: ggwgpu's gemma4 does not "
                                    "support a fused attn_qkv")):
        path = write_tensors(tmp_path / f"{name}.gguf", cfg,
                             values | {f"blk.1.{name}.weight": np.ones((4, 16), np.float32)})
        with pytest.raises(GGUFError, match=what):
            load_model(path)
    # the layer a shared one reads must be of its kind (llama.cpp's reuse takes the last
    # sliding and the last global layer before the shared ones)
    with pytest.raises(ValueError, match="layer 4 would attend to the K/V of layer 2, which "
                                         "is not a sliding one"):
        dataclasses.replace(cfg, swa_layers=(0, 1, 3, 4))


def test_an_ernie4_5_file_s_output_biases_are_read_past(tmp_path):
    """llama.cpp's ernie4_5 loads attn_output.bias where a file has one and never adds it:
    reading drops it, and the model computes as without it."""
    cfg = FAMILIES["ernie4_5"]
    values = family_values(cfg)
    biases = {f"blk.{i}.attn_output.bias": np.full(16, 5.0, np.float32) for i in range(2)}
    got_cfg, got, _ = load_model(write_tensors(tmp_path / "m.gguf", cfg, values | biases))
    assert float32_fields(got_cfg) == float32_fields(cfg) and got.keys() == values.keys()


def test_a_mistral3_file_s_biases_are_refused_and_its_temperature_counts_in_its_context(
        tmp_path):
    """llama.cpp adds a mistral3's biases where a file has them (the published models have
    none): refused by name. Without an original context the attention temperature counts in
    the trained one (llama.cpp's n_ctx_orig_yarn), and the model computes the temperature
    only past it."""
    cfg = FAMILIES["mistral3"]
    values = family_values(cfg)
    for name, what in (("attn_output.bias", "an attention output bias"),
                       ("ffn_up.bias", "feed-forward biases")):
        path = write_tensors(tmp_path / f"{name}.gguf", cfg,
                             values | {f"blk.0.{name}": np.ones(16, np.float32)})
        with pytest.raises(GGUFError, match=f"tensor blk.0.{name}: ggwgpu's mistral3 does not "
                                            f"support {what}"):
            load_model(path)
    plain = dataclasses.replace(cfg, rope_scaling="linear", rope_freq_scale=1.0,
                                rope_orig_ctx=0, attn_temp_scale=0.0)
    path = family_file(tmp_path / "t.gguf", plain, values, config_json=False)
    meta = gguf_llama.model_metadata(path, plain, ByteTokenizer(), None)
    del meta[gguf_llama.K_CONFIG_JSON]
    meta["mistral3.attention.temperature_scale"] = (0.1, GGUFValueType.FLOAT32)
    gguf_file.write_gguf(path, meta, values)
    got = load_model(path)[0]
    assert (got.attn_temp_scale, got.rope_orig_ctx) == (np.float32(0.1), cfg.n_ctx)
    def tables(c):
        return [t for t in topo_order([build_train_graph(c, values, 1).loss])
                if t.name == "attention temperature"]
    assert not tables(got)
    (table,) = tables(dataclasses.replace(got, rope_orig_ctx=cfg.n_ctx // 2))   # all layers'
    assert table.shape == (cfg.n_ctx, 1)


def test_a_hunyuan_file_s_rope_alpha_scales_its_base_as_llama_cpp_reads_it(tmp_path):
    """rope.scaling.alpha (llama.cpp's converter folds it into the base itself; a file may
    carry it): base * alpha^(d / (d - 2)), d the head size."""
    cfg = dataclasses.replace(FAMILIES["hunyuan-dense"], rope_freq_base=1e4)
    values = family_values(cfg)
    path = family_file(tmp_path / "m.gguf", cfg, values, config_json=False)
    meta = gguf_llama.model_metadata(path, cfg, ByteTokenizer(), None)
    del meta[gguf_llama.K_CONFIG_JSON]
    meta["hunyuan-dense.rope.scaling.alpha"] = (1000.0, GGUFValueType.FLOAT32)
    gguf_file.write_gguf(path, meta, values)
    d = cfg.head_dim
    assert np.isclose(load_model(path)[0].rope_freq_base, 1e4 * 1000 ** (d / (d - 2)))


def test_a_minicpm_file_without_its_scales_takes_llama_cpp_s_and_ours_always_has_them(
        tmp_path):
    """Older MiniCPM files have no scale keys: llama.cpp then takes 12, 1.4 / sqrt(n_layer)
    and n_embd / 256; ggwgpu writes all three always, even at 1, so that llama.cpp never
    takes a default instead."""
    cfg = FAMILIES["minicpm"]
    values = family_values(cfg)
    path = family_file(tmp_path / "m.gguf", cfg, values, config_json=False)
    meta = gguf_llama.model_metadata(path, cfg, ByteTokenizer(), None)
    del meta[gguf_llama.K_CONFIG_JSON]
    for name in ("embedding_scale", "residual_scale", "logit_scale"):
        del meta[f"minicpm.{name}"]
    gguf_file.write_gguf(path, meta, values)
    got = load_model(path)[0]
    assert (got.embedding_scale, got.residual_scale, got.logit_scale) == \
        (12.0, 1.4 / np.sqrt(cfg.n_layer), cfg.n_embd / 256)
    ones = dataclasses.replace(cfg, embedding_scale=1.0, residual_scale=1.0, logit_scale=1.0)
    save_model(tmp_path / "ones.gguf", ones, values, ByteTokenizer())
    reader = GGUFReader(tmp_path / "ones.gguf")
    assert all(reader.fields[f"minicpm.{name}"].contents() == 1.0
               for name in ("embedding_scale", "residual_scale", "logit_scale"))


@pytest.mark.parametrize("key, value, words", [
    ("glm4.rope.dimension_sections", ([8, 12, 12, 0], GGUFValueType.ARRAY), "no M-RoPE"),
    ("glm4.nextn_predict_layers", (1, GGUFValueType.UINT32), "multi-token-prediction")])
def test_glm4_files_of_the_vision_models_or_with_prediction_blocks_are_refused(key, value,
                                                                              words, tmp_path):
    cfg = FAMILIES["glm4"]
    values = family_values(cfg)
    path = family_file(tmp_path / "m.gguf", cfg, values, config_json=False)
    meta = gguf_llama.model_metadata(path, cfg, ByteTokenizer(), None)
    meta[key] = value
    gguf_file.write_gguf(path, meta, values)
    with pytest.raises(GGUFError, match=f"{key}.*{words}"):
        load_model(path)


def test_exaone4_windows_and_ropes_only_three_layers_of_four_of_its_64_layer_model():
    """llama.cpp gives the 64-layer EXAONE 4.0 (32B) its sliding windows, on layers i % 4 < 3,
    and ropes only those; other depths are roped everywhere and never windowed."""
    from ggwgpu.generate import Decoder
    from ggwgpu.testing import reference_logits
    deep = ModelConfig(n_vocab=11, n_embd=8, n_head=2, n_head_kv=1, n_layer=64, n_ff=8,
                       n_ctx=8, sliding_window=3, arch="exaone4")
    family = deep.family
    assert [family.window(deep, i) for i in range(5)] == [3, 3, 3, 0, 3]
    assert [family.ropes(deep, i) for i in range(5)] == [True, True, True, False, True]
    shallow = dataclasses.replace(deep, n_layer=30)
    assert not any(family.window(shallow, i) for i in range(30))
    assert all(family.ropes(shallow, i) for i in range(30))
    values = init_parameters(deep, seed=2)
    tokens = [1, 4, 2, 7, 3, 9, 5]
    got = Decoder(NumpyBackend(np.float64), deep, values).prefill(tokens)
    np.testing.assert_allclose(np.asarray(got).reshape(-1),
                               reference_logits(deep, values, np.array(tokens))[-1], rtol=1e-9,
                               atol=1e-12)


def test_qwen35_files_say_which_layers_recur_and_what_is_refused(tmp_path):
    """Recurrent layers from full_attention_interval (4 when absent, as llama.cpp reads it)
    or from attention.recurrent_layers; the multi-token-prediction block the converter
    appends is read past; an inner size that is not heads * state, and rope sections that
    would leave pairs unturned are refused."""
    cfg = FAMILIES["qwen35"]
    values = family_values(cfg)
    meta = gguf_llama.model_metadata(tmp_path / "m.gguf", cfg, ByteTokenizer(), None)
    del meta[gguf_llama.K_CONFIG_JSON]
    assert meta["qwen35.full_attention_interval"][0] == 4
    assert meta["qwen35.ssm.inner_size"][0] == cfg.ssm_heads * cfg.ssm_state

    def read(path, **changes):
        edited = {k: v for k, v in meta.items() if k not in changes}
        edited.update({k: v for k, v in changes.items() if v is not None})
        gguf_file.write_gguf(path, edited, values)
        return load_model(path)[0]
    plain = read(tmp_path / "a.gguf", **{"qwen35.full_attention_interval": None})
    assert float32_fields(plain) == float32_fields(cfg)
    odd = dataclasses.replace(cfg, recurrent_layers=(0, 2, 3))
    path = write_tensors(tmp_path / "odd.gguf", odd, family_values(odd))
    assert "qwen35.attention.recurrent_layers" in GGUFReader(path).fields
    assert load_model(path)[0].recurrent_layers == (0, 2, 3)
    # a multi-token-prediction block appended (block_count counts it; llama.cpp's main
    # graph, as ggwgpu, reads past it)
    mtp = dataclasses.replace(cfg, n_layer=cfg.n_layer + 1, recurrent_layers=(0, 1, 2))
    extra = {k: v for k, v in family_values(mtp).items() if k.startswith(f"blk.{cfg.n_layer}.")}
    extra[f"blk.{cfg.n_layer}.nextn.eh_proj.weight"] = np.ones((16, 32), np.float32)
    meta_mtp = gguf_llama.model_metadata(tmp_path / "m.gguf", mtp, ByteTokenizer(), None)
    del meta_mtp[gguf_llama.K_CONFIG_JSON]
    assert meta_mtp["qwen35.attention.recurrent_layers"][0] == [True] * 3 + [False] * 2
    meta_mtp["qwen35.nextn_predict_layers"] = (1, GGUFValueType.UINT32)
    path = tmp_path / "mtp.gguf"
    gguf_file.write_gguf(path, meta_mtp, values | extra)
    got_cfg, got, _ = load_model(path)
    assert float32_fields(got_cfg) == float32_fields(cfg) and got.keys() == values.keys()
    with pytest.raises(GGUFError, match="leaves no block of the 4"):
        read(tmp_path / "b.gguf", **{"qwen35.nextn_predict_layers": (4, GGUFValueType.UINT32)})
    with pytest.raises(GGUFError, match="ssm.inner_size = 12 is not"):
        read(tmp_path / "c.gguf", **{"qwen35.ssm.inner_size": (12, GGUFValueType.UINT32)})
    with pytest.raises(ShapeError, match=r"leave rotated pairs \[1\] to the fourth"):
        dataclasses.replace(cfg, rope_sections=(1, 0, 0, 1))


def test_a_common_rank_above_a_narrow_matrix_takes_the_rank_it_can_use():
    """qwen35's ssm_alpha and ssm_beta have a row per value head (4): --lora-r 8 gives them
    rank-4 pairs; asking rank 8 of them alone is refused."""
    cfg = FAMILIES["qwen35"]
    ranks = lora.lora_ranks(cfg, 8)
    assert ranks["blk.0.ssm_alpha.weight"] == ranks["blk.0.ssm_beta.weight"] == 4
    assert ranks["blk.0.attn_qkv.weight"] == 8
    with pytest.raises(ValueError, match="rank 8 of ssm_beta is more than blk.0.ssm_beta.weight"):
        lora.lora_ranks(cfg, 2, {"ssm_beta": 8})


@pytest.mark.parametrize("arch, taps", [("lfm2", "shortconv.conv.weight"),
                                        ("qwen35", "ssm_conv1d.weight")])
def test_convolution_taps_stored_in_f16_are_read_as_values(arch, taps, tmp_path):
    """An F16 file stores the convolutions' taps (2-D, too short a row for a block type) in
    F16: the graph reads them as values, so they come back as f32 even where the matrices
    stay in their block type, with the logits of the file read all in f32."""
    from ggwgpu.quant import quantize
    cfg = FAMILIES[arch]
    path = tmp_path / "m.gguf"
    save_model(path, cfg, {k: quantize(v, "f16") if v.ndim == 2 else v
                           for k, v in family_values(cfg).items()}, ByteTokenizer())
    kept = load_model(path, keep_quantized=True)[1]
    assert kept["blk.0.ffn_up.weight"].dtype == "f16"
    assert isinstance(kept[f"blk.0.{taps}"], np.ndarray)
    tokens = np.random.default_rng(0).integers(0, cfg.n_vocab, (1, cfg.n_ctx))
    logits = []
    for values in (kept, load_model(path)[1]):
        g = build_train_graph(cfg, values, 1, frozen=True)
        plan = NumpyBackend().plan(g.logits)
        plan.run({g.tokens: tokens, g.positions: np.arange(cfg.n_ctx, dtype=np.int32)})
        logits.append(g.read_logits(plan))
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def converter_file(cfg, tmp_path):
    """(meta, read): cfg's keys as llama.cpp's converter writes them (no config JSON), and
    read(path, values=cfg's, **changes), which writes a file of them with `changes` (a None
    drops a key) and reads its config back."""
    values = family_values(cfg)
    meta = gguf_llama.model_metadata(tmp_path / "m.gguf", cfg, ByteTokenizer(), None)
    del meta[gguf_llama.K_CONFIG_JSON]

    def read(path, values=values, **changes):
        edited = {k: v for k, v in meta.items() if k not in changes}
        edited.update({k: v for k, v in changes.items() if v is not None})
        gguf_file.write_gguf(path, edited, values)
        return load_model(path)[0]
    return meta, read


def reads_past_a_prediction_block(cfg, read, tmp_path):
    """A file of cfg with one multi-token-prediction block after its own (counted in
    block_count, as the converter writes it) reads as cfg."""
    last = f"blk.{cfg.n_layer}."
    mtp = dataclasses.replace(cfg, n_layer=cfg.n_layer + 1)
    extra = {k: v for k, v in family_values(mtp).items() if k.startswith(last)}
    extra[last + "nextn.eh_proj.weight"] = np.ones((cfg.n_embd, 2 * cfg.n_embd), np.float32)
    got = read(tmp_path / "mtp.gguf", family_values(cfg) | extra, **{
        f"{cfg.arch}.block_count": (cfg.n_layer + 1, GGUFValueType.UINT32),
        f"{cfg.arch}.nextn_predict_layers": (1, GGUFValueType.UINT32)})
    assert float32_fields(got) == float32_fields(cfg)


def test_glm4moe_files_read_past_their_prediction_block_and_refuse_m_rope(tmp_path):
    """A glm4moe file as the converter writes it (expert_shared_count, sigmoid gating,
    QK norms and biases told by the tensors) reads back as ggwgpu holds it; a
    multi-token-prediction block (counted in block_count) is read past; a file without
    expert_gating_func takes the sigmoids, as llama.cpp; GLM-4.5V's M-RoPE is refused."""
    cfg = FAMILIES["glm4moe"]
    meta, read = converter_file(cfg, tmp_path)
    assert meta["glm4moe.expert_shared_count"][0] == 1
    reads_past_a_prediction_block(cfg, read, tmp_path)
    unset = read(tmp_path / "unset.gguf", **{"glm4moe.expert_gating_func": None})
    assert cfg.family.expert_gating(unset) == "sigmoid"
    with pytest.raises(GGUFError, match="glm4moe.rope.dimension_sections: ggwgpu's glm4moe "
                                        "has no M-RoPE"):
        read(tmp_path / "mrope.gguf", **{"glm4moe.rope.dimension_sections":
                                         ([8, 12, 12, 0], GGUFValueType.ARRAY)})


def test_bailingmoe2_shared_experts_are_as_wide_as_llama_cpp_makes_them(tmp_path):
    """llama.cpp sizes bailingmoe2's shared experts expert_shared_feed_forward_length (else
    the experts' width) times expert_shared_count; ggwgpu reads that width and writes it
    back as one shared expert of it. A prediction block is read past."""
    cfg = FAMILIES["bailingmoe2"]
    meta, read = converter_file(cfg, tmp_path)
    assert meta["bailingmoe2.expert_shared_count"][0] == 1
    reads_past_a_prediction_block(cfg, read, tmp_path)
    two = read(tmp_path / "two.gguf", **{
        "bailingmoe2.expert_shared_count": (2, GGUFValueType.UINT32),
        "bailingmoe2.expert_shared_feed_forward_length": (16, GGUFValueType.UINT32)})
    assert float32_fields(two) == float32_fields(cfg)
    unset = read(tmp_path / "unset.gguf", **{
        "bailingmoe2.expert_shared_feed_forward_length": None})
    assert unset.n_ff_shexp == cfg.n_ff_exp


def test_a_smallthinker_file_s_window_is_llama_cpp_s_4096_whatever_it_says(tmp_path):
    cfg = FAMILIES["smallthinker"]
    meta, read = converter_file(cfg, tmp_path)
    got = read(tmp_path / "w.gguf", **{
        "smallthinker.attention.sliding_window": (512, GGUFValueType.UINT32)})
    assert got.sliding_window == 4096
    got = read(tmp_path / "none.gguf", **{"smallthinker.attention.sliding_window": None})
    assert got.sliding_window == 0 and all(got.family.ropes(got, i) for i in range(2))
    with pytest.raises(ShapeError, match="windows a smallthinker's layers at 4096"):
        dataclasses.replace(cfg, sliding_window=512)


def test_deepseek2_files_read_past_their_prediction_block_and_say_their_gating(tmp_path):
    """A deepseek2 file as the converter writes it: expert_shared_count, kv_lora_rank and
    the 0.1 * mscale_all_dim log multiplier read back as ggwgpu holds them; a
    multi-token-prediction block (GLM-4.7-Flash's, counted in block_count) read past; a file
    without expert_gating_func takes llama.cpp's rule (sigmoids for GLM-4.7-Flash's 47
    blocks and 154 880 tokens, else the softmax); grouped routing and a latent that is not
    key_length - rope dims are refused by name."""
    cfg = FAMILIES["deepseek2"]
    meta, read = converter_file(cfg, tmp_path)
    assert meta["deepseek2.expert_shared_count"][0] == 2
    assert meta["deepseek2.attention.kv_lora_rank"][0] == 16
    assert meta["deepseek2.attention.value_length"][0] == 16
    assert np.isclose(meta["deepseek2.rope.scaling.yarn_log_multiplier"][0], 0.05)
    reads_past_a_prediction_block(cfg, read, tmp_path)
    with pytest.raises(GGUFError, match="nextn_predict_layers leaves no block"):
        read(tmp_path / "b.gguf", **{"deepseek2.nextn_predict_layers": (2, GGUFValueType.UINT32)})
    with pytest.raises(GGUFError, match="does not route by groups of experts"):
        read(tmp_path / "c.gguf", **{"deepseek2.expert_group_count": (2, GGUFValueType.UINT32)})
    with pytest.raises(GGUFError, match="key_length must be deepseek2.attention.kv_lora_rank"):
        read(tmp_path / "d.gguf", **{"deepseek2.attention.kv_lora_rank":
                                      (12, GGUFValueType.UINT32)})
    # without expert_gating_func: the file's shape says (llama.cpp's rule), read from the
    # keys as read so far (hp) and the file's vocabulary
    path = tmp_path / "e.gguf"
    read(path, **{"deepseek2.expert_gating_func": None})
    f = gguf_file.GGUFFile(path)
    hp = {"n_layer": 47, "n_rot": 4, "n_embd": 16, "n_head": 2, "n_embd_head": 20,
          "n_ff_exp": 16, "expert_gating": 0}
    family = FAMILIES["deepseek2"].family
    assert "expert_gating" not in family.read_more_keys(f, hp)       # softmax
    f.meta["tokenizer.ggml.tokens"] = ["t"] * 154880
    assert family.read_more_keys(f, hp)["expert_gating"] == 2        # GLM-4.7-Flash's
    assert "expert_gating" not in family.read_more_keys(f, {**hp, "expert_gating": 1})


def test_latent_heads_wider_than_the_fused_kernels_take_the_unfused_path():
    """DeepSeek's latent heads (512 + 64 there) exceed the fused kernels' bound: with flash
    attention asked for, a deepseek2 of heads of 256 + 4 attends unfused, as the reference."""
    from ggwgpu.ops.attention import MAX_D
    from ggwgpu.testing import reference_logits
    cfg = dataclasses.replace(FAMILIES["deepseek2"], n_embd_head=MAX_D + 4)
    values = family_values(cfg)
    tokens = np.random.default_rng(2).integers(0, cfg.n_vocab, (1, cfg.n_ctx))
    np.testing.assert_allclose(float64_logits(cfg, values, tokens, flash=True)[0],
                               reference_logits(cfg, values, tokens[0]), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("key, value, words", [
    ("moe_latent_size", 8, "has no latent experts"),
    ("expert_group_count", 2, "does not route by groups of experts"),
    ("nextn_predict_layers", 1, "does not read multi-token-prediction blocks")])
def test_nemotron_3_files_of_what_ggwgpu_does_not_compute_are_refused_by_name(key, value, words,
                                                                             tmp_path):
    """Nemotron 3 Super's latent experts, grouped routing and prediction blocks."""
    cfg = FAMILIES["nemotron_h_moe"]
    meta = gguf_llama.model_metadata(tmp_path / "m.gguf", cfg, ByteTokenizer(), None)
    del meta[gguf_llama.K_CONFIG_JSON]
    meta[f"nemotron_h_moe.{key}"] = (value, GGUFValueType.UINT32)
    gguf_file.write_gguf(tmp_path / "m.gguf", meta, family_values(cfg))
    with pytest.raises(GGUFError, match=f"nemotron_h_moe.{key}: ggwgpu's nemotron_h_moe {words}"):
        load_model(tmp_path / "m.gguf")


def test_an_ernie4_5_moe_file_with_experts_on_every_other_block_is_refused(tmp_path):
    """llama.cpp's graph puts experts on every interleave_moe_layer_step-th block but loads
    them on all: only a step of 1 (the published models', the one ggwgpu writes) makes one
    model of both."""
    cfg = FAMILIES["ernie4_5-moe"]
    meta = gguf_llama.model_metadata(tmp_path / "m.gguf", cfg, ByteTokenizer(), None)
    assert meta["ernie4_5-moe.interleave_moe_layer_step"][0] == 1
    del meta[gguf_llama.K_CONFIG_JSON]
    meta["ernie4_5-moe.interleave_moe_layer_step"] = (2, GGUFValueType.UINT32)
    gguf_file.write_gguf(tmp_path / "m.gguf", meta, family_values(cfg))
    with pytest.raises(GGUFError, match="interleave_moe_layer_step = 2: ggwgpu's ernie4_5-moe "
                                        "takes experts on every block past the dense ones"):
        load_model(tmp_path / "m.gguf")


def test_a_minicpm3_file_without_its_value_length_has_values_of_n_embd_over_n_head(tmp_path):
    """The converter writes MiniCPM3's key_length and no value_length, which llama.cpp then
    takes as n_embd / n_head."""
    cfg = FAMILIES["minicpm3"]
    meta = gguf_llama.model_metadata(tmp_path / "m.gguf", cfg, ByteTokenizer(), None)
    del meta[gguf_llama.K_CONFIG_JSON], meta["minicpm3.attention.value_length"]
    gguf_file.write_gguf(tmp_path / "m.gguf", meta, family_values(cfg))
    assert float32_fields(load_model(tmp_path / "m.gguf")[0]) == float32_fields(cfg)


@pytest.mark.parametrize("arch", ["internlm2", "gptneox"])
def test_families_whose_llama_cpp_loader_needs_an_output_matrix_refuse_tied_embeddings(arch):
    with pytest.raises(ShapeError, match=f"llama.cpp's {arch} needs its own output matrix"):
        dataclasses.replace(FAMILIES[arch], tied_embeddings=True)


def test_a_gpt2_keeps_its_position_table_whatever_context_a_run_takes(tmp_path):
    """The file's context_length is the table's rows even after a run at a shorter
    context (llama.cpp reads the table's shape from it); a context beyond it is refused."""
    cfg = FAMILIES["gpt2"]
    short = dataclasses.replace(cfg, n_ctx=8)
    save_model(tmp_path / "m.gguf", short, family_values(short), ByteTokenizer())
    assert GGUFReader(tmp_path / "m.gguf").fields["gpt2.context_length"].contents() == 16
    got = write_tensors(tmp_path / "plain.gguf", short, family_values(short))
    assert float32_fields(load_model(got)[0]) == float32_fields(cfg)
    with pytest.raises(ShapeError, match="gpt2 of 16 learned positions .* context of 32"):
        dataclasses.replace(cfg, n_ctx=32)
