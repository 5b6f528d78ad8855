"""The run directory: unique per launch, locked by its live run, claimed before anything is written into it.

The default one, `outputs/<date>/<H-M-S>-<suffix>` (multirun: `multirun/<date>/<H-M-S>-<suffix>/<job number>`), is
unique per launch: `run_suffix`, a resolver of conf/config.yaml. A directory serves one live run at a time:
`lock_run_dir` takes its `run.lock`. What a new run finds in its directory is settled before anything is written
there (`take`, called by training/launch.py before Hydra writes its files): `claim` continues the run in it, refuses,
or moves the earlier run's records aside, by the resume policy of training/resume.py. Under torchrun, the processes
of one job share the directory: rank 0 alone locks, claims and writes Hydra's files (.hydra/ and train.log: a file
another rank made before rank 0's claim would be taken for an earlier run's).

Torch-free, as everything train.py imports before the config is known to be good.
"""

import atexit
import errno
import fcntl
import functools
import hashlib
import json
import os
import secrets
import socket
import sys
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from training.config import TrainConfig
from training.resume import MOVED_ASIDE, own_checkpoints, resume_point

LOCK = "run.lock"
RECORDS = (".hydra", "checkpoints", "metrics.jsonl", "summary.json", "wandb", "train.log")  # what a run writes
SWEEP_RECORDS = ("multirun.yaml",)  # what a sweep writes besides its job directories


@functools.cache
def run_suffix() -> str:
    """The `<suffix>` of the default run directory, one per process: two runs started in the same second get different
    directories. The processes of one torchrun job get the same one, derived from torchrun's rendezvous id (a fresh
    uuid with --standalone, --rdzv-id otherwise), or from their launcher's process when that id is torchrun's default
    `none`."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if job is None:
        return secrets.token_hex(3)
    if job in ("", "none"):
        job = f"{socket.gethostname()}/{os.getppid()}"  # torchrun's agent, the parent of every local rank
    return hashlib.sha256(job.encode()).hexdigest()[:6]


@functools.cache
def run_start() -> float:
    """When the run started (seconds since the epoch), the `<date>/<time>` of its default directory: this process's
    first call, or for the processes of one torchrun job their agent's start, the same in every rank however late
    a loaded machine starts one (each rank's Hydra makes the directory it names)."""
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None:
        with suppress(OSError, ValueError, IndexError, StopIteration):  # Linux's /proc; elsewhere: this process
            with open(f"/proc/{os.getppid()}/stat") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks since boot
            with open("/proc/stat") as f:
                boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
            return boot + ticks / os.sysconf("SC_CLK_TCK")
    return time.time()


def is_main_process() -> bool:
    """Rank 0 of a torchrun job, or a process on its own: the one that takes the run directory and writes to it."""
    return os.environ.get("RANK", "0") == "0"


def register_resolvers() -> None:
    """The resolvers of conf/config.yaml (hydra.run.dir, hydra.sweep.dir, hydra.output_subdir): run_start formats the
    run's start as Hydra's `now` does, but once per job."""
    OmegaConf.register_new_resolver("run_suffix", run_suffix, replace=True)
    OmegaConf.register_new_resolver("run_start", lambda pattern: time.strftime(pattern, time.localtime(run_start())),
                                    replace=True)
    OmegaConf.register_new_resolver("main_process_only",
                                    lambda value, other=None: value if is_main_process() else other, replace=True)


class RunDirInUseError(RuntimeError):
    """The run directory is locked by a run that is alive."""

    user_error = True  # its message names the fix: train.py prints it as one `error:` line (training/launch.py)


@dataclass
class RunLock:
    """`<run dir>/run.lock`, held by this process: an exclusive flock on a file naming its holder. The kernel drops
    the flock when the process ends, however it ends, so a lock is never stale while its file may be; the file is
    removed at exit."""

    path: Path
    fd: int | None

    def release(self) -> None:
        if self.fd is None:
            return
        # Removed before the flock is dropped: a process that opened this file meanwhile then finds, once it gets the
        # flock, that the path no longer names it, and starts over (lock_run_dir).
        with suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self.fd)
        self.fd = None


def lock_run_dir(directory: Path, key: str = "hydra.run.dir") -> tuple[RunLock, str | None]:
    """Take the directory's lock (made if needed), or raise RunDirInUseError naming the live run holding it. A lock
    file left by a run that is gone (no process holds its flock; on a filesystem without flock, its PID is not alive
    on this host) is taken over; the note returned says so."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        holder = _read_holder(fd)
        if not _flock(fd, holder):
            os.close(fd)
            raise RunDirInUseError(f"{directory} is in use by a live run ({_describe(holder)}; {path}): wait for it "
                                   f"to end, or choose another {key}")
        if _names(path, fd):
            break
        os.close(fd)  # its holder removed the file between our open and our flock: lock the new one
    holder_now = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join(sys.argv)}
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder_now).encode())
    except OSError as e:  # a full disk: the error of a write to an open file names no file
        os.close(fd)
        e.filename = str(path)
        raise
    lock = RunLock(path, fd)
    atexit.register(lock.release)
    note = f"note: took over the lock of a run that is gone ({_describe(holder)}) in {directory}" if holder else None
    return lock, note


def _flock(fd: int, holder: dict[str, Any] | None) -> bool:
    """Whether this process got the flock of fd."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
    # A filesystem without flock: judge by the PID the file names. A run on another host cannot be checked.
    if not holder:
        return True
    if holder.get("host") != socket.gethostname():
        return False
    # Our own PID there is a leftover of an earlier process that had it (a restarted container).
    return holder.get("pid") == os.getpid() or not _alive(holder.get("pid"))


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _read_holder(fd: int) -> dict[str, Any] | None:
    try:
        holder = json.loads(os.pread(fd, 4096, 0))
    except ValueError:  # empty: just made, or its holder is writing it
        return None
    return holder if isinstance(holder, dict) and holder else None


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"


def _names(path: Path, fd: int) -> bool:
    """Whether path still names the file open as fd."""
    try:
        here, there = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def claim(directory: Path, resume: str | None, overwrite: bool, sweep: bool = False) -> str | None:
    """What this run does with what `directory` already holds, decided before anything is written to it, by the
    resume policy the loop applies again (training/resume.py: resume_point): it continues the run in its directory
    (train.resume=auto, or train.resume=<that directory or its last checkpoint>); it is refused where another run's
    checkpoints are, unless train.overwrite=true; otherwise it starts afresh, and the records of an earlier run found
    there (checkpoints, metrics, .hydra/, wandb/, ...) are moved aside into `<directory>/replaced-<time>/`, never
    mixed with the new run's nor deleted. Returns a note on what was moved. `sweep`: directory is a multirun's sweep
    directory, its job directories one level below."""
    target = resume_point(directory, resume, overwrite, sweep)
    if target is not None and any(os.path.samefile(target, c) for c in own_checkpoints(directory, sweep)):
        return None  # continues
    records = _records(directory, sweep)
    if not records:
        return None
    if target and any(target.resolve().is_relative_to(r.resolve()) for r in records):
        raise ValueError(f"train.resume={resume} lies among the records of {directory} that this run would move "
                         f"aside to start afresh: copy the checkpoint elsewhere first, or choose another "
                         f"{'hydra.sweep.dir' if sweep else 'hydra.run.dir'}")
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    aside, n = directory / f"{MOVED_ASIDE}{stamp}", 1
    while aside.exists():
        aside, n = directory / f"{MOVED_ASIDE}{stamp}-{n}", n + 1
    aside.mkdir()
    for record in records:
        record.rename(aside / record.name)  # the same filesystem: a rename, nothing copied
    return f"note: {directory} held an earlier run's records: moved {', '.join(r.name for r in records)} to {aside}"


def _records(directory: Path, sweep: bool) -> list[Path]:
    if not directory.is_dir():
        return []
    if not sweep:
        return [directory / name for name in RECORDS if (directory / name).exists()]
    jobs = [p for p in sorted(directory.iterdir())
            if p.is_dir() and not p.name.startswith(MOVED_ASIDE) and _records(p, sweep=False)]
    return jobs + [directory / name for name in SWEEP_RECORDS if (directory / name).exists()]


def take(directory: Path, train: TrainConfig, sweep: bool = False) -> None:
    """Lock `directory` and claim it for a run with these train.* settings; notes go to stderr."""
    directory = directory.absolute()  # as Hydra's run_job makes it
    _, note = lock_run_dir(directory, "hydra.sweep.dir" if sweep else "hydra.run.dir")
    for line in (note, claim(directory, train.resume, train.overwrite, sweep)):
        if line:
            print(line, file=sys.stderr, flush=True)
