"""What a run starts from: `init_from` resolved once into the model's config, the tokenizer and the weights.

    init = resolve_init(cfg)   # reads init_from's config (a hub id: downloaded once), never its weights
    init.gpt_config            # the model's config: init_from's shapes, this run's dropout, attention, ...
    init.encoding              # data.encoding, else the tokenizer init_from was trained with
    model = init.model()       # the model, with init_from's weights (read here only)

init_from is one of
    scratch         the shapes of cfg.model (vocab: model.vocab_size, else the tokenizer's), random weights; byte
                    tokens unless data.encoding names another tokenizer
    our checkpoint  a .pt file or a sharded .dcp directory: its shapes, weights and tokenizer
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
from training.resume import is_sharded


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
        state = load_checkpoint(cfg.init_from)  # tensors memory-mapped: read when the model loads them
        saved = state["model_config"]
        # A checkpoint written before a shape key existed lacks it: the key's default is what that model had.
        gpt_config = GPTConfig(**{k: saved[k] for k in SHAPE_KEYS if k in saved}, **run)

        def load() -> GPT:
            model = GPT(gpt_config)
            model.load_state_dict(state["model"])
            return model

        return Init(gpt_config, cfg.data.encoding or state["config"]["data"]["encoding"], load)
    model_dir = resolve(cfg.init_from)  # a hub id: downloaded here, once
    gpt_config = config_from_dir(model_dir, block_size=cfg.model.block_size, **run)
    return Init(gpt_config, cfg.data.encoding or pretrained_encoding(model_dir),
                lambda: load_from_dir(model_dir, gpt_config))


def is_checkpoint(init_from: str) -> bool:
    """Whether init_from names one of our checkpoints (a .pt file or a sharded .dcp directory) rather than a model."""
    return Path(init_from).is_file() or is_sharded(init_from)
