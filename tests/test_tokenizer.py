"""Tokenizers: the byte vocabulary, llama.cpp's SPM and BPE algorithms on hand-made
vocabularies, the byte vocabulary's llama.cpp compatibility, and tokenizer.ggml.* keys through
real GGUF files (published vocabularies against llama.cpp: test_bpe.py).

Expected ids of the SPM cases are worked out by hand from the algorithm (see the comments):
symbols start as characters; the adjacent pair whose concatenation is the best-scored token
merges first (ties: leftmost); leftover symbols that are not tokens become byte tokens."""
import numpy as np
import pytest

from ggwgpu import gguf_file
from ggwgpu.tokenizer import (BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, BPEVocab,
                              ByteTokenizer, SentencePieceVocab, Tokenizer, VocabError,
                              load_vocab, read_metadata, tokenizer_from_metadata)

TEXTS = ["", "hello", "Hello, world!\n", " leading", "trailing ", "double  space",
         "   ", "\n\n a \n", "tab\tand\r\nCRLF", "naïve café — ünïcödé", "日本語のテキスト",
         "emoji 🙂🚀 and ZWJ 👩\u200d💻", "\x00nul and \x7f",
         "<s> looks special </s> <unk>", "<0x41> is not a byte token", "▁ already escaped"]


def test_byte_round_trip_including_non_ascii_and_emoji():
    tok = ByteTokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and ids.ndim == 1
        assert len(ids) == len(text.replace("▁", " ").encode("utf-8"))
        assert tok.decode(ids) == text.replace("▁", " ")
    assert tok.encode("A ").tolist() == [3 + 0x41, 3 + 0x20]
    assert tok.decode([1, 3 + 0x41, 0, 2]) == "A"                 # control tokens dropped
    assert tok.decode([3 + 0xC3]) == "\ufffd"                      # a cut UTF-8 sequence
    with pytest.raises(ValueError, match="259"):
        tok.decode([259])


def test_byte_vocabulary_layout():
    meta = ByteTokenizer().gguf_metadata()
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert ByteTokenizer.n_vocab == len(tokens) == 259
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and types[:3] == [UNKNOWN, CONTROL, CONTROL]
    assert tokens[3 + 0x20] == "▁" and types[3 + 0x20] == NORMAL
    assert tokens[3 + 0x0A] == "<0x0A>" and tokens[3 + 0xFF] == "<0xFF>"
    assert all(t == BYTE for i, t in enumerate(types[3:]) if i != 0x20)
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.add_space_prefix"] is False
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["tokenizer.ggml.add_eos_token"] is False
    assert all(type(s) is float for s in meta["tokenizer.ggml.scores"])
    assert [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "unknown")] == [1, 2, 0]
    assert ByteTokenizer.newline_ids == (3 + 0x0A,)


def test_metadata_round_trip():
    tok = tokenizer_from_metadata(ByteTokenizer().gguf_metadata())
    assert isinstance(tok, ByteTokenizer)
    spm = hand_vocab()
    back = tokenizer_from_metadata(spm.gguf_metadata())
    assert isinstance(back, SentencePieceVocab)
    assert back.gguf_metadata() == spm.gguf_metadata()
    # Any change to the byte vocabulary's settings makes it a general SentencePiece vocabulary.
    meta = ByteTokenizer().gguf_metadata()
    del meta["tokenizer.ggml.add_space_prefix"]                    # llama.cpp default: true
    other = tokenizer_from_metadata(meta)
    assert isinstance(other, SentencePieceVocab) and other.add_space_prefix
    assert other.encode("a").tolist() == [3 + 0x20, 3 + 0x61]      # the prefix llama.cpp adds


def test_metadata_errors_name_the_key_or_model():
    meta = ByteTokenizer().gguf_metadata()
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens"):
        with pytest.raises(VocabError, match=key.replace(".", r"\.")):
            tokenizer_from_metadata({k: v for k, v in meta.items() if k != key})
    with pytest.raises(VocabError, match="'bert' is not supported"):
        tokenizer_from_metadata({**meta, "tokenizer.ggml.model": "bert"})
    with pytest.raises(VocabError, match=r"needs tokenizer\.ggml\.merges"):
        tokenizer_from_metadata({**meta, "tokenizer.ggml.model": "gpt2"})
    with pytest.raises(VocabError, match="'no-such-pre' is not a pre-tokenizer"):
        tokenizer_from_metadata({**meta, "tokenizer.ggml.model": "gpt2",
                                 "tokenizer.ggml.merges": [], "tokenizer.ggml.pre": "no-such-pre"})
    for pre, said in (("x" * 1_000_000, r"'xxxx.*'\.\.\. \(1000000 characters\) is not"),
                      (["qwen2"], "must be a string")):
        with pytest.raises(VocabError, match=said) as e:
            tokenizer_from_metadata({**meta, "tokenizer.ggml.model": "gpt2",
                                     "tokenizer.ggml.merges": [], "tokenizer.ggml.pre": pre})
        assert len(str(e.value)) < 2000       # a hostile name is not echoed whole
    with pytest.raises(VocabError, match="scores has 3 entries for 259"):
        tokenizer_from_metadata({**meta, "tokenizer.ggml.scores": [0.0] * 3})
    with pytest.raises(VocabError, match="bos_token_id = 999"):
        tokenizer_from_metadata({**meta, "tokenizer.ggml.bos_token_id": 999})
    with pytest.raises(VocabError, match="duplicate token"):
        SentencePieceVocab(["a", "b", "a"])


@pytest.mark.parametrize("key, value", [
    ("bos_token_id", "1"), ("eos_token_id", [2]), ("unknown_token_id", 0.5),
    ("bos_token_id", True), ("tokens", None), ("tokens", [1, 2, 3]), ("tokens", "abc"),
    ("token_type", [1.5] * 259), ("token_type", [float("nan")] * 259), ("scores", ["x"] * 259),
])
def test_metadata_values_of_the_wrong_type_are_vocab_errors(key, value):
    # what a forged file can hold: nested arrays read as None, strings, floats, lists
    meta = {**ByteTokenizer().gguf_metadata(), "tokenizer.ggml." + key: value}
    with pytest.raises(VocabError, match=r"tokenizer\.ggml\." + key):
        tokenizer_from_metadata(meta)


# -- llama.cpp's SPM algorithm on a hand-made vocabulary -------------------------------------

def hand_vocab(he_score=-1.5, add_space_prefix=False):
    """<unk> <s> </s>, the 256 byte tokens (ids 3..258), then the pieces below."""
    pieces = [("▁", -1.0), ("t", -2.0), ("h", -2.0), ("e", -2.0), ("th", -3.0),
              ("he", he_score), ("▁t", -4.0), ("▁the", -5.0), ("a", -2.0), ("aa", -1.0),
              ("<tag>", 0.0)]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    tokens += [p for p, _ in pieces]
    types += [USER_DEFINED if p == "<tag>" else NORMAL for p, _ in pieces]
    scores = [0.0] * 259 + [s for _, s in pieces]
    return SentencePieceVocab(tokens, scores, types, add_space_prefix=add_space_prefix)


SP, T, H, E, TH, HE, SP_T, SP_THE, A, AA, TAG = range(259, 270)


def byte_ids(text):
    return [3 + b for b in text.encode("utf-8")]


def test_spm_merges_go_by_score():
    # "the": pairs "th" (-3) and "he" (-1.5); "he" scores better and merges first, after
    # which "t"+"he" = "the" is no token: t, he.
    assert hand_vocab().encode("the").tolist() == [T, HE]
    # With "he" scored -3.5, "th" (-3) goes first and "th"+"e" is no token: th, e.
    assert hand_vocab(he_score=-3.5).encode("the").tolist() == [TH, E]


def test_spm_merges_chain_through_worse_scores():
    # " the" -> "▁the": "he" (-1.5) merges, then "th" is stale, then "▁t" (-4), and then
    # "▁t"+"he" = "▁the" (-5) is a token and merges last.
    vocab = hand_vocab()
    assert vocab.encode(" the").tolist() == [SP_THE]
    # add_space_prefix puts the "▁" in front of the text itself.
    assert hand_vocab(add_space_prefix=True).encode("the").tolist() == [SP_THE]
    # Spaces are each a "▁"; one of them starts the "▁the".
    assert vocab.encode("  the ").tolist() == [SP, SP_THE, SP]


def test_spm_ties_merge_leftmost_first():
    # "aaa": both pairs are "aa" with the same score; the left one merges: aa, a.
    assert hand_vocab().encode("aaa").tolist() == [AA, A]
    assert hand_vocab().encode("aaaa").tolist() == [AA, AA]


def test_spm_unknown_characters_fall_back_to_bytes():
    # "é" and "🙂" are not tokens: their UTF-8 bytes are. "th" merges as usual.
    vocab = hand_vocab()
    assert vocab.encode("thé").tolist() == [TH] + byte_ids("é")
    assert vocab.encode("x🙂").tolist() == byte_ids("x🙂")
    assert vocab.decode(vocab.encode("thé x🙂")) == "thé x🙂"


def test_spm_special_tokens():
    vocab = hand_vocab(add_space_prefix=True)
    # User-defined tokens are cut out first; each text piece after one gets the space prefix.
    assert vocab.encode("x<tag>e").tolist() == [SP] + byte_ids("x") + [TAG, SP, E]
    # Control tokens only with parse_special.
    assert vocab.encode("<s>e").tolist() == [SP] + byte_ids("<s>") + [E]
    assert vocab.encode("<s>e", parse_special=True).tolist() == [1, SP, E]
    # decode: control tokens give nothing, the prefix space of the first piece is dropped.
    assert vocab.decode([1, SP_THE, SP, TAG, E]) == " the <tag>e"
    assert vocab.decode([SP_THE, SP, E]) == "the e"


def test_byte_tokenizer_equals_llama_cpp_algorithm_on_its_exported_vocab():
    """The compatibility property: SentencePieceVocab is llama.cpp's SPM tokenizer, fed the
    vocabulary ByteTokenizer exports; both must give the same ids for any text."""
    byte = ByteTokenizer()
    spm = SentencePieceVocab(**_spm_kwargs(byte.gguf_metadata()))
    rng = np.random.default_rng(0)
    alphabet = list(" \n\t ab▁é€日🙂<>s/0xunk") + ["<s>", "</s>", "<unk>"]
    texts = TEXTS + ["".join(rng.choice(alphabet, size=rng.integers(1, 40)))
                     for _ in range(200)]
    for text in texts:
        assert spm.encode(text).tolist() == byte.encode(text).tolist(), repr(text)
        assert spm.encode(text, parse_special=True, add_special=True).tolist() == \
            byte.encode(text, parse_special=True, add_special=True).tolist(), repr(text)
        assert spm.decode(byte.encode(text)) == byte.decode(byte.encode(text))
    assert spm.newline_ids == byte.newline_ids


def _spm_kwargs(meta):
    k = "tokenizer.ggml."
    return dict(tokens=meta[k + "tokens"], scores=meta[k + "scores"],
                token_types=meta[k + "token_type"], bos_id=meta[k + "bos_token_id"],
                eos_id=meta[k + "eos_token_id"], unk_id=meta[k + "unknown_token_id"],
                add_space_prefix=meta[k + "add_space_prefix"])


# -- GGUF files ------------------------------------------------------------------------------

def write_gguf(path, meta):
    """A metadata-only GGUF, Python types mapped as gguf_metadata documents."""
    gguf_file.write_metadata(path, meta)


def test_byte_vocabulary_through_a_gguf_file(tmp_path):
    meta = ByteTokenizer().gguf_metadata()
    write_gguf(tmp_path / "byte.gguf", meta)
    assert read_metadata(tmp_path / "byte.gguf") == meta
    assert isinstance(load_vocab(tmp_path / "byte.gguf"), ByteTokenizer)


def test_sentencepiece_vocabulary_through_a_gguf_file(tmp_path):
    vocab = hand_vocab(add_space_prefix=True)
    meta = {**vocab.gguf_metadata(), "tokenizer.ggml.pre": "default"}
    write_gguf(tmp_path / "spm.gguf", meta)
    back = load_vocab(tmp_path / "spm.gguf")
    assert isinstance(back, SentencePieceVocab)
    assert back.gguf_metadata() == meta                            # extra keys kept
    assert back.encode("the thé").tolist() == vocab.encode("the thé").tolist()


def test_load_vocab_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing.gguf"
    with pytest.raises(VocabError, match="missing.gguf: no such file"):
        load_vocab(missing)
    (tmp_path / "text.gguf").write_text("not a gguf file")
    with pytest.raises(VocabError, match="text.gguf: not a GGUF file"):
        load_vocab(tmp_path / "text.gguf")
    write_gguf(tmp_path / "novocab.gguf", {"general.name": "x"})
    with pytest.raises(VocabError, match=r"novocab.gguf: no vocabulary.*tokenizer\.ggml\.model"):
        load_vocab(tmp_path / "novocab.gguf")
    write_gguf(tmp_path / "t5.gguf", {"tokenizer.ggml.model": "t5",
                                      "tokenizer.ggml.tokens": ["a", "b"]})
    with pytest.raises(VocabError, match="t5.gguf: .*'t5' is not supported"):
        load_vocab(tmp_path / "t5.gguf")


# -- llama.cpp's BPE algorithm on a hand-made vocabulary -------------------------------------

def bpe_vocab(merges, pre="gpt-2", extra_tokens=()):
    """The 256 GPT-2 byte characters (id = byte), then `extra_tokens`, then the merges'
    results."""
    from ggwgpu.tokenizer import _BYTE_CHARS
    tokens = list(_BYTE_CHARS) + list(extra_tokens)
    tokens += [m.replace(" ", "") for m in merges if m.replace(" ", "") not in tokens]
    return BPEVocab(tokens, merges, pre=pre)


def test_bpe_merges_go_by_rank_then_leftmost():
    # "abc": (b, c) has the better rank, then (a, bc) is no merge: a, bc.
    v = bpe_vocab(["b c", "a b", "ab c"])
    assert [v.tokens[i] for i in v.encode("abc")] == ["a", "bc"]
    # with (a, b) first, (ab, c) follows: abc.
    v = bpe_vocab(["a b", "b c", "ab c"])
    assert [v.tokens[i] for i in v.encode("abc")] == ["abc"]
    # ties: the leftmost pair first.
    v = bpe_vocab(["a a"])
    assert [v.tokens[i] for i in v.encode("aaa")] == ["aa", "a"]
    # a space is the byte character 'Ġ'; words are cut first, and merges never cross them.
    v = bpe_vocab(["Ġ a", "a b"])
    assert [v.tokens[i] for i in v.encode("ab ab")] == ["ab", "Ġa", "b"]


def test_bpe_ignore_merges_takes_a_word_that_is_a_token_whole():
    # llama-bpe: "abc" is a token though no merge makes it.
    v = bpe_vocab(["a b"], pre="llama-bpe", extra_tokens=["abc"])
    assert [v.tokens[i] for i in v.encode("abc")] == ["abc"]
    v = bpe_vocab(["a b"], pre="gpt-2", extra_tokens=["abc"])
    assert [v.tokens[i] for i in v.encode("abc")] == ["ab", "c"]


def test_bpe_decode_cleans_spaces_where_the_pre_tokenizer_says():
    ids = bpe_vocab([]).encode("a , b ' c 's")
    assert bpe_vocab([]).decode(ids) == "a, b'c's"                   # gpt-2: clean_spaces
    assert bpe_vocab([], pre="qwen2").decode(ids) == "a , b ' c 's"  # qwen2: as written


# -- the Tokenizer protocol ------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    ByteTokenizer,
    lambda: hand_vocab(add_space_prefix=True),
    lambda: bpe_vocab(["h e", "l l", "he ll"], pre="llama-bpe",
                      extra_tokens=["<|im_end|>"])])
def test_every_tokenizer_provides_the_protocol_it_is_used_through(make):
    """isinstance checks the members are there; one text checks what they do: encode and
    decode round-trip, BOS as add_bos says, newline and end-of-generation ids, and the
    GGUF keys give back a tokenizer that encodes alike."""
    tok, text = make(), "hello there\nsecond line"
    assert isinstance(tok, Tokenizer)
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ((0 <= ids) & (ids < tok.n_vocab)).all()
    assert tok.decode(ids) == text and tok.n_vocab == len(tok.tokens)
    with_special = tok.encode(text, add_special=True)
    assert (with_special[0] == tok.bos_id) == (tok.add_bos and tok.bos_id is not None)
    assert tok.eos_id in tok.eog_ids and tok.unk_id in (None, *range(tok.n_vocab))
    assert tok.add_eos is False and set(tok.newline_ids) & set(ids.tolist())
    assert all(tok.decode([i]).endswith("\n") for i in tok.newline_ids)
    again = tokenizer_from_metadata(tok.gguf_metadata())
    assert type(again) is type(tok) and again.encode(text).tolist() == ids.tolist()


def test_an_object_without_decode_is_no_tokenizer():
    class EncodeOnly:
        n_vocab, tokens, bos_id, eos_id, unk_id = 1, ["a"], None, None, None
        add_bos = add_eos = False
        eog_ids, newline_ids = frozenset(), ()

        def encode(self, text, parse_special=False, add_special=False):
            return np.zeros(len(text), np.int32)

        def gguf_metadata(self):
            return {}
    assert not isinstance(EncodeOnly(), Tokenizer)
