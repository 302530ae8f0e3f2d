"""ftctl: configuration-driven fine-tuning of large language models."""

__version__ = "0.1.0"
