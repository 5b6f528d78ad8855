"""Tokenizers: tiktoken encodings by name, an offline byte-level one, and a model's own Hugging Face tokenizer.json.

    get_encoding("bytes")  # 256 byte tokens + <|endoftext|> (id 256): n_vocab 257, needs no download
    byte_tokenizer()       # the same ids as a Hugging Face tokenizer (what an export writes as tokenizer.json)
    get_encoding("gpt2")   # any tiktoken encoding; its BPE files are downloaded once and cached by tiktoken
    get_encoding("models/SmolLM2-135M")                 # a Hugging Face model folder that holds a tokenizer.json,
    get_encoding("models/SmolLM2-135M/tokenizer.json")  # or the file itself: an HFTokenizer

Both kinds offer the part of tiktoken's interface this code base uses: `name`, `n_vocab`, `eot_token` (the token
appended after every document), `encode_ordinary_batch(texts)` (data preparation: no special tokens),
`encode(text, allowed_special="all")` (prompts) and `decode(ids)`. To print generated tokens as they arrive:

    decode = stream_decoder(enc, context=prompt_ids)
    for token in tokens:
        print(decode(token), end="", flush=True)  # only the text that is complete so far
    print(decode.flush())                         # what is left: an unfinished character comes out as U+FFFD

When tiktoken cannot download its files, `DataUnavailableError` says how to get them or how to work offline.
"""

import codecs
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol

import tiktoken
from tokenizers import AddedToken, Tokenizer, decoders, models
from tokenizers.decoders import DecodeStream

EOT = "<|endoftext|>"
# A tokenizer.json whose end-of-sequence token is named neither by tokenizer_config.json nor by config.json ends
# documents with the first of these in its vocabulary (GPT-2/Qwen/SmolLM, Llama 3, Llama 2/TinyLlama, ChatML).
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<|im_end|>")
ENCODING_CHOICES = "data.encoding=bytes|gpt2|<path to tokenizer.json or model dir>"


class DataUnavailableError(RuntimeError):
    """Data or tokenizer files must be downloaded but cannot be; the message says what to fetch and where to put it."""

    user_error = True  # its message names the fix: train.py prints it as one `error:` line (training/launch.py)


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (a model's tokenizer.json) behind the part of tiktoken's interface we use.

    Ids are the tokenizer's own, so a model trained (or fine-tuned) on them keeps working with its tokenizer.
    """

    def __init__(self, name: str, path: Path):
        self.name = name  # the data.encoding string, as the run config and meta.json hold it
        self.path = path
        raw = path.read_bytes()
        self.sha256 = hashlib.sha256(raw).hexdigest()
        try:
            self._tokenizer = Tokenizer.from_str(raw.decode())
        except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(f"{path} is not a Hugging Face tokenizer.json ({err}): set {ENCODING_CHOICES}") from err
        # A second copy for data preparation, told to read special-token text ("<|endoftext|>" in a document) as
        # plain text, like tiktoken's encode_ordinary: the copy for prompts keeps reading it as the special token.
        self._ordinary = Tokenizer.from_str(raw.decode())
        # one past the largest id, as tiktoken counts: added tokens may sit past the base vocabulary, or leave holes
        self.n_vocab = max(self._tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.eot_token = self._find_eot()

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens: no BOS/EOS added, special-token text stays plain text."""
        # set on every call: pickling (datasets' worker processes) drops the flag
        self._ordinary.encode_special_tokens = True
        return [e.ids for e in self._ordinary.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str, allowed_special: Literal["all"] = "all") -> list[int]:
        """Token ids of a prompt, as the model saw text in training: its post-processor's tokens added (e.g. a BOS),
        and special-token text read as the special token (tiktoken's allowed_special="all", the only value taken)."""
        if allowed_special != "all":
            raise ValueError(f"{self.name}: encode takes only allowed_special='all', not {allowed_special!r}")
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens included (as tiktoken's decode); ids past the vocabulary are dropped."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, n_vocab={self.n_vocab}, eot_token={self.eot_token})"

    def _find_eot(self) -> int:
        """The end-of-sequence token: tokenizer_config.json's eos_token, else config.json's eos_token_id, else the
        first of EOT_CANDIDATES in the vocabulary."""
        folder = self.path.parent
        tokenizer_config = _read_json(folder / "tokenizer_config.json")
        eos = tokenizer_config.get("eos_token")
        if isinstance(eos, dict):  # an AddedToken written out: {"content": "</s>", "lstrip": false, ...}
            eos = eos.get("content")
        if eos is not None:
            token = self._tokenizer.token_to_id(eos)
            if token is None:
                raise ValueError(f"{folder / 'tokenizer_config.json'} names eos_token {eos!r}, which is not in the "
                                 f"vocabulary of {self.path}: set eos_token to a token of that tokenizer")
            return token
        eos_id = _read_json(folder / "config.json").get("eos_token_id")
        if isinstance(eos_id, list):  # some chat models list several stop tokens: the first ends documents
            eos_id = eos_id[0] if eos_id else None
        if eos_id is not None:
            if self._tokenizer.id_to_token(eos_id) is None:
                raise ValueError(f"{folder / 'config.json'} names eos_token_id {eos_id}, which is not in the "
                                 f"vocabulary of {self.path}: set eos_token_id to a token of that tokenizer")
            return eos_id
        for candidate in EOT_CANDIDATES:
            token = self._tokenizer.token_to_id(candidate)
            if token is not None:
                return token
        raise ValueError(
            f"{self.path}: cannot tell which token ends a document: no eos_token in a tokenizer_config.json next to "
            f"it, no eos_token_id in a config.json next to it, and none of {list(EOT_CANDIDATES)} in its vocabulary. "
            'Put a tokenizer_config.json holding {"eos_token": "<its end-of-text token>"} next to it.'
        )


Encoding = tiktoken.Encoding | HFTokenizer


def byte_encoding() -> tiktoken.Encoding:
    """Every byte is its own token (ranks 0..255), no merges; <|endoftext|> is the special token 256."""
    return tiktoken.Encoding(
        name="bytes",
        # the split pattern only cuts text into pieces of work: without merges every byte becomes one token anyway
        pat_str=r"(?s:.{1,256})",
        mergeable_ranks={bytes([b]): b for b in range(256)},
        special_tokens={EOT: 256},
    )


def byte_tokenizer() -> Tokenizer:
    """The byte encoding as a Hugging Face tokenizer with the same ids, for those who load a model with transformers:
    byte b is the token <0xbb> (id b, reached through the byte fallback of Llama's tokenizers), <|endoftext|> the
    special token 256."""
    tokenizer = Tokenizer(models.BPE(vocab={f"<0x{b:02X}>": b for b in range(256)}, merges=[], byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens([AddedToken(EOT, special=True)])
    return tokenizer


def is_tiktoken(name: str) -> bool:
    """Whether data.encoding=`name` is a tiktoken encoding (bytes or one of tiktoken's names): no file holds it."""
    return name == "bytes" or name in tiktoken.list_encoding_names()


def tokenizer_file(name: str) -> Path | None:
    """The tokenizer.json that data.encoding=`name` names (a file, or a folder holding one); None for a tiktoken name.

    Relative paths start at the working directory.
    """
    if is_tiktoken(name):
        return None
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ValueError(
                f"data.encoding={name!r}: the folder {path.resolve()} holds no tokenizer.json. Set "
                f"{ENCODING_CHOICES}. A model folder with only a tokenizer.model or vocab.json + merges.txt gets its "
                "tokenizer.json from transformers: AutoTokenizer.from_pretrained(folder).save_pretrained(folder)"
            )
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"data.encoding={name!r} is neither a tiktoken encoding ({', '.join(tiktoken.list_encoding_names())}) "
            f"nor an existing file or folder (relative paths start at {Path.cwd()}): set {ENCODING_CHOICES}"
        )
    # The folder resolved, not the file: in the Hugging Face cache tokenizer.json links into blobs/, away from the
    # tokenizer_config.json and config.json beside it that name the end-of-text token.
    return path.parent.resolve() / path.name


def get_encoding(name: str) -> Encoding:
    """The encoding data.encoding=`name` names: "bytes", a tiktoken encoding name, or a path to a tokenizer.json or
    to a Hugging Face model folder holding one. Loaded once per process; an edited tokenizer file is loaded again."""
    path = tokenizer_file(name)
    if path is None:
        return _load(name, None, None)
    # keyed by the content of the files that make the tokenizer, not by size and mtime: a file replaced by another
    # of the same size within one tick of the file system's clock is still loaded again (hashing a 10 MB file: ~20 ms)
    digest = hashlib.sha256()
    for f in (path, *_side_files(path)):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return _load(name, path, digest.hexdigest())


@functools.cache
def _load(name: str, path: Path | None, content_sha256: str | None) -> Encoding:  # the digest only keys the cache
    if path is not None:
        return HFTokenizer(name, path)
    if name == "bytes":
        return byte_encoding()
    try:
        return tiktoken.get_encoding(name)
    except OSError as err:  # requests' connection and HTTP errors are OSErrors
        cache = os.environ.get("TIKTOKEN_CACHE_DIR", os.path.join(tempfile.gettempdir(), "data-gym-cache"))
        raise DataUnavailableError(
            f"tiktoken could not download the BPE files of the {name!r} encoding ({err}). Fetch them once where the "
            f"network is reachable (tiktoken caches them in TIKTOKEN_CACHE_DIR, here {cache}), copy that directory "
            "here and set TIKTOKEN_CACHE_DIR to it; or tokenize offline byte-level with data.encoding=bytes."
        ) from err


get_encoding.cache_clear = _load.cache_clear  # forget every loaded encoding (tests that fake tiktoken's downloads)


class StreamDecoder(Protocol):
    """What stream_decoder returns: call it with each new token id; flush() once at the end."""

    def __call__(self, token: int) -> str: ...

    def flush(self) -> str: ...


def stream_decoder(enc: Encoding, context: Sequence[int] = ()) -> StreamDecoder:
    """A callable that takes the next token id and returns the text completed by it (often "" mid-character), and
    whose flush() returns what is left at the end. `context`: the ids already shown (the prompt); their text is not
    returned, but a SentencePiece-style tokenizer needs them to know whether a "▁" becomes a space (tiktoken
    encodings do not: for them it is ignored)."""
    if isinstance(enc, HFTokenizer):
        return _TokenizerStream(enc, context)
    return _Utf8Stream(enc)


class _Utf8Stream:
    """tiktoken: a token's bytes may end inside a UTF-8 character, so bytes go through an incremental decoder."""

    def __init__(self, enc: tiktoken.Encoding):
        self._enc = enc
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, token: int) -> str:
        return self._utf8.decode(self._enc.decode_single_token_bytes(token))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _TokenizerStream:
    """tokenizers' DecodeStream: it runs the tokenizer's own decoder (byte-level BPE, byte fallback, "▁" spaces) over
    a short window of recent ids and returns the new text once it no longer ends in an unfinished character."""

    def __init__(self, enc: HFTokenizer, context: Sequence[int]):
        self._tokenizer = enc._tokenizer
        self._stream = DecodeStream(skip_special_tokens=False)
        self._ids = [int(i) for i in context]
        for token in self._ids:  # one id per step: older releases' step takes no list
            self._stream.step(self._tokenizer, token)
        self._shown = len(self._ids)  # the ids whose text has been returned (or was the context)

    def __call__(self, token: int) -> str:
        self._ids.append(int(token))
        text = self._stream.step(self._tokenizer, int(token))
        if text is None:  # an unfinished character, or a token without text
            return ""
        self._shown = len(self._ids)
        return text

    def flush(self) -> str:
        if self._shown == len(self._ids):
            return ""
        # the held-back ids, decoded after what was shown: an unfinished character comes out as U+FFFD
        head = self._tokenizer.decode(self._ids[: self._shown], skip_special_tokens=False)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=False)[len(head):]
        self._shown = len(self._ids)
        return text


def _side_files(path: Path) -> list[Path]:
    """The files next to a tokenizer.json that decide its end-of-sequence token (see HFTokenizer._find_eot)."""
    return [f for f in (path.parent / "tokenizer_config.json", path.parent / "config.json") if f.is_file()]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON ({err}): fix or remove it") from err
    return content if isinstance(content, dict) else {}
