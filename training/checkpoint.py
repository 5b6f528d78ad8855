"""Checkpoints: atomic save, validated load, and what a run needs to resume exactly where it stopped.

A checkpoint is one torch file holding plain tensors and containers only (loadable with weights_only=True):
model, optimizer and scheduler state, the step, RNG states, the data loader's position and the run's config.
It is written to a temporary file in the same folder, flushed to disk and renamed over the old one, so a crash at
any moment leaves either the previous checkpoint or the new one, never a torn file.
"""

import os
import random
import tempfile
from pathlib import Path
from typing import Any

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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a writer that was killed mid-write
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
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
