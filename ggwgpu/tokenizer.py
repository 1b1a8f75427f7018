"""Tokenizers: text <-> token ids, and the tokenizer.ggml.* keys of a GGUF file.

Two vocabularies, one interface (`encode`, `decode`, `n_vocab`, `bos_id`, `eos_id`,
`unk_id`, `newline_ids`, `gguf_metadata()`):

- `ByteTokenizer`, the default: one token per UTF-8 byte plus <unk>, <s>, </s>. No file
  needed. Exported as a SentencePiece-style ("llama") vocabulary that llama.cpp tokenizes
  into exactly the ids ggwgpu trained on.
- `SentencePieceVocab`: the vocabulary of any llama GGUF (tokens, scores, token types), with
  llama.cpp's SPM tokenizer reimplemented, so `encode` gives the ids llama.cpp gives.

`tokenizer_from_metadata` turns tokenizer.ggml.* keys back into one of the two, and
`load_vocab` reads those keys from a GGUF file. BPE ("gpt2") vocabularies are not supported.

How llama.cpp tokenizes plain text with a "llama" vocabulary (llama-vocab.cpp,
llm_tokenizer_spm_session; special tokens not parsed):
  1. user-defined tokens are cut out of the text first and emitted as themselves;
  2. each remaining piece gets a leading space if add_space_prefix (default true) and it
     starts the text or follows a special token; every ' ' becomes U+2581 '▁';
  3. the piece is split into UTF-8 characters; adjacent symbols whose concatenation is a
     token are merged, highest token score first (ties: leftmost first), until no adjacent
     pair forms a token;
  4. each final symbol is its token, or, if it is not in the vocabulary, one <0xXX> byte
     token per UTF-8 byte.
"""
from __future__ import annotations

import heapq

import numpy as np

from . import gguf_io

# llama.cpp's token types (tokenizer.ggml.token_type values).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE_PIECE = "\u2581"      # '▁': SentencePiece's visible space
KEY = "tokenizer.ggml."


class VocabError(gguf_io.GGUFError):
    """A vocabulary is missing, malformed or of a kind ggwgpu cannot tokenize with. A
    GGUFError, so that callers reading GGUF files catch one exception type."""


def byte_piece(b: int) -> str:
    return f"<0x{b:02X}>"


# -- the byte vocabulary ---------------------------------------------------------------------

_N_SPECIAL = 3                                  # <unk>, <s>, </s>
_BYTE_TOKENS = ["<unk>", "<s>", "</s>"] + [
    SPACE_PIECE if b == 0x20 else byte_piece(b) for b in range(256)]
_BYTE_TYPES = [UNKNOWN, CONTROL, CONTROL] + [NORMAL if b == 0x20 else BYTE for b in range(256)]


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
    newline_ids = (_N_SPECIAL + 0x0A,)          # ids of tokens whose text ends with "\n"

    @property
    def tokens(self) -> list[str]:
        return list(_BYTE_TOKENS)

    def encode(self, text: str) -> np.ndarray:
        """UTF-8 bytes + 3, as int32; no BOS. U+2581 '▁' is read as a space (see above)."""
        data = text.replace(SPACE_PIECE, " ").encode("utf-8")
        return np.frombuffer(data, np.uint8).astype(np.int32) + _N_SPECIAL

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


# -- any SentencePiece-style ("llama") vocabulary --------------------------------------------

class SentencePieceVocab:
    """A "llama" vocabulary (tokens, scores, token types) tokenized as llama.cpp does.

    `encode(text)` follows llama.cpp's llama_tokenize(text, add_special=False,
    parse_special=False) unless `parse_special=True`, which also turns the text of control
    and unknown tokens (e.g. "<s>") into those tokens. No BOS is added.
    `decode(ids)` follows llama_detokenize(remove_special=False, unparse_special=False):
    control, unknown and unused tokens give nothing, "▁" in normal tokens becomes a space,
    byte tokens give their byte, and with add_space_prefix the leading space of the first
    piece is dropped.

    Defaults are llama.cpp's for a "llama" vocabulary: bos 1, eos 2, unk 0, add_space_prefix
    true, add_bos true, add_eos false, scores 0.0, token type NORMAL. `extra` holds any other
    tokenizer.ggml.* keys, returned unchanged by `gguf_metadata()`.
    """

    def __init__(self, tokens, scores=None, token_types=None, *, bos_id: int | None = 1,
                 eos_id: int | None = 2, unk_id: int | None = 0, add_space_prefix: bool = True,
                 add_bos: bool = True, add_eos: bool = False, extra: dict | None = None):
        self.tokens = [str(t) for t in tokens]
        n = len(self.tokens)
        if n == 0:
            raise VocabError(f"{KEY}tokens is empty")
        # Scores are float32 in llama.cpp; rounding them here keeps its ties and its order.
        self.scores = [0.0] * n if scores is None else (
            np.asarray(scores, np.float32).astype(np.float64).tolist())
        self.token_types = [NORMAL] * n if token_types is None else [int(t) for t in token_types]
        for name, values in (("scores", self.scores), ("token_type", self.token_types)):
            if len(values) < n:         # more is fine, as in llama.cpp: the rest is unused
                raise VocabError(f"{KEY}{name} has {len(values)} entries for {n} tokens")
            del values[n:]
        self.bos_id, self.eos_id, self.unk_id = (
            self._check_id(i, name) for i, name in ((bos_id, "bos_token_id"),
                                                    (eos_id, "eos_token_id"),
                                                    (unk_id, "unknown_token_id")))
        self.add_space_prefix, self.add_bos, self.add_eos = (
            bool(add_space_prefix), bool(add_bos), bool(add_eos))
        self.extra = dict(extra or {})

        # llama.cpp's text -> id map: an empty piece is named "[EMPTY_<id>]", and a piece
        # that occurs twice makes the vocabulary unloadable.
        self._texts = [piece or f"[EMPTY_{i}]" for i, piece in enumerate(self.tokens)]
        self._ids: dict[str, int] = {}
        for i, piece in enumerate(self._texts):
            if piece in self._ids:
                raise VocabError(f"duplicate token in vocabulary: {piece!r} has ids "
                                 f"{self._ids[piece]} and {i}")
            self._ids[piece] = i
        # Special tokens, longest text first: llama.cpp cuts them out of the text in this order.
        special = [i for i, t in enumerate(self.token_types)
                   if t in (CONTROL, USER_DEFINED, UNKNOWN)]
        special.sort(key=lambda i: -len(self._texts[i].encode("utf-8")))
        self._special = [(i, self._texts[i], self.token_types[i] == USER_DEFINED)
                         for i in special]
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

    # -- encode ---------------------------------------------------------------------------
    def encode(self, text: str, parse_special: bool = False) -> np.ndarray:
        fragments: list = [text] if text else []
        for tid, piece, user_defined in self._special:
            if not (user_defined or parse_special):
                continue
            cut = []
            for frag in fragments:
                if isinstance(frag, int) or piece not in frag:
                    cut.append(frag)
                    continue
                parts = frag.split(piece)
                for k, part in enumerate(parts):
                    if k:
                        cut.append(tid)
                    if part:
                        cut.append(part)
            fragments = cut

        out: list[int] = []
        prev_special = True
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                frag = " " + frag
            self._spm(frag.replace(" ", SPACE_PIECE), out)
            prev_special = False
        return np.asarray(out, dtype=np.int32)

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

    # -- decode ---------------------------------------------------------------------------
    def _piece_bytes(self, i: int) -> bytes:
        kind, piece = self.token_types[i], self._texts[i]
        if kind == USER_DEFINED:
            return piece.encode("utf-8")
        if kind == NORMAL:
            return piece.replace(SPACE_PIECE, " ").encode("utf-8")
        if kind == BYTE:
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                raise VocabError(f"byte token {i} is {piece!r}, not <0xXX>") from None
        return b""                          # control, unknown, unused, undefined

    def decode(self, ids) -> str:
        parts = []
        for k, tid in enumerate(np.asarray(ids, dtype=np.int64).reshape(-1).tolist()):
            if not 0 <= tid < self.n_vocab:
                raise ValueError(f"token id {tid} is outside the vocabulary "
                                 f"(0..{self.n_vocab - 1})")
            piece = self._pieces[tid]
            if k == 0 and self.add_space_prefix and piece.startswith(b" "):
                piece = piece[1:]
            parts.append(piece)
        return b"".join(parts).decode("utf-8", errors="replace")

    # -- metadata -------------------------------------------------------------------------
    def gguf_metadata(self) -> dict[str, object]:
        """The tokenizer.ggml.* keys (typed as `ByteTokenizer.gguf_metadata` says)."""
        meta = dict(self.extra)
        meta.update({KEY + "model": "llama", KEY + "tokens": list(self.tokens),
                     KEY + "scores": list(self.scores), KEY + "token_type": list(self.token_types)})
        for name, value in (("bos_token_id", self.bos_id), ("eos_token_id", self.eos_id),
                            ("unknown_token_id", self.unk_id)):
            if value is not None:
                meta[KEY + name] = value
        meta.update({KEY + "add_space_prefix": self.add_space_prefix,
                     KEY + "add_bos_token": self.add_bos, KEY + "add_eos_token": self.add_eos})
        return meta

    def __repr__(self) -> str:
        return (f"SentencePieceVocab(n_vocab={self.n_vocab}, "
                f"add_space_prefix={self.add_space_prefix})")


# -- from metadata and from files ------------------------------------------------------------

_OWN_KEYS = {KEY + k for k in ("model", "tokens", "scores", "token_type", "bos_token_id",
                               "eos_token_id", "unknown_token_id", "add_space_prefix",
                               "add_bos_token", "add_eos_token")}


_ITEM_TYPES = {str: (str,), int: (int, np.integer), float: (float, int, np.number)}


def _as_list(meta: dict, key: str, kind):
    if key not in meta:
        return None
    value = meta[key]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise VocabError(f"{key} must be an array, got {type(value).__name__}")
    items = value.tolist() if isinstance(value, np.ndarray) else list(value)
    if not all(isinstance(v, _ITEM_TYPES[kind]) for v in items):
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


def tokenizer_from_metadata(meta: dict):
    """The tokenizer that tokenizer.ggml.* keys describe (the inverse of `gguf_metadata`).

    Exactly ByteTokenizer's vocabulary and settings give a `ByteTokenizer`; any other "llama"
    vocabulary gives a `SentencePieceVocab`. Raises VocabError naming a missing key or an
    unsupported tokenizer.ggml.model.
    """
    for key in (KEY + "model", KEY + "tokens"):
        if key not in meta:
            raise VocabError(f"no vocabulary: the metadata has no {key}")
    model = meta[KEY + "model"]
    if model != "llama":
        raise VocabError(f"{KEY}model {model!r} is not supported: ggwgpu tokenizes "
                         f"SentencePiece-style (\"llama\") vocabularies only")
    tokens = _as_list(meta, KEY + "tokens", str)
    scores = _as_list(meta, KEY + "scores", float)
    types = _as_list(meta, KEY + "token_type", int)
    flags = {name: bool(meta.get(KEY + key, default)) for name, key, default in (
        ("add_space_prefix", "add_space_prefix", True), ("add_bos", "add_bos_token", True),
        ("add_eos", "add_eos_token", False))}
    # A missing id takes llama.cpp's default, or none where a small vocabulary cannot hold it.
    special = {}
    for name, key, default in (("bos_id", "bos_token_id", 1), ("eos_id", "eos_token_id", 2),
                               ("unk_id", "unknown_token_id", 0)):
        value = _token_id(meta, KEY + key)
        special[name] = value if value is not None else (
            default if default < len(tokens) else None)
    extra = {k: v for k, v in meta.items() if k.startswith(KEY) and k not in _OWN_KEYS}

    byte_meta = ByteTokenizer().gguf_metadata()
    if (tokens == byte_meta[KEY + "tokens"] and not extra
            and types in (None, byte_meta[KEY + "token_type"])
            and (scores is None or scores == byte_meta[KEY + "scores"])
            and flags == {"add_space_prefix": False, "add_bos": True, "add_eos": False}
            and all(special[n] == getattr(ByteTokenizer, n) for n in special)):
        return ByteTokenizer()
    return SentencePieceVocab(tokens, scores, types, extra=extra, **flags, **special)


def read_metadata(path) -> dict[str, object]:
    """The tokenizer.ggml.* keys of a GGUF file, as Python values. The file goes through
    gguf_io's layout check; its errors come back as VocabErrors naming the file."""
    try:
        meta = gguf_io.read_metadata(path)
    except gguf_io.GGUFError as e:
        raise VocabError(str(e)) from None
    return {k: v for k, v in meta.items() if k.startswith(KEY)}


def load_vocab(path):
    """The tokenizer of a GGUF file's tokenizer.ggml.* keys (`tokenizer_from_metadata`).
    Errors (no file, a malformed GGUF, no or unsupported vocabulary) are VocabErrors (so
    GGUFErrors) naming it."""
    meta = read_metadata(path)
    try:
        return tokenizer_from_metadata(meta)
    except VocabError as e:
        raise VocabError(f"{path}: {e}") from None
