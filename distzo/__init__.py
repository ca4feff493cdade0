"""distzo: zeroth-order fine-tuning of language models with forward passes only, from one CPU to a cluster."""

__version__ = "0.1.0"
