"""Model acquisition and adapters over stock transformers models."""

from .adapters import DecoderAdapter
from .loading import load_model, load_tokenizer
from .selection import adapter_for

__all__ = ["DecoderAdapter", "adapter_for", "load_model", "load_tokenizer"]
