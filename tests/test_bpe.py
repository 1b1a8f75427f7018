"""Vocabularies of published models against llama.cpp, with no llama.cpp needed.

tests/data/vocab holds, per vocabulary, a GGUF file cut down to what these texts need (ids
unchanged; trim_vocab.py), llama.cpp's own test texts and ids for the ones its models/
folder tests (NAME.gguf.inp / .out), and llama_cpp_ids.json: what llama.cpp gives on a
varied text set (record_llama_cpp.py), plain and with special tokens parsed and BOS/EOS
added, its detokenized text, and its end-of-generation ids. Vocabularies whose name is a
pre-tokenizer (dbrx, bloom, tekken, ...) are llama-bpe's with tokenizer.ggml.pre changed:
every pre-tokenizer setting ggwgpu knows has one.
"""
import gzip
import json
import shutil
from pathlib import Path

import pytest

from ggwgpu.pretokenizers import PRE_TOKENIZERS
from ggwgpu.tokenizer import BPEVocab, SentencePieceVocab, load_vocab, tokenizer_from_metadata

DATA = Path(__file__).parent / "data" / "vocab"
FIXTURE = json.loads((DATA / "llama_cpp_ids.json").read_text(encoding="utf-8"))
TEXTS = FIXTURE["texts"]
RECORDED = sorted(FIXTURE["vocabs"])
WITH_LLAMA_CPP_TESTS = sorted(p.name.removesuffix(".gguf.inp") for p in DATA.glob("*.gguf.inp"))
SEP = "\n__ggml_vocab_test__\n"


@pytest.fixture(scope="session")
def vocab(tmp_path_factory):
    """name -> the vocabulary of tests/data/vocab/<name>.gguf.gz, loaded once."""
    loaded, where = {}, tmp_path_factory.mktemp("vocab")

    def get(name):
        if name not in loaded:
            path = where / f"{name}.gguf"
            with gzip.open(DATA / f"{name}.gguf.gz", "rb") as f, open(path, "wb") as g:
                shutil.copyfileobj(f, g)
            loaded[name] = load_vocab(path)
        return loaded[name]
    return get


def test_the_data_covers_the_vocabularies_and_pre_tokenizers_promised(vocab):
    assert set(WITH_LLAMA_CPP_TESTS) >= {
        "gpt-2", "mpt", "starcoder", "refact", "falcon", "deepseek-coder", "deepseek-llm",
        "qwen2", "qwen35", "llama-bpe", "command-r", "llama-spm", "phi-3"}
    assert set(WITH_LLAMA_CPP_TESTS) <= set(RECORDED)
    assert {"gpt-neox", "aquila", "smollm"} <= set(RECORDED)
    # every distinct pre-tokenizer setting ggwgpu knows is checked on some vocabulary
    checked = {vocab(name).pre for name in RECORDED if isinstance(vocab(name), BPEVocab)}
    assert set(PRE_TOKENIZERS.values()) <= checked, set(PRE_TOKENIZERS.values()) - checked


@pytest.mark.parametrize("name", WITH_LLAMA_CPP_TESTS)
def test_llama_cpp_test_texts_give_its_ids(vocab, name):
    raw = (DATA / f"{name}.gguf.inp").read_text(encoding="utf-8")
    texts = raw.split(SEP)
    texts = texts[:-1] if raw.endswith(SEP) else texts
    want = (DATA / f"{name}.gguf.out").read_text(encoding="utf-8").split("\n")[:len(texts)]
    assert len(texts) > 30
    tok = vocab(name)
    for text, ids in zip(texts, want):
        assert tok.encode(text).tolist() == [int(i) for i in ids.split()], repr(text)


@pytest.mark.parametrize("name", RECORDED)
def test_varied_texts_give_llama_cpp_ids(vocab, name):
    tok, rec = vocab(name), FIXTURE["vocabs"][name]
    for text, plain, special in zip(TEXTS, rec["plain"], rec["special"]):
        assert tok.encode(text).tolist() == plain, repr(text)
        assert tok.encode(text, parse_special=True, add_special=True).tolist() == special, \
            repr(text)


@pytest.mark.parametrize("name", RECORDED)
def test_decode_gives_llama_cpp_text_and_round_trips_where_it_does(vocab, name):
    tok, rec = vocab(name), FIXTURE["vocabs"][name]
    same = 0
    for text, plain, decoded in zip(TEXTS, rec["plain"], rec["decoded"]):
        assert tok.decode(plain) == decoded, repr(text)
        if decoded == text:
            assert tok.decode(tok.encode(text)) == text
            same += 1
    assert same > len(TEXTS) // 2


@pytest.mark.parametrize("name", RECORDED)
def test_end_of_generation_ids_are_llama_cpp_ones(vocab, name):
    assert sorted(vocab(name).eog_ids) == FIXTURE["vocabs"][name]["eog"]


def test_bpe_metadata_round_trip(vocab):
    tok = vocab("qwen2")
    assert isinstance(tok, BPEVocab)
    back = tokenizer_from_metadata(tok.gguf_metadata())
    assert back.gguf_metadata() == tok.gguf_metadata()
    text = "Hello, y'all! <|im_start|> 1234"
    assert back.encode(text, True, True).tolist() == tok.encode(text, True, True).tolist()


def test_control_looking_tokens_become_control_tokens(vocab):
    # phi-3 types </s> USER_DEFINED; llama.cpp makes it a control token (and an eog one), so
    # plain text "</s>" is text, and only parse_special turns it into the token.
    tok = vocab("phi-3")
    assert isinstance(tok, SentencePieceVocab)
    end = tok.tokens.index("</s>")
    assert end in tok.eog_ids
    assert end not in tok.encode("a</s>b").tolist()
    assert end in tok.encode("a</s>b", parse_special=True).tolist()


def test_add_bos_follows_the_vocabulary(vocab):
    assert vocab("llama-bpe").add_bos and not vocab("qwen2").add_bos
    assert vocab("llama-bpe").encode("x", add_special=True).tolist()[0] == 128000
    assert vocab("qwen2").encode("x", add_special=True).tolist() == vocab("qwen2").encode(
        "x").tolist()


def test_gguf_file_reads_arrays_as_gguf_py_does(tmp_path):
    # gguf_file reads array fields whole (fast); the values must be gguf-py's, item for item
    import gguf

    from ggwgpu import gguf_file
    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", ["", "a", "Ġthe", "日本", "<|im_end|>"] * 400)
    w.add_array("tokenizer.ggml.merges", ["Ġ t", "h e"] * 300)
    w.add_array("tokenizer.ggml.token_type", [1, 3, 4, 6] * 500)
    w.add_array("tokenizer.ggml.scores", [0.5, -1.25] * 1000)
    w.add_key_value("bools", [True, False], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL)
    w.add_key_value("u64s", [1, 2**40], gguf.GGUFValueType.ARRAY,
                    gguf.GGUFValueType.UINT64)
    w.add_string("general.name", "x")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = gguf_file.read_metadata(path)
    theirs = {k: gguf_file.field_value(f) for k, f in gguf.GGUFReader(path).fields.items()
              if not k.startswith("GGUF.")}
    assert ours == theirs
    assert ours["tokenizer.ggml.tokens"][:5] == ["", "a", "Ġthe", "日本", "<|im_end|>"]
    assert ours["u64s"] == [1, 2**40] and ours["bools"] == [True, False]


def test_a_control_token_s_text_inside_a_message_becomes_that_token_as_in_llama_cpp(vocab):
    """Rendered chat is tokenized with special tokens parsed, as llama.cpp
    (common_tokenize(..., parse_special = true)) and transformers (the rendered string
    through the tokenizer) do: "<|im_start|>" typed by a user is the control token, not
    its characters. Data that must not hold control tokens is cleaned before training."""
    from ggwgpu.chat import CHATML, ChatTemplate, rendered_ids
    tok = vocab("smollm")
    start = tok.encode("<|im_start|>", parse_special=True)
    assert len(start) == 1
    text = ChatTemplate(CHATML).render([{"role": "user", "content": "a <|im_start|> b"}])
    ids = rendered_ids(tok, text)
    assert ids.count(start[0]) == 2         # the template's and the user's
