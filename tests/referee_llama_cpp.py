"""ggwgpu against llama.cpp (llama-cpp-python, never a dependency of ggwgpu) on random tiny
files of each family, written as llama.cpp's converter writes them: logits of 64 tokens
(float64 reference, NumPy, and with --wgpu the WebGPU backend) against llama.cpp's with an f32
KV cache, greedy generation token for token, a random LoRA adapter that llama.cpp applies,
and the merged file llama.cpp evaluates. Prints one line per check (relative RMS).

Not a test (pytest does not collect it): it needs llama-cpp-python in a throwaway venv, e.g.

    python3 -m venv /tmp/referee
    CMAKE_ARGS="-DGGML_NATIVE=OFF" /tmp/referee/bin/pip install llama-cpp-python==0.3.36 \
        'wgpu>=0.32,<0.33' gguf click regex jinja2
    PYTHONPATH=. /tmp/referee/bin/python tests/referee_llama_cpp.py [--wgpu] [config ...]

llama.cpp's CPU gelu reads an f16 table (GGML_GELU_FP16 in ggml-cpu/vec.h): gemma3 then
differs by ~4e-4 from the exact tanh gelu both ggwgpu and llama.cpp's model define; with
that define removed from the sdist before building, gemma3 agrees as the others do."""
import sys
import tempfile
from pathlib import Path

import numpy as np
import llama_cpp

from ggwgpu import gguf_file, gguf_llama, lora
from ggwgpu.backends.numpy_backend import NumpyBackend
from ggwgpu.generate import Decoder
from ggwgpu.models import ModelConfig, build_train_graph, init_parameters, vector_like
from ggwgpu.testing import reference_logits
from ggwgpu.tokenizer import ByteTokenizer

N = 64
BASE = dict(n_vocab=ByteTokenizer.n_vocab, n_embd=64, n_ff=96, n_ctx=N, norm_eps=1e-6)
CONFIGS = {
    "llama": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2),
    "qwen2": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, tied_embeddings=True,
                         rope_freq_base=1e6, arch="qwen2"),
    "qwen3": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_embd_head=32, n_layer=2,
                         tied_embeddings=True, rope_freq_base=1e6, arch="qwen3"),
    "gemma2": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_embd_head=16, n_layer=4,
                          tied_embeddings=True, sliding_window=16, attn_logit_softcap=1.0,
                          final_logit_softcap=3.0, arch="gemma2"),
    "olmo2": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, rope_freq_base=5e5,
                         arch="olmo2"),
    "olmo3": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=4, rope_freq_base=5e5,
                         rope_freq_scale=0.5, sliding_window=16, arch="olmo2"),
    # YaRN: OLMo 3's (factor 8, its global layers only), and Qwen3's with a ramp over pairs
    # 5 .. 11 of 16 and a rope.scaling.attn_factor
    "olmo3-yarn": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=4, rope_freq_base=5e5,
                              rope_scaling="yarn", rope_freq_scale=0.125, rope_orig_ctx=16,
                              sliding_window=16, arch="olmo2"),
    "qwen3-yarn": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_embd_head=32, n_layer=2,
                              tied_embeddings=True, rope_freq_base=1e4, rope_scaling="yarn",
                              rope_freq_scale=0.25, rope_orig_ctx=3580, rope_attn_factor=0.9,
                              arch="qwen3"),
    # Ministral 3: YaRN with the file's betas and log multiplier, the attention temperature
    # from position 16 on; Mistral Small 3.x: neither
    "mistral3": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_embd_head=32, n_layer=2,
                            tied_embeddings=True, rope_freq_base=1e4, rope_scaling="yarn",
                            rope_freq_scale=0.0625, rope_orig_ctx=16, yarn_beta_fast=16.0,
                            yarn_beta_slow=2.0, yarn_log_mul=0.5, attn_temp_scale=0.1,
                            arch="mistral3"),
    "mistral3-plain": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2,
                                  rope_freq_base=1e8, arch="mistral3"),
    # Hunyuan dense: QK norms after rope, an alpha-scaled base
    # Hunyuan-A13B: QK norms after rope; 8 experts of n_ff 96 (2 taken, normalized; the
    # file's expert_feed_forward_length, 48, sizes nothing) and a shared expert of 64
    "hunyuan-moe": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, n_expert=8,
                               n_expert_used=2, n_ff_exp=48, n_ff_shexp=64,
                               rope_freq_base=1e6, arch="hunyuan-moe"),
    "hunyuan-dense": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2,
                                 tied_embeddings=True, rope_freq_base=1.1e7,
                                 arch="hunyuan-dense"),
    # MiniCPM4: granite's scales, LongRoPE ("longrope" files: the long factors past an
    # original context of 32, the short ones within 4096)
    # MiniCPM3-4B: latent attention (keys of 16 + 8 rope dims, values of 16, queries through
    # a rank of 24, a latent of 16), LongRoPE (long factors), its fixed scales
    "minicpm3": ModelConfig(**BASE, n_head=4, n_embd_head=24, n_rot=8, n_layer=2,
                            mla_value_length=16, q_lora_rank=24, kv_lora_rank=16, longrope=True,
                            rope_scaling="longrope", rope_orig_ctx=32, arch="minicpm3"),
    "minicpm": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, tied_embeddings=True,
                           longrope=True, rope_scaling="longrope", rope_orig_ctx=32,
                           embedding_scale=12.0, residual_scale=0.99, logit_scale=0.25,
                           arch="minicpm"),
    "minicpm-short": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, longrope=True,
                                 rope_scaling="longrope", rope_orig_ctx=4096,
                                 embedding_scale=12.0, residual_scale=0.99, logit_scale=0.25,
                                 arch="minicpm"),
    # AFM-4.5B: relu(ffn_up h)^2 with no gate, YaRN (factor 20 over an original context of
    # 16), rope factors
    "arcee": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, rope_freqs=True,
                         rope_scaling="yarn", rope_freq_scale=0.05, rope_orig_ctx=16,
                         arch="arcee"),
    # GLM-4-0414: Q/K/V biases, half of each head roped, sandwich norms, gate | up fused
    "glm4": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_rot=8, n_layer=2, arch="glm4"),
    # Granite 4.0 H: Mamba2 layers (8 heads of 16 over 1 group of B and C, state 16,
    # convolution of 4) with attention on the third of four, no rope, granite's scales; and
    # with rope and 2 groups
    "granitehybrid": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=4,
                                 recurrent_layers=(0, 1, 3), conv_kernel=4, ssm_state=16,
                                 ssm_heads=8, ssm_groups=1, embedding_scale=12.0,
                                 residual_scale=0.25, attention_scale=0.0625, logit_scale=4.0,
                                 no_rope=True, tied_embeddings=True, arch="granitehybrid"),
    "granitehybrid-rope": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=3,
                                      recurrent_layers=(0, 2), conv_kernel=3, ssm_state=8,
                                      ssm_heads=4, ssm_groups=2, logit_scale=2.0,
                                      arch="granitehybrid"),
    # Nemotron-H: Mamba2 blocks (16 heads of 8 over 2 groups, state 16), feed-forward
    # blocks of relu(up)^2, an attention block without rope
    "nemotron_h": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=6,
                              recurrent_layers=(0, 3, 5), mlp_layers=(1, 4), conv_kernel=4,
                              ssm_state=16, ssm_heads=16, ssm_groups=2, ssm_inner=128,
                              arch="nemotron_h"),
    # Nemotron 3 Nano: those blocks, the feed-forward ones 8 experts of relu(up)^2 (2 taken
    # by sigmoids ranked with a bias, normalized, times 2.5) and a shared expert of 96
    "nemotron_h_moe": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=6,
                                  recurrent_layers=(0, 3, 5), mlp_layers=(1, 4), conv_kernel=4,
                                  ssm_state=16, ssm_heads=16, ssm_groups=2, ssm_inner=128,
                                  n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff_shexp=96,
                                  expert_weights_norm=True, expert_weights_scale=2.5,
                                  arch="nemotron_h_moe"),
    # Falcon-H1: attention (neox rope) and a Mamba2 (8 heads over 2 groups, state 16) side by
    # side in every block; and without ssm_norm
    "falcon-h1": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=3,
                             recurrent_layers=(0, 1, 2), conv_kernel=4, ssm_state=16,
                             ssm_heads=8, ssm_groups=2, ssm_inner=96, rope_freq_base=1e11,
                             arch="falcon-h1"),
    "falcon-h1-plain": ModelConfig(**BASE, n_head=4, n_head_kv=1, n_layer=2,
                                   recurrent_layers=(0, 1), conv_kernel=4, ssm_state=8,
                                   ssm_heads=4, ssm_groups=1, ssm_inner=64, mamba_norm=False,
                                   tied_embeddings=True, arch="falcon-h1"),
    "ernie4_5": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_embd_head=32, n_layer=2,
                            tied_embeddings=True, rope_freq_base=5e5, arch="ernie4_5"),
    # EXAONE 3.5: llama's block, neox rope with rope factors, tied; InternLM2.5: llama's
    "exaone": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, tied_embeddings=True,
                          rope_freqs=True, rope_freq_base=1e6, arch="exaone"),
    "internlm2": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, rope_freq_base=1e6,
                             arch="internlm2"),
    "exaone4": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, tied_embeddings=True,
                           rope_freqs=True, rope_freq_base=1e6, arch="exaone4"),
    # the 32B's 64 layers: windows on three layers of four, which alone are roped
    "exaone4-64": ModelConfig(**{**BASE, "n_embd": 16, "n_ff": 16}, n_head=2, n_head_kv=1,
                              n_layer=64, sliding_window=16, rope_freq_base=1e6,
                              arch="exaone4"),
    "gemma3": ModelConfig(**BASE, n_head=4, n_head_kv=1, n_embd_head=32, n_layer=6,
                          tied_embeddings=True, rope_freq_base=1e6, sliding_window=16,
                          rope_freq_base_swa=1e4, arch="gemma3"),
    "gemma3-softcap": ModelConfig(**BASE, n_head=4, n_head_kv=1, n_embd_head=32, n_layer=6,
                                  rope_freq_base=1e6, sliding_window=16,
                                  rope_freq_base_swa=1e4, final_logit_softcap=3.0,
                                  arch="gemma3"),
    "smollm3": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=4, tied_embeddings=True,
                           rope_freq_base=5e6, arch="smollm3"),
    "phi3-long": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_rot=12, n_layer=2,
                             longrope=True, rope_orig_ctx=32, rope_attn_factor=1.19,
                             arch="phi3"),
    "phi3-short": ModelConfig(**BASE, n_head=4, n_head_kv=4, n_layer=2, tied_embeddings=True,
                              longrope=True, rope_orig_ctx=4096, rope_attn_factor=1.19,
                              arch="phi3"),
    "phi3-plain": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, arch="phi3"),
    "lfm2": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=6, tied_embeddings=True,
                        conv_layers=(0, 1, 3, 4), conv_kernel=3, rope_freq_base=1e6,
                        arch="lfm2"),
    "lfm2-window": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=4, conv_layers=(0, 2),
                               conv_kernel=4, sliding_window=8, arch="lfm2"),
    # Gemma 4 E2B-shaped: 4 sliding layers of 6 with heads of 16 over one K/V head, global
    # ones with heads of 32 over two and proportional rope (a quarter of the pairs turn);
    # the last two layers on the K/V of layers 2 and 3 with a double-wide feed-forward;
    # per-layer embeddings of 8; layer output scales; tied
    "gemma4": ModelConfig(**{**BASE, "n_ff": 192}, n_head=4, n_head_kv=2, n_embd_head=32, n_layer=6,
                          n_ff_layers=(96, 96, 96, 96, 192, 192),
                          n_head_kv_layers=(1, 1, 1, 2, 1, 2), swa_layers=(0, 1, 2, 4),
                          head_dim_swa=16, n_rot_swa=16, sliding_window=16, shared_kv_layers=2,
                          n_embd_per_layer=8, layer_output_scale=True, rope_freqs=True,
                          tied_embeddings=True, rope_freq_base=1e6, rope_freq_base_swa=1e4,
                          arch="gemma4"),
    # 31B-shaped: no per-layer embeddings, no shared K/V, untied, a final softcap
    "gemma4-softcap": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_embd_head=32, n_layer=4,
                                  n_head_kv_layers=(1, 1, 1, 2), swa_layers=(0, 1, 2),
                                  head_dim_swa=16, n_rot_swa=16, sliding_window=16,
                                  rope_freqs=True, rope_freq_base=1e6, final_logit_softcap=3.0,
                                  arch="gemma4"),
    # 26B-A4B-shaped: the dense GeGLU beside 8 GeGLU experts of 32 (2 taken, gate | up one
    # stack), tied, a final softcap
    "gemma4-moe": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_embd_head=32, n_layer=4,
                              n_head_kv_layers=(1, 1, 1, 2), swa_layers=(0, 1, 2),
                              head_dim_swa=16, n_rot_swa=16, sliding_window=16, n_expert=8,
                              n_expert_used=2, n_ff_exp=32, fused_gate_up=True,
                              rope_freqs=True, tied_embeddings=True, rope_freq_base=1e6,
                              final_logit_softcap=3.0, arch="gemma4"),
    # Qwen3.5 0.8B-shaped: three gated delta-net layers of four (as many query/key heads as
    # value heads), gated attention with heads wider than n_embd / n_head and a quarter of
    # each rotated (IMROPE's sections), tied
    "qwen35": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_embd_head=32, n_rot=8, n_layer=4,
                          recurrent_layers=(0, 1, 2), conv_kernel=4, ssm_state=16, ssm_heads=4,
                          ssm_groups=4, rope_sections=(2, 1, 1, 0), tied_embeddings=True,
                          rope_freq_base=1e7, arch="qwen35"),
    # 35B-A3B-shaped: qwen35's blocks, 8 experts of 32 (2 taken), a gated shared expert
    "qwen35moe": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_embd_head=32, n_rot=8, n_layer=4,
                             recurrent_layers=(0, 1, 2), conv_kernel=4, ssm_state=16,
                             ssm_heads=4, ssm_groups=4, rope_sections=(2, 1, 1, 0),
                             n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff_shexp=48,
                             tied_embeddings=True, rope_freq_base=1e7, arch="qwen35moe"),
    # 9B-shaped: twice as many value heads as query/key heads, untied, eight layers
    "qwen35-groups": ModelConfig(**BASE, n_head=4, n_head_kv=1, n_embd_head=16, n_rot=4,
                                 n_layer=8, recurrent_layers=(0, 1, 2, 4, 5, 6), conv_kernel=4,
                                 ssm_state=8, ssm_heads=8, ssm_groups=4,
                                 rope_sections=(1, 1, 0, 0), rope_freq_base=1e7,
                                 arch="qwen35"),
    # recurrent layers that no interval gives: attention.recurrent_layers
    "qwen35-layers": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_embd_head=16, n_rot=16,
                                 n_layer=4, recurrent_layers=(0, 2, 3), conv_kernel=3,
                                 ssm_state=16, ssm_heads=2, ssm_groups=2,
                                 rope_sections=(3, 3, 2, 0), tied_embeddings=True,
                                 arch="qwen35"),
    # Phi-2: LayerNorm blocks with biases, attention and feed-forward side by side, 16 of the
    # head's 32 dims roped
    "phi2": ModelConfig(**BASE, n_head=2, n_rot=16, n_layer=2, arch="phi2"),
    # StableLM 2 1.6B: LayerNorms, Q/K/V biases, a quarter of the head roped, SwiGLU; StableLM
    # 3B 4E1T without the biases
    "stablelm": ModelConfig(**BASE, n_head=2, n_rot=8, n_layer=2, qkv_bias=True,
                            arch="stablelm"),
    "stablelm-3b": ModelConfig(**BASE, n_head=2, n_rot=8, n_layer=2, arch="stablelm"),
    # StarCoder2-3B: the same pieces one after the other, grouped-query attention, tied
    "starcoder2": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, tied_embeddings=True,
                              rope_freq_base=1e5, arch="starcoder2"),
    # mixtures of experts: 8 experts, 2 (qwen2moe 4) taken; qwen2moe's shared expert
    "qwen3moe": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_embd_head=32, n_layer=2,
                            n_expert=8, n_expert_used=2, n_ff_exp=32, rope_freq_base=1e6,
                            arch="qwen3moe"),
    "qwen2moe": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, n_expert=8,
                            n_expert_used=4, n_ff_exp=24, n_ff_shexp=80, arch="qwen2moe"),
    "olmoe": ModelConfig(**BASE, n_head=4, n_layer=2, n_expert=8, n_expert_used=2,
                         arch="olmoe"),
    "mixtral": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, n_expert=4,
                           n_expert_used=2, tied_embeddings=True),
    # granitemoe with a shared expert; Granite 4.0 H-tiny: Mamba2, attention, experts, shared
    "granitemoe": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, n_expert=8,
                              n_expert_used=2, n_ff_shexp=48, embedding_scale=12.0,
                              residual_scale=0.22, attention_scale=0.0625, logit_scale=0.5,
                              tied_embeddings=True, arch="granitemoe"),
    "granitehybrid-moe": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=3,
                                     recurrent_layers=(0, 2), conv_kernel=4, ssm_state=16,
                                     ssm_heads=8, ssm_groups=1, n_expert=4, n_expert_used=2,
                                     n_ff_shexp=64, embedding_scale=12.0, residual_scale=0.25,
                                     attention_scale=0.0078125, logit_scale=4.0, no_rope=True,
                                     tied_embeddings=True, arch="granitehybrid"),
    # LFM2-8B-A1B: sigmoid gating, a ranking bias, the first block dense
    "lfm2moe": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=4, conv_layers=(0, 1, 3),
                           conv_kernel=3, n_expert=8, n_expert_used=2, n_ff_exp=32,
                           expert_gating=2, n_dense_lead=1, tied_embeddings=True,
                           rope_freq_base=1e6, arch="lfm2moe"),
    # gpt-oss-20b's pieces: biases, sinks, the even layer windowed, YaRN (factor 32 over
    # an original context of 16), 8 experts with biases (2 taken), swiglu_oai
    "gpt-oss": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_embd_head=32, n_layer=2,
                           sliding_window=16, rope_freq_base=1.5e5, rope_scaling="yarn",
                           rope_freq_scale=1 / 32, rope_orig_ctx=16, n_expert=8,
                           n_expert_used=2, n_ff_exp=32, arch="gpt-oss"),
    # DeepSeek-V2-Lite's pieces: latent attention (attn_q; a latent of 32, 16 rope dims,
    # heads of 16 + 16 in and 24 out), a dense first block, 8 experts (2 taken, softmax,
    # times 1.5) and 2 shared, YaRN (factor 4 over 16 positions) with its log multiplier
    # GLM-4.5: Q/K/V biases and QK norms, 8 of 16 dims roped, the first block dense, 8
    # experts (2 taken by sigmoids ranked with a bias, normalized, times 2.5) and a shared
    # one; GLM-4.5-Air: without QK norms
    "glm4moe": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_rot=8, n_layer=3, n_dense_lead=1,
                           n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff_shexp=32,
                           expert_gating=2, expert_weights_norm=True, expert_weights_scale=2.5,
                           qkv_bias=True, qk_norm=True, arch="glm4moe"),
    # Phi-3.5-MoE: biased RMS norms, Q/K/V and output biases, 8 experts of 96 (2 taken by
    # softmax, normalized), LongRoPE (long factors), an output bias
    "phimoe": ModelConfig(**BASE, n_head=4, n_layer=2, n_expert=8, n_expert_used=2,
                          qkv_bias=True, longrope=True, rope_scaling="longrope",
                          rope_orig_ctx=32, arch="phimoe"),
    # Ling-mini-2.0: one attn_qkv, QK norms, 8 of 16 dims roped, the first block dense, 8
    # experts of 32 (2 taken by sigmoids ranked with a bias, normalized, times 2.5) and a
    # shared one of 32
    "bailingmoe2": ModelConfig(**BASE, n_head=4, n_rot=8, n_layer=3, n_dense_lead=1,
                               n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff_shexp=32,
                               expert_gating=2, expert_bias=True, expert_weights_norm=True,
                               expert_weights_scale=2.5, arch="bailingmoe2"),
    # Trinity Nano: sandwich norms, gated attention, QK norms, windows of 16 on three layers
    # of four (the fourth unroped), the first block dense, 8 experts of 32 by sigmoids with
    # a bias (normalized, times 2.5) and a shared one
    "afmoe": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=4, n_dense_lead=1, n_expert=8,
                         n_expert_used=2, n_ff_exp=32, n_ff_shexp=32, expert_gating=2,
                         expert_weights_norm=True, expert_weights_scale=2.5, sliding_window=16,
                         rope_freq_base_swa=1e4, rope_freq_base=1e6, arch="afmoe"),
    # SmallThinker: 8 ReGLU experts of 32 (2 taken by sigmoids, normalized) routed by each
    # block's input; windowed (4096) layers i % 4 != 0, the others unroped; and without
    # windows (every layer roped, the router by softmax)
    "smallthinker": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, n_expert=8,
                                n_expert_used=2, n_ff_exp=32, expert_gating=2,
                                sliding_window=4096, rope_freq_base=1.5e6,
                                rope_freq_base_swa=1e4, arch="smallthinker"),
    "smallthinker-global": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, n_expert=8,
                                       n_expert_used=2, n_ff_exp=32, expert_gating=1,
                                       tied_embeddings=True, arch="smallthinker"),
    # Seed-OSS: Q/K/V biases, neox rope, the feed-forward's norm post_attention_norm
    "seed_oss": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, qkv_bias=True,
                            arch="seed_oss"),
    "glm4moe-air": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_rot=8, n_layer=2, n_expert=8,
                               n_expert_used=2, n_ff_exp=32, n_ff_shexp=32, expert_gating=2,
                               expert_weights_norm=True, qkv_bias=True, tied_embeddings=True,
                               arch="glm4moe"),
    # Mistral Large 3 (deepseek2's graph): queries through a normed rank of 32, 8 experts of
    # 32 (gate | up one stack) by sigmoids ranked with a bias, normalized, and a shared one
    "mistral4": ModelConfig(**BASE, n_head=4, n_head_kv=1, n_embd_head=48, n_rot=16, n_layer=2,
                            n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff_shexp=32,
                            expert_gating=2, expert_bias=True, expert_weights_norm=True,
                            fused_gate_up=True, q_lora_rank=32, mla_key_length=32,
                            mla_value_length=24, arch="mistral4"),
    "deepseek2": ModelConfig(**BASE, n_head=4, n_head_kv=1, n_embd_head=48, n_rot=16,
                             n_layer=3, n_dense_lead=1, n_expert=8, n_expert_used=2,
                             n_ff_exp=32, n_ff_shexp=64, expert_weights_scale=1.5,
                             mla_key_length=32, mla_value_length=24, rope_scaling="yarn",
                             rope_freq_scale=0.25, rope_orig_ctx=16, yarn_log_mul=0.707,
                             arch="deepseek2"),
    # GLM-4.7-Flash's: queries through a normed rank of 32, experts by sigmoids ranked with
    # a bias, normalized, times 1.8, one shared expert, tied
    "deepseek2-glm": ModelConfig(**BASE, n_head=4, n_head_kv=1, n_embd_head=48, n_rot=16,
                                 n_layer=2, n_expert=8, n_expert_used=2, n_ff_exp=32,
                                 n_ff_shexp=32, expert_gating=2, expert_bias=True,
                                 expert_weights_norm=True, expert_weights_scale=1.8,
                                 q_lora_rank=32, mla_key_length=32, mla_value_length=24,
                                 tied_embeddings=True, rope_freq_base=1e6, arch="deepseek2"),
    # ERNIE-4.5-21B-A3B's pieces: the first block dense, then 8 experts (2 taken, softmax,
    # normalized) ranked with a bias and a shared expert of 64; heads of 32; tied
    "ernie4_5-moe": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_embd_head=32, n_layer=3,
                                n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff_shexp=64,
                                n_dense_lead=1, expert_bias=True, tied_embeddings=True,
                                rope_freq_base=5e5, arch="ernie4_5-moe"),
    # GPT-2: learned positions (a table of 80 for the 64-token context), LayerNorms and
    # biases, a fused attn_qkv, no rope, tied
    "gpt2": ModelConfig(**BASE, n_head=4, n_layer=2, n_positions=80, tied_embeddings=True,
                        arch="gpt2"),
    # Aya Expanse (command-r): parallel blocks on one LayerNorm without bias, logits times
    # logit_scale; Command R7B (cohere2): windows of 16 and rope on three layers of four
    "command-r": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, logit_scale=0.125,
                             tied_embeddings=True, rope_freq_base=4e6, arch="command-r"),
    "cohere2": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=4, sliding_window=16,
                           logit_scale=0.25, tied_embeddings=True, rope_freq_base=5e4,
                           arch="cohere2"),
    # the converter's --fuse-qkv: Q, K and V (and Qwen2's biases) one attn_qkv; Phi-2's
    # older checkpoints' Wqkv
    "llama-fused-qkv": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, fused_qkv=True),
    "qwen2-fused-qkv": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, fused_qkv=True,
                                   tied_embeddings=True, arch="qwen2"),
    "phi2-fused-qkv": ModelConfig(**BASE, n_head=2, n_rot=16, n_layer=2, fused_qkv=True,
                                  arch="phi2"),
    # Pythia: a fused attn_qkv and biases, 8 of 32 dims roped (neox), parallel LayerNorm
    # branches; and GPT-NeoX's sequential order
    "gptneox": ModelConfig(**BASE, n_head=2, n_rot=8, n_layer=2, parallel_residual=True,
                           arch="gptneox"),
    # Minitron: LayerNorm blocks, relu(up)^2, half of each head of 16 roped (neox)
    "nemotron": ModelConfig(**BASE, n_head=4, n_rot=8, n_layer=2, arch="nemotron"),
    "gptneox-sequential": ModelConfig(**BASE, n_head=2, n_rot=8, n_layer=2, arch="gptneox"),
    "granite": ModelConfig(**BASE, n_head=4, n_head_kv=2, n_layer=2, embedding_scale=12.0,
                           residual_scale=0.22, attention_scale=0.0625, logit_scale=0.5,
                           arch="granite"),
}


def values_of(cfg, seed=1):
    rng = np.random.default_rng(seed)
    v = {k: rng.uniform(0.5, 1.5, x.shape).astype(np.float32) if vector_like(k, x.shape)
         else x for k, x in init_parameters(cfg, seed).items()}
    v["output.weight" if "output.weight" in v else "token_embd.weight"] *= 4
    for k in v:
        if k.endswith(".bias"):
            v[k] = rng.uniform(-0.5, 0.5, v[k].shape).astype(np.float32)
        if k.endswith("ssm_a"):     # -exp(A_log)
            v[k] = -v[k]
    if cfg.arch == "gpt-oss":   # gates and ups past swiglu_oai's clips at +-7
        for k in v:
            if k.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
                v[k] *= 16
    if cfg.arch == "gemma4" and cfg.rope_freqs:     # the converter's proportional rope
        turning = len(v["rope_freqs.weight"]) // 4
        v["rope_freqs.weight"][:] = 1e30
        v["rope_freqs.weight"][:turning] = 1.0
    return v


def write_plain(path, cfg, values):
    """As llama.cpp's converter writes it: no ggwgpu.config_json."""
    # llama.cpp looks up </s> in a vocabulary whose model name says phi3: a byte vocabulary
    # has none, so the name must not say it
    meta = gguf_llama.model_metadata(path, cfg, ByteTokenizer(), {"general.name": "tiny"})
    del meta[gguf_llama.K_CONFIG_JSON]
    gguf_file.write_gguf(path, meta, values)


def ggwgpu_logits(backend, cfg, values, tokens, adapters=()):
    g = build_train_graph(cfg, values, 1, adapters=adapters, frozen=True)
    plan = backend.plan(g.logits)
    plan.run({g.tokens: np.asarray(tokens, np.int32)[None],
              g.positions: np.arange(cfg.n_ctx, dtype=np.int32)})
    return g.read_logits(plan)[0]


def llama_cpp_model(path, lora_path=None):
    # YaRN's settings from the file, as llama.cpp's own tools take them (llama-cpp-python's
    # defaults would replace the file's betas with 32 and 1)
    return llama_cpp.Llama(str(path), n_ctx=N, logits_all=True, type_k=0, type_v=0,
                           n_threads=2, verbose=False, lora_path=lora_path and str(lora_path),
                           n_batch=N, n_ubatch=N, yarn_attn_factor=-1.0, yarn_beta_fast=-1.0,
                           yarn_beta_slow=-1.0)


def llama_cpp_logits(llm, tokens):
    llm.reset()
    llm.eval(list(map(int, tokens)))
    return np.array(llm.scores[:len(tokens)], np.float64)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def greedy_ggwgpu(backend, cfg, values, prompt, n):
    d = Decoder(backend, cfg, values)
    out, logits = [], d.prefill(prompt)
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = d.step(out[-1])
    return out


def greedy_llama_cpp(llm, prompt, n):
    llm.reset()
    llm.eval(list(map(int, prompt)))
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


def compare(name, backends):
    cfg = CONFIGS[name]
    values = values_of(cfg)
    tmp = Path(tempfile.mkdtemp())
    write_plain(tmp / "m.gguf", cfg, values)
    tokens = np.random.default_rng(7).integers(3, cfg.n_vocab, N)
    llm = llama_cpp_model(tmp / "m.gguf")
    theirs = llama_cpp_logits(llm, tokens)
    rows = {"ref64 vs llama.cpp": rel(reference_logits(cfg, values, tokens), theirs)}
    for bname, backend in backends.items():
        rows[f"{bname} vs llama.cpp"] = rel(ggwgpu_logits(backend, cfg, values, tokens), theirs)
    prompt = tokens[:8]
    mine = greedy_ggwgpu(backends["numpy"], cfg, values, prompt, 24)
    rows["greedy tokens equal (of 24)"] = sum(a == b for a, b in
                                              zip(mine, greedy_llama_cpp(llm, prompt, 24)))
    del llm
    # a LoRA adapter with random non-zero pairs
    adapter = lora.init_adapter(cfg, lora.lora_ranks(cfg, 4), 8.0, seed=3)
    rng = np.random.default_rng(4)
    for k, t in adapter.tensors.items():
        if k.endswith(".lora_b"):
            adapter.tensors[k] = rng.uniform(-0.3, 0.3, t.shape).astype(np.float32)
    lora.save_adapter(tmp / "a.gguf", adapter, cfg)
    adapted_llm = llama_cpp_model(tmp / "m.gguf", tmp / "a.gguf")
    theirs_a = llama_cpp_logits(adapted_llm, tokens)
    mine_a = ggwgpu_logits(backends["numpy"], cfg, values, tokens, (adapter,))
    rows["adapter moves llama.cpp's logits"] = rel(theirs_a, theirs)
    rows["adapter: numpy vs llama.cpp --lora"] = rel(mine_a, theirs_a)
    del adapted_llm
    mcfg, merged = lora.merge(cfg, values, [adapter])
    write_plain(tmp / "merged.gguf", mcfg, merged)
    merged_llm = llama_cpp_model(tmp / "merged.gguf")
    rows["merged: llama.cpp vs ggwgpu adapted"] = rel(llama_cpp_logits(merged_llm, tokens),
                                                       mine_a)
    for k, v in rows.items():
        print(f"{name:15s} {k:38s} {v:.3g}" if isinstance(v, float) else
              f"{name:15s} {k:38s} {v}")
    sys.stdout.flush()


if __name__ == "__main__":
    backends = {"numpy": NumpyBackend()}
    if "--wgpu" in sys.argv:
        from ggwgpu.backends import shared_wgpu_backend
        backends["wgpu"] = shared_wgpu_backend()
    for name in [a for a in sys.argv[1:] if not a.startswith("--")] or CONFIGS:
        compare(name, backends)
