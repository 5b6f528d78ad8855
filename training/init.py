"""What a run starts from: `init_from` resolved once into the model's config, the tokenizer and the weights.

    init = resolve_init(cfg)   # reads init_from's config (a hub id: downloaded once), never its weights
    init.gpt_config            # the model's config: init_from's shapes, this run's dropout, attention, ...
    init.encoding              # data.encoding, else the tokenizer init_from was trained with
    model = init.model()       # the model, with init_from's weights (read here only)

init_from is one of
    scratch         the shapes of cfg.model (vocab: model.vocab_size, else the tokenizer's), random weights; byte
                    tokens unless data.encoding names another tokenizer
    our checkpoint  a .pt file or a sharded .dcp directory: its shapes, weights and tokenizer (a run directory is
                    refused with its checkpoints named: which of them is meant is the user's choice)
    pretrained      a GPT-2 name, a hub id or a local Hugging Face directory (model/pretrained.py): its config.json's
                    shapes (cfg.model.block_size may crop its positions), weights and tokenizer
and in every case the run keys of cfg.model (model/config.py: RUN_KEYS: dropout, attention, sdpa_backend,
loss_chunk_tokens) are this run's.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from data import get_encoding
from model import GPT, GPTConfig
from model.config import RUN_KEYS, SHAPE_KEYS
from model.pretrained import config_from_dir, load_from_dir, pretrained_encoding, resolve
from training.checkpoint import load_checkpoint
from training.config import Config
from training.resume import SHARDED, CheckpointError, find_checkpoint, is_sharded

RUN_MARKS = ("checkpoints", ".hydra")  # what only a run directory holds (training/rundir.py: RECORDS)


@dataclass
class Init:
    gpt_config: GPTConfig
    encoding: str  # as data.encoding names a tokenizer (data/tokenizers.py)
    load: Callable[[], GPT] | None = None  # the model of gpt_config with init_from's weights; None: random ones

    def model(self) -> GPT:
        return self.load() if self.load is not None else GPT(self.gpt_config)


def resolve_init(cfg: Config) -> Init:
    """init_from's model config, tokenizer and weights (the module docstring); errors name the accepted init_from."""
    run = {key: getattr(cfg.model, key) for key in RUN_KEYS}
    if cfg.init_from == "scratch":
        encoding = cfg.data.encoding or "bytes"
        vocab_size = cfg.model.vocab_size or get_encoding(encoding).n_vocab
        return Init(dataclasses.replace(cfg.model, vocab_size=vocab_size), encoding)
    if is_checkpoint(cfg.init_from):
        # Its config only: no tensor is read (nor checked against its CRC32s) until the model loads its weights.
        state = load_checkpoint(cfg.init_from, tensors=False, verify=False)
        saved = state["model_config"]
        # A checkpoint written before a shape key existed lacks it: the key's default is what that model had.
        gpt_config = GPTConfig(**{k: saved[k] for k in SHAPE_KEYS if k in saved}, **run)

        def load() -> GPT:
            model = GPT(gpt_config)
            model.load_state_dict(load_checkpoint(cfg.init_from)["model"])  # checked, then memory-mapped
            return model

        return Init(gpt_config, cfg.data.encoding or state["config"]["data"]["encoding"], load)
    refuse_run_paths(cfg.init_from)
    model_dir = resolve(cfg.init_from)  # a hub id: downloaded here, once
    gpt_config = config_from_dir(model_dir, block_size=cfg.model.block_size, **run)
    return Init(gpt_config, cfg.data.encoding or pretrained_encoding(model_dir),
                lambda: load_from_dir(model_dir, gpt_config))


def is_checkpoint(init_from: str) -> bool:
    """Whether init_from names one of our checkpoints (a .pt file or a sharded .dcp directory) rather than a model."""
    return Path(init_from).is_file() or is_sharded(init_from)


def is_run_dir(path: str | Path) -> bool:
    """Whether path is one of our run directories (it holds checkpoints/ or .hydra/)."""
    return any((Path(path) / mark).exists() for mark in RUN_MARKS)


def refuse_run_paths(init_from: str) -> None:
    """CheckpointError for a directory of ours that is no checkpoint (a run directory, a .dcp directory without its
    .metadata), naming what to give instead: `resolve` would call it no Hugging Face model directory."""
    path = Path(init_from)
    if path.suffix == SHARDED and path.is_dir():
        raise CheckpointError(f"init_from={init_from}: this sharded checkpoint directory lacks its .metadata file: it "
                              "is incomplete (its write did not finish) or was copied without its hidden files (copy "
                              "the whole directory, e.g. cp -r)")
    if path.is_dir() and is_run_dir(path):
        found = [str(c) for c in (find_checkpoint(path, (name,)) for name in ("best", "last")) if c is not None]
        fix = f"one of its checkpoints: {' or '.join(found)}" if found else "a checkpoint (this run saved none)"
        raise CheckpointError(f"init_from={init_from} is a run directory: point init_from at {fix}")
