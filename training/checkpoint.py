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

Integrity: `load_checkpoint` verifies what it returns against the CRC32 checksums written with it (unless
verify=False), so that a bit flipped on disk or in a copy is a CheckpointError naming the file and the checkpoints
beside it, not a silently altered resume. A `.pt` file is a
zip archive whose directory records the CRC32 of every record (torch.save writes them; torch.load does not check
them); a sharded checkpoint's state.pt records the CRC32 of every shard file (save_sharded). The check reads the
whole checkpoint once, in threads, at CRC32's speed (zlib: ~6 GB/s per core, measured); the page cache then serves
the memory-mapped tensors, so a resume reads the file once either way.

A write that fails (disk full, quota, read-only filesystem, permission, any OSError) is a `WriteError` naming the
file, the free space against what the write needs, and that the previous file is intact; the temporary file (or a
sharded checkpoint's new directory) is removed.

Where checkpoints are and which one a run resumes from is training/resume.py's (torch-free: train.py's launch uses it
before torch is imported).
"""

import errno
import mmap
import os
import random
import secrets
import shutil
import struct
import zipfile
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import torch

from training.resume import SHARDED, CheckpointError, is_sharded, resolve_checkpoint

FORMAT = "flashgpt-checkpoint-v1"
REQUIRED_KEYS = {"format", "model", "optimizer", "scheduler", "step", "rng", "loader", "config", "best_val_loss"}
SHARDED_STATE = "state.pt"  # in a sharded checkpoint: everything but the model and optimizer tensors
SHARD_CRC32 = "shard_crc32"  # in a sharded checkpoint's state.pt: {shard file name: its CRC32}
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class WriteError(OSError):
    """A file that could not be written, for a reason of the operating system's (disk full, quota, read-only
    filesystem, permission, I/O error), its errno kept: the message names the file, the free space against what the
    write needs, and that the previous version is intact."""

    user_error = True  # that is all there is to know: train.py prints it as one `error:` line (training/launch.py)

    def __str__(self) -> str:
        return self.strerror or super().__str__()  # WriteError(errno, message): the message alone


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
    atomic_write(path, lambda f: torch.save({"format": FORMAT, **state}, f), size=_tensor_bytes(state),
                 what="checkpoint")


def _tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in a state (nested dicts, lists and tuples): about what saving it writes."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        value = list(value.values())
    return sum(map(_tensor_bytes, value)) if isinstance(value, list | tuple) else 0


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None], size: int | None = None,
                 what: str = "file") -> None:
    """Replace `path` with what `write` writes to the binary file it is given, atomically and durably: a crash or
    an error at any moment leaves the old file or the new one. The new file gets the mode of any newly created file
    (0o666 less the umask), so that a team sharing a run directory can read it. A write that fails for a reason of the
    operating system's (a full disk) before the new file is in place is a WriteError (`write_failure`: size, about
    what the write needs, and `what` the file is are for its message)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a writer that was killed mid-write
            stale.unlink(missing_ok=True)
        # Not tempfile.mkstemp: it makes files of mode 0600 whatever the umask. A random name with O_EXCL is as safe.
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
        except BaseException:
            tmp.unlink(missing_ok=True)  # also frees the space it took
            raise
    except Exception as e:
        error = os_error_of(e)
        if error is None:
            raise
        raise write_failure(path, error, size, what) from e
    _fsync_dir(path.parent)


def os_error_of(e: BaseException | None) -> OSError | None:
    """The operating system's error behind e, if any: e itself, or the error it was raised while handling (torch.save's
    zip writer, closing after a failed write, raises a RuntimeError of its own); a WriteError's cause."""
    while e is not None and not isinstance(e, OSError):
        e = e.__context__
    return e.__cause__ if isinstance(e, WriteError) else e


def write_failure(path: Path, error: OSError, size: int | None, what: str) -> WriteError:
    """The WriteError of a failed write of `path` (a file, or a sharded checkpoint's symlink), whose previous version
    was left as it was; on a full disk its message compares the free space to `size` (else to the previous version's
    size), what the write needs about."""
    reason = error.strerror or str(error)
    if error.errno in NO_SPACE:
        existing = next(p for p in (path.parent, *path.parent.parents) if p.exists())
        need = size or _disk_size(path)
        reason += f" ({_bytes(shutil.disk_usage(existing).free)} free on its filesystem"
        reason += f"; the {what} needs about {_bytes(need)})" if need else ")"
    previous = f"the previous {what} {path} is intact" if path.exists() else f"there was no {what} {path} before"
    return WriteError(error.errno, f"could not write the {what} {path}: {reason}; {previous}")


def _disk_size(path: Path) -> int:
    """The bytes of a file, or of the files of a directory (a sharded checkpoint); 0 if there is none."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.resolve().rglob("*") if p.is_file())
    return path.stat().st_size if path.is_file() else 0


def _bytes(n: int) -> str:
    """n bytes, readable: 512 bytes, 16.0 KiB, 1.2 GiB."""
    exponent = min((n.bit_length() - 1) // 10, 4) if n > 0 else 0
    return f"{n} bytes" if exponent == 0 else f"{n / 1024**exponent:.1f} {'KMGT'[exponent - 1]}iB"


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


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", tensors: bool = True,
                    verify: bool = True) -> dict[str, Any]:
    """The checkpoint at path (resolve_checkpoint's rules), whole. A sharded one is gathered into this process;
    tensors=False leaves its model and optimizer out (a distributed resume loads them shard by shard, and
    load_sharded verifies them).

    verify: the checkpoint is first checked against the CRC32s written with it (`verify_checkpoint`), and a damaged
    one is a CheckpointError. That reads every tensor (once: the page cache then serves the memory-mapped tensors).
    Without it, reading a checkpoint's config (init_from's shapes) reads no tensor at all: call verify_checkpoint
    before the tensors are used."""
    path = resolve_checkpoint(path)
    sharded = is_sharded(path)
    try:
        if verify:
            verify_checkpoint(path, shards=slice(None) if tensors else None)
        # mmap: tensors are read from disk only when used, so that reading a large checkpoint's config (init_from's
        # shapes and tokenizer) costs nothing, and a resume holds no second copy of the state in host memory.
        state = torch.load(path / SHARDED_STATE if sharded else path, map_location=map_location, weights_only=True,
                           mmap=True)
        if sharded and tensors:
            state.update(_gather(path))
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{path} is corrupt or not a checkpoint ({type(e).__name__}: {e}); {_instead(path)}"
                              ) from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} checkpoint of this project")
    missing = REQUIRED_KEYS - ({"model", "optimizer"} if sharded and not tensors else set()) - state.keys()
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(sorted(missing))}: it is not a complete {FORMAT} checkpoint; "
                              f"{_instead(path)}")
    return state


def verify_checkpoint(path: str | Path, shards: slice | None = slice(None)) -> None:
    """Raise CheckpointError if the checkpoint at path (resolve_checkpoint's rules) does not match the CRC32s written
    with it (`damaged_parts`)."""
    path = resolve_checkpoint(path)
    damaged = damaged_parts(path, shards)
    if damaged:
        raise damaged_error(path, damaged)


def damaged_parts(path: Path, shards: slice | None = slice(None)) -> list[str]:
    """The parts of the checkpoint at path that do not match the CRC32s written with them: of a .pt file, its zip
    records (torch.save records the CRC32 of each, every tensor's among them; torch.load does not check them); of a
    sharded checkpoint, its state.pt's records and the `shards` of its shard files (in name order; None: none) whose
    CRC32s state.pt records (save_sharded; the shards of one written before it recorded them go unchecked). Threads
    check the records or files side by side."""
    sharded = is_sharded(path)
    damaged = _damaged_records(path / SHARDED_STATE if sharded else path)
    if sharded and shards is not None:
        recorded = torch.load(path / SHARDED_STATE, weights_only=True, mmap=True).get(SHARD_CRC32, {})
        names = sorted(recorded)[shards]
        with ThreadPoolExecutor() as pool:
            crcs = pool.map(lambda name: file_crc32(path / name), names)
            damaged += [name for name, crc in zip(names, crcs, strict=True) if crc != recorded[name]]
    return damaged


def damaged_error(path: Path, damaged: list[str]) -> CheckpointError:
    """The error of a checkpoint whose listed parts do not match their CRC32s."""
    listed = ", ".join(damaged[:3]) + (f" and {len(damaged) - 3} more" if len(damaged) > 3 else "")
    return CheckpointError(f"{path} is damaged: {listed} failed the check against the CRC32 checksums written with it "
                           f"(a bit flipped on disk or in a copy); {_instead(path)}")


def _instead(path: Path) -> str:
    """What to use instead of a checkpoint that cannot be used: the other checkpoints beside it (the run's best.pt
    for its last.pt), if any."""
    others = sorted(str(p) for p in path.parent.glob("[!.]*") if p.suffix in (".pt", SHARDED) and p.name != path.name)
    if not others:
        return "there is no other checkpoint beside it to use instead"
    return f"use another checkpoint (train.resume=... or init_from=...): {', '.join(others)}"


def _damaged_records(path: Path) -> list[str]:
    """The names of the records of a zip file (torch.save's format) whose bytes do not match the CRC32 its directory
    records. torch stores every record uncompressed, so each is checked in place, in the memory-mapped file."""
    with zipfile.ZipFile(path) as archive, path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:

        def damaged(record: zipfile.ZipInfo) -> bool:
            header = m[record.header_offset:record.header_offset + 30]  # the local header, then its name and extra
            if header[:4] != b"PK\x03\x04" or record.compress_type != zipfile.ZIP_STORED:
                return True
            start = record.header_offset + 30 + sum(struct.unpack("<HH", header[26:30]))
            with memoryview(m)[start:start + record.file_size] as data:  # no copy; zlib.crc32 releases the GIL
                return zlib.crc32(data) != record.CRC

        records = sorted(archive.infolist(), key=lambda r: -r.file_size)  # the largest first: threads end together
        with ThreadPoolExecutor() as pool:
            return [r.filename for r, bad in zip(records, pool.map(damaged, records), strict=True) if bad]


def file_crc32(path: Path) -> int:
    """The CRC32 of a file's bytes (a shard file of a sharded checkpoint)."""
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # mmap refuses an empty file
            return zlib.crc32(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, memoryview(m) as data:
            return zlib.crc32(data)


def _gather(path: Path) -> dict[str, Any]:
    """The full model and optimizer state of a sharded checkpoint, in this process's memory (no process group)."""
    # What torch's own dcp_to_torch_save does: dcp.load fills only the keys it is given, this reader every key.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state
