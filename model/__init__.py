"""The GPT model and its attention backends: `from model import GPT, GPTConfig`.

The names are imported on first use (PEP 562): `from model.config import GPTConfig` alone, as the run config's schema
does, costs no torch import.
"""

import importlib
from typing import Any

_HOMES = {"GPT": "gpt", "GPTConfig": "config"}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    return getattr(importlib.import_module(f"model.{_HOMES[name]}"), name)
