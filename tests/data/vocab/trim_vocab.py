"""Write the small vocabulary files tests/test_bpe.py runs on: a GGUF vocabulary cut down to
what the test texts need, with every token id unchanged.

    python trim_vocab.py FIXTURE.json OUT_DIR [NAME=]VOCAB.gguf ...
    python trim_vocab.py relabel VOCAB.gguf PRE OUT.gguf

The second form writes VOCAB.gguf's vocabulary with tokenizer.ggml.pre set to PRE: how the
pre-tokenizers that no vocabulary of llama.cpp's models/ uses get a test vocabulary.

For each vocabulary it encodes the fixture's texts and, if VOCAB.gguf.inp exists, llama.cpp's
own test texts (copied to OUT_DIR with their .out ids), plain and with special tokens. It
keeps every token some encoding gave, every token that is not typed NORMAL and every token
whose text llama.cpp gives a role at load; the others become empty strings, so ids stay
where they were. Of the merges it keeps, in their order, those any encoding looked up: given
the same candidate pairs, BPE merges the same way (a merge never looked up could never have
been the best pair). It then checks that the trimmed file gives every text the same ids and
writes NAME.gguf.gz. SentencePiece ("llama") vocabularies are small and are copied whole.
"""
import gzip
import json
import shutil
import sys
import tempfile
from pathlib import Path

from ggwgpu import gguf_file
from ggwgpu.tokenizer import (_ALWAYS_SHOWN, _EOG_TEXTS, _ROLE_TEXTS, KEY, NORMAL, BPEVocab,
                              load_vocab)

SEP = "\n__ggml_vocab_test__\n"


class _LookedUp(dict):
    """A merge-rank dict that remembers the ranks it was asked for and had."""

    def __init__(self, ranks):
        super().__init__(ranks)
        self.found = set()

    def get(self, pair, default=None):
        rank = super().get(pair, default)
        if rank is not None:
            self.found.add(rank)
        return rank


def llama_cpp_texts(path: Path) -> list[str]:
    inp = Path(str(path) + ".inp")
    if not inp.exists():
        return []
    raw = inp.read_text(encoding="utf-8")
    texts = raw.split(SEP)
    return texts[:-1] if raw.endswith(SEP) else texts


def encodings(vocab, texts):
    return [vocab.encode(t).tolist() + [-1] + vocab.encode(t, True, True).tolist()
            for t in texts]


def write(path: Path, meta: dict, arch: str):
    gguf_file.write_metadata(path, meta, arch)


def trim(src: Path, texts: list[str], out: Path):
    vocab = load_vocab(src)
    if not isinstance(vocab, BPEVocab):     # SentencePiece merges depend on every token
        with open(src, "rb") as f, gzip.open(out, "wb", compresslevel=9) as g:
            shutil.copyfileobj(f, g)
        print(f"{out.name}: whole, {out.stat().st_size} bytes")
        return
    vocab._ranks = _LookedUp(vocab._ranks)
    expected = encodings(vocab, texts)
    used = {i for ids in expected for i in ids if i >= 0}
    used |= {i for i, t in enumerate(vocab.token_types) if t != NORMAL}
    named = set(_EOG_TEXTS) | set(_ALWAYS_SHOWN) | {t for ts in _ROLE_TEXTS.values() for t in ts}
    used |= {i for i, t in enumerate(vocab.tokens) if t in named}
    used |= {i for i in (vocab.bos_id, vocab.eos_id, vocab.unk_id) if i is not None}

    full = gguf_file.read_metadata(src)
    meta = {k: v for k, v in full.items() if k.startswith(KEY) or k == "general.name"}
    meta.pop("tokenizer.chat_template", None)
    meta[KEY + "tokens"] = [t if i in used else "" for i, t in enumerate(vocab.tokens)]
    meta[KEY + "merges"] = [m for r, m in enumerate(vocab.merges) if r in vocab._ranks.found]
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "vocab.gguf"
        write(plain, meta, full.get("general.architecture", "llama"))
        if encodings(load_vocab(plain), texts) != expected:
            raise SystemExit(f"{src}: the trimmed vocabulary encodes differently")
        with open(plain, "rb") as f, gzip.open(out, "wb", compresslevel=9) as g:
            shutil.copyfileobj(f, g)
    print(f"{out.name}: {len(used)} of {vocab.n_vocab} tokens, "
          f"{len(meta.get(KEY + 'merges', []))} merges, {out.stat().st_size} bytes")


def relabel(src, pre, out):
    full = gguf_file.read_metadata(src)
    meta = {k: v for k, v in full.items() if k.startswith(KEY) or k == "general.name"}
    meta[KEY + "pre"] = pre
    write(Path(out), meta, full.get("general.architecture", "llama"))


def main(fixture, out_dir, *vocabs):
    if fixture == "relabel":
        return relabel(out_dir, *vocabs)
    texts = json.loads(Path(fixture).read_text(encoding="utf-8"))["texts"]
    out_dir = Path(out_dir)
    for arg in vocabs:
        name, _, path = arg.rpartition("=")
        path = Path(path)
        name = name or path.name.removeprefix("ggml-vocab-").removesuffix(".gguf")
        own = llama_cpp_texts(path)
        if own:
            for suffix in (".inp", ".out"):
                shutil.copyfile(str(path) + suffix, out_dir / f"{name}.gguf{suffix}")
        trim(path, texts + own, out_dir / f"{name}.gguf.gz")


if __name__ == "__main__":
    main(*sys.argv[1:])
