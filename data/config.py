"""The data section of the run config (`data=<preset>` in conf/data/): where text comes from and how it is tokenized.

A plain dataclass: the training package registers it with Hydra's ConfigStore, the data code only reads it. Its
enums make Hydra refuse a bad value of those keys as the config is composed, naming the key and the choices.
"""

from dataclasses import dataclass
from enum import Enum
from typing import List, Optional


class DataFormat(Enum):
    text = "text"  # documents of plain text, joined into one token stream (data/prepare.py)
    instruction = "instruction"  # Alpaca-style rows: an instruction, an optional input, an output (data/sft.py)
    chat = "chat"  # conversations: a list of {role, content} messages, roles system/user/assistant (data/sft.py)


class TrainOn(Enum):
    assistant = "assistant"  # the assistant's answers and the template's end-of-turn token after each
    all = "all"  # every token of the rendered example


class Overlong(Enum):
    truncate = "truncate"  # keep an example's first model.block_size + 1 tokens
    drop = "drop"  # leave out an example longer than model.block_size + 1 tokens


@dataclass
class DataConfig:
    name: str = "stdlib"  # preset name; also names the cache folder of the prepared token files
    # stdlib (Python's own source files, offline) | text (local/URL text files) | hub | files (local/URL json, jsonl,
    # parquet or csv files, read by datasets' builder of that kind)
    source: str = "stdlib"
    path: Optional[str] = None  # hub: dataset id for load_dataset (e.g. roneneldan/TinyStories)
    subset: Optional[str] = None  # hub: dataset config name, if any
    data_files: Optional[List[str]] = None  # text, files: files (or URLs) for load_dataset(..., data_files=...)
    split: str = "train"  # split to read; val is carved out of it by val_fraction
    text_column: str = "text"  # hub, files: the column holding a document's text (data.format=text)
    # bytes (256 byte ranks + <|endoftext|>, offline) | gpt2 | any tiktoken encoding name | a path to a model's own
    # tokenizer.json or to the Hugging Face model folder holding it (relative paths start at the working directory) |
    # null: the tokenizer of init_from (a pretrained model's own, our checkpoint's), bytes when training from scratch
    encoding: Optional[str] = None
    val_fraction: float = 0.1  # share held out for validation: of the documents, or of the tokens (val_split=tail)
    # documents: a random val_fraction of the documents is val (local text: paragraphs, split on blank lines) |
    # tail: the documents in order, joined into one token stream (local text: one document per file, its characters
    # exactly), whose last val_fraction is val, as nanoGPT's shakespeare_char. Instruction and chat data: a random
    # val_fraction of the examples (documents), or the last val_fraction of them in order (tail)
    val_split: str = "documents"
    max_documents: Optional[int] = None  # cap on the documents read (keeps the offline default small)
    num_proc: int = 1  # processes for datasets.map
    cache_dir: str = ".cache/data"  # prepared token files live in <cache_dir>/<name>-<hash of this config>/
    # Instruction and chat data (supervised fine-tuning, data/sft.py; docs/instruction-tuning.md)
    format: DataFormat = DataFormat.text
    messages_column: str = "messages"  # chat: the column of conversations, each a list of {role, content}
    instruction_column: str = "instruction"  # instruction: the task ...
    input_column: str = "input"  # ... its optional input, appended to the instruction after a blank line ...
    output_column: str = "output"  # ... and the answer, the assistant's turn
    system_prompt: Optional[str] = None  # the system message of every example that has none
    # null: the model's own chat template (tokenizer_config.json's chat_template, or chat_template.jinja, beside its
    # tokenizer.json) | alpaca | chatml: a plain prompt template of data/sft.py (PROMPT_TEMPLATES), for a model
    # without one (a base model, byte tokens from scratch, GPT-2); named, it is used even where the model has one
    prompt_template: Optional[str] = None
    train_on: TrainOn = TrainOn.assistant  # the tokens the loss is on
    overlong: Overlong = Overlong.truncate  # examples longer than model.block_size + 1 tokens (counted either way)
    # several examples per row of model.block_size tokens (best-fit decreasing), each attending only to itself with
    # its own positions; false: one example per row, padded. Text (data.format=text) always fills its rows
    packing: bool = True
