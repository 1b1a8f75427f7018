"""mistral4 (Mistral Large 3 and the other models llama.cpp's converter writes as mistral4;
llama.cpp's llama_model_mistral4, which is its deepseek2 under another name): deepseek2's
latent attention and experts as they are (models.deepseek2); the converter writes the
experts' gate and up as one stack (ffn_gate_up_exps), read as it is."""
from .deepseek2 import Deepseek2


class Mistral4(Deepseek2):
    arch = "mistral4"


FAMILY = Mistral4()
