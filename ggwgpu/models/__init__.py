"""Model families, one module each (llama.cpp's src/models/<arch>.cpp), built from the pieces
of blocks.py on the base block of family.py; transformer.py makes their graphs.

FAMILIES maps llama.cpp's general.architecture to its family."""
from . import (arcee, ernie4_5, exaone4, gemma2, gemma3, gemma4, glm4, granite, hunyuan_dense,
               lfm2, llama, minicpm, mistral3, olmo2, phi3, qwen2, qwen3, qwen35, smollm3)

FAMILIES = {m.FAMILY.arch: m.FAMILY
            for m in (llama, qwen2, qwen3, gemma2, gemma3, smollm3, phi3, granite, lfm2,
                       gemma4, qwen35, olmo2, ernie4_5, exaone4, mistral3, hunyuan_dense,
                       minicpm, arcee, glm4)}


def arch_list() -> str:
    """The archs ggwgpu reads, for messages: "'llama', 'qwen2' and 'qwen3'"."""
    names = [repr(a) for a in FAMILIES]
    return ", ".join(names[:-1]) + " and " + names[-1]


from .blocks import LORA, LORA_A, LORA_B, OUTPUT, ROPE_FREQS, TOKEN_EMBD, attention  # noqa: E402
from .config import ModelConfig  # noqa: E402
from .transformer import (FROZEN, MAX_LOGITS_BYTES, PRECISIONS, ROPE_TABLES,  # noqa: E402
                          DecodeGraph, TrainGraph, build_decode_graph, build_train_graph, frozen,
                          half_values, init_parameters, matrix_shapes, model_weights,
                          packed_inputs, parameter_shapes)

__all__ = ["FAMILIES", "arch_list", "ModelConfig", "TrainGraph", "DecodeGraph", "build_train_graph",
           "build_decode_graph", "init_parameters", "parameter_shapes", "matrix_shapes",
           "model_weights", "half_values", "packed_inputs", "attention", "FROZEN", "ROPE_TABLES",
           "frozen", "MAX_LOGITS_BYTES", "PRECISIONS", "LORA", "LORA_A", "LORA_B", "OUTPUT",
           "ROPE_FREQS", "TOKEN_EMBD"]
