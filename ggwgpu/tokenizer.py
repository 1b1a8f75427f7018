"""Tokenizers: text <-> token ids, and the tokenizer.ggml.* keys of a GGUF file.

Three vocabularies, one interface (the `Tokenizer` protocol: `encode`, `decode`,
`n_vocab`, `tokens`, `bos_id`, `eos_id`, `unk_id`, `eog_ids`, `add_bos`, `add_eos`,
`newline_ids`, `gguf_metadata()`):

- `ByteTokenizer`, the default: one token per UTF-8 byte plus <unk>, <s>, </s>. No file
  needed. Exported as a SentencePiece-style ("llama") vocabulary that llama.cpp tokenizes
  into exactly the ids ggwgpu trained on.
- `SentencePieceVocab`: the vocabulary of any llama GGUF (tokens, scores, token types), with
  llama.cpp's SPM tokenizer reimplemented, so `encode` gives the ids llama.cpp gives.
- `BPEVocab`: a byte-level BPE ("gpt2") vocabulary (tokens, merges, the pre-tokenizer that
  tokenizer.ggml.pre names: ggwgpu.pretokenizers), tokenized as llama.cpp does.

`load_vocab(path)` reads a GGUF file's vocabulary; `tokenizer_from_metadata` turns
tokenizer.ggml.* keys into one of the three.

What llama.cpp does to a vocabulary at load, done here too (`_Vocabulary`):
  - token types become attributes; tokens whose text says they end a turn or fill in the
    middle ("<|im_end|>", "<|eot_id|>", "</s>", "<|fim_prefix|>", ...) become control
    tokens whatever their type;
  - `eog_ids`, the end-of-generation set: eos, eot, eom, those texts and the FIM pad, repo
    and separator tokens; generation stops at any of them;
  - for phi-3 models (general.name), text right of a special token loses its leading
    whitespace.

Encoding (llama_tokenize): special tokens are cut out of the text first, longest first:
user-defined ones always, control and unknown ones only with parse_special; each remaining
piece of text goes through the vocabulary's own algorithm; add_special puts BOS before
(if add_bos) and EOS after (if add_eos).

How llama.cpp tokenizes a text piece with a "llama" vocabulary (llm_tokenizer_spm_session):
  1. the piece gets a leading space if add_space_prefix (default true) and it starts the
     text or follows a special token; every ' ' becomes U+2581 '▁';
  2. the piece is split into UTF-8 characters; adjacent symbols whose concatenation is a
     token are merged, highest token score first (ties: leftmost first), until no adjacent
     pair forms a token;
  3. each final symbol is its token, or, if it is not in the vocabulary, one <0xXX> byte
     token per UTF-8 byte.

And with a "gpt2" vocabulary (llm_tokenizer_bpe_session):
  1. the pre-tokenizer cuts the piece into words;
  2. each word's UTF-8 bytes become GPT-2's printable byte characters ('Ġ' for a space);
  3. with ignore_merges (llama-bpe), a word that is a token is that token; otherwise its
     characters merge pairwise, the pair with the lowest merge rank first (ties: leftmost),
     until no adjacent pair is a merge;
  4. each final symbol is its token; one that is not (a vocabulary without all 256 byte
     characters) gives the tokens of its single ASCII bytes, if any.
"""
from __future__ import annotations

import heapq
from typing import Protocol, runtime_checkable

import numpy as np

from . import gguf_file
from .pretokenizers import PreTokenizer, UnknownPreTokenizer, pre_tokenizer, split_words

# llama.cpp's token types (tokenizer.ggml.token_type values).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's token attributes (bit flags), derived from the types at load.
ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL, ATTR_CONTROL, ATTR_USER_DEFINED, ATTR_BYTE = (
    1, 2, 4, 8, 16, 32)
ATTR_LSTRIP, ATTR_RSTRIP = 128, 256
_TYPE_ATTR = {NORMAL: ATTR_NORMAL, UNKNOWN: ATTR_UNKNOWN, CONTROL: ATTR_CONTROL,
              USER_DEFINED: ATTR_USER_DEFINED, UNUSED: ATTR_UNUSED, BYTE: ATTR_BYTE}
_SPECIAL = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN   # cut out of text before encoding

SPACE_PIECE = "\u2581"      # '▁': SentencePiece's visible space
KEY = "tokenizer.ggml."
_C_SPACE = " \t\n\v\f\r"  # C's isspace: what llama.cpp strips next to lstrip/rstrip tokens


class VocabError(gguf_file.GGUFError):
    """A vocabulary is missing, malformed or of a kind ggwgpu cannot tokenize with. A
    GGUFError, so that callers reading GGUF files catch one exception type."""


def byte_piece(b: int) -> str:
    return f"<0x{b:02X}>"


def _split_special(text: str, specials, parse_special: bool) -> list:
    """`text` as a list of text pieces (str) and special token ids (int), as llama.cpp's
    tokenizer_st_partition: `specials` are (id, text, attr), longest first; control and
    unknown tokens only count with parse_special; lstrip/rstrip tokens eat the whitespace
    next to them. Text that is not Unicode (a lone surrogate, as Python decodes bytes that
    are not UTF-8 in a command line) is a VocabError: it has no UTF-8 bytes to tokenize."""
    if not isinstance(text, str):
        raise VocabError(f"cannot encode a {type(text).__name__}: text must be a str")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise VocabError(f"cannot encode the text: character {e.start} is a lone surrogate "
                         f"U+{ord(text[e.start]):04X}, not Unicode (bytes that were not UTF-8?)"
                         ) from None
    fragments: list = [text] if text else []
    for tid, piece, attr in specials:
        if not parse_special and attr & (ATTR_CONTROL | ATTR_UNKNOWN):
            continue
        cut = []
        for frag in fragments:
            if isinstance(frag, int) or piece not in frag:
                cut.append(frag)
                continue
            pos = 0
            while True:
                at = frag.find(piece, pos)
                if at < 0:
                    if pos < len(frag):
                        cut.append(frag[pos:])
                    break
                left = frag[pos:at]
                if attr & ATTR_LSTRIP:
                    left = left.rstrip(_C_SPACE)
                if left:
                    cut.append(left)
                cut.append(tid)
                pos = at + len(piece)
                if attr & ATTR_RSTRIP:
                    while pos < len(frag) and frag[pos] in _C_SPACE:
                        pos += 1
        fragments = cut
    return fragments


# -- the byte vocabulary ---------------------------------------------------------------------

_N_SPECIAL = 3                                  # <unk>, <s>, </s>
_BYTE_TOKENS = ["<unk>", "<s>", "</s>"] + [
    SPACE_PIECE if b == 0x20 else byte_piece(b) for b in range(256)]
_BYTE_TYPES = [UNKNOWN, CONTROL, CONTROL] + [NORMAL if b == 0x20 else BYTE for b in range(256)]


@runtime_checkable
class Tokenizer(Protocol):
    """What training, generation, chat and the GGUF writers use of a tokenizer; ByteTokenizer,
    SentencePieceVocab and BPEVocab provide it. Ids are ints in 0 .. n_vocab - 1; a role
    the vocabulary lacks (no BOS, no <unk>) is None."""

    @property
    def n_vocab(self) -> int: ...
    @property
    def tokens(self) -> list[str]:
        """Each id's token text, as the GGUF file spells it."""
    @property
    def bos_id(self) -> int | None: ...
    @property
    def eos_id(self) -> int | None: ...
    @property
    def unk_id(self) -> int | None: ...
    @property
    def add_bos(self) -> bool:
        """Whether a text starts with BOS (encode's add_special; a generation's context)."""
    @property
    def add_eos(self) -> bool:
        """Whether encode(add_special=True) ends a text with EOS."""
    @property
    def eog_ids(self) -> frozenset[int]:
        """The ids that end a generation (eos, end of turn, ...)."""
    @property
    def newline_ids(self) -> tuple[int, ...]:
        """The ids of the tokens whose text ends with a newline (samples start after one)."""

    def encode(self, text: str, parse_special: bool = False,
               add_special: bool = False) -> np.ndarray:
        """int32 ids of `text`; parse_special: control tokens' texts are those tokens;
        add_special: BOS first (and EOS last) as add_bos (add_eos) say."""

    def decode(self, ids) -> str:
        """The text of `ids` (special tokens give none), invalid UTF-8 as U+FFFD."""

    def gguf_metadata(self) -> dict[str, object]:
        """The tokenizer.ggml.* keys that describe the vocabulary (and any other tokenizer.*
        key it read, e.g. the chat template)."""


class ByteTokenizer:
    """One token per UTF-8 byte: id = byte + 3, after <unk> (0), <s> (BOS, 1), </s> (EOS, 2).

    Exported (`gguf_metadata`) as a "llama" vocabulary whose byte tokens are the pieces
    "<0x00>".."<0xFF>" (type BYTE) except the space, which is the piece "▁" (type NORMAL),
    with add_space_prefix false. llama.cpp's SPM tokenizer then gives the same ids for any
    text: it turns each space into '▁', which is a token (id 35); no two tokens concatenate
    into a third, so nothing ever merges; every other character is missing from the
    vocabulary and falls back to its UTF-8 byte tokens; and it prepends no space. llama.cpp
    detokenizes "▁" (NORMAL) back to a space and byte tokens to their bytes.

    One consequence, mirrored by `encode`: llama.cpp cannot tell a '▁' typed in the text from
    a space, so `encode` reads U+2581 as a space (and `decode` gives a space back).

    Scores are all 0.0: with no possible merge the SPM tokenizer never consults them, and 0.0
    is also what llama.cpp assumes when a file has no scores.

    `gguf_metadata()` returns the tokenizer.ggml.* keys, with Python types that decide the
    GGUF types the writer uses: str -> string, bool -> bool, int -> uint32, float ->
    float32, list[str] -> string array, list[float] -> float32 array, list[int] -> int32
    array.
    """

    n_vocab = len(_BYTE_TOKENS)                 # 259
    unk_id, bos_id, eos_id = 0, 1, 2
    add_bos, add_eos = True, False
    eog_ids = frozenset({eos_id})
    newline_ids = (_N_SPECIAL + 0x0A,)          # ids of tokens whose text ends with "\n"
    # what llama.cpp's special-token parsing sees in the exported vocabulary, longest first
    _specials = ((0, "<unk>", ATTR_UNKNOWN), (2, "</s>", ATTR_CONTROL), (1, "<s>", ATTR_CONTROL))

    @property
    def tokens(self) -> list[str]:
        return list(_BYTE_TOKENS)

    def encode(self, text: str, parse_special: bool = False,
               add_special: bool = False) -> np.ndarray:
        """UTF-8 bytes + 3, as int32. U+2581 '▁' is read as a space (see above).
        parse_special: "<unk>", "<s>", "</s>" in the text are those tokens; add_special: BOS
        first."""
        parts = [np.array([self.bos_id], np.int32)] if add_special else []
        for frag in _split_special(text, self._specials, parse_special):
            if isinstance(frag, int):
                parts.append(np.array([frag], np.int32))
            else:
                data = frag.replace(SPACE_PIECE, " ").encode("utf-8")
                parts.append(np.frombuffer(data, np.uint8).astype(np.int32) + _N_SPECIAL)
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def decode(self, ids) -> str:
        """Bytes back to text (invalid UTF-8 becomes U+FFFD); <unk>, <s>, </s> are dropped."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = (ids < 0) | (ids >= self.n_vocab)
        if bad.any():
            raise ValueError(f"token id {int(ids[bad][0])} is outside the byte vocabulary "
                             f"(0..{self.n_vocab - 1})")
        data = (ids[ids >= _N_SPECIAL] - _N_SPECIAL).astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")

    def gguf_metadata(self) -> dict[str, object]:
        return {
            KEY + "model": "llama",
            KEY + "tokens": list(_BYTE_TOKENS),
            KEY + "scores": [0.0] * self.n_vocab,
            KEY + "token_type": list(_BYTE_TYPES),
            KEY + "bos_token_id": self.bos_id,
            KEY + "eos_token_id": self.eos_id,
            KEY + "unknown_token_id": self.unk_id,
            KEY + "add_space_prefix": False,
            KEY + "add_bos_token": True,
            KEY + "add_eos_token": False,
        }

    def __repr__(self) -> str:
        return f"ByteTokenizer(n_vocab={self.n_vocab})"


# -- what every vocabulary file gets at load ---------------------------------------------------

# Token texts llama.cpp recognises (llama_vocab::impl::load): a role's first token by id,
# unless the file names it; each becomes a control token.
_ROLE_TEXTS = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
            "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
            "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# The keys that name a role's token instead (the older prefix/suffix/middle names too).
_ROLE_KEYS = {"eot": ("eot",), "eom": ("eom",), "fim_pre": ("fim_pre", "prefix"),
              "fim_suf": ("fim_suf", "suffix"), "fim_mid": ("fim_mid", "middle"),
              "fim_pad": ("fim_pad",), "fim_rep": ("fim_rep",), "fim_sep": ("fim_sep",)}
# Texts of end-of-generation tokens.
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~["))
# gpt-oss: always shown, so user-defined.
_ALWAYS_SHOWN = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


class _Vocabulary:
    """What all vocabularies read from files share: tokens and types, llama.cpp's load-time
    attributes and end-of-generation set, special-token parsing, encode and decode around the
    per-piece algorithm of the subclass (`_encode_piece`, `_normal_piece_bytes`).

    Ids: bos/eos/unk must lie in the vocabulary (None: none); the eot, eom and FIM ids are
    read from `extra` (tokenizer.ggml.eot_token_id, ...) where in range, as llama.cpp.
    `model_name` (general.name) matters for phi-3 only."""

    def __init__(self, tokens, token_types, *, bos_id, eos_id, unk_id, add_bos, add_eos,
                 extra, model_name=None):
        self.tokens = [str(t) for t in tokens]
        n = len(self.tokens)
        if n == 0:
            raise VocabError(f"{KEY}tokens is empty")
        self.token_types = [NORMAL] * n if token_types is None else [int(t) for t in token_types]
        if len(self.token_types) < n:       # more is fine, as in llama.cpp: the rest is unused
            raise VocabError(f"{KEY}token_type has {len(self.token_types)} entries for {n} "
                             f"tokens")
        del self.token_types[n:]
        self.bos_id, self.eos_id, self.unk_id = (
            self._check_id(i, name) for i, name in ((bos_id, "bos_token_id"),
                                                    (eos_id, "eos_token_id"),
                                                    (unk_id, "unknown_token_id")))
        self.add_bos, self.add_eos = bool(add_bos), bool(add_eos)
        self.extra = dict(extra or {})
        self.model_name = model_name

        # llama.cpp's text -> id map: an empty piece is named "[EMPTY_<id>]", and a piece
        # that occurs twice makes the vocabulary unloadable.
        self._texts = [piece or f"[EMPTY_{i}]" for i, piece in enumerate(self.tokens)]
        self._ids: dict[str, int] = dict(zip(self._texts, range(n)))
        if len(self._ids) < n:
            first = {}
            for i, piece in enumerate(self._texts):
                if piece in first:
                    raise VocabError(f"duplicate token in vocabulary: {piece!r} has ids "
                                     f"{first[piece]} and {i}")
                first[piece] = i
        self.attrs = [_TYPE_ATTR.get(t, 0) for t in self.token_types]
        self.roles, self.eog_ids = self._find_roles()
        # Special tokens, longest text first: llama.cpp cuts them out of the text in this order.
        special = [i for i, a in enumerate(self.attrs) if a & _SPECIAL]
        if model_name and any(s in model_name.lower() for s in ("phi-3", "phi3")):
            self._phi3_rstrip(special)
        special.sort(key=lambda i: -len(self._texts[i].encode("utf-8")))
        self._specials = [(i, self._texts[i], self.attrs[i]) for i in special]
        self._pieces = [self._piece_bytes(i) for i in range(n)]
        self.newline_ids = tuple(i for i, p in enumerate(self._pieces) if p.endswith(b"\n"))

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def _check_id(self, value, name):
        if value is None:
            return None
        value = int(value)
        if not 0 <= value < len(self.tokens):
            raise VocabError(f"{KEY}{name} = {value} is outside the vocabulary "
                             f"(0..{len(self.tokens) - 1})")
        return value

    def _find_roles(self):
        """({role: id}, eog ids) as llama.cpp derives them; marks the tokens control."""
        roles = {}
        for role, keys in _ROLE_KEYS.items():
            for key in keys:
                value = self.extra.get(f"{KEY}{key}_token_id")
                if isinstance(value, int) and 0 <= value < self.n_vocab:
                    roles[role] = value
        present = self._ids.get
        for role, texts in _ROLE_TEXTS.items():
            found = [present(t) for t in texts if present(t) is not None]
            if role not in roles and found:
                roles[role] = min(found)
                self.attrs[min(found)] |= ATTR_CONTROL
        eog = {roles[r] for r in ("fim_pad", "fim_rep", "fim_sep") if r in roles}
        for i in (present(t) for t in _EOG_TEXTS):
            if i is not None:
                eog.add(i)
                self.attrs[i] |= ATTR_CONTROL
        for i in (present(t) for t in _ALWAYS_SHOWN):
            if i is not None:
                self.attrs[i] = ATTR_USER_DEFINED
        eog.update(i for i in (self.eos_id, roles.get("eot"), roles.get("eom")) if i is not None)
        texts = {self._texts[i]: i for i in eog}
        # gpt-oss and solar-open: <|end|> ends a message, not the generation.
        calls = "<|call|>" in texts or "<|calls|>" in texts
        if "<|end|>" in texts and calls and ("<|return|>" in texts or "<|flush|>" in texts):
            eog.discard(texts["<|end|>"])
            self.attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
        # gemma4 and plamo: </s> is an ordinary token.
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            self.attrs[texts["</s>"]] = ATTR_NORMAL
        return roles, frozenset(eog)

    def _phi3_rstrip(self, special):
        for i in special:
            self.attrs[i] |= ATTR_RSTRIP
        for text, on in (("</s>", True), ("<unk>", False), ("<s>", False),
                         ("<|endoftext|>", False)):
            if text in self._ids:
                i = self._ids[text]
                self.attrs[i] = self.attrs[i] | ATTR_RSTRIP if on else self.attrs[i] & ~ATTR_RSTRIP

    # -- encode ---------------------------------------------------------------------------
    def encode(self, text: str, parse_special: bool = False,
               add_special: bool = False) -> np.ndarray:
        """llama_tokenize(text, add_special, parse_special) as int32 ids: parse_special
        makes the text of control tokens (e.g. "<|im_start|>") those tokens; add_special
        adds BOS first if add_bos and EOS last if add_eos."""
        out: list[int] = []
        if add_special and self.add_bos:
            if self.bos_id is None:
                raise VocabError("add_bos_token is set but the vocabulary has no BOS token")
            out.append(self.bos_id)
        prev_special = True
        for frag in _split_special(text, self._specials, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            else:
                self._encode_piece(frag, prev_special, out)
                prev_special = False
        if add_special and self.add_eos:
            if self.eos_id is None:
                raise VocabError("add_eos_token is set but the vocabulary has no EOS token")
            out.append(self.eos_id)
        return np.asarray(out, dtype=np.int32)

    def _encode_piece(self, text: str, after_special: bool, out: list[int]) -> None:
        raise NotImplementedError

    # -- decode ---------------------------------------------------------------------------
    def _piece_bytes(self, i: int) -> bytes:
        """llama_token_to_piece(special=False): control and unknown tokens give nothing,
        user-defined ones their text, normal ones their text as the vocabulary spells it,
        byte tokens their byte, anything else nothing."""
        attr, piece = self.attrs[i], self._texts[i]
        if attr & (ATTR_CONTROL | ATTR_UNKNOWN):
            return b""
        if attr & ATTR_USER_DEFINED:
            return piece.encode("utf-8")
        if attr & ATTR_NORMAL:
            return self._normal_piece_bytes(piece)
        if attr & ATTR_BYTE:
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                raise VocabError(f"byte token {i} is {piece!r}, not <0xXX>") from None
        return b""

    def _normal_piece_bytes(self, piece: str) -> bytes:
        raise NotImplementedError

    def decode(self, ids) -> str:
        """llama_detokenize(remove_special=False, unparse_special=False), invalid UTF-8
        as U+FFFD."""
        parts = []
        for tid in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if not 0 <= tid < self.n_vocab:
                raise ValueError(f"token id {tid} is outside the vocabulary "
                                 f"(0..{self.n_vocab - 1})")
            parts.append(self._pieces[tid])
        return self._join(parts).decode("utf-8", errors="replace")

    def _join(self, pieces: list[bytes]) -> bytes:
        return b"".join(pieces)

    def _metadata(self, model: str, own: dict) -> dict[str, object]:
        """The tokenizer.ggml.* keys (typed as `ByteTokenizer.gguf_metadata` says)."""
        meta = dict(self.extra)
        meta.update({KEY + "model": model, KEY + "tokens": list(self.tokens)})
        meta.update(own)
        meta[KEY + "token_type"] = list(self.token_types)
        for name, value in (("bos_token_id", self.bos_id), ("eos_token_id", self.eos_id),
                            ("unknown_token_id", self.unk_id)):
            if value is not None:
                meta[KEY + name] = value
        meta.update({KEY + "add_bos_token": self.add_bos, KEY + "add_eos_token": self.add_eos})
        return meta


# -- any SentencePiece-style ("llama") vocabulary --------------------------------------------

class SentencePieceVocab(_Vocabulary):
    """A "llama" vocabulary (tokens, scores, token types) tokenized as llama.cpp does
    (module docstring). `decode` drops the leading space of the first piece when
    add_space_prefix.

    Defaults are llama.cpp's for a "llama" vocabulary: bos 1, eos 2, unk 0, add_space_prefix
    true, add_bos true, add_eos false, scores 0.0, token type NORMAL. `extra` holds any other
    tokenizer.ggml.* keys, returned unchanged by `gguf_metadata()`.
    """

    def __init__(self, tokens, scores=None, token_types=None, *, bos_id: int | None = 1,
                 eos_id: int | None = 2, unk_id: int | None = 0, add_space_prefix: bool = True,
                 add_bos: bool = True, add_eos: bool = False, extra: dict | None = None,
                 model_name: str | None = None):
        n = len(tokens)
        # Scores are float32 in llama.cpp; rounding them here keeps its ties and its order.
        self.scores = [0.0] * n if scores is None else (
            np.asarray(scores, np.float32).astype(np.float64).tolist())
        if len(self.scores) < n:
            raise VocabError(f"{KEY}scores has {len(self.scores)} entries for {n} tokens")
        del self.scores[n:]
        self.add_space_prefix = bool(add_space_prefix)
        super().__init__(tokens, token_types, bos_id=bos_id, eos_id=eos_id, unk_id=unk_id,
                         add_bos=add_bos, add_eos=add_eos, extra=extra, model_name=model_name)

    def _encode_piece(self, text: str, after_special: bool, out: list[int]) -> None:
        if self.add_space_prefix and after_special:
            text = " " + text
        self._spm(text.replace(" ", SPACE_PIECE), out)

    def _spm(self, text: str, out: list[int]) -> None:
        """llama.cpp's SPM merge over one piece of text: symbols are characters (code points,
        i.e. UTF-8 sequences); a symbol absorbs its right neighbour when their concatenation
        is a token, best score first."""
        ids, scores = self._ids, self.scores
        n = len(text)
        start = list(range(n))          # a symbol is text[start[i] : start[i] + size[i]]
        size = [1] * n                  # 0 once merged into its left neighbour
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        if n:
            nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []

        def add_bigram(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            merged = size[left] + size[right]
            tid = ids.get(text[start[left]:start[left] + merged])
            if tid is not None:
                # Highest score first, then leftmost; the size tells a stale entry apart.
                heapq.heappush(heap, (-scores[tid], left, right, merged))

        for i in range(1, n):
            add_bigram(i - 1, i)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != merged:
                continue                # one of the two was merged since this was queued
            size[left], size[right] = merged, 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add_bigram(prev[left], left)
            add_bigram(left, nxt[left])

        i = 0 if n else -1
        while i >= 0:
            piece = text[start[i]:start[i] + size[i]]
            tid = ids.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._byte_token(b, piece) for b in piece.encode("utf-8"))
            i = nxt[i]

    def _byte_token(self, b: int, piece: str) -> int:
        tid = self._ids.get(byte_piece(b))
        if tid is None and b < 0x80:
            tid = self._ids.get(chr(b))       # llama.cpp's fallback: the byte as a piece
        if tid is None:
            raise VocabError(f"cannot encode {piece!r}: it is not a token and the vocabulary "
                             f"has no byte token {byte_piece(b)}")
        return tid

    def _normal_piece_bytes(self, piece: str) -> bytes:
        return piece.replace(SPACE_PIECE, " ").encode("utf-8")

    def _join(self, pieces: list[bytes]) -> bytes:
        if pieces and self.add_space_prefix and pieces[0].startswith(b" "):
            pieces = [pieces[0][1:]] + pieces[1:]
        return b"".join(pieces)

    def gguf_metadata(self) -> dict[str, object]:
        return self._metadata("llama", {KEY + "scores": list(self.scores),
                                        KEY + "add_space_prefix": self.add_space_prefix})

    def __repr__(self) -> str:
        return (f"SentencePieceVocab(n_vocab={self.n_vocab}, "
                f"add_space_prefix={self.add_space_prefix})")


# -- any byte-level BPE ("gpt2") vocabulary --------------------------------------------------

def _gpt2_byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for
    themselves, the others (controls, space, ...) take the characters from U+0100 on."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(0x100, 0x200))
    return [chr(b) if b in kept else chr(next(extra)) for b in range(256)]


_BYTE_CHARS = _gpt2_byte_chars()
_BYTES_TO_CHARS = {b: c for b, c in enumerate(_BYTE_CHARS)}     # str.translate on Latin-1
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_CHARS)}
# The inverse for str.translate: a byte character -> its byte as a Latin-1 character; any
# other character below U+0200 -> U+FFFF, so that one test (max) finds them all.
_CHARS_TO_LATIN1 = {**{c: "\uffff" for c in range(0x200)},
                    **{ord(c): chr(b) for b, c in enumerate(_BYTE_CHARS)}}


class BPEVocab(_Vocabulary):
    """A byte-level BPE vocabulary (tokens, merges "left right" by rank, token types, the
    pre-tokenizer named `pre`) tokenized as llama.cpp does (module docstring).

    `pre` None means llama.cpp's "default"; an unknown name is a VocabError. Defaults are
    llama.cpp's for a "gpt2" vocabulary: bos = eos = 11 (none if the vocabulary is
    smaller), no unk, add_bos as the pre-tokenizer says (true for llama-bpe), add_eos false.
    `decode` applies llama.cpp's clean-up of spaces where the pre-tokenizer asks for it.
    Words already encoded are cached.
    """

    def __init__(self, tokens, merges, token_types=None, *, pre: str | None = None,
                 bos_id: int | None = 11, eos_id: int | None = 11, unk_id: int | None = None,
                 add_bos: bool | None = None, add_eos: bool = False, extra: dict | None = None,
                 model_name: str | None = None):
        try:
            self.pre: PreTokenizer = pre_tokenizer(pre)
        except UnknownPreTokenizer as e:
            raise VocabError(str(e)) from None
        self.pre_name = pre
        if not self.pre.has_bos:
            bos_id = None
        super().__init__(tokens, token_types, bos_id=bos_id, eos_id=eos_id, unk_id=unk_id,
                         add_bos=self.pre.add_bos if add_bos is None else add_bos,
                         add_eos=add_eos, extra=extra, model_name=model_name)
        self.merges = list(merges)
        self._ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(self.merges):
            left, space, right = merge.partition(" ")
            if not left or not space:       # llama.cpp: the first space after the first char
                cut = merge.find(" ", 1)
                left, right = (merge[:cut], merge[cut + 1:]) if cut >= 0 else ("", "")
            self._ranks.setdefault((left, right), rank)
        self._cache: dict[str, list[int]] = {}

    def _encode_piece(self, text: str, after_special: bool, out: list[int]) -> None:
        cache = self._cache
        if len(cache) > 500_000:            # bound the memory a long, varied text can take
            cache.clear()
        for word in split_words(text, self.pre.regexes):
            ids = cache.get(word)
            if ids is None:
                chars = word.encode("utf-8").decode("latin-1").translate(_BYTES_TO_CHARS)
                ids = cache[word] = self._bpe(chars)
            out.extend(ids)

    def _bpe(self, word: str) -> list[int]:
        """The ids of one byte-encoded word: llama.cpp's merge loop (a heap of adjacent
        pairs by rank, then position; stale pairs skipped)."""
        ids = self._ids
        if self.pre.ignore_merges and word in ids:
            return [ids[word]]
        symbols = list(word)
        n = len(symbols)
        prev, nxt = list(range(-1, n - 1)), list(range(1, n + 1))
        nxt[-1] = -1
        ranks, heap = self._ranks, []

        def add_pair(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                rank = ranks.get((symbols[left], symbols[right]))
                if rank is not None:
                    heapq.heappush(heap, (rank, left, right, symbols[left] + symbols[right]))

        for i in range(1, n):
            add_pair(i - 1, i)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not symbols[left] or not symbols[right] or symbols[left] + symbols[right] != merged:
                continue                    # one side changed since the pair was queued
            symbols[left], symbols[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add_pair(prev[left], left)
            add_pair(left, nxt[left])
        out = []
        for symbol in symbols:
            if not symbol:
                continue
            tid = ids.get(symbol)
            if tid is not None:
                out.append(tid)
            else:                           # llama.cpp's fallback: single ASCII bytes
                out.extend(ids[chr(b)] for b in symbol.encode("utf-8")
                           if b < 0x80 and chr(b) in ids)
        return out

    def _normal_piece_bytes(self, piece: str) -> bytes:
        latin1 = piece.translate(_CHARS_TO_LATIN1)
        if not latin1 or max(latin1) <= "\xff":
            return latin1.encode("latin-1")
        out = bytearray()
        for c in piece:
            b = _CHAR_TO_BYTE.get(c)
            if b is None:                   # not a byte character: llama.cpp says so inline
                out += f"[UNK_BYTE_0x{c.encode('utf-8').hex()}{piece}]".encode("utf-8")
            else:
                out.append(b)
        return bytes(out)

    def _join(self, pieces: list[bytes]) -> bytes:
        text = b"".join(pieces)
        return _clean_spaces(text) if self.pre.clean_spaces else text

    def gguf_metadata(self) -> dict[str, object]:
        own = {KEY + "merges": list(self.merges)}
        if self.pre_name is not None:
            own[KEY + "pre"] = self.pre_name
        return self._metadata("gpt2", own)

    def __repr__(self) -> str:
        return f"BPEVocab(n_vocab={self.n_vocab}, pre={self.pre_name!r})"


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's clean_up_tokenization_spaces: no space before ? ! . and , ; " ' "
    becomes "'"; no space before 's 'm 're 've (each a single pass, as llama.cpp's)."""
    for before, after in ((b" ?", b"?"), (b" !", b"!"), (b" .", b"."), (b" ,", b",")):
        text = text.replace(before, after)
    out = bytearray()
    i, n = 0, len(text)
    while i < n:
        if text[i:i + 3] == b" ' ":
            out += b"'"
            i += 3
            continue
        out.append(text[i])
        i += 1
    text = bytes(out)
    for before, after in ((b" 's", b"'s"), (b" 'm", b"'m"), (b" 're", b"'re"),
                          (b" 've", b"'ve")):
        text = text.replace(before, after)
    return text

# -- from metadata and from files ------------------------------------------------------------

TOKENIZER = "tokenizer."
CHAT_TEMPLATE = TOKENIZER + "chat_template"
_OWN_KEYS = {KEY + k for k in ("model", "tokens", "scores", "token_type", "merges", "pre",
                               "bos_token_id", "eos_token_id", "unknown_token_id",
                               "add_space_prefix", "add_bos_token", "add_eos_token")}


_ITEM_TYPES = {str: (str,), int: (int, np.integer), float: (float, int, np.number)}


def _as_list(meta: dict, key: str, kind):
    if key not in meta:
        return None
    value = meta[key]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise VocabError(f"{key} must be an array, got {type(value).__name__}")
    items = value.tolist() if isinstance(value, np.ndarray) else list(value)
    types = set(map(type, items))
    if types <= {kind}:
        return items
    if not all(issubclass(t, _ITEM_TYPES[kind]) for t in types):
        raise VocabError(f"{key} must be an array of {_ITEM_TYPES[kind][0].__name__}s")
    return [kind(v) for v in items]


def _token_id(meta: dict, key: str):
    """An id key's value as an int, None when absent."""
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise VocabError(f"{key} must be an integer, got {value!r}")
    return int(value)


def tokenizer_from_metadata(meta: dict, model_name: str | None = None) -> Tokenizer:
    """The tokenizer that tokenizer.ggml.* keys describe (the inverse of `gguf_metadata`).

    Exactly ByteTokenizer's vocabulary and settings give a `ByteTokenizer`; any other "llama"
    vocabulary gives a `SentencePieceVocab`, a "gpt2" one a `BPEVocab`. `model_name` is the
    file's general.name (llama.cpp treats phi-3 vocabularies specially). Raises VocabError
    naming a missing key, an unsupported tokenizer.ggml.model or tokenizer.ggml.pre.
    """
    for key in (KEY + "model", KEY + "tokens"):
        if key not in meta:
            raise VocabError(f"no vocabulary: the metadata has no {key}")
    model = meta[KEY + "model"]
    if model not in ("llama", "gpt2"):
        raise VocabError(f"{KEY}model {model!r} is not supported: ggwgpu tokenizes "
                         f"SentencePiece-style (\"llama\") and byte-level BPE (\"gpt2\") "
                         f"vocabularies")
    tokens = _as_list(meta, KEY + "tokens", str)
    types = _as_list(meta, KEY + "token_type", int)
    flags = {name: bool(meta[KEY + key]) for name, key in (
        ("add_bos", "add_bos_token"), ("add_eos", "add_eos_token")) if KEY + key in meta}
    # A missing id takes llama.cpp's default, or none where a small vocabulary cannot hold it.
    defaults = {"llama": (1, 2, 0), "gpt2": (11, 11, None)}[model]
    special = {}
    for name, key, default in zip(("bos_id", "eos_id", "unk_id"),
                                  ("bos_token_id", "eos_token_id", "unknown_token_id"), defaults):
        value = _token_id(meta, KEY + key)
        special[name] = value if value is not None else (
            default if default is not None and default < len(tokens) else None)
    # every other tokenizer.* key, tokenizer.chat_template among them, goes back into what
    # the vocabulary writes (a finetuned or merged model keeps its template)
    extra = {k: v for k, v in meta.items() if k.startswith(TOKENIZER) and k not in _OWN_KEYS}

    if model == "gpt2":
        merges = _as_list(meta, KEY + "merges", str)
        if merges is None:
            raise VocabError(f"a \"gpt2\" vocabulary needs {KEY}merges")
        pre = meta.get(KEY + "pre")
        if pre is not None and not isinstance(pre, str):
            raise VocabError(f"{KEY}pre must be a string, got {pre!r}")
        for key in (KEY + "scores", KEY + "add_space_prefix"):     # kept, unused
            if key in meta:
                extra[key] = meta[key]
        return BPEVocab(tokens, merges, types, pre=pre, extra=extra, model_name=model_name,
                        **flags, **special)

    scores = _as_list(meta, KEY + "scores", float)
    flags["add_space_prefix"] = bool(meta.get(KEY + "add_space_prefix", True))
    if KEY + "pre" in meta:                 # "llama" vocabularies have no pre-tokenizer
        extra[KEY + "pre"] = meta[KEY + "pre"]
    byte_meta = ByteTokenizer().gguf_metadata()
    if (tokens == byte_meta[KEY + "tokens"] and not extra
            and types in (None, byte_meta[KEY + "token_type"])
            and (scores is None or scores == byte_meta[KEY + "scores"])
            and flags.get("add_bos", True) and not flags.get("add_eos", False)
            and not flags["add_space_prefix"]
            and all(special[n] == getattr(ByteTokenizer, n) for n in special)):
        return ByteTokenizer()
    return SentencePieceVocab(tokens, scores, types, extra=extra, model_name=model_name,
                              **flags, **special)


def read_metadata(path) -> dict[str, object]:
    """The tokenizer.ggml.* keys of a GGUF file, as Python values. The file goes through
    ggwgpu.gguf_file's reader; its errors come back as VocabErrors naming the file."""
    return {k: v for k, v in _read_all(path).items() if k.startswith(KEY)}


def _read_all(path) -> dict[str, object]:
    try:
        return gguf_file.read_metadata(path)
    except gguf_file.GGUFError as e:
        raise VocabError(str(e)) from None


def load_vocab(path) -> Tokenizer:
    """The tokenizer of a GGUF file's tokenizer.ggml.* keys (`tokenizer_from_metadata`, with
    the file's general.name). Errors (no file, a malformed GGUF, no or unsupported
    vocabulary) are VocabErrors (so GGUFErrors) naming it."""
    meta = _read_all(path)
    name = meta.get("general.name")
    try:
        return tokenizer_from_metadata({k: v for k, v in meta.items() if k.startswith(TOKENIZER)},
                                       name if isinstance(name, str) else None)
    except VocabError as e:
        raise VocabError(f"{path}: {e}") from None
