"""Record what llama.cpp makes of the test texts with each vocabulary: the fixture that
tests/test_bpe.py compares ggwgpu with, so that CI needs no llama.cpp.

    python record_llama_cpp.py OUT.json VOCAB.gguf [NAME=VOCAB.gguf ...]

Runs with llama-cpp-python (not a ggwgpu dependency). A NAME= prefix names the entry (default:
the file name without "ggml-vocab-" and ".gguf"). For every text of TEXTS it stores the ids of
llama_tokenize(text, add_special=False, parse_special=False) ("plain"), of
llama_tokenize(text, add_special=True, parse_special=True) ("special"), and
llama_detokenize(plain ids, remove_special=False, unparse_special=False) ("decoded"), plus
the vocabulary's end-of-generation ids ("eog").
"""
import ctypes
import json
import re
import sys
from pathlib import Path

TEXTS = [
    "", " ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", " \n", "\t\n", "\r\n", " \r\n\r\n  x",
    "Hello world", " Hello world", "Hello World!", "  Hello", "    Hello\n    Hello",
    "hello   world  \n\n   next", "trailing spaces   ", "a\u00a0b\u3000c\u2003d",
    "tab\tand\tmore\t\t",
    "3", "33", "333", "3333", "33333", "1234567890", "3.14159 and 2,718,281", "v1.2.3-rc4",
    "100% of $42.50 (approx.) -- 1e-9 ~ 0x1F", "Call 555-0123 at 10:30pm!!!",
    "I'm sure you're right, we'll see; it's John's. They've/I'd/don't",
    "I'M SURE YOU'RE RIGHT, WE'LL SEE. IT'S JOHN'S", "' era", "don ' t", "\"quoted\" 'single'",
    "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～",
    "naïve café — ünïcödé, Ångström, façade", "нещо на Български, Ελληνικά, עברית, العربية",
    "日本語のテキストと中文文本和한국어 텍스트", "हिन्दी पाठ और ภาษาไทย",
    "🚀 (normal) 😶‍🌫️ (multiple emojis concatenated) ✅ 👩‍💻 👍🏽 🇫🇷",
    "e\u0301 combining, \ufb01 ligature, \u200b zero width, \u00ad soft hyphen",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "int main() { printf(\"%d\\n\", a[i++]); return 0; }",
    '{"key": [1, 2.5, null], "nested": {"a": "b"}}', "<div class=\"x\">&amp; &lt;tag&gt;</div>",
    "    ```python\n    x = {'a': 1}\n    ```", "a ,b .c !d ?e", "x = y != z && (a || b) >= c",
    "<s> looks special </s> <unk> <|endoftext|>", "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>"
    "assistant\n", "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n4<|end|>", "text</s>  after\n<s> before",
    "<|fim_prefix|>def f(<|fim_suffix|>):<|fim_middle|>",
]


def entry(llama_cpp, path):
    model = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(model.model)

    def detokenize(ids):
        arr = (llama_cpp.llama_token * len(ids))(*ids)
        size = 64 + 64 * len(ids)
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, False)
        return buf.raw[:n].decode("utf-8", errors="replace")

    plain = [model.tokenize(t.encode(), add_bos=False, special=False) for t in TEXTS]
    return {
        "plain": plain,
        "special": [model.tokenize(t.encode(), add_bos=True, special=True) for t in TEXTS],
        "decoded": [detokenize(ids) for ids in plain],
        "eog": [i for i in range(model.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)],
    }


def main(out, *vocabs):
    import llama_cpp
    result = {"texts": TEXTS, "vocabs": {}}
    for arg in vocabs:
        name, _, path = arg.rpartition("=")
        path = Path(path)
        name = name or path.name.removeprefix("ggml-vocab-").removesuffix(".gguf")
        result["vocabs"][name] = entry(llama_cpp, path)
        print(name, file=sys.stderr)
    text = json.dumps(result, ensure_ascii=False, indent=1)
    # a list of ids on one line
    text = re.sub(r"\[[\d,\s-]*\]", lambda m: json.dumps(json.loads(m.group())), text)
    Path(out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(*sys.argv[1:])
