"""Data pipeline: text corpora -> cached token files (prepare.py) -> batches of token windows (loader.py).

    from data import DataConfig, prepare_dataset, TokenLoader
    data = prepare_dataset(DataConfig(max_documents=300))  # offline: Python's stdlib sources, byte-level tokens
    loader = TokenLoader(data, block_size=256, batch_size=32, device="cpu", seed=0, vocab_size=data.vocab_size)

Instruction and chat data (data.format=instruction|chat) -> rendered with the model's chat template, tokenized with
a loss mask and cached (sft.py) -> batches of one example per row, padded (loader.py: ExampleLoader):

    data = prepare_dataset(DataConfig(format="chat", source="files", data_files=["chats.jsonl"], encoding=model_dir))
    loader = ExampleLoader(data, block_size=1024, batch_size=8, device="cpu", seed=0)

Tokenizers (data/tokenizers.py): `get_encoding("bytes" | "gpt2" | "<path to tokenizer.json or model dir>")`, and
`stream_decoder(enc)` to print generated tokens as they arrive.

The names are imported on first use (PEP 562): `from data.config import DataConfig` alone, as the run config's schema
does, costs no torch or datasets import.
"""

import importlib
from typing import Any

_HOMES = {"DataConfig": "config", "DataFormat": "config", "Batch": "loader", "TokenLoader": "loader",
          "ExampleLoader": "loader", "PreparedData": "prepare", "prepare_dataset": "prepare",
          "PreparedExamples": "sft",
          **{name: "tokenizers" for name in ("DataUnavailableError", "Encoding", "HFTokenizer", "get_encoding",
                                              "stream_decoder")}}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"data.{_HOMES[name]}"), name)
