"""Turn a text corpus into token files: <cache_dir>/<name>-<hash>/{train.bin, val.bin, meta.json}.

Instruction and chat data (data.format=instruction|chat) are prepared by data/sft.py into examples with a loss mask;
`prepare_dataset` hands them there, and this module's readers and writers serve both.

Documents are loaded with HF `datasets`, tokenized in a batched `map` (tiktoken, or a model's own tokenizer.json:
data/tokenizers.py), each followed by the encoding's end-of-text token, split into train/val, and written as flat
uint16 (or uint32, for vocabularies over 65536) token files that the loader memory-maps. The split (data.val_split)
holds out a random share of the documents (`documents`), or the last share of the token stream (`tail`: nanoGPT's
split, where a local text file is one document). Local text files are checked first, so that an empty, binary or
non-UTF-8 file is an error that names it and the fix. A folder is prepared once: the hash covers every setting that
changes the tokens (for a tokenizer.json, its sha256 and its end-of-text token), so a second call with the same
settings just reads meta.json. Delete the folder to force re-preparation.

Prepare a preset from the command line: `python -m data --preset stdlib` (see data/__main__.py).
"""

import codecs
import glob
import hashlib
import json
import os
import platform
import shlex
import sysconfig
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import datasets
import numpy as np
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from data.config import DataConfig, DataFormat
from data.tokenizers import DataUnavailableError, Encoding, get_encoding, tokenizer_file

if TYPE_CHECKING:
    from data.sft import PreparedExamples

FORMAT_VERSION = 1  # bump when a change here changes the files, so old cache folders are not reused
SPLIT_SEED = 1337  # the train/val split is fixed: the hash names the folder, not the seed
VAL_SPLITS = ("documents", "tail")  # data.val_split
# data.source=files: datasets' builder for each file extension
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# the keys of instruction and chat data (data/sft.py): left out of a text folder's hash, whose name stays as it was
SFT_KEYS = ("format", "messages_column", "instruction_column", "input_column", "output_column", "system_prompt",
            "prompt_template", "train_on", "overlong", "packing")
CHECK_CHUNK = 1 << 20  # bytes per read when checking a local text file
BINARY_HEAD = 8000  # a NUL byte this early marks a binary file, as git decides (so a PNG is not "not UTF-8")
# byte-order marks of text that is not UTF-8; UTF-32's first, since its little-endian mark begins with UTF-16's
BOMS = {codecs.BOM_UTF32_LE: "utf-32", codecs.BOM_UTF32_BE: "utf-32", codecs.BOM_UTF16_LE: "utf-16",
        codecs.BOM_UTF16_BE: "utf-16"}


@dataclass
class PreparedData:
    dir: Path
    encoding: str  # the data.encoding string: a tiktoken name or the tokenizer.json path as given
    vocab_size: int  # the encoding's n_vocab
    eot_token: int
    dtype: str  # "uint16" | "uint32"
    n_train: int
    n_val: int
    max_token_id: int

    @classmethod
    def load(cls, folder: Path) -> "PreparedData":
        meta = json.loads((folder / "meta.json").read_text())
        return cls(dir=folder, **{k: meta[k] for k in cls.__dataclass_fields__ if k != "dir"})

    def tokens(self, split: str) -> np.memmap:
        n = {"train": self.n_train, "val": self.n_val}[split]
        path = self.dir / f"{split}.bin"
        expected = n * np.dtype(self.dtype).itemsize
        size = path.stat().st_size if path.exists() else None
        if size != expected:
            found = "is missing" if size is None else f"has {size} bytes"
            raise ValueError(
                f"token file {path} {found}, but meta.json says {n} {self.dtype} tokens ({expected} bytes): "
                f"the cache is damaged; delete the folder {self.dir} to re-prepare it"
            )
        return np.memmap(path, dtype=self.dtype, mode="r", shape=(n,))


def prepare_dataset(cfg: DataConfig, root: str | Path | None = None) -> "PreparedData | PreparedExamples":
    """Prepare (or reuse) the token files of `cfg`; relative paths are resolved against `root` (default: cwd).
    Instruction and chat data give data/sft.py's PreparedExamples."""
    if isinstance(cfg, DictConfig):  # also take the Hydra node as it is
        cfg = OmegaConf.to_object(cfg)
    if cfg.encoding is None:  # null: init_from's tokenizer, which training/loop.py resolves; without a model, bytes
        cfg = replace(cfg, encoding="bytes")
    root = Path(root or os.getcwd())
    if not 0 < cfg.val_fraction < 1:
        raise ValueError(f"data.val_fraction={cfg.val_fraction} must lie strictly between 0 and 1")
    if cfg.val_split not in VAL_SPLITS:
        raise ValueError(f"data.val_split={cfg.val_split!r}: use {' or '.join(VAL_SPLITS)}")
    if DataFormat(cfg.format) != DataFormat.text:
        from data.sft import prepare_examples  # here: data/sft.py builds on this module

        return prepare_examples(cfg, root)
    files = local_files(cfg, root) if cfg.source in ("text", "files") else []
    settings = _token_settings(cfg, files)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    folder = root / cfg.cache_dir / f"{cfg.name}-{key}"
    if (folder / "meta.json").exists():
        return PreparedData.load(folder)

    enc = get_encoding(cfg.encoding)  # before loading: a missing tokenizer should fail before a long download
    dtype = np.uint16 if enc.n_vocab <= 2**16 else np.uint32
    # datasets would only say "An error occurred while generating the dataset" of a text file it cannot read
    text_files = _check_text_files(files) if cfg.source == "text" else files
    folder.mkdir(parents=True, exist_ok=True)
    # the text builder's arrow copies are only a step on the way: keep them in a scratch folder deleted at the end
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        docs = _load_documents(cfg, text_files, scratch)
        if cfg.max_documents is not None:
            docs = docs.select(range(min(cfg.max_documents, len(docs))))
        ids = docs.map(
            _tokenize,
            batched=True,
            fn_kwargs={"enc": enc, "column": cfg.text_column if cfg.source in ("hub", "files") else "text"},
            remove_columns=docs.column_names,
            features=datasets.Features({"ids": datasets.List(datasets.Value(np.dtype(dtype).name))}),
            num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
            desc=f"tokenizing {cfg.name} ({cfg.encoding})",
        )
        if cfg.val_split == "tail":
            n_train, n_val, max_id = _write_tail_split(cfg, ids, folder, Path(scratch), dtype)
            documents = {"total": len(ids)}  # the cut falls inside a document: it has no train or val count
        else:
            if len(ids) < 2:
                raise ValueError(
                    f"{cfg.name}: {len(ids)} non-empty documents, but train and val need one each: give more text "
                    "(data.data_files, data.max_documents), or hold out the end of the text with data.val_split=tail"
                )
            n_val_docs = min(max(1, round(cfg.val_fraction * len(ids))), len(ids) - 1)  # at least one document each
            split = ids.train_test_split(test_size=n_val_docs, seed=SPLIT_SEED)
            n_train, max_train = write_tokens(split["train"], folder / "train.bin", dtype)
            n_val, max_val = write_tokens(split["test"], folder / "val.bin", dtype)
            max_id = max(max_train, max_val)
            documents = {"train": len(split["train"]), "val": len(split["test"])}
    meta = {
        "encoding": cfg.encoding,
        "vocab_size": enc.n_vocab,
        "eot_token": enc.eot_token,
        "dtype": np.dtype(dtype).name,
        "n_train": n_train,
        "n_val": n_val,
        "max_token_id": max_id,
        "documents": documents,
        "settings": settings,
    }
    write_atomic(folder / "meta.json", json.dumps(meta, indent=2).encode())  # last: it marks the folder complete
    return PreparedData.load(folder)


def local_files(cfg: DataConfig, root: Path) -> list[str]:
    """The files of data.source=text or files, globs expanded and relative paths resolved against root; URLs are kept
    as they are."""
    kind, suffix = ("text files", ".txt") if cfg.source == "text" else ("files", ".jsonl")
    if not cfg.data_files:
        raise ValueError(f"{cfg.name}: no data files given: set data.data_files=[path/to/file{suffix}, ...]")
    files = []
    for pattern in cfg.data_files:
        if "://" in pattern:
            files.append(pattern)
            continue
        matches = sorted(glob.glob(str(root / Path(pattern).expanduser())))
        if not matches:
            raise ValueError(f"data.data_files: no file matches {pattern!r} (relative paths start at {root})")
        if folders := [m for m in matches if os.path.isdir(m)]:
            raise ValueError(f"data.data_files: {pattern!r} names the directory {folders[0]}: name the {kind} in "
                             f"it, e.g. data.data_files=[{Path(folders[0]) / ('*' + suffix)}]")
        files += matches
    return files


def _token_settings(cfg: DataConfig, files: list[str]) -> dict:
    """Everything that changes the token files; the cache folder's name hashes it."""
    settings = asdict(cfg)
    for unused in ("name", "num_proc", "cache_dir", *SFT_KEYS):
        del settings[unused]
    if cfg.val_split == "documents":
        # the split from before val_split existed: leaving it out of the hash keeps the names of the folders already
        # prepared (OpenWebText takes hours), while tail hashes differently
        del settings["val_split"]
    settings["format"] = FORMAT_VERSION
    if cfg.source == "stdlib":
        settings["python"] = platform.python_version()  # the stdlib's files change with the Python version
    settings["files"] = file_stamps(files)
    if tokenizer_file(cfg.encoding) is not None:
        # a tokenizer.json can change under the same path: its content and the end-of-text token chosen for it
        # (tokenizer_config.json / config.json next to it) decide the tokens. Loading it is local and fast.
        enc = get_encoding(cfg.encoding)
        settings["tokenizer"] = {"sha256": enc.sha256, "eot_token": enc.eot_token}
    return settings


def file_stamps(files: list[str]) -> list[list]:
    """Each file with its size and mtime (a URL as it is), for a cache key: editing a local file re-prepares it
    instead of reusing stale tokens."""
    return [[f, os.stat(f).st_size, os.stat(f).st_mtime_ns] if "://" not in f else [f] for f in files]


def _check_text_files(files: list[str]) -> list[str]:
    """The files to hand to datasets. Each local file is read through once, in chunks: a binary or non-UTF-8 one is
    an error naming the file, the problem and the fix (datasets' text loader fails on it with a bare
    DatasetGenerationError), every such file at once.

    An empty file among others adds no text and is left out (datasets skips it too); all of them empty is an error
    (datasets fails on that as well). URLs are not checked: datasets downloads them.
    """
    local = [f for f in files if "://" not in f]
    problems = [f"{path}: {problem}" for path in local if (problem := _text_file_problem(path))]
    if problems:
        raise ValueError("data.data_files: cannot read as UTF-8 text:\n  " + "\n  ".join(problems))
    empty = [f for f in local if os.path.getsize(f) == 0]
    if empty and len(empty) == len(files):
        named = f"{empty[0]} is" if len(empty) == 1 else f"every file is ({', '.join(empty)})"
        raise ValueError(f"data.data_files: {named} empty (0 bytes), no text to train on: put text in "
                         f"{'it' if len(empty) == 1 else 'them'}, or set data.data_files to files that hold text")
    return [f for f in files if f not in empty]


def _text_file_problem(path: str) -> str | None:
    """Why `path` cannot be read as UTF-8 text, and the fix; None when it can (or is empty: see _check_text_files).

    The file is streamed through an incremental decoder, so the reported byte offset is exact even when a character
    straddles two chunks, and a huge file is never in memory at once.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = newlines = 0  # bytes and line breaks before the current chunk
    with open(path, "rb") as f:
        head = f.read(BINARY_HEAD)
        for bom, encoding in BOMS.items():
            if head.startswith(bom):
                return f"{encoding.upper()} text (it starts with a byte-order mark): " + _convert_fix(path, encoding)
        if (nul := head.find(b"\0")) >= 0:
            return _binary_problem(path, nul)
        f.seek(0)
        while chunk := f.read(CHECK_CHUNK):
            pending = len(decoder.getstate()[0])  # bytes of a character cut by the previous chunk, not yet decoded
            try:
                decoder.decode(chunk)
                bad = None
            except UnicodeDecodeError as err:
                bad = err
            # err.start counts from the decoder's pending bytes, which the chunk continues
            bad_at = None if bad is None else bad.start - pending
            nul = chunk.find(b"\0")
            if nul >= 0 and (bad_at is None or nul < bad_at):  # valid UTF-8 up to a NUL: not text either
                return _binary_problem(path, offset + nul)
            if bad is not None:
                line = newlines + chunk[:max(bad_at, 0)].count(b"\n") + 1
                return _not_utf8_problem(path, f, offset + bad_at, bad, line)
            offset, newlines = offset + len(chunk), newlines + chunk.count(b"\n")
        pending = len(decoder.getstate()[0])
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as err:  # the file ends inside a character
            return _not_utf8_problem(path, f, offset - pending + err.start, err, newlines + 1)
    return None


def _binary_problem(path: str, offset: int) -> str:
    return (f"looks binary, not text (a NUL byte at byte {offset}): remove it from data.data_files. If it is text "
            "saved as UTF-16 or UTF-32 (NUL bytes between the letters), " + _convert_fix(path, "utf-16"))


def _not_utf8_problem(path: str, f: BinaryIO, offset: int, err: UnicodeDecodeError, line: int) -> str:
    """The bad bytes at `offset` with up to 20 bytes either side, read again from the file: the chunk that held them
    may have cut the context short."""
    n_bad = err.end - err.start
    f.seek(max(0, offset - 20))
    context = f.read(min(offset, 20) + n_bad + 20)
    bad = context[min(offset, 20) : min(offset, 20) + n_bad]
    return (f"not UTF-8 at byte {offset} (line {line}): {bad!r} in {context!r} ({err.reason}). Find its encoding "
            f"(`file -i {shlex.quote(path)}` guesses it) and " + _convert_fix(path, "latin1", example=True))


def _convert_fix(path: str, encoding: str, example: bool = False) -> str:
    """The command that writes a UTF-8 copy next to the file: notes.txt -> notes.utf8.txt."""
    source = Path(path)
    target = source.with_name(f"{source.stem}.utf8{source.suffix}")
    return (f"convert it to UTF-8{', e.g. from Latin-1' if example else ''}: iconv -f {encoding} -t utf-8 "
            f"{shlex.quote(path)} > {shlex.quote(str(target))}, then use {target} in data.data_files")


def _load_documents(cfg: DataConfig, files: list[str], scratch: str) -> datasets.Dataset:
    if cfg.source == "stdlib":
        return _stdlib_documents(cfg.max_documents)
    if cfg.source == "text":
        # documents split: paragraphs (split on blank lines) are the documents, so one long file still splits into
        # train and val. tail: a file is one document, its text exactly as written (nanoGPT reads it whole too)
        sample_by = "document" if cfg.val_split == "tail" else "paragraph"
        try:
            return datasets.load_dataset("text", data_files=files, sample_by=sample_by, split="train",
                                         cache_dir=scratch)
        except ValueError as err:  # datasets refuses a split without rows: the files hold no text
            raise ValueError(f"no text in {files} ({err}): set data.data_files to files that hold text") from err
        except datasets.exceptions.DatasetGenerationError as err:  # a URL's text: _check_text_files cannot see it
            raise ValueError(f"could not read {files} as UTF-8 text ({err.__cause__!r}): download the file and name "
                             "the copy in data.data_files, where a local file's problem is found and named") from err
        except OSError as err:
            raise DataUnavailableError(
                f"could not read {files} ({err}). For a URL, download the file yourself and train on it with "
                "data=local_text data.data_files=[path/to/file.txt]"
            ) from err
    if cfg.source in ("hub", "files"):
        docs, origins = load_rows(cfg, files, scratch)
        if cfg.text_column not in docs.column_names:
            raise ValueError(f"{', '.join(name for name, _ in origins)} has no column data.text_column="
                             f"{cfg.text_column!r} (its columns: {docs.column_names}): set data.text_column to the "
                             "column that holds the text")
        return docs
    raise ValueError(f"unknown data.source={cfg.source!r}: use stdlib, text, hub or files")


def load_rows(cfg: DataConfig, files: list[str], scratch: str) -> tuple[datasets.Dataset, list[tuple[str, int]]]:
    """The rows of a hub dataset (data.source=hub) or of data files (files: json, jsonl, parquet or csv, each read by
    datasets' builder for its extension, in order), and where they come from: (the file or dataset holding them,
    the row where its rows begin), so that an error can name a row's file."""
    if cfg.source == "hub":
        try:
            rows = datasets.load_dataset(cfg.path, cfg.subset, split=cfg.split, num_proc=cfg.num_proc)
        except OSError as err:  # unreachable or offline Hub: ConnectionError; the original message is kept below
            local = {DataFormat.text: "text with data=local_text data.data_files=[path/to/file.txt]",
                     DataFormat.chat: "files with data=chat_local data.data_files=[path/to/file.jsonl]",
                     DataFormat.instruction: "files with data=instruct_local data.data_files=[path/to/file.jsonl]"}
            raise DataUnavailableError(
                f"could not load {cfg.path!r} from the Hugging Face Hub ({err}). Download it once where the Hub is "
                "reachable (it is cached under HF_HOME, default ~/.cache/huggingface), copy that cache here, point "
                "HF_HOME at it and set HF_DATASETS_OFFLINE=1 (or HF_HUB_OFFLINE=1); or train on local "
                + local[DataFormat(cfg.format)]
            ) from err
        return rows, [(f"{cfg.path} ({cfg.split} split)", 0)]
    parts = []
    for f in files:
        builder = FILE_BUILDERS.get(Path(f.split("?")[0]).suffix.lower())
        if builder is None:
            raise ValueError(f"data.data_files: cannot tell how to read {f}: data.source=files reads "
                             f"{', '.join(FILE_BUILDERS)} files (plain text: data.source=text)")
        try:
            parts.append(datasets.load_dataset(builder, data_files=[f], split="train", cache_dir=scratch))
        except datasets.exceptions.DatasetGenerationError as err:
            raise ValueError(f"could not read {f} as {builder} ({err.__cause__}): fix the file, or remove it from "
                             "data.data_files") from err
        except OSError as err:
            raise DataUnavailableError(f"could not read {f} ({err}). For a URL, download the file yourself and name "
                                       "the copy in data.data_files") from err
    starts = np.cumsum([0] + [len(part) for part in parts[:-1]]).tolist()
    return datasets.concatenate_datasets(parts), list(zip(files, starts, strict=True))


def _stdlib_documents(max_documents: int | None) -> datasets.Dataset:
    """Python's own standard library sources, one document per .py file, in a fixed (sorted) order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.relative_to(stdlib).parts)
    paths = paths[:max_documents]
    # a few stdlib test files are deliberately not UTF-8; replacing their odd bytes keeps the file list stable
    return datasets.Dataset.from_dict({"text": [p.read_text(encoding="utf-8", errors="replace") for p in paths]})


def _tokenize(batch: dict, enc: Encoding, column: str) -> dict:
    texts = [t for t in batch[column] if t]  # empty documents would only add a lone end-of-text token
    # encode_ordinary: a literal "<|endoftext|>" inside the text is plain text, not the separator token
    return {"ids": [ids + [enc.eot_token] for ids in enc.encode_ordinary_batch(texts)]}


def _write_tail_split(cfg: DataConfig, ids: datasets.Dataset, folder: Path, scratch: Path,
                      dtype: type) -> tuple[int, int, int]:
    """val_split=tail: the documents' tokens, in order, form one stream whose last val_fraction is val; returns the
    train and val token counts and the largest id.

    Documents are joined by the end-of-text token, with none after the last: one text file's stream is exactly its
    text's tokens, so byte tokens of tinyshakespeare's input.txt split as nanoGPT's shakespeare_char does its
    characters (1,003,854 train, 111,540 val).
    """
    stream_path = scratch / "stream.bin"
    n, max_id = write_tokens(ids, stream_path, dtype, drop_last=True)
    if n < 2:
        raise ValueError(f"{cfg.name}: {n} tokens, but train and val need one each: give more text "
                         "(data.data_files, data.max_documents)")
    # int(), not round(): nanoGPT's train is data[:int(n * 0.9)]; at least one token on each side
    n_train = min(max(1, int((1 - cfg.val_fraction) * n)), n - 1)
    stream = np.memmap(stream_path, dtype=dtype, mode="r", shape=(n,))
    write_atomic(folder / "train.bin", stream[:n_train])
    write_atomic(folder / "val.bin", stream[n_train:])
    del stream  # unmapped before the scratch folder goes
    return n_train, n - n_train, max_id


def write_tokens(ids: datasets.Dataset, path: Path, dtype: type, drop_last: bool = False,
                  column: str = "ids") -> tuple[int, int]:
    """Stream the split's tokens (the lists of `column`) into one flat file; return the token count and the largest.

    drop_last leaves out the very last token: the end-of-text after the last document (val_split=tail).
    """
    n, max_id = 0, 0
    n_batches = -(-len(ids) // 1024)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: concurrent preparers don't collide
    with open(tmp, "wb") as f:
        batches = ids.with_format("arrow").iter(batch_size=1024)
        for i, batch in enumerate(tqdm(batches, desc=f"writing {path.name}", total=n_batches)):
            flat = batch[column].combine_chunks().flatten().to_numpy().astype(dtype, copy=False)
            if drop_last and i == n_batches - 1:
                flat = flat[:-1]
            flat.tofile(f)
            n, max_id = n + len(flat), max(max_id, int(flat.max(initial=0)))
    os.replace(tmp, path)
    return n, max_id


def write_atomic(path: Path, content: bytes | np.ndarray) -> None:
    """Write to a temporary name, then rename: a reader sees the whole file or none. An array (a memmap slice) is
    written from its buffer, without a copy in memory."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(content)
    os.replace(tmp, path)
