"""Turn a text corpus into token files: <cache_dir>/<name>-<hash>/{train.bin, val.bin, meta.json}.

Documents are loaded with HF `datasets`, tokenized in a batched `map` (tiktoken, or a model's own tokenizer.json:
data/tokenizers.py), each followed by the encoding's end-of-text token, split into train/val by document, and
written as flat uint16 (or uint32, for vocabularies over 65536) token files that the loader memory-maps. A folder is
prepared once: the hash covers every setting that changes the tokens (for a tokenizer.json, its sha256 and its
end-of-text token), so a second call with the same settings just reads meta.json. Delete the folder to force
re-preparation.

Prepare a preset from the command line: `python -m data --preset stdlib` (see data/__main__.py).
"""

import glob
import hashlib
import json
import os
import platform
import sysconfig
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import datasets
import numpy as np
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from data.config import DataConfig
from data.tokenizers import DataUnavailableError, Encoding, get_encoding, tokenizer_file

FORMAT_VERSION = 1  # bump when a change here changes the files, so old cache folders are not reused
SPLIT_SEED = 1337  # the train/val split is fixed: the hash names the folder, not the seed


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


def prepare_dataset(cfg: DataConfig, root: str | Path | None = None) -> PreparedData:
    """Prepare (or reuse) the token files of `cfg`; relative paths are resolved against `root` (default: cwd)."""
    if isinstance(cfg, DictConfig):  # also take the Hydra node as it is
        cfg = OmegaConf.to_object(cfg)
    if cfg.encoding is None:  # null: init_from's tokenizer, which training/loop.py resolves; without a model, bytes
        cfg = replace(cfg, encoding="bytes")
    root = Path(root or os.getcwd())
    if not 0 < cfg.val_fraction < 1:
        raise ValueError(f"data.val_fraction={cfg.val_fraction} must lie strictly between 0 and 1")
    files = _local_files(cfg, root) if cfg.source == "text" else []
    settings = _token_settings(cfg, files)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    folder = root / cfg.cache_dir / f"{cfg.name}-{key}"
    if (folder / "meta.json").exists():
        return PreparedData.load(folder)

    enc = get_encoding(cfg.encoding)  # before loading: a missing tokenizer should fail before a long download
    dtype = np.uint16 if enc.n_vocab <= 2**16 else np.uint32
    folder.mkdir(parents=True, exist_ok=True)
    # the text builder's arrow copies are only a step on the way: keep them in a scratch folder deleted at the end
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        docs = _load_documents(cfg, files, scratch)
        if cfg.max_documents is not None:
            docs = docs.select(range(min(cfg.max_documents, len(docs))))
        ids = docs.map(
            _tokenize,
            batched=True,
            fn_kwargs={"enc": enc, "column": cfg.text_column if cfg.source == "hub" else "text"},
            remove_columns=docs.column_names,
            features=datasets.Features({"ids": datasets.List(datasets.Value(np.dtype(dtype).name))}),
            num_proc=cfg.num_proc if cfg.num_proc > 1 else None,
            desc=f"tokenizing {cfg.name} ({cfg.encoding})",
        )
        if len(ids) < 2:
            raise ValueError(
                f"{cfg.name}: {len(ids)} non-empty documents, but train and val need one each: give more text "
                "(data.data_files, data.max_documents)"
            )
        n_val_docs = min(max(1, round(cfg.val_fraction * len(ids))), len(ids) - 1)  # at least one document each
        split = ids.train_test_split(test_size=n_val_docs, seed=SPLIT_SEED)
        n_train, max_train = _write_tokens(split["train"], folder / "train.bin", dtype)
        n_val, max_val = _write_tokens(split["test"], folder / "val.bin", dtype)
    meta = {
        "encoding": cfg.encoding,
        "vocab_size": enc.n_vocab,
        "eot_token": enc.eot_token,
        "dtype": np.dtype(dtype).name,
        "n_train": n_train,
        "n_val": n_val,
        "max_token_id": max(max_train, max_val),
        "documents": {"train": len(split["train"]), "val": len(split["test"])},
        "settings": settings,
    }
    _write_atomic(folder / "meta.json", json.dumps(meta, indent=2).encode())  # last: it marks the folder complete
    return PreparedData.load(folder)


def _local_files(cfg: DataConfig, root: Path) -> list[str]:
    """The text source's files, globs expanded and relative paths resolved against root; URLs are kept as they are."""
    if not cfg.data_files:
        raise ValueError(f"{cfg.name}: no text files given: set data.data_files=[path/to/file.txt, ...]")
    files = []
    for pattern in cfg.data_files:
        if "://" in pattern:
            files.append(pattern)
            continue
        matches = sorted(glob.glob(str(root / Path(pattern).expanduser())))
        if not matches:
            raise ValueError(f"data.data_files: no file matches {pattern!r} (relative paths start at {root})")
        files += matches
    return files


def _token_settings(cfg: DataConfig, files: list[str]) -> dict:
    """Everything that changes the token files; the cache folder's name hashes it."""
    settings = asdict(cfg)
    for unused in ("name", "num_proc", "cache_dir"):
        del settings[unused]
    settings["format"] = FORMAT_VERSION
    if cfg.source == "stdlib":
        settings["python"] = platform.python_version()  # the stdlib's files change with the Python version
    # local files are stamped with size and mtime, so editing them re-prepares instead of reusing stale tokens
    settings["files"] = [[f, *_stamp(f)] if "://" not in f else [f] for f in files]
    if tokenizer_file(cfg.encoding) is not None:
        # a tokenizer.json can change under the same path: its content and the end-of-text token chosen for it
        # (tokenizer_config.json / config.json next to it) decide the tokens. Loading it is local and fast.
        enc = get_encoding(cfg.encoding)
        settings["tokenizer"] = {"sha256": enc.sha256, "eot_token": enc.eot_token}
    return settings


def _stamp(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _load_documents(cfg: DataConfig, files: list[str], scratch: str) -> datasets.Dataset:
    if cfg.source == "stdlib":
        return _stdlib_documents(cfg.max_documents)
    if cfg.source == "text":
        try:
            # paragraphs (split on blank lines) are the documents: one long file still splits into train and val
            return datasets.load_dataset("text", data_files=files, sample_by="paragraph", split="train",
                                         cache_dir=scratch)
        except ValueError as err:  # datasets refuses a split without rows: the files hold no text
            raise ValueError(f"no text in {files} ({err}): set data.data_files to files that hold text") from err
        except OSError as err:
            raise DataUnavailableError(
                f"could not read {files} ({err}). For a URL, download the file yourself and train on it with "
                "data=local_text data.data_files=[path/to/file.txt]"
            ) from err
    if cfg.source == "hub":
        try:
            return datasets.load_dataset(cfg.path, cfg.subset, split=cfg.split, num_proc=cfg.num_proc)
        except OSError as err:  # unreachable or offline Hub: ConnectionError; the original message is kept below
            raise DataUnavailableError(
                f"could not load {cfg.path!r} from the Hugging Face Hub ({err}). Download it once where the Hub is "
                "reachable (it is cached under HF_HOME, default ~/.cache/huggingface), copy that cache here, point "
                "HF_HOME at it and set HF_DATASETS_OFFLINE=1 (or HF_HUB_OFFLINE=1); or train on local text with "
                "data=local_text data.data_files=[path/to/file.txt]"
            ) from err
    raise ValueError(f"unknown data.source={cfg.source!r}: use stdlib, text or hub")


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


def _write_tokens(ids: datasets.Dataset, path: Path, dtype: type) -> tuple[int, int]:
    """Stream the split's tokens into one flat file; return the token count and the largest id."""
    n, max_id = 0, 0
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: concurrent preparers don't collide
    with open(tmp, "wb") as f:
        for batch in tqdm(ids.with_format("arrow").iter(batch_size=1024), desc=f"writing {path.name}",
                          total=-(-len(ids) // 1024)):
            flat = batch["ids"].combine_chunks().flatten().to_numpy().astype(dtype, copy=False)
            flat.tofile(f)
            n, max_id = n + len(flat), max(max_id, int(flat.max()))
    os.replace(tmp, path)
    return n, max_id


def _write_atomic(path: Path, content: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(content)
    os.replace(tmp, path)
