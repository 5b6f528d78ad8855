"""The run config's schema: dataclasses registered in Hydra's ConfigStore, validated before any work starts.

conf/config.yaml composes `base_config` (the `Config` below) with one file from each group (model/, attention/,
data/). The `model` node is the model's own config, model/config.py: GPTConfig, nested as it is: its fields, their
kinds (shape or run keys) and ranges live there, checked as the config is built. Because every node is typed, an
unknown key (`train.batch_sise=8`) or a bad value (`train.max_steps=many`) fails at composition with a message naming
the key. `validate` adds the checks types cannot express: the range of every numeric train/data key (RANGES) and a
few rules across keys. Names whose one home is elsewhere are plain strings checked there, with the same kind of
message: the attention settings by the registry in model/attention.py (called by `validate`, last), train.dtype by
training/device.py (as `train` starts).

This module stays light (no torch, datasets or wandb) so that train.py reports config mistakes in a fraction of a
second: `validate` imports torch only for its last check, the attention registry.
"""

import functools
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from data.config import DataConfig, DataFormat
from model.config import AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, PROBABILITY, GPTConfig, LoRAConfig, Range


class Device(Enum):
    auto = "auto"  # cuda when available, else cpu
    cpu = "cpu"
    cuda = "cuda"


class Distributed(Enum):
    auto = "auto"  # ddp when torchrun started several processes, else none
    none = "none"  # one process
    ddp = "ddp"  # DistributedDataParallel: a full replica per GPU, gradients all-reduced
    fsdp = "fsdp"  # FSDP2 fully_shard per block: parameters, gradients and optimizer state sharded


class ActivationCheckpointing(Enum):
    none = "none"  # store every block's activations for the backward
    mlp = "mlp"  # recompute each MLP's activation from its input projection (compiled: one elementwise pass)
    selective = "selective"  # recompute every other block's activations in the backward (half the saving, less time)
    full = "full"  # recompute every block's activations: stores only each block's input


class Reshard(Enum):
    auto = "auto"  # every unit but the last (the backward gathers it again at once); none at world size 1
    always = "always"  # every unit: the least memory, a second all-gather per unit in the backward
    never = "never"  # none: the full weights stay from forward to backward (ZeRO-2's memory, one all-gather)


@dataclass
class FsdpConfig:
    """How train.distributed=fsdp shards, gathers and compiles (training/distributed.py: wrap)."""

    reshard_after_forward: Reshard = Reshard.auto  # free each unit's gathered weights after its forward
    blocks_per_unit: int = 0  # blocks gathered, reduced and hooked together; 0: sized by parameters (distributed.py)
    prefetch: int = 0  # all-gather this many units ahead explicitly (forward and backward); 0: FSDP2's implicit order
    compile_blocks: bool = True  # with train.compile: each block compiled alone, FSDP2's hooks outside the graphs
    local_optimizer: bool = True  # AdamW and the clip on each rank's local shards, not through DTensor (optim.py)
    compile_units: bool = True  # with compile_blocks: each unit's blocks compiled as one graph, hooks around it
    gather_fp32: bool = False  # gather fp32 weights for the loop's autocast to cast, not bf16 ones cast by FSDP2


class NonFinite(Enum):
    stop = "stop"  # end the run at the first NaN/inf step (that step is not applied)
    skip = "skip"  # skip such steps, up to train.max_skipped_steps


class WandbMode(Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class AttentionConfig:
    """The model's attention settings (model.attention and model.sdpa_backend follow these: conf/config.yaml)."""

    name: str = "sdpa"  # a name in model/attention.py: BACKENDS (the preset conf/attention/<name>.yaml sets it)
    sdpa_backend: str = "auto"  # auto, or pin a kernel of model/attention.py: SDPA_BACKENDS (attention=sdpa only)


@dataclass
class TrainConfig:
    max_steps: int = 300
    epochs: Optional[int] = None  # passes over the train data (instruction/chat: its examples); sets max_steps
    batch_size: int = 16  # sequences per micro-batch
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    seed: int = 1337
    device: Device = Device.auto
    dtype: str = "auto"  # auto (bf16 on a GPU that supports it, else fp16 on CUDA, fp32 on CPU) | bf16 | fp16 | fp32
    compile: bool = False
    distributed: Distributed = Distributed.auto  # data parallelism over torchrun's processes (training/distributed.py)
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none  # model/gpt.py: Block
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)  # train.distributed=fsdp only
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
    gc_interval: int = 50  # Python's garbage collection every this many steps (loop.py: ScheduledGC); 0: automatic
    # autograd's backward threads (PyTorch's default): each GPU's backward runs on a thread of its own; off, it runs on
    # the training thread, without the two thread handoffs and the GIL contention per backward (one GPU per process)
    autograd_multithreading: bool = False
    perf_warmup_steps: int = 3  # steps left out of tokens/sec (compilation, the profiled step, allocator warm-up)
    resume: Optional[str] = None  # a .pt file or .dcp dir, a run directory (its checkpoints/last), or auto (this run's)
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
    # GPTConfig's defaults as they are written: built, GPTConfig resolves n_kv_head and qkv_bias from the run's values
    model: GPTConfig = field(default_factory=lambda: OmegaConf.structured(GPTConfig))
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # rank > 0: train adapters on a frozen init_from
    init_from: str = "scratch"  # scratch | our checkpoint | a GPT-2 name (gpt2, ...) | a hub id | a local HF model dir


def register_configs() -> None:
    """The schema in Hydra's ConfigStore, and the resolvers conf/config.yaml uses (training/rundir.py)."""
    from training.rundir import register_resolvers  # imported here: rundir imports this module

    ConfigStore.instance().store(name="base_config", node=Config)
    register_resolvers()


# Every numeric train/data key and its valid values (the model's are in its fields: model/config.py). A key that may
# be null (Optional) is checked only when set. tests/test_cli.py checks that a numeric key added to the schema gets
# an entry.
RANGES: dict[str, Range] = {
    "train.max_steps": AT_LEAST_1,
    "train.epochs": AT_LEAST_1,
    "train.batch_size": AT_LEAST_1,
    "train.grad_accum_steps": AT_LEAST_1,
    "train.seed": Range(0, 2**64 - 1, why="numpy's and torch's generators take unsigned 64-bit seeds"),
    "train.learning_rate": POSITIVE,
    "train.min_lr_ratio": FRACTION,
    "train.warmup_steps": AT_LEAST_0,
    "train.lr_decay_steps": AT_LEAST_1,
    "train.weight_decay": AT_LEAST_0,
    "train.beta1": PROBABILITY,
    "train.beta2": PROBABILITY,
    "train.grad_clip": Range(0, why="0 disables clipping"),
    "train.log_interval": AT_LEAST_1,
    "train.eval_interval": AT_LEAST_1,
    "train.eval_batches": AT_LEAST_1,
    "train.perf_warmup_steps": Range(2, why="the first step compiles, the second may be profiled"),
    "train.max_skipped_steps": AT_LEAST_0,
    "train.fsdp.prefetch": AT_LEAST_0,
    "train.gc_interval": Range(0, why="0 leaves Python's automatic garbage collection on"),
    "train.fsdp.blocks_per_unit": Range(0, why="0 sizes the units by their parameters"),
    "data.val_fraction": Range(0, 1, low_open=True, high_open=True, why="both splits need data"),
    "data.max_documents": AT_LEAST_1,
    "data.num_proc": AT_LEAST_1,
}


def validate(cfg: Config) -> None:
    """Checks that types cannot express; each error names the key to change. Ordered cheapest first: everything but
    the last check runs without torch."""
    for key, valid in RANGES.items():
        valid.check(key, functools.reduce(getattr, key.split("."), cfg))
    if (cfg.model.attention, cfg.model.sdpa_backend) != (cfg.attention.name, cfg.attention.sdpa_backend):
        raise ValueError("the attention group sets the model's attention: use attention=<name> and "
                         "attention.sdpa_backend=<kernel>, not model.attention or model.sdpa_backend")
    if cfg.lora.rank and cfg.init_from == "scratch":
        raise ValueError(f"lora.rank={cfg.lora.rank} trains adapters on a pretrained model, whose weights stay frozen: "
                         "set init_from (a hub id, a Hugging Face directory or one of our checkpoints), or lora.rank=0")
    packed = cfg.data.format != DataFormat.text and cfg.data.packing
    if packed and cfg.attention.name == "sdpa" and cfg.attention.sdpa_backend != "auto":
        raise ValueError(f"data.packing=true runs attention=sdpa through FlexAttention's document mask, not an SDPA "
                         f"kernel: attention.sdpa_backend={cfg.attention.sdpa_backend} does not apply; set "
                         "attention.sdpa_backend=auto, or data.packing=false")
    if packed and cfg.attention.name == "sdpa" and cfg.model.dropout > 0:
        raise ValueError(f"data.packing=true with attention=sdpa runs FlexAttention, which has no attention dropout, "
                         f"but model.dropout={cfg.model.dropout}: set model.dropout=0, attention=triton (dropout "
                         "inside the kernel), or data.packing=false")
    # torchrun sets WORLD_SIZE (with RANK, LOCAL_RANK, MASTER_ADDR/PORT) in every process it starts.
    mode, world_size = cfg.train.distributed, os.environ.get("WORLD_SIZE")
    if mode in (Distributed.ddp, Distributed.fsdp) and world_size is None:
        raise ValueError(f"train.distributed={mode.value} needs the processes of a launcher: run `torchrun "
                         "--nproc_per_node=N train.py ...`, or use train.distributed=auto|none for one process")
    if mode == Distributed.none and world_size is not None and int(world_size) > 1:
        raise ValueError(f"train.distributed=none, but torchrun started {world_size} processes that would each train "
                         "alone into the same run directory: use train.distributed=auto, ddp or fsdp")
    # Last, as it imports torch (~1 s): the registry of model/attention.py is the one list of backends (a backend
    # added there at run time is accepted, tests/test_registry.py), and its SDPA kernel names are torch enums.
    from model.attention import get_attention

    get_attention(cfg.attention.name, cfg.attention.sdpa_backend)  # names the key and the choices


def config_warnings(train: TrainConfig) -> list[str]:
    """Settings that are valid but rarely meant, said as the run starts."""
    warnings = []
    if train.warmup_steps > train.max_steps:
        warnings.append(f"train.warmup_steps={train.warmup_steps} > train.max_steps={train.max_steps}: the learning "
                        f"rate never reaches train.learning_rate (it ends the run at {train.max_steps}/"
                        f"{train.warmup_steps} of it)")
    if train.lr_decay_steps is not None and train.lr_decay_steps < train.warmup_steps:
        warnings.append(f"train.lr_decay_steps={train.lr_decay_steps} < train.warmup_steps={train.warmup_steps}: the "
                        "cosine ends before the warm-up does, so the learning rate drops from its peak to "
                        "learning_rate × min_lr_ratio at once")
    return warnings
