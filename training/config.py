"""The run config's schema: dataclasses registered in Hydra's ConfigStore, validated before any work starts.

conf/config.yaml composes `base_config` (the `Config` below) with one file from each group (model/, attention/,
data/). Because every node is typed, an unknown key (`train.batch_sise=8`) or a bad value (`train.max_steps=many`)
fails at composition with a message naming the key. `validate` adds the checks types cannot express. Names whose
one home is elsewhere are plain strings checked there, with the same kind of message: the attention settings by the
registry in model/attention.py (called by `validate`), train.dtype by training/device.py (as `train` starts).
"""

import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore

from data.config import DataConfig


class Device(Enum):
    auto = "auto"  # cuda when available, else cpu
    cpu = "cpu"
    cuda = "cuda"


class Distributed(Enum):
    auto = "auto"  # ddp when torchrun started several processes, else none
    none = "none"  # one process
    ddp = "ddp"  # DistributedDataParallel: a full replica per GPU, gradients all-reduced
    fsdp = "fsdp"  # FSDP2 fully_shard per block: parameters, gradients and optimizer state sharded


class NonFinite(Enum):
    stop = "stop"  # end the run at the first NaN/inf step (that step is not applied)
    skip = "skip"  # skip such steps, up to train.max_skipped_steps


class WandbMode(Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class ModelConfig:
    """The shapes of model/gpt.py: GPTConfig (its comments say what each key means)."""

    family: str = "gpt2"  # gpt2 | llama
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: Optional[int] = None  # key-value heads (grouped-query attention); None: n_head
    n_embd: int = 128
    block_size: int = 128
    vocab_size: Optional[int] = None  # None: the data's tokenizer vocabulary
    pad_vocab_multiple: int = 64
    dropout: float = 0.0
    bias: bool = True
    intermediate_size: Optional[int] = None  # MLP width; None: the family's default
    rope_theta: float = 10000.0  # llama
    rope_scaling: Optional[Dict[str, Any]] = None  # llama: Llama-3's rope scaling
    norm_eps: float = 1e-5  # llama: RMSNorm epsilon
    qkv_bias: Optional[bool] = None  # None: as bias
    tie_embeddings: bool = True
    loss_chunk_tokens: int = 0  # training loss computed this many tokens at a time; 0: all at once


@dataclass
class AttentionConfig:
    name: str = "sdpa"  # a name in model/attention.py: BACKENDS (the preset conf/attention/<name>.yaml sets it)
    sdpa_backend: str = "auto"  # auto, or pin a kernel of model/attention.py: SDPA_BACKENDS (attention=sdpa only)


@dataclass
class TrainConfig:
    max_steps: int = 300
    batch_size: int = 16  # sequences per micro-batch
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    seed: int = 1337
    device: Device = Device.auto
    dtype: str = "auto"  # auto (bf16 on a GPU that supports it, else fp16 on CUDA, fp32 on CPU) | bf16 | fp16 | fp32
    compile: bool = False
    distributed: Distributed = Distributed.auto  # data parallelism over torchrun's processes (training/distributed.py)
    tf32: bool = True  # TF32 matmuls for fp32 work on Ampere+ GPUs
    learning_rate: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * min_lr_ratio
    warmup_steps: int = 20
    lr_decay_steps: Optional[int] = None  # end of the cosine; None: max_steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    log_interval: int = 10
    eval_interval: int = 100  # also the checkpoint interval
    save_checkpoints: bool = True  # false only for throwaway runs such as benchmarks
    eval_batches: int = 20
    perf_warmup_steps: int = 3  # steps left out of tokens/sec (compilation, the profiled step, allocator warm-up)
    resume: Optional[str] = None  # a checkpoint file, a run directory (its checkpoints/last.pt), or auto (this run's)
    overwrite: bool = False  # allow a run directory that already holds checkpoints to be written over
    nonfinite: NonFinite = NonFinite.stop
    max_skipped_steps: int = 10


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.offline
    project: str = "flashgpt"
    name: Optional[str] = None
    group: Optional[str] = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    init_from: str = "scratch"  # scratch | our checkpoint | a GPT-2 name (gpt2, ...) | a hub id | a local HF model dir


def register_configs() -> None:
    ConfigStore.instance().store(name="base_config", node=Config)


def validate(cfg: Config) -> None:
    """Checks that types cannot express; each error names the key to change."""
    from model.attention import get_attention  # imported here: the schema itself needs no torch

    positive = {
        "train.max_steps": cfg.train.max_steps,
        "train.batch_size": cfg.train.batch_size,
        "train.grad_accum_steps": cfg.train.grad_accum_steps,
        "train.log_interval": cfg.train.log_interval,
        "train.eval_interval": cfg.train.eval_interval,
        "train.eval_batches": cfg.train.eval_batches,
        "data.num_proc": cfg.data.num_proc,
    }
    for key, value in positive.items():
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")
    if cfg.train.learning_rate <= 0:
        raise ValueError(f"train.learning_rate must be > 0, got {cfg.train.learning_rate}")
    if not 0.0 <= cfg.train.min_lr_ratio <= 1.0:
        raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {cfg.train.min_lr_ratio}")
    if cfg.train.warmup_steps < 0:
        raise ValueError(f"train.warmup_steps must be >= 0, got {cfg.train.warmup_steps}")
    if cfg.train.perf_warmup_steps < 2:
        raise ValueError("train.perf_warmup_steps must be >= 2: the first step compiles, the second may be profiled")
    # torchrun sets WORLD_SIZE (with RANK, LOCAL_RANK, MASTER_ADDR/PORT) in every process it starts.
    mode, world_size = cfg.train.distributed, os.environ.get("WORLD_SIZE")
    if mode in (Distributed.ddp, Distributed.fsdp) and world_size is None:
        raise ValueError(f"train.distributed={mode.value} needs the processes of a launcher: run `torchrun "
                         "--nproc_per_node=N train.py ...`, or use train.distributed=auto|none for one process")
    if mode == Distributed.none and world_size is not None and int(world_size) > 1:
        raise ValueError(f"train.distributed=none, but torchrun started {world_size} processes that would each train "
                         "alone into the same run directory: use train.distributed=auto, ddp or fsdp")
    get_attention(cfg.attention.name, cfg.attention.sdpa_backend)  # names the key and the choices
