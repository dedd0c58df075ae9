"""Tokenizer: the `tokenizers` library over tokenizer.json, and the chat template of tokenizer_config.json;
or the same built from a GGUF file's metadata (kvedge.models.gguf_vocab)."""

from __future__ import annotations

import json
from pathlib import Path

from kvedge.errors import KvedgeError, require


class Tokenizer:
    def __init__(self, folder: str | Path):
        """`folder`: a Hugging Face folder (tokenizer.json), or a .gguf file (its tokenizer.ggml.* metadata)."""
        folder = Path(folder)
        if folder.suffix.lower() == ".gguf" and folder.is_file():
            self._from_gguf(folder)
            return
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise KvedgeError(f"{folder}: no tokenizer.json; pass token ids instead of text, or add the tokenizer")
        tokenizers = require("tokenizers", "tokenizers", "text input")
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = folder / "chat_template.jinja"
        self.chat_template = template.read_text() if template.is_file() else self.config.get("chat_template")
        self.bos_token = self._token_text("bos_token")
        self.eos_token = self._token_text("eos_token")
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

    def _from_gguf(self, path: Path) -> None:
        from kvedge.models.gguf_vocab import read_vocab

        vocab = read_vocab(path)
        self._tok = vocab.tokenizer()  # BOS / EOS as the metadata's add_bos_token / add_eos_token say
        self.config = vocab.tokenizer_config()
        self.chat_template = self.config.get("chat_template")
        self.bos_token = self._token_text("bos_token")
        self.eos_token = self._token_text("eos_token")
        self.eos_token_id = vocab.eos_id

    def _token_text(self, key: str) -> str | None:
        v = self.config.get(key)
        return v.get("content") if isinstance(v, dict) else v

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode holds it throughout), so kvedge serve's event loop and scheduler
        # run on while a worker thread encodes a long prompt
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render the checkpoint's Jinja chat template (as transformers does) into the prompt text."""
        if not self.chat_template:
            raise KvedgeError("this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
        if getattr(self, "_template", None) is None:  # compiled once: a server renders it every request
            require("jinja2", "jinja2", "chat templates")
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(msg):
                raise KvedgeError(f"chat template: {msg}")

            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def eos_ids(cfg, tokenizer: Tokenizer | None) -> frozenset[int]:
    """The model's end-of-sequence ids: its config's eos_token_id (one or a list), else its tokenizer's."""
    ids = cfg.eos_token_id
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return frozenset()
    return frozenset(int(i) for i in (ids if isinstance(ids, (list, tuple, set)) else [ids]))


class TextStream:
    """The text of one generated sequence, token by token, in whole characters, cut at the first stop string.

    Each token decodes only a short window (the tokens since the last complete piece, after the piece before them
    as context, the way byte-level and SentencePiece decoders need it), so a token costs the same at any length:
    decoding the whole output every token made a long answer quadratic. `take` hands out the text that is now
    certain: complete characters, up to the first stop string, and short of a tail that could begin one."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] | list[str] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)  # an empty one stops at once
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read]: the last piece, context for the next; ids[read:] pending
        self.context = ""  # the decode of ids[prefix:read]
        self.pending = ""  # decoded text not yet taken (a possible stop string's start, held back)
        self.taken: list[str] = []  # the pieces handed out
        self.stopped = False

    @property
    def text(self) -> str:
        """The text handed out so far."""
        return "".join(self.taken)

    def add(self, token: int) -> None:
        self.ids.append(token)
        self._decode(final=False)

    def _decode(self, final: bool) -> None:
        now = self.tokenizer.decode(self.ids[self.prefix:])
        if not final and (len(now) <= len(self.context) or now.endswith("\ufffd")):
            return  # a character's bytes are not all there yet
        if now.startswith(self.context):
            self.pending += now[len(self.context):]
        else:  # a decoder that rewrites the context (no known one does): decode it all once
            self.pending = self.tokenizer.decode(self.ids)[len(self.text):]
        self.prefix, self.read = self.read, len(self.ids)
        self.context = self.tokenizer.decode(self.ids[self.prefix:self.read])

    def take(self, final: bool = False) -> tuple[str, bool]:
        """(the text now certain and not yet taken, whether a stop string ended it); final: the sequence has
        ended, so pending bytes and a possible stop string's start are text too."""
        if self.stopped:
            return "", True
        if final and self.read < len(self.ids):
            self._decode(final=True)
        # no stop string starts in the text already taken: the tail that could begin one is held back
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        end = min(hits) if hits else len(self.pending)
        if not hits and not final:
            end -= max((k for s in self.stop for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        piece, self.pending = self.pending[:end], self.pending[end:]
        if piece:
            self.taken.append(piece)
        self.stopped = bool(hits)
        return piece, self.stopped


class Output:
    """One generated sequence as it grows: its tokens, the text they make certain, and why it ended, for
    Session and kvedge serve alike. `finish`: None while it runs, then "eos" (an end-of-sequence token, kept in
    `tokens`, not in the text), "stop" (a stop string, cut from the text) or "length" (max_tokens)."""

    def __init__(self, tokenizer: Tokenizer | None, stop: tuple[str, ...] | list[str] = (),
                 eos: frozenset[int] | set[int] = frozenset(), max_tokens: int = 2 ** 62):
        self.text = TextStream(tokenizer, stop) if tokenizer is not None else None  # None: token ids only
        self.eos, self.max_tokens = eos, max_tokens
        self.tokens: list[int] = []
        self.finish: str | None = None

    def add(self, token: int) -> str:
        """Append the next token; returns the text it made certain (with the last token, all that was held
        back) and sets `finish` if the sequence ends with it."""
        self.tokens.append(token)
        if token in self.eos:
            self.finish = "eos"
        elif self.text is not None:
            self.text.add(token)
        last = self.finish is not None or len(self.tokens) >= self.max_tokens
        new, stopped = self.text.take(final=last) if self.text is not None else ("", False)
        if stopped and self.finish is None:  # (after an EOS, the text is cut but the reason stays "eos")
            self.finish = "stop"
        elif last and self.finish is None:
            self.finish = "length"
        return new
