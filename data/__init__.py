"""Data pipeline: text corpora -> cached token files (prepare.py) -> batches of token windows (loader.py).

    from data import DataConfig, prepare_dataset, TokenLoader
    data = prepare_dataset(DataConfig(max_documents=300))  # offline: Python's stdlib sources, byte-level tokens
    loader = TokenLoader(data, block_size=256, batch_size=32, device="cpu", seed=0, vocab_size=data.vocab_size)

Tokenizers (data/tokenizers.py): `get_encoding("bytes" | "gpt2" | "<path to tokenizer.json or model dir>")`, and
`stream_decoder(enc)` to print generated tokens as they arrive.
"""

from data.config import DataConfig
from data.loader import TokenLoader
from data.prepare import PreparedData, prepare_dataset
from data.tokenizers import DataUnavailableError, Encoding, HFTokenizer, get_encoding, stream_decoder

__all__ = ["DataConfig", "DataUnavailableError", "Encoding", "HFTokenizer", "PreparedData", "TokenLoader",
           "get_encoding", "prepare_dataset", "stream_decoder"]
