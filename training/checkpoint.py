"""Checkpoints: atomic save, validated load, and what a run needs to resume exactly where it stopped.

A checkpoint holds the model, optimizer and scheduler state, the step, RNG states, the data loader's position and
the run's config, in one of two forms:

- `<name>.pt`, one torch file of plain tensors and containers (loadable with weights_only=True), from one process or
  DDP. It is written to a temporary file in the same folder, flushed to disk and renamed over the old one, so a
  crash at any moment leaves either the previous checkpoint or the new one, never a torn file (`atomic_write`, which
  training/metrics.py also uses).
- `<name>.dcp/`, a sharded `torch.distributed.checkpoint` directory, from FSDP2 runs (training/distributed.py:
  save_sharded): each rank writes its shards of the model and optimizer, so no process ever holds the whole state;
  `state.pt` beside them holds the rest. `<name>.dcp` is a symlink to the directory, switched to a new one by an
  atomic rename (`publish_dir`). It resumes on any number of processes, in any mode; `load_checkpoint` reads it
  whole into one process (scripts/convert_checkpoint.py writes that as a `.pt` file).

Where checkpoints are and which one a run resumes from is training/resume.py's (torch-free: train.py's launch uses it
before torch is imported).
"""

import os
import random
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from training.resume import CheckpointError, is_sharded, resolve_checkpoint

FORMAT = "flashgpt-checkpoint-v1"
REQUIRED_KEYS = {"format", "model", "optimizer", "scheduler", "step", "rng", "loader", "config", "best_val_loss"}
SHARDED_STATE = "state.pt"  # in a sharded checkpoint: everything but the model and optimizer tensors


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(state: dict[str, Any], path: str | Path) -> None:
    atomic_write(path, lambda f: torch.save({"format": FORMAT, **state}, f))


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """Replace `path` with what `write` writes to the binary file it is given, atomically and durably: a crash or
    an error at any moment leaves the old file or the new one. The new file gets the mode of any newly created file
    (0o666 less the umask), so that a team sharing a run directory can read it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a writer that was killed mid-write
        stale.unlink(missing_ok=True)
    # Not tempfile.mkstemp: it creates files with mode 0600 whatever the umask. A random name with O_EXCL is as safe.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make the renames in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_dir(tmp: Path, path: Path) -> None:
    """Make the complete directory `tmp` the checkpoint `path`, atomically: `path` is a symlink, replaced by a rename
    (readers see the old directory or the new one), after which the old directory is deleted. Directories of
    writers killed mid-write (`.<name>.*`, not linked) are deleted too."""
    link = path.parent / f".{path.name}.{secrets.token_hex(8)}.link"
    os.symlink(tmp.name, link)
    os.replace(link, path)  # atomic on POSIX, also over an existing symlink
    _fsync_dir(path.parent)
    for stale in path.parent.glob(f".{path.name}.*"):
        if stale.name != tmp.name:
            shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink(missing_ok=True)


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint file, or a sharded checkpoint's symlink and directory, if there is one."""
    if is_sharded(path):
        target = path.resolve()
        if path.is_symlink():
            path.unlink()
        shutil.rmtree(target)
    elif path.is_file():
        path.unlink()


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", tensors: bool = True) -> dict[str, Any]:
    """The checkpoint at path (resolve_checkpoint's rules), whole. A sharded one is gathered into this process;
    tensors=False leaves its model and optimizer out (a distributed resume loads them shard by shard)."""
    path = resolve_checkpoint(path)
    sharded = is_sharded(path)
    try:
        # mmap: tensors are read from disk only when used, so that reading a large checkpoint's config (init_from's
        # shapes and tokenizer) costs nothing, and a resume holds no second copy of the state in host memory.
        state = torch.load(path / SHARDED_STATE if sharded else path, map_location=map_location, weights_only=True,
                           mmap=True)
        if sharded and tensors:
            state.update(_gather(path))
    except Exception as e:
        raise CheckpointError(f"{path} is corrupt or not a checkpoint ({type(e).__name__}: {e})") from e
    required = REQUIRED_KEYS - ({"model", "optimizer"} if sharded and not tensors else set())
    if not isinstance(state, dict) or state.get("format") != FORMAT or not required <= state.keys():
        raise CheckpointError(f"{path} is not a {FORMAT} checkpoint of this project")
    return state


def _gather(path: Path) -> dict[str, Any]:
    """The full model and optimizer state of a sharded checkpoint, in this process's memory (no process group)."""
    # What torch's own dcp_to_torch_save does: dcp.load fills only the keys it is given, this reader every key.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state
