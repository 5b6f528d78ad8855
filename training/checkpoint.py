"""Checkpoints: atomic save, validated load, and what a run needs to resume exactly where it stopped.

A checkpoint is one torch file holding plain tensors and containers only (loadable with weights_only=True):
model, optimizer and scheduler state, the step, RNG states, the data loader's position and the run's config.
It is written to a temporary file in the same folder, flushed to disk and renamed over the old one, so a crash at
any moment leaves either the previous checkpoint or the new one, never a torn file (`atomic_write`, which
training/metrics.py also uses).
"""

import os
import random
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

FORMAT = "flashgpt-checkpoint-v1"
REQUIRED_KEYS = {"format", "model", "optimizer", "scheduler", "step", "rng", "loader", "config", "best_val_loss"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, corrupt, foreign, or not matching the run."""


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
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or a run directory whose checkpoints/last.pt is meant."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoints" / "last.pt"
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: point train.resume at a .pt file or a run directory")
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = resolve_checkpoint(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path} is corrupt or not a checkpoint ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT or not REQUIRED_KEYS <= state.keys():
        raise CheckpointError(f"{path} is not a {FORMAT} checkpoint of this project")
    return state
