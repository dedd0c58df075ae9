"""Reference decoder models: config, checkpoint loader, the one Decoder, its attention op and cache math."""

from kvedge.models.attention import attention
from kvedge.models.cache import KVCache, cache_bytes_per_token, kv_bytes_per_token, kv_cache_bytes, mla_bytes_per_token
from kvedge.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, is_checkpoint, load_config
from kvedge.models.decoder import Decoder
from kvedge.models.loader import load_decoder

__all__ = [
    "SUPPORTED_ARCHITECTURES", "Decoder", "KVCache", "ModelConfig", "attention", "cache_bytes_per_token",
    "kv_bytes_per_token", "is_checkpoint", "kv_cache_bytes", "load_config", "load_decoder", "mla_bytes_per_token",
]
