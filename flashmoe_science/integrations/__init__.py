"""Integrations with other libraries, each an optional extra: `transformers` (`[hf]`)."""
