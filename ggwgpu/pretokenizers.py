"""Pre-tokenizers of byte-level BPE vocabularies: text -> words, as llama.cpp splits it.

A GGUF "gpt2" vocabulary names its pre-tokenizer in tokenizer.ggml.pre (missing: "default").
Each pre-tokenizer is a list of regexes (llama.cpp's llama-vocab.cpp lists them per type;
they come from the models' tokenizer.json). They apply one after the other, each to every
piece the previous ones left: a piece splits into the regex's matches and the text between
them, and both kinds become pieces (Hugging Face's "Isolated" split). BPE then runs on each
final piece (word) on its own.

llama.cpp's own semantics, kept here:
  - \\s is Unicode White_Space (what the `regex` package's \\s matches), but llama.cpp's
    std::regex sees every non-ASCII whitespace character as "\\v"; `split_words` does the
    same, which matters where a regex lists such a character itself (deepseek-llm's U+3000);
  - $ is the end of the piece (\\Z here);
  - \\p{L}, \\p{N}, \\p{P}, \\p{S}, \\p{M} are Unicode general categories.

`PRE_TOKENIZERS` maps every tokenizer.ggml.pre name ggwgpu knows to its `PreTokenizer`:
the regexes plus the vocabulary settings llama.cpp ties to that name. An unknown name is an
error (`pre_tokenizer`), never a silent fallback.
"""
from __future__ import annotations

from dataclasses import dataclass

import regex

# -- the regexes, by llama.cpp pre-tokenizer type ---------------------------------------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
# Mistral's tekken and GPT-4o: llama.cpp emulates \p{Lu}/\p{Ll} classes with lookaheads
# ("a letter that is not a-z"), so every non-ASCII letter counts as both; kept as it is.
_UPPERISH, _LOWERISH = r"(?:(?=\p{L})[^a-z])", r"(?:(?=\p{L})[^A-Z])"
TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+"
          rf"{_LOWERISH}*|\p{{N}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+{_CONTRACTIONS}?"
         rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*{_CONTRACTIONS}?|\p{{N}}{{1,3}}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Hunyuan's dense models: digits in threes, runs of CJK ideographs and kana, then words
HUNYUAN = ("[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
           "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+")

REGEXES = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "gpt2": (GPT2,),
    "llama3": (LLAMA3,),
    "qwen2": (QWEN2,),
    "qwen35": (QWEN35,),
    "starcoder": (r"\p{N}", GPT2),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"),
    "deepseek-llm": ("[\r\n]", _DEEPSEEK_LETTERS,
                     "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                     r"\s+\Z", _CJK, r"\p{N}+"),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
    "bloom": (_BLOOM,),
    "viking": (_BLOOM, r"\p{N}"),
    "tekken": (TEKKEN,),
    "gpt4o": (GPT4O,),
    "seed-coder": (SEED_CODER,),
    "bailingmoe": (BAILINGMOE,),
    "hunyuan-dense": (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", HUNYUAN),
}


@dataclass(frozen=True)
class PreTokenizer:
    """What a tokenizer.ggml.pre name means to llama.cpp: `regexes` (a key of REGEXES);
    `ignore_merges`: a word that is itself a token is that token, merges or not;
    `clean_spaces`: decoding drops the space before ?!., and in some contractions;
    `add_bos`: the add_bos_token default; `has_bos`: False where llama.cpp drops the
    file's bos_token_id."""
    regexes: str
    ignore_merges: bool = False
    clean_spaces: bool = True
    add_bos: bool = False
    has_bos: bool = True


def _names(names: str, **settings) -> dict[str, PreTokenizer]:
    return {name: PreTokenizer(**settings) for name in names.split()}


# tokenizer.ggml.pre -> settings, as llama.cpp's vocabulary loader assigns them.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_names("default", regexes="default"),
    **_names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
             regexes="llama3", ignore_merges=True, add_bos=True),
    **_names("dbrx smaug-bpe", regexes="llama3"),
    **_names("deepseek-llm", regexes="deepseek-llm", clean_spaces=False),
    **_names("deepseek-coder", regexes="deepseek-coder", clean_spaces=False),
    **_names("falcon", regexes="falcon"),
    **_names("mpt olmo jais exaone4 gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es "
             "jina-v2-de a.x-4.0 mellum modern-bert", regexes="gpt2"),
    **_names("trillion granite-docling", regexes="gpt2", clean_spaces=False),
    **_names("starcoder refact codeshell exaone minerva-7b mellum2", regexes="starcoder"),
    **_names("command-r smollm", regexes="starcoder", clean_spaces=False),
    **_names("qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open", regexes="qwen2",
             clean_spaces=False),
    **_names("stablelm2 megrez", regexes="qwen2"),
    **_names("grok-2", regexes="qwen2", clean_spaces=False),
    **_names("qwen35", regexes="qwen35", clean_spaces=False),
    **_names("chatglm-bpe", regexes="llama3", has_bos=False),
    **_names("glm4 glm5", regexes="llama3", has_bos=False, ignore_merges=True),
    **_names("poro-chat", regexes="bloom", clean_spaces=False),
    **_names("bloom gpt3-finnish", regexes="bloom"),
    **_names("viking", regexes="viking", clean_spaces=False),
    **_names("tekken", regexes="tekken", clean_spaces=False, ignore_merges=True, add_bos=True),
    **_names("gpt-4o llama4 kanana2 talkie", regexes="gpt4o", clean_spaces=False),
    **_names("seed-coder", regexes="seed-coder", clean_spaces=False),
    **_names("bailingmoe bailingmoe2 llada-moe", regexes="bailingmoe", clean_spaces=False),
    **_names("hunyuan-dense joyai-llm hy_v4", regexes="hunyuan-dense", clean_spaces=False),
}


class UnknownPreTokenizer(ValueError):
    pass


def pre_tokenizer(name: str | None) -> PreTokenizer:
    """The settings of tokenizer.ggml.pre `name` (None or "": "default", as llama.cpp)."""
    if not name:
        name = "default"
    try:
        return PRE_TOKENIZERS[name]
    except KeyError:
        shown = repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name)} characters)"
        raise UnknownPreTokenizer(
            f"tokenizer.ggml.pre {shown} is not a pre-tokenizer ggwgpu knows; known: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}") from None


_COMPILED: dict[str, regex.Pattern] = {}
# llama.cpp's std::regex sees non-ASCII whitespace as "\v" (see the module docstring).
_WIDE_SPACE_AS_VT = {c: "\v" for c in (0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028,
                                        0x2029, 0x202F, 0x205F, 0x3000)}


def _compiled(pattern: str) -> regex.Pattern:
    if pattern not in _COMPILED:
        _COMPILED[pattern] = regex.compile(pattern)
    return _COMPILED[pattern]


def split_words(text: str, regexes: str) -> list[str]:
    """`text` cut into the words that BPE encodes one by one (REGEXES[regexes])."""
    seen = text.translate(_WIDE_SPACE_AS_VT)
    spans = [(0, len(text))] if text else []
    for pattern in REGEXES[regexes]:
        compiled, cut = _compiled(pattern), []
        for start, end in spans:
            pos = start
            for m in compiled.finditer(seen, start, end):
                if m.start() > pos:
                    cut.append((pos, m.start()))
                if m.end() > m.start():
                    cut.append((m.start(), m.end()))
                pos = m.end()
            if pos < end:
                cut.append((pos, end))
        spans = cut
    return [text[a:b] for a, b in spans]
