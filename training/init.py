"""What a run starts from: `init_from` resolved once into the model's config, the tokenizer and the weights.

    init = resolve_init(cfg)   # reads init_from's config (a hub id: downloaded once), never its weights
    init.gpt_config            # the model's config: init_from's shapes, this run's dropout, attention, ...
    init.encoding              # data.encoding, else the tokenizer init_from was trained with
    model = init.model()       # the model, with init_from's weights (read here only)

init_from is one of
    scratch         the shapes of cfg.model (vocab: model.vocab_size, else the tokenizer's), random weights; byte
                    tokens unless data.encoding names another tokenizer
    our checkpoint  a .pt file or a sharded .dcp directory: its shapes, weights and tokenizer (a run directory is
                    refused with its checkpoints named: which of them is meant is the user's choice); a LoRA run's
                    checkpoint gives its base with its adapters merged (`checkpoint_model`)
    pretrained      a GPT-2 name, a hub id or a local Hugging Face directory (model/pretrained.py): its config.json's
                    shapes (cfg.model.block_size may crop its positions), weights and tokenizer
    an adapter dir  PEFT's adapter directory (adapter_config.json: PEFT's save_pretrained, scripts/export_hf.py
                    --adapter): its base (base_model_name_or_path, resolved as any init_from) with its adapters merged
                    into the weights; the base's shapes, and the tokenizer.json the directory holds, else the base's
and in every case the run keys of cfg.model (model/config.py: RUN_KEYS: dropout, attention, sdpa_backend,
loss_chunk_tokens) are this run's.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data import get_encoding
from model import GPT, GPTConfig
from model.config import RUN_KEYS, SHAPE_KEYS, LoRAConfig
from model.lora import (
    LoRAError,
    adapter_base,
    adapter_encoding,
    add_lora,
    fingerprint,
    is_adapter_dir,
    load_adapter,
    merge_lora,
)
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
    if is_adapter_dir(cfg.init_from):
        # The base's shapes, and its tokenizer unless the directory holds one (asked of the base only then).
        encoding = cfg.data.encoding or adapter_encoding(cfg.init_from)
        base = resolve_init(dataclasses.replace(cfg, init_from=base_of(cfg.init_from),
                                                data=dataclasses.replace(cfg.data, encoding=encoding)))
        return Init(base.gpt_config, base.encoding, lambda: base_model(cfg.init_from, base.gpt_config))
    if is_checkpoint(cfg.init_from):
        # Its config only: no tensor is read (nor checked against its CRC32s) until the model loads its weights.
        state = load_checkpoint(cfg.init_from, tensors=False, verify=False)
        saved = state["model_config"]
        # A checkpoint written before a shape key existed lacks it: the key's default is what that model had.
        gpt_config = GPTConfig(**{k: saved[k] for k in SHAPE_KEYS if k in saved}, **run)

        return Init(gpt_config, cfg.data.encoding or state["config"]["data"]["encoding"],
                    lambda: checkpoint_model(cfg.init_from, gpt_config, merge=True))
    refuse_run_paths(cfg.init_from)
    model_dir = resolve(cfg.init_from)  # a hub id: downloaded here, once
    gpt_config = config_from_dir(model_dir, block_size=cfg.model.block_size, **run)
    return Init(gpt_config, cfg.data.encoding or pretrained_encoding(model_dir),
                lambda: load_from_dir(model_dir, gpt_config))


def checkpoint_model(path: str | Path, gpt_config: GPTConfig | None = None, merge: bool = False) -> GPT:
    """The model of our checkpoint at path (the model of gpt_config, default the checkpoint's own): its weights, or,
    for a LoRA run's checkpoint, which holds the adapters alone, its base (the run's init_from, checked against the
    fingerprint the checkpoint recorded) with its adapters, merged into the weights if merge."""
    state = load_checkpoint(path)  # checked against its CRC32s, then memory-mapped
    config = gpt_config or GPTConfig(**state["model_config"])
    if "lora" not in state:
        model = GPT(config)
        model.load_state_dict(state["model"])
        return model
    model = base_model(state["base"]["init_from"], config)
    add_lora(model, LoRAConfig(**state["lora"]))
    check_base(model, state["base"], path)
    load_adapters(model, state["model"])
    return merged(model) if merge else model


def base_model(init_from: str, config: GPTConfig) -> GPT:
    """The model of config with the weights init_from names (our checkpoint, a pretrained model, or an adapter
    directory: its base with its adapters merged): a LoRA run's base."""
    if is_adapter_dir(init_from):
        model = base_model(base_of(init_from), config)
        try:
            load_adapter(model, init_from)
        except LoRAError as e:  # an adapter of another model than the base it names
            raise LoRAError(f"init_from={init_from}: {e}") from None
        return merged(model)
    if is_checkpoint(init_from):
        return checkpoint_model(init_from, config, merge=True)
    return load_from_dir(resolve(init_from), config)


def merged(model: GPT) -> GPT:
    """model with its adapters folded into the weights: a plain model again, every weight trainable (add_lora froze
    them), as a pretrained one's are."""
    merge_lora(model)
    return model.requires_grad_(True)


def base_of(adapter_dir: str) -> str:
    """The base model an adapter directory names (base_model_name_or_path); LoRAError naming the fix where it names
    none."""
    base = adapter_base(adapter_dir)
    if base is None:
        raise LoRAError(f"init_from={adapter_dir} is an adapter directory whose adapter_config.json names no base "
                        "model: set its base_model_name_or_path to the hub id or directory of the model its adapters "
                        "were trained on")
    return base


def check_base(model: GPT, base: dict[str, Any], checkpoint: str | Path) -> None:
    """CheckpointError unless model's frozen weights are the base a checkpoint's adapters were trained on."""
    if fingerprint(model) != base["fingerprint"]:
        raise CheckpointError(f"{checkpoint} holds adapters trained on init_from={base['init_from']}, whose weights "
                              "differ from the base they are loaded onto now (its files changed, or init_from names "
                              "another model): load them onto the base they were trained on")


def load_adapters(model: GPT, adapters: dict[str, Any]) -> None:
    """A checkpoint's adapter tensors into model's adapters, every one of them (the base is not in the checkpoint)."""
    expected = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(adapters) != expected:
        raise CheckpointError(f"the checkpoint's adapters do not fit the model's: {len(adapters)} tensors for "
                              f"{len(expected)} adapter parameters")
    model.load_state_dict(adapters, strict=False)


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
