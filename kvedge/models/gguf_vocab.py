"""The tokenizer and chat template a GGUF file carries in its metadata, as a `tokenizers` Tokenizer.

A GGUF has no tokenizer.json: llama.cpp's converter stores the vocabulary under `tokenizer.ggml.*`
(model, pre, tokens, token_type, merges or scores, bos/eos/unk/pad ids, add_bos_token / add_eos_token,
add_space_prefix) and the Jinja chat template as `tokenizer.chat_template`. This module reads those back
into the tokenizer they describe, so a `.gguf` path takes text prompts and `--chat` like a Hugging Face
folder, and `write_tokenizer_files` turns them into tokenizer.json + tokenizer_config.json.

    vocab = read_vocab("model.gguf")      # GGUFVocab: the metadata, checked
    tok = vocab.tokenizer()               # tokenizers.Tokenizer (or tokenizer_from_gguf(path))
    cfg = vocab.tokenizer_config()        # bos/eos/unk/pad tokens, add_bos_token, chat_template

Supported `tokenizer.ggml.model`s:

- "gpt2": byte-level BPE (Llama 3, Qwen2/3, SmolLM, Mistral Nemo, Phi-2, ...). The merges are the
  file's; how text is split before BPE is named by `tokenizer.ggml.pre`, mapped here to the split
  llama.cpp applies for that name (`PRE_TOKENIZERS`); an unknown name is refused.
- "llama": SentencePiece-style BPE with byte fallback (Llama 2, Mistral 7B, TinyLlama; Gemma and Phi-3 by
  their architecture's spelling). Merges from the file, or rebuilt from the token scores.

The reference is transformers' own GGUF tokenizer builder (the ids must be equal to it); where llama.cpp
(which runs these files) and the model's original tokenizer.json agree on a behaviour transformers leaves
out, that is followed instead, and said where it is done: the smollm/starcoder family splits digits one
by one, the llama3 and tekken families keep a whole word that is in the vocabulary (BPE ignore_merges),
an absent add_bos_token falls back to llama.cpp's default for the vocabulary, add_space_prefix is read.

Layer: kvedge.models; reads the file through kvedge.models.gguf (open_gguf), builds with `tokenizers`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvedge.errors import ConfigError, require

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The pre-tokenizer splits, as the models' own tokenizer.json files spell them (llama.cpp runs the same
# expressions, rewritten for its regex engine: src/llama-vocab.cpp).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How a byte-level vocabulary splits text before BPE: `splits` (regexes, each isolating its matches,
    applied in turn), then the byte-level mapping, with GPT-2's own split when `gpt2_regex`.
    `ignore_merges`: a whole piece found in the vocabulary is taken as is; `add_bos`: llama.cpp's
    default when the file has no tokenizer.ggml.add_bos_token."""

    splits: tuple[str, ...] = ()
    gpt2_regex: bool = False
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2 = PreTokenizer(gpt2_regex=True)
_DIGITS_GPT2 = PreTokenizer(splits=(r"\p{N}",), gpt2_regex=True)  # llama.cpp: "\p{N}" then GPT-2's
_LLAMA3 = PreTokenizer(splits=(_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_LLAMA3_MERGES = PreTokenizer(splits=(_LLAMA3_SPLIT,))
_QWEN2 = PreTokenizer(splits=(_QWEN2_SPLIT,))

# tokenizer.ggml.pre -> its split, by llama.cpp's names (src/llama-vocab.cpp, convert_hf_to_gguf.py)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(["gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe", "gigachat"], _GPT2),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
                    _DIGITS_GPT2),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
                    _LLAMA3),
    **dict.fromkeys(["dbrx", "smaug-bpe", "jina-v5-nano"], _LLAMA3_MERGES),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "kormo", "f2llmv2"], _QWEN2),
    "qwen35": PreTokenizer(splits=(_QWEN35_SPLIT,)),
    "tekken": PreTokenizer(splits=(_TEKKEN_SPLIT,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "minimax-m2"], PreTokenizer(splits=(_GPT4O_SPLIT,))),
}
# A file without tokenizer.ggml.pre (an old conversion) or with "default": GPT-2's split, as transformers reads
# it (llama.cpp's own "default" split, which it warns degrades generation, is not reproduced).
_NO_PRE = _GPT2

MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values this module builds


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: each byte spelled as one printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@dataclass
class GGUFVocab:
    """The tokenizer metadata of one GGUF file (`read_vocab`), checked; builds the tokenizer from it."""

    source: str
    model: str  # tokenizer.ggml.model
    pre: str | None  # tokenizer.ggml.pre
    tokens: list[str]
    token_types: list[int] | None = None
    scores: list[float] | None = None
    merges: list[str] | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = None
    architecture: str | None = None

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]

    @property
    def special_ids(self) -> dict[str, int]:
        """{"bos": id, "eos": id, "unk": id, "pad": id}, those the file names."""
        ids = {"bos": self.bos_id, "eos": self.eos_id, "unk": self.unk_id, "pad": self.pad_id}
        return {k: v for k, v in ids.items() if v is not None}

    def tokenizer(self):
        """The `tokenizers.Tokenizer` this metadata describes (ids as transformers' GGUF tokenizer)."""
        require("tokenizers", "tokenizers", "GGUF tokenizers")
        tok = _byte_level(self) if self.model == "gpt2" else _sentencepiece(self)
        _add_special_tokens(tok, self)
        _post_processor(tok, self)
        return tok

    def tokenizer_config(self) -> dict[str, Any]:
        """tokenizer_config.json's content: the special tokens by text, add_bos/eos_token, chat_template."""
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.token(self.bos_id), "eos_token": self.token(self.eos_id),
            "unk_token": self.token(self.unk_id), "pad_token": self.token(self.pad_id),
            "add_bos_token": self.add_bos, "add_eos_token": self.add_eos,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        return cfg


def _open(path_or_file):
    """The GGUFFile of a path (opened once for the config, the weights and the vocabulary: open_gguf), or the
    GGUFFile given."""
    from kvedge.models.gguf import GGUFFile, open_gguf

    return path_or_file if isinstance(path_or_file, GGUFFile) else open_gguf(path_or_file)


def _value(g, key: str, kind: type | tuple[type, ...] | None = None):
    v = g.value(key)
    if v is not None and kind is not None and not (isinstance(v, kind) and not (isinstance(v, bool) and kind is int)):
        raise ConfigError(f"{g.path}: metadata {key} is {type(v).__name__} {str(v)[:60]!r}, "
                          f"expected {getattr(kind, '__name__', kind)}")
    return v


def read_vocab(path_or_reader) -> GGUFVocab:
    """The tokenizer metadata of a GGUF file (a path or a kvedge.models.gguf.GGUFFile), checked: a missing vocabulary,
    an unknown tokenizer model or pre-tokenizer, ids out of range or arrays of the wrong length each give
    one ConfigError naming the file and the key."""
    g = _open(path_or_reader)
    source = str(g.path)

    def get(key, kind=None):
        return _value(g, key, kind)

    model = get("tokenizer.ggml.model", str)
    tokens = get("tokenizer.ggml.tokens", list)
    if model is None or not tokens:
        what = "tokenizer.ggml.model" if model is None else "tokenizer.ggml.tokens"
        raise ConfigError(f"{source}: no tokenizer in the GGUF metadata ({what} is missing or empty); "
                          "pass token ids instead of text")
    if model not in MODELS:
        raise ConfigError(f"{source}: tokenizer.ggml.model {model!r} is not supported (supported: "
                          f"{', '.join(MODELS)})")
    if not all(isinstance(t, str) for t in tokens):
        raise ConfigError(f"{source}: tokenizer.ggml.tokens must be an array of strings")
    n = len(tokens)

    def array(key, length_must_match=True):
        v = get(key, list)
        if v is not None and length_must_match and len(v) != n:
            raise ConfigError(f"{source}: {key} has {len(v)} entries for {n} tokens")
        return v

    def token_id(key):
        v = get(key, int)
        if v is not None and not 0 <= v < n:
            raise ConfigError(f"{source}: {key} = {v} is outside the vocabulary of {n} tokens")
        return v

    pre = get("tokenizer.ggml.pre", str)
    if model == "gpt2" and pre is not None and pre not in PRE_TOKENIZERS and pre != "default":
        raise ConfigError(f"{source}: tokenizer.ggml.pre {pre!r} (how this vocabulary splits text) is not known; "
                          f"known: {', '.join(sorted(PRE_TOKENIZERS))}")
    merges = array("tokenizer.ggml.merges", length_must_match=False)
    scores = array("tokenizer.ggml.scores")
    if model == "gpt2" and merges is None:
        raise ConfigError(f"{source}: a byte-level BPE vocabulary (tokenizer.ggml.model 'gpt2') needs "
                          "tokenizer.ggml.merges, and the file has none")
    if model == "llama" and merges is None and scores is None:
        raise ConfigError(f"{source}: a SentencePiece vocabulary (tokenizer.ggml.model 'llama') needs "
                          "tokenizer.ggml.scores or tokenizer.ggml.merges, and the file has neither")
    if merges is not None and not all(isinstance(m, str) and len(m.split(" ")) == 2 for m in merges):
        bad = next(m for m in merges if not (isinstance(m, str) and len(m.split(" ")) == 2))
        raise ConfigError(f"{source}: tokenizer.ggml.merges holds {bad!r}; each merge is two tokens joined by one space")

    arch = get("general.architecture", str)
    add_bos = get("tokenizer.ggml.add_bos_token", bool)
    if add_bos is None:  # llama.cpp's default for the vocabulary (transformers: the same for "llama")
        add_bos = model == "llama" or PRE_TOKENIZERS.get(pre or "", _NO_PRE).add_bos
    return GGUFVocab(
        source=source, model=model, pre=pre, tokens=tokens,
        token_types=array("tokenizer.ggml.token_type"), scores=scores, merges=merges,
        bos_id=token_id("tokenizer.ggml.bos_token_id"), eos_id=token_id("tokenizer.ggml.eos_token_id"),
        unk_id=token_id("tokenizer.ggml.unknown_token_id"), pad_id=token_id("tokenizer.ggml.padding_token_id"),
        add_bos=add_bos, add_eos=bool(get("tokenizer.ggml.add_eos_token", bool)),
        add_space_prefix=get("tokenizer.ggml.add_space_prefix", bool),
        chat_template=get("tokenizer.chat_template", str), architecture=arch,
    )


def tokenizer_from_gguf(path_or_reader):
    """The `tokenizers.Tokenizer` of a GGUF file (a path or a kvedge.models.gguf.GGUFFile), from its metadata."""
    return read_vocab(path_or_reader).tokenizer()


def tokenizer_config_from_gguf(path_or_reader) -> dict[str, Any]:
    """tokenizer_config.json's content for a GGUF file: special tokens, add_bos_token, chat_template."""
    return read_vocab(path_or_reader).tokenizer_config()


def write_tokenizer_files(reader_or_path, out_dir: str | Path) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) for a GGUF file into
    `out_dir`, so the folder loads as a Hugging Face tokenizer. Returns the paths written."""
    vocab = read_vocab(reader_or_path)
    tok = vocab.tokenizer()  # built before anything is written: a bad file leaves nothing behind
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "tokenizer.json", out / "tokenizer_config.json"]
    tok.save(str(paths[0]))
    paths[1].write_text(json.dumps(vocab.tokenizer_config(), indent=2, ensure_ascii=False) + "\n")
    return paths


# --- builders ---------------------------------------------------------------------------------------


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ")) for m in merges]


def _byte_level(v: GGUFVocab):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = set(_bytes_to_unicode().values())
    spell = _bytes_to_unicode()
    # A token the converter stored as raw text (an added token with a space, say) is spelled in the byte
    # alphabet, as every other token of the vocabulary is (transformers does the same).
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(v.tokens)}
    pre = PRE_TOKENIZERS.get(v.pre or "", _NO_PRE)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merge_pairs(v.merges), dropout=None,
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                               ignore_merges=pre.ignore_merges))
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=pre.gpt2_regex))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a token into two tokens, the token's
    score first (best first), then the shorter left part (transformers' generate_merges)."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _sentencepiece(v: GGUFVocab):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    arch = (v.architecture or "").lower()
    tokens = list(v.tokens)
    if arch in ("gemma", "gemma2", "gemma3"):
        # Gemma stores a token of spaces as spaces; its merges are in the order of the file.
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        scores = {t: -i for i, t in enumerate(tokens)}
    else:
        vocab = {t: i for i, t in enumerate(tokens)}
        scores = dict(zip(tokens, v.scores)) if v.scores is not None else None
    merges = _merge_pairs(v.merges) if v.merges is not None else _generate_merges(vocab, scores)
    unk = tokens[v.unk_id] if v.unk_id is not None else ("<unk>" if "<unk>" in vocab else None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True,
                               dropout=None))
    if arch in ("gemma", "gemma2", "gemma3"):
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        return tok
    prefix = v.add_space_prefix is not False  # llama.cpp's default for a SentencePiece vocabulary: True
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if arch == "phi3":
        # Phi-3: the prefix space comes from a normalizer, on every piece of text (transformers does the same)
        tok.normalizer = normalizers.Sequence(
            ([normalizers.Prepend("\u2581")] if prefix else []) + [normalizers.Replace(" ", "\u2581")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                     prepend_scheme="first" if prefix else "never")
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _add_special_tokens(tok, v: GGUFVocab) -> None:
    """CONTROL tokens (and the file's bos/eos/unk/pad) matched whole as special tokens, USER_DEFINED ones as
    plain added tokens, as llama.cpp matches both in text. In a byte-level vocabulary a CONTROL token
    spelled outside the byte alphabet is a converter's mislabel and is left alone (transformers: the same)."""
    from tokenizers import AddedToken

    types = v.token_types or [NORMAL] * len(v.tokens)
    spelled = set(_bytes_to_unicode().values()) if v.model == "gpt2" else None
    vocab = tok.get_vocab()
    control = [t for t, k in zip(v.tokens, types) if k == CONTROL and (spelled is None or set(t) <= spelled)]
    named = [v.tokens[i] for i in v.special_ids.values()]
    special = list(dict.fromkeys(control + [t for t in named if t in vocab]))
    if special:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, k in zip(v.tokens, types) if k == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _post_processor(tok, v: GGUFVocab) -> None:
    """BOS / EOS added around the text as the metadata says (add_special_tokens=True)."""
    from tokenizers import processors

    bos = v.add_bos and v.bos_id is not None
    eos = v.add_eos and v.eos_id is not None
    single = (["BOS"] if bos else []) + ["$A:0"] + (["EOS"] if eos else [])
    pair = single + (["BOS:1"] if bos else []) + ["$B:1"] + (["EOS:1"] if eos else [])
    special = ([{"id": "BOS", "ids": [v.bos_id], "tokens": [v.tokens[v.bos_id]]}] if bos else []) + \
              ([{"id": "EOS", "ids": [v.eos_id], "tokens": [v.tokens[v.eos_id]]}] if eos else [])
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
