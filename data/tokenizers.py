"""Tokenizers: tiktoken encodings by name, plus an offline byte-level one.

    get_encoding("bytes")  # 256 byte tokens + <|endoftext|> (id 256): n_vocab 257, needs no download
    get_encoding("gpt2")   # any tiktoken encoding; its BPE files are downloaded once and cached by tiktoken

When tiktoken cannot download its files, `DataUnavailableError` says how to get them or how to work offline.
"""

import functools
import os
import tempfile

import tiktoken

EOT = "<|endoftext|>"


class DataUnavailableError(RuntimeError):
    """Data or tokenizer files must be downloaded but cannot be; the message says what to fetch and where to put it."""


def byte_encoding() -> tiktoken.Encoding:
    """Every byte is its own token (ranks 0..255), no merges; <|endoftext|> is the special token 256."""
    return tiktoken.Encoding(
        name="bytes",
        # the split pattern only cuts text into pieces of work: without merges every byte becomes one token anyway
        pat_str=r"(?s:.{1,256})",
        mergeable_ranks={bytes([b]): b for b in range(256)},
        special_tokens={EOT: 256},
    )


@functools.cache
def get_encoding(name: str) -> tiktoken.Encoding:
    if name == "bytes":
        return byte_encoding()
    if name not in tiktoken.list_encoding_names():
        raise ValueError(f"unknown data.encoding={name!r}: use 'bytes' or one of {tiktoken.list_encoding_names()}")
    try:
        return tiktoken.get_encoding(name)
    except OSError as err:  # requests' connection and HTTP errors are OSErrors
        cache = os.environ.get("TIKTOKEN_CACHE_DIR", os.path.join(tempfile.gettempdir(), "data-gym-cache"))
        raise DataUnavailableError(
            f"tiktoken could not download the BPE files of the {name!r} encoding ({err}). Fetch them once where the "
            f"network is reachable (tiktoken caches them in TIKTOKEN_CACHE_DIR, here {cache}), copy that directory "
            "here and set TIKTOKEN_CACHE_DIR to it; or tokenize offline byte-level with data.encoding=bytes."
        ) from err
