"""The calibration text as token rows: what GPTQ, the int8 KV-cache scales and the quantization report's
perplexity run the model on. Shared by export and the torch backend, so it lives above both."""

from __future__ import annotations

from pathlib import Path

import torch

from kvedge.errors import KvedgeError

CALIBRATION_ROW = 256  # tokens per calibration sequence (at most the model's positions)


def calibration_rows(model_dir: Path, cfg, text_file: str | None, tokens: int) -> tuple[torch.Tensor, dict]:
    """The calibration text as token rows [R, L] (L <= CALIBRATION_ROW and the model's positions), and
    what they are. Tokenized by the checkpoint's tokenizer.json, else as UTF-8 bytes modulo the vocabulary."""
    if text_file is None:
        from importlib import resources

        text, source = resources.files("kvedge.models").joinpath("calibration.txt").read_text("utf-8"), "built-in"
    else:
        text, source = Path(text_file).read_text("utf-8"), str(Path(text_file).resolve())
    if (model_dir / "tokenizer.json").is_file():
        from kvedge.runtime.tokenizer import Tokenizer

        ids, how = Tokenizer(model_dir).encode(text, add_special_tokens=False), "tokenizer.json"
        if ids and max(ids) >= cfg.vocab_size:
            raise KvedgeError(f"{model_dir / 'tokenizer.json'} gives token id {max(ids)} for the calibration text, "
                              f"outside the model's vocabulary ({cfg.vocab_size})")
    else:
        ids, how = [b % cfg.vocab_size for b in text.encode("utf-8")], "utf-8 bytes modulo the vocabulary"
    row = min(CALIBRATION_ROW, cfg.max_position_embeddings, len(ids))
    if row < 2:
        raise KvedgeError(f"calibration text {source}: {len(ids)} tokens, need at least 2")
    n = max(1, min(tokens, len(ids)) // row)
    rows = torch.tensor(ids[:n * row]).reshape(n, row)
    return rows, {"text": source, "tokenizer": how, "tokens": n * row, "rows": n, "row_length": row}
