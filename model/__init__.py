"""The GPT model and its attention backends: `from model import GPT, GPTConfig`."""

from model.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
