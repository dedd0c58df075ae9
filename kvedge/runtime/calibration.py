"""Running the model on the calibration text: the text as token rows (what GPTQ, the int8 KV-cache scales
and the quantization report's perplexity run on), and the int8 cache's scales calibrated on them. The
torch and native backends calibrate here; export calls it too (export may use the runtime).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvedge.errors import KvedgeError
from kvedge.models.cache import KVCache

CALIBRATION_ROW = 256  # tokens per calibration sequence (at most the model's positions)
# int8 cache scales: the calibrated max |k|, |v| times this maps to 127, headroom for tokens the text lacks
# (its measured effect: docs/benchmarks.md)
KV_SCALE_MARGIN = 1.5


def calibration_rows(model_dir: Path, cfg, text_file: str | None, tokens: int) -> tuple[torch.Tensor, dict]:
    """The calibration text (GPTQ, int8 cache scales) as token rows: text_rows of the built-in calibration.txt."""
    return text_rows(model_dir, cfg, text_file, tokens, "calibration.txt")


def heldout_rows(model_dir: Path, cfg, text_file: str | None, tokens: int) -> tuple[torch.Tensor, dict]:
    """The evaluation text as token rows: text_rows of the built-in heldout.txt, which calibration never sees."""
    return text_rows(model_dir, cfg, text_file, tokens, "heldout.txt")


def text_rows(model_dir: Path, cfg, text_file: str | None, tokens: int, builtin: str) -> tuple[torch.Tensor, dict]:
    """At most `tokens` of a text as token rows [R, L] (L <= CALIBRATION_ROW and the model's positions), and what
    they are: the file, or kvedge's built-in one (kvedge/models/`builtin`). Tokenized by the model's tokenizer
    (tokenizer.json, or a GGUF file's own), else as UTF-8 bytes modulo the vocabulary."""
    model_dir = Path(model_dir)
    if text_file is None:
        from importlib import resources

        text, source = resources.files("kvedge.models").joinpath(builtin).read_text("utf-8"), f"built-in {builtin}"
    else:
        text, source = Path(text_file).read_text("utf-8"), str(Path(text_file).resolve())
    if (model_dir / "tokenizer.json").is_file() or model_dir.suffix == ".gguf":
        from kvedge.runtime.tokenizer import Tokenizer

        how = "gguf metadata" if model_dir.suffix == ".gguf" else "tokenizer.json"
        ids = Tokenizer(model_dir).encode(text, add_special_tokens=False)
        if ids and max(ids) >= cfg.vocab_size:
            raise KvedgeError(f"the tokenizer of {model_dir} gives token id {max(ids)} for the text {source}, "
                              f"outside the model's vocabulary ({cfg.vocab_size})")
    else:
        ids, how = [b % cfg.vocab_size for b in text.encode("utf-8")], "utf-8 bytes modulo the vocabulary"
    # at most `tokens` in all: a short request is one short row, not a whole 256-token one
    row = min(CALIBRATION_ROW, cfg.max_position_embeddings, len(ids), tokens)
    if row < 2:
        raise KvedgeError(f"text {source}: {len(ids)} tokens, of which at most {tokens} asked for: need at least 2")
    n = max(1, min(tokens, len(ids)) // row)
    rows = torch.tensor(ids[:n * row]).reshape(n, row)
    return rows, {"text": source, "tokenizer": how, "tokens": n * row, "rows": n, "row_length": row}


@torch.inference_mode()
def calibrate_kv_scales(decoder, rows: torch.Tensor, margin: float = KV_SCALE_MARGIN
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer (k_scales, v_scales) [1, Hkv, 1, D] float32 for an int8 cache: the decoder, with a float
    cache, over token rows [R, L] (one at a time); per layer, KV head and channel the largest |k| (after
    RoPE: the op rotates before writing) and |v| in its cache, times `margin`, / 127."""
    cfg = decoder.cfg
    param = next(decoder.parameters())
    k_shape, v_shape = (shape[1::2] for shape in cfg.cache_shapes(1, 1))  # [Hkv, D]; MLA: [1, d_R], [1, d_c]
    k_max = [torch.zeros(k_shape) for _ in range(cfg.num_layers)]
    v_max = [torch.zeros(v_shape) for _ in range(cfg.num_layers)]
    for row in rows:
        row = row.to(param.device)
        cache = KVCache.allocate(cfg, 1, row.numel(), dtype=param.dtype, device=param.device)
        decoder(row[None], torch.arange(row.numel(), device=param.device)[None], cache.for_batch(1),
                logit_index=torch.zeros(1, dtype=torch.long, device=param.device))
        for i in range(cfg.num_layers):
            k_max[i] = torch.maximum(k_max[i], cache.keys[i][0].abs().amax(1).float().cpu())
            v_max[i] = torch.maximum(v_max[i], cache.values[i][0].abs().amax(1).float().cpu())

    def scale(m):  # a channel that was always 0 gets a tiny scale, not a division by zero
        return (m * margin / 127).clamp_min(1e-8)[None, :, None]

    return [scale(m) for m in k_max], [scale(m) for m in v_max]


def builtin_kv_scales(decoder, model_dir: str | Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """An int8 cache's scales for `decoder` calibrated on 2048 tokens of the built-in text, tokenized by
    model_dir's tokenizer: what `kvedge export --kv-dtype int8` calibrates by default."""
    rows, _ = calibration_rows(Path(model_dir), decoder.cfg, None, 2048)
    return calibrate_kv_scales(decoder, rows)
