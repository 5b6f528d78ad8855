"""Data-parallel training across torchrun's processes with PyTorch's own engine: DDP or FSDP2.

    torchrun --nproc_per_node=8 train.py train.distributed=fsdp ...

`setup` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), joins the process group (nccl on GPUs, gloo on
CPU) and gives each process its GPU; `wrap` makes the model data-parallel:

- `ddp`: DistributedDataParallel, a full replica per GPU; gradients are all-reduced (averaged) in buckets during
  backward, except in `gradient_sync(False)` (non-final micro-batches of gradient accumulation).
- `fsdp`: FSDP2 `fully_shard` on every unit of train.fsdp.blocks_per_unit transformer blocks, then on the
  root (embeddings, final norm, tied head): parameters, gradients and AdamW state are sharded DTensors, all-gathered
  per unit for compute; under torch.compile each block is compiled alone (`shard`, train.fsdp). With bf16 the
  mixed-precision policy computes in bf16 and reduce-scatters gradients in fp32; the autocast of the loop stays on
  (it keeps softmax and the loss in fp32). fp16 is refused: its GradScaler does not handle sharded gradients.
  AdamW (fused on GPUs) and the clip run on each rank's local shards, the clip folded into the optimizer as on one
  GPU (train.fsdp.local_optimizer, training/optim.py: ShardAdamW); with local_optimizer=false, torch's AdamW steps
  the DTensors and `clip_grad_norm_` rescales the gradients.

Checkpoints (training/checkpoint.py): one process and DDP write a single file (the full state, gathered by rank
0). FSDP2 runs write sharded `torch.distributed.checkpoint` directories (`save_sharded`): each rank writes its own
shards of the model and optimizer, so a model too large for one process is never gathered, and the CRC32 of every
shard file is recorded in its state.pt (torch.distributed.checkpoint records none), which `load_sharded` verifies.
Both forms are keyed by parameter name, not by sharding: either resumes on any number of processes, in any mode (a
sharded one through `load_sharded`, which reads each rank's part of it). Resuming needs the checkpoint on every node
(a shared filesystem).

Everything rank-dependent the loop needs is a method of `Context`, which is a no-op for a single process.
"""

import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from training.checkpoint import (
    SHARD_CRC32,
    SHARDED_STATE,
    damaged_error,
    damaged_parts,
    file_crc32,
    os_error_of,
    publish_dir,
    save_checkpoint,
    write_failure,
)
from training.config import Distributed, FsdpConfig, Reshard

# Frozen parameters (a LoRA run's base, loaded from its init_from) are never saved: a checkpoint holds what trains.
GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)  # on rank 0's CPU only
SCATTER = StateDictOptions(full_state_dict=True)  # every rank holds the full state and keeps its part
SHARDS = StateDictOptions(ignore_frozen_params=True)  # each rank its shards
UNIT_PARAMS = 100_000_000  # train.fsdp.blocks_per_unit=0: each FSDP2 unit gathers at least this many parameters


@dataclass
class Context:
    mode: Distributed  # none, ddp or fsdp (auto is resolved by setup)
    device: torch.device  # this process's device: cuda:LOCAL_RANK under torchrun on GPUs
    rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.mode != Distributed.none

    @property
    def is_main(self) -> bool:
        """Rank 0 logs and writes checkpoints."""
        return self.rank == 0

    def from_main(self, value: Any) -> Any:
        """Rank 0's value on every rank (e.g. the run directory, whose timestamp may differ between processes)."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def to_main(self, value: Any) -> list[Any]:
        """Every rank's value, in rank order, on rank 0 (the others get []). A collective: call it on every rank."""
        if not self.enabled:
            return [value]
        values = [None] * self.world_size if self.is_main else None
        dist.gather_object(value, values, dst=0)
        return values or []

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean over ranks (gloo has no AVG: sum, then divide). A collective: call it on every rank."""
        if not self.enabled:
            return value
        value = value.detach().clone()
        dist.all_reduce(value)
        return value / self.world_size

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over ranks (e.g. of trained-token counts), on the device. A collective: call it on every rank."""
        if not self.enabled:
            return value
        value = value.detach().clone()
        dist.all_reduce(value)
        return value

    def any(self, flag: torch.Tensor) -> torch.Tensor:
        """True on every rank if it is true on one (a 0-d bool tensor; stays on the device: no host sync)."""
        if not self.enabled:
            return flag
        value = flag.to(torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value.bool()

    def stop_agreed(self, received: bool, at_sync_point: bool) -> bool:
        """Whether to stop for a signal, the same answer on every rank so that no rank is left waiting in a
        collective. torchrun forwards SIGTERM to every process, but each may get it at a different step, so ranks
        agree at sync points only: every step on CPU, at log/eval points on GPUs (a per-step host read would stall
        the GPU; preemption grace periods are far longer than a log interval)."""
        if not self.enabled:
            return received
        if not at_sync_point:
            return False
        return bool(self.any(torch.tensor(received, device=self.device)).item())

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def setup(mode: Distributed, device: torch.device) -> Context:
    """Join torchrun's process group (config.validate has checked that the launcher's environment is there)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if mode == Distributed.auto:
        mode = Distributed.ddp if world_size > 1 else Distributed.none
    if mode == Distributed.none:
        return Context(mode, device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Context(mode, device, dist.get_rank(), dist.get_world_size())


def teardown(ctx: Context) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: nn.Module, ctx: Context, dtype: torch.dtype, compile: bool = False,
         fsdp: FsdpConfig | None = None) -> tuple[nn.Module, nn.Module]:
    """(parallel, step_model): the data-parallel module (DDP around the model, the model sharded in place by FSDP2,
    or the model itself) and what the steps call, the same compiled if `compile`. The optimizer and the state dicts
    use `model` itself (under FSDP its parameters are then DTensor shards)."""
    if ctx.mode == Distributed.ddp:
        # torch.compile then traces the whole model as one graph, as on one GPU, instead of splitting it at DDP's
        # gradient buckets (DDPOptimizer) to overlap their all-reduces with the backward: on GPUs joined by NVLink
        # the split graphs ran slower than eager DDP, while the one un-overlapped all-reduce costs a few percent of
        # a step (measured in docs/results/).
        torch._dynamo.config.optimize_ddp = False
        model = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    elif ctx.mode == Distributed.fsdp:
        fsdp = fsdp or FsdpConfig()
        shard(model, dtype, compile and fsdp.compile_blocks, fsdp, ctx.world_size)
        compile = compile and not fsdp.compile_blocks
    return model, torch.compile(model) if compile else model


def shard(model: nn.Module, dtype: torch.dtype, compile_blocks: bool, fsdp: FsdpConfig, world_size: int) -> None:
    """FSDP2 in place: fully_shard on every unit of `blocks_per_unit` blocks (one all-gather per unit: only one
    unit's full weights at a time), then on the root (embeddings, final norm, tied head). torchtitan's recipe: with
    `compile_blocks`, each block's forward is compiled alone (fullgraph), so FSDP2's hooks run eagerly between the
    graphs instead of breaking a whole-model graph into pieces at every hook; so is the root's LM head with the
    loss. With train.fsdp.compile_units, each unit's blocks are one graph instead (unit_run)."""
    if dtype == torch.float16:
        raise ValueError("train.distributed=fsdp supports train.dtype=bf16 or fp32, not fp16 (its GradScaler "
                         "does not handle sharded gradients): use bf16, or train.distributed=ddp")
    blocks = list(model.transformer.h)
    # The blocks' inputs keep their dtype (cast_forward_inputs=False): the rotary tables stay in fp32 as on one GPU
    # (the loop's autocast picks each op's dtype), and no unit walks its inputs to cast them. gather_fp32: the
    # weights too, as on one GPU, instead of FSDP2 casting them at every gather.
    policy = MixedPrecisionPolicy(param_dtype=None if fsdp.gather_fp32 else dtype, reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)
    k = blocks_per_unit(blocks, fsdp)
    units = [blocks[i : i + k] for i in range(0, len(blocks), k)]
    kept = []  # the units that stay gathered after forward (gradient_sync keeps them so between micro-batches)
    for i, unit in enumerate(units):
        reshard = reshard_after_forward(fsdp.reshard_after_forward, i == len(units) - 1, world_size)
        fully_shard(unit if len(unit) > 1 else unit[0], mp_policy=policy, reshard_after_forward=reshard)
        kept += [] if reshard else [unit[0]]
    if compile_blocks:
        if fsdp.compile_units:
            model.block_runs = [unit_run(unit) for unit in units]
        else:
            for block in blocks:  # forward, not the module's __call__: the hooks FSDP2 adds stay outside the graph
                block.forward = torch.compile(block.forward, fullgraph=True)
        model.head = torch.compile(model.head)  # the LM head and the loss: the root's largest work
    # the root's weights (embeddings, tied head) are needed again as soon as the backward starts
    root_reshard = fsdp.reshard_after_forward == Reshard.always
    fully_shard(model, mp_policy=policy, reshard_after_forward=root_reshard)
    model.fsdp_kept_gathered = kept + ([] if root_reshard else [model])
    if fsdp.prefetch:
        firsts = [unit[0] for unit in units]  # a unit's hooks are its first block's
        for i, first in enumerate(firsts):
            first.set_modules_to_forward_prefetch(firsts[i + 1 : i + 1 + fsdp.prefetch])
            first.set_modules_to_backward_prefetch(firsts[max(i - fsdp.prefetch, 0) : i][::-1])


def run_blocks(blocks: list[nn.Module], x: torch.Tensor, rope: Any, documents: Any) -> torch.Tensor:
    """A unit's blocks in order, each through its forward: their modules' __call__ (FSDP2's per-module hooks) is left
    out of the graph; unit_run runs the unit's hooks once around it."""
    for block in blocks:
        x = block.forward(x, None, rope, documents)
    return x


def unit_run(unit: list[nn.Module]) -> Callable[[torch.Tensor, Any, Any], torch.Tensor]:
    """The unit's blocks as one compiled graph (fullgraph), a forward method of its first block that FSDP2 wraps in
    the unit's pre- and post-forward (gather, reshard, backward hooks): one graph and one set of hooks per unit
    instead of one per block. GPT.hidden_states calls it in place of the blocks (GPT.block_runs)."""
    first = unit[0]
    first.run_unit = torch.compile(partial(run_blocks, unit), fullgraph=True)
    register_fsdp_forward_method(first, "run_unit")
    return first.run_unit


def reshard_after_forward(policy: Reshard, last: bool, world_size: int) -> bool:
    """Whether a unit frees its gathered weights after its forward. `auto`: every unit but the last, whose weights
    the backward needs at once; at world size 1 none, since there a shard is the whole parameter and resharding
    frees only the bf16 copies, which the backward would then cast again, parameter by parameter."""
    if policy == Reshard.auto:
        return world_size > 1 and not last
    return policy == Reshard.always


def blocks_per_unit(blocks: list[nn.Module], fsdp: FsdpConfig) -> int:
    """The blocks of each FSDP2 unit: train.fsdp.blocks_per_unit, or for 0 the fewest blocks whose parameters reach
    UNIT_PARAMS (FSDP1's size-based policy): FSDP2's hooks cost host time per unit and parameter, which a small
    block's compute cannot hide."""
    if fsdp.blocks_per_unit:
        return fsdp.blocks_per_unit
    per_block = sum(p.numel() for p in blocks[0].parameters())
    return min(len(blocks), -(-UNIT_PARAMS // per_block))


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Forward + backward inside it reduce gradients across ranks only if enabled: gradient accumulation syncs on
    its last micro-batch alone. The FSDP2 units that stay gathered after forward (shard: fsdp_kept_gathered) also
    stay gathered after the backward of every micro-batch but the last: the weights do not change before the next
    one, whose forward then gathers (and casts) nothing for them."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        for unit in model.fsdp_kept_gathered:
            unit.set_reshard_after_backward(enabled, recurse=False)
    with model.no_sync() if isinstance(model, DistributedDataParallel) and not enabled else nullcontext():
        yield


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a DTensor (FSDP's gradient norm), for checks that mix it with plain tensors."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def model_state(model: nn.Module, options: StateDictOptions) -> dict[str, Any]:
    """get_model_state_dict, with no frozen parameter (a LoRA run's base): ignore_frozen_params keeps a tied one."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in get_model_state_dict(model, options=options).items() if k not in frozen}


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Full model and optimizer state keyed by parameter name, on rank 0's CPU (other ranks get empty dicts). A
    collective under FSDP: call it on every rank."""
    return {"model": model_state(model, GATHER),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=GATHER)}


def load_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a checkpoint's full state on every rank; FSDP keeps this rank's shards."""
    # With frozen parameters the state holds the trained ones alone (the run checked they are the model's).
    frozen = any(not p.requires_grad for p in model.parameters())
    set_model_state_dict(model, state["model"], options=replace(SCATTER, strict=not frozen))
    if any(isinstance(key, int) for key in state["optimizer"]["state"]):  # a state keyed by parameter index
        optimizer.load_state_dict(state["optimizer"])  # (one process or DDP: the optimizer holds full tensors)
    else:
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=SCATTER)


def save_sharded(ctx: Context, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                 path: Path) -> None:
    """The sharded checkpoint directory `path`: every rank writes its shards of the model and optimizer into a new
    directory, rank 0 adds `state` (everything else) and the shard files' CRC32s and publishes it atomically. A write
    that fails (a full disk) removes the new directory and is a WriteError; the previous checkpoint stays. A
    collective: call it on every rank."""
    tmp = path.parent / ctx.from_main(f".{path.name}.{secrets.token_hex(8)}")
    try:
        dcp.save({"model": model_state(model, SHARDS),
                  "optimizer": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=tmp, no_dist=not ctx.enabled)
        # Each rank checksums the files it wrote (torch's FileSystemWriter names them __<rank>_<n>.distcp): they are
        # still in its page cache.
        crcs = ctx.to_main({f.name: file_crc32(f) for f in tmp.glob(f"__{ctx.rank}_*.distcp")})
        if ctx.is_main:
            crc32 = {name: crc for files in crcs for name, crc in files.items()}
            save_checkpoint({**state, SHARD_CRC32: crc32}, tmp / SHARDED_STATE)
    except (Exception, CheckpointException) as e:  # dcp raises every rank's errors as one CheckpointException
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        errors = [error for error, _ in e.failures.values()] if isinstance(e, CheckpointException) else [e]
        cause = next(filter(None, map(os_error_of, errors)), None)
        if cause is None:
            raise
        raise write_failure(path, cause, None, "checkpoint") from e
    if ctx.is_main:
        publish_dir(tmp, path)
    ctx.barrier()


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Load a sharded checkpoint's model and optimizer: each rank reads the part it holds (all of it without FSDP),
    whatever the number of processes that wrote it. Its shard files are verified first (training/checkpoint.py:
    verify_checkpoint), each rank its share of them: all raise the same CheckpointError if one finds damage."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    damaged = damaged_parts(path, shards=slice(rank, None, world))
    if world > 1:
        everyone: list[list[str]] = [[] for _ in range(world)]
        dist.all_gather_object(everyone, damaged)
        damaged = sorted(set().union(*everyone))  # state.pt: checked by every rank
    if damaged:
        raise damaged_error(path, damaged)
    # The optimizer's state dict lists every Adam moment even before the first step (it initialises them), so that
    # the load knows what to read.
    state = {"model": model_state(model, SHARDS),
             "optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    frozen = any(not p.requires_grad for p in model.parameters())
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not frozen))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
