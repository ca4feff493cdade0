"""Model acquisition and adapters over stock transformers models."""

from .adapters import DecoderAdapter, adapter_for
from .loading import load_model, load_tokenizer

__all__ = ["DecoderAdapter", "adapter_for", "load_model", "load_tokenizer"]
