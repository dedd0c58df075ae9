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
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render the checkpoint's Jinja chat template (as transformers does) into the prompt text."""
        if not self.chat_template:
            raise KvedgeError("this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
        require("jinja2", "jinja2", "chat templates")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise KvedgeError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")
