"""The data section of the run config (`data=<preset>` in conf/data/): where text comes from and how it is tokenized.

A plain dataclass: the training package registers it with Hydra's ConfigStore, the data code only reads it.
"""

from dataclasses import dataclass
from typing import List, Optional


@dataclass
class DataConfig:
    name: str = "stdlib"  # preset name; also names the cache folder of the prepared token files
    source: str = "stdlib"  # stdlib (Python's own source files, offline) | text (local/URL text files) | hub
    path: Optional[str] = None  # hub: dataset id for load_dataset (e.g. roneneldan/TinyStories)
    subset: Optional[str] = None  # hub: dataset config name, if any
    data_files: Optional[List[str]] = None  # text: files (or URLs) for load_dataset("text", data_files=...)
    split: str = "train"  # split to read; val is carved out of it by val_fraction
    text_column: str = "text"
    # bytes (256 byte ranks + <|endoftext|>, offline) | gpt2 | any tiktoken encoding name | a path to a model's own
    # tokenizer.json or to the Hugging Face model folder holding it (relative paths start at the working directory) |
    # null: the tokenizer of init_from (a pretrained model's own, our checkpoint's), bytes when training from scratch
    encoding: Optional[str] = None
    val_fraction: float = 0.1  # share held out for validation: of the documents, or of the tokens (val_split=tail)
    # documents: a random val_fraction of the documents is val (local text: paragraphs, split on blank lines) |
    # tail: the documents in order, joined into one token stream (local text: one document per file, its characters
    # exactly), whose last val_fraction is val, as nanoGPT's shakespeare_char
    val_split: str = "documents"
    max_documents: Optional[int] = None  # cap on the documents read (keeps the offline default small)
    num_proc: int = 1  # processes for datasets.map
    cache_dir: str = ".cache/data"  # prepared token files live in <cache_dir>/<name>-<hash of this config>/
