"""Model families, one module each (llama.cpp's src/models/<arch>.cpp), built from the pieces
of blocks.py on the base block of family.py; transformer.py makes their graphs.

FAMILIES maps llama.cpp's general.architecture to its family."""
from . import (afmoe, arcee, bailingmoe2, cohere2, command_r, deepseek2, ernie4_5, ernie4_5_moe,
               exaone, exaone4, falcon_h1, gemma2, gemma3, gemma4, glm4, glm4moe, gpt2, gpt_oss,
               gptneox, granite, granitehybrid, granitemoe, hunyuan_dense, hunyuan_moe, internlm2,
               lfm2, lfm2moe, llama, minicpm, minicpm3, mistral3, mistral4, nemotron, nemotron_h,
               nemotron_h_moe, olmo2, olmoe, phi2, phi3, phimoe, qwen2, qwen2moe, qwen3, qwen35,
               qwen35moe, qwen3moe, seed_oss, smallthinker, smollm3, stablelm, starcoder2)

FAMILIES = {m.FAMILY.arch: m.FAMILY
            for m in (llama, qwen2, qwen3, gemma2, gemma3, smollm3, phi3, granite, lfm2, gemma4,
                       qwen35, olmo2, ernie4_5, exaone4, mistral3, hunyuan_dense, minicpm, arcee,
                       glm4, granitehybrid, nemotron_h, falcon_h1, qwen3moe, qwen2moe, olmoe,
                       granitemoe, lfm2moe, qwen35moe, phi2, starcoder2, stablelm, gpt_oss,
                       deepseek2, nemotron_h_moe, ernie4_5_moe, gpt2, command_r, cohere2, gptneox,
                       exaone, internlm2, minicpm3, nemotron, glm4moe, seed_oss, phimoe,
                       hunyuan_moe, bailingmoe2, afmoe, smallthinker, mistral4)}


# Archs of well-known models that ggwgpu does not compute yet, and what it lacks for them:
# a file of one is refused saying so (gguf_llama.read_model), not only that it is unknown.
MISSING = {
    **dict.fromkeys(("llama4", "qwen3next"),
                    "mixture-of-experts blocks"),
    "mamba2": "Mamba2 models without attention", "jamba": "Jamba's Mamba and experts",
    "mamba": "Mamba layers", "rwkv7": "RWKV-7 layers",
    "jais": "LayerNorm blocks",
    "gemma3n": "Gemma 3n's AltUp and LAuReL blocks", "apertus": "the xIELU activation",
    "bert": "encoder models",
}


def arch_list() -> str:
    """The archs ggwgpu reads, for messages: "'llama', 'qwen2' and 'qwen3'"."""
    names = [repr(a) for a in FAMILIES]
    return ", ".join(names[:-1]) + " and " + names[-1]


from .blocks import LORA, LORA_A, LORA_B, OUTPUT, ROPE_FREQS, TOKEN_EMBD, attention  # noqa: E402
from .config import ModelConfig  # noqa: E402
from .transformer import (FROZEN, MAX_LOGITS_BYTES, PRECISIONS, ROPE_TABLES,  # noqa: E402
                          DecodeGraph, TrainGraph, build_decode_graph, build_train_graph, frozen,
                          half_values, init_parameters, matrix_shapes, model_weights,
                          packed_inputs, parameter_shapes, vector_like)

__all__ = ["FAMILIES", "MISSING", "arch_list", "ModelConfig", "TrainGraph", "DecodeGraph",
           "build_train_graph", "build_decode_graph", "init_parameters", "parameter_shapes",
           "matrix_shapes", "model_weights", "half_values", "packed_inputs", "attention", "FROZEN",
           "ROPE_TABLES", "frozen", "MAX_LOGITS_BYTES", "PRECISIONS", "LORA", "LORA_A", "LORA_B",
           "OUTPUT", "ROPE_FREQS", "TOKEN_EMBD", "vector_like"]
