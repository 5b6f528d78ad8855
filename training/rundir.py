"""The run directory, and the launch of train.py around it.

The run directory. The default one, `outputs/<date>/<H-M-S>-<suffix>` (multirun: `multirun/<date>/<H-M-S>-<suffix>/
<job number>`), is unique per launch: `run_suffix`, a resolver of conf/config.yaml. A directory serves one live run at
a time: `lock_run_dir` takes its `run.lock`. What a new run finds in its directory is settled before anything is
written there: `claim` continues the run in it, refuses, or moves the earlier run's records aside. Under torchrun, the
processes of one job share the directory: rank 0 alone locks, claims and writes Hydra's files.

The launch. `LaunchCallback` (conf/config.yaml: hydra.callbacks) runs after Hydra composed the config and before
Hydra writes anything (Hydra's run_job then makes the directory and writes .hydra/ into it): it validates the config
and takes the directory. Errors leave through `fail`: a user error (a message naming what to change) as
`error: <message>` on stderr, anything else with its traceback; exit status 2 when the launch is refused (nothing
ran), 1 when the run failed. HYDRA_FULL_ERROR=1 shows the traceback of user errors too. A multirun job that fails is
reported and recorded (`sweep_job`), the sweep goes on, and it ends with the list of failed jobs and status 1.

Only this module and training/config.py are imported before the config is known to be good: no torch, datasets or
wandb.
"""

import atexit
import copy
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
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from training.config import Config, TrainConfig, validate

LOCK = "run.lock"
# The loop's resume point (training/loop.py: resume_path): a file, or (FSDP runs) a sharded checkpoint directory.
LAST, LAST_SHARDED = Path("checkpoints") / "last.pt", Path("checkpoints") / "last.dcp"
RECORDS = (".hydra", "checkpoints", "metrics.jsonl", "summary.json", "wandb", "train.log")  # what a run writes
SWEEP_RECORDS = ("multirun.yaml",)  # what a sweep writes besides its job directories
REPLACED = "replaced-"  # <directory>/replaced-<time>/: an earlier run's records, moved aside by `claim`
# The user's own HYDRA_FULL_ERROR, read before `run_cli` sets it for Hydra.
TRACEBACKS = os.environ.get("HYDRA_FULL_ERROR") == "1"


# --- the run directory ---


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


def is_main_process() -> bool:
    """Rank 0 of a torchrun job, or a process on its own: the one that takes the run directory and writes to it."""
    return os.environ.get("RANK", "0") == "0"


def register_resolvers() -> None:
    """The resolvers of conf/config.yaml (hydra.run.dir, hydra.sweep.dir, hydra.output_subdir)."""
    OmegaConf.register_new_resolver("run_suffix", run_suffix, replace=True)
    OmegaConf.register_new_resolver("main_process_only", lambda value: value if is_main_process() else None,
                                    replace=True)


class RunDirInUseError(RuntimeError):
    """The run directory is locked by a run that is alive."""


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
    os.ftruncate(fd, 0)
    holder_now = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join(sys.argv)}
    os.write(fd, json.dumps(holder_now).encode())
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
    """What this run does with what `directory` already holds, decided before anything is written to it. The rules
    of training/loop.py's resume_path, applied before Hydra writes its files: a run continues the run in its directory
    with train.resume=auto or train.resume=<that directory or its last.pt>; it is refused (FileExistsError) where
    another run's checkpoints are, unless train.overwrite=true; otherwise it starts afresh, and the records of an
    earlier run found there (checkpoints, metrics, .hydra/, wandb/, ...) are moved aside into
    `<directory>/replaced-<time>/`, never mixed with the new run's nor deleted. Returns a note on what was moved.
    `sweep`: directory is a multirun's sweep directory, its job directories one level below."""
    target = _checkpoint_of(resume) if resume and resume != "auto" else None
    if target is not None and not target.exists():
        raise ValueError(f"no checkpoint at {target}: point train.resume at a .pt file, a .dcp directory or a run "
                         "directory")
    checkpoints = _checkpoints(directory, sweep)
    if checkpoints and (resume == "auto" or (target and any(os.path.samefile(target, c) for c in checkpoints))):
        return None  # continues
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    if checkpoints and not overwrite:
        raise FileExistsError(f"{directory} already holds a {'sweep' if sweep else 'run'}'s checkpoints: continue it "
                              f"with train.resume=auto, choose another {key}, or set train.overwrite=true to start "
                              f"over (the earlier records are moved into {directory / REPLACED}<time>/)")
    records = _records(directory, sweep)
    if not records:
        return None
    if target and any(target.resolve().is_relative_to(r.resolve()) for r in records):
        raise ValueError(f"train.resume={resume} lies among the records of {directory} that this run would move "
                         f"aside to start afresh: copy the checkpoint elsewhere first, or choose another {key}")
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    aside, n = directory / f"{REPLACED}{stamp}", 1
    while aside.exists():
        aside, n = directory / f"{REPLACED}{stamp}-{n}", n + 1
    aside.mkdir()
    for record in records:
        record.rename(aside / record.name)  # the same filesystem: a rename, nothing copied
    return f"note: {directory} held an earlier run's records: moved {', '.join(r.name for r in records)} to {aside}"


def _checkpoint_of(resume: str) -> Path:
    """train.resume's checkpoint, as training/checkpoint.py: resolve_checkpoint reads it (that module imports torch)."""
    path = Path(resume)
    if not path.is_dir() or (path / ".metadata").is_file():
        return path
    return path / LAST if (path / LAST).is_file() or not (path / LAST_SHARDED).is_dir() else path / LAST_SHARDED


def _checkpoints(directory: Path, sweep: bool) -> list[Path]:
    found = [p for last in (LAST, LAST_SHARDED) for p in (directory.glob(f"*/{last}") if sweep else [directory / last])]
    return [p for p in found if p.exists() and not p.relative_to(directory).parts[0].startswith(REPLACED)]


def _records(directory: Path, sweep: bool) -> list[Path]:
    if not directory.is_dir():
        return []
    if not sweep:
        return [directory / name for name in RECORDS if (directory / name).exists()]
    jobs = [p for p in sorted(directory.iterdir())
            if p.is_dir() and not p.name.startswith(REPLACED) and _records(p, sweep=False)]
    return jobs + [directory / name for name in SWEEP_RECORDS if (directory / name).exists()]


def take(directory: Path, train: TrainConfig, sweep: bool = False) -> None:
    """Lock `directory` and claim it for a run with these train.* settings; notes go to stderr."""
    directory = directory.absolute()  # as Hydra's run_job makes it
    _, note = lock_run_dir(directory, "hydra.sweep.dir" if sweep else "hydra.run.dir")
    for line in (note, claim(directory, train.resume, train.overwrite, sweep)):
        if line:
            print(line, file=sys.stderr, flush=True)


# --- errors ---

# The project's own error classes, by module: each module imports torch, and an exception can only be an instance
# of a class whose module is loaded, so `is_user_error` looks in sys.modules instead of importing them.
OWN_ERRORS = (("training.checkpoint", "CheckpointError"), ("model.pretrained", "PretrainedError"),  # + HubUnavailable
              ("data.tokenizers", "DataUnavailableError"), ("training.faults", "NonFiniteError"))


def is_user_error(exc: BaseException) -> bool:
    """An error whose message says what to change (a key, a value, a file): ValueError, FileExistsError, Hydra's and
    OmegaConf's config errors, and the project's own error classes. Any other exception is a bug."""
    classes = [ValueError, FileExistsError, RunDirInUseError, HydraException, OmegaConfBaseException]
    classes += [getattr(sys.modules[module], name) for module, name in OWN_ERRORS if module in sys.modules]
    return isinstance(exc, tuple(classes))


def message(exc: BaseException) -> str:
    """The message of a user error, as Hydra prints a config error: its own, then its OmegaConf cause's."""
    text, cause = str(exc), exc.__cause__
    if isinstance(exc, HydraException) and isinstance(cause, OmegaConfBaseException) and str(cause) not in text:
        text += "\n" + str(cause)
    return text


def report(exc: BaseException, context: str = "") -> None:
    """A user error as `error: <context><message>` on stderr; a bug (or any error under HYDRA_FULL_ERROR=1) with its
    traceback."""
    if TRACEBACKS or not is_user_error(exc):
        traceback.print_exception(exc)
        if context:
            print(f"error: {context}{type(exc).__name__}: {exc}", file=sys.stderr)
    else:
        print(f"error: {context}{message(exc)}", file=sys.stderr)
    sys.stderr.flush()


def fail(exc: BaseException, status: int) -> NoReturn:
    """Report exc and exit: with `status` for a user error, 1 for a bug."""
    report(exc)
    raise SystemExit(status if is_user_error(exc) else 1)


@contextmanager
def exit_on_error(status: int) -> Iterator[None]:
    """An exception raised inside is reported and ends the process (`fail`). The exit is a SystemExit, which Hydra
    lets through: it catches Exception only (and turns a callback's into a mere warning)."""
    try:
        yield
    except Exception as e:
        fail(e, status)


def run_cli(main: Callable[[], Any]) -> None:
    """Run train.py's @hydra.main function with the error reporting of `fail`. Hydra prints an error raised while it
    composes the config (a typo, an unknown preset) in its own format with status 1, unless HYDRA_FULL_ERROR=1 asks it
    to re-raise: set here, so that the error reaches `fail` (the user's own setting is TRACEBACKS). Errors of the run
    itself are handled inside the task (train.py) and never reach Hydra."""
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except Exception as e:
        fail(e, status=2)


# --- multirun ---


@dataclass
class Job:
    name: str  # "#<n> (<its swept overrides>)"
    error: str | None = None  # the first line of its error, if it failed


JOBS: list[Job] = []  # this process's multirun jobs (Hydra's basic launcher runs them all in this process)
SWEPT: list[str] = []  # the swept keys, which name a job


@contextmanager
def sweep_job() -> Iterator[None]:
    """One multirun job: an exception raised inside is reported and recorded, not raised, so the sweep goes on to its
    other jobs (Hydra's basic launcher would re-raise the first failure once the batch ends, with a traceback);
    LaunchCallback.on_multirun_end lists the failures and exits 1."""
    hydra = HydraConfig.get()
    swept = [o for o in hydra.overrides.task if o.split("=", 1)[0] in SWEPT] or list(hydra.overrides.task)
    job = Job(f"#{hydra.job.num} ({' '.join(swept)})")
    JOBS.append(job)
    try:
        yield
    except Exception as e:
        report(e, context=f"job {job.name}: ")
        # A job that failed mid-run leaves its wandb run open, and the next job's wandb.init would return that run
        # (wandb's default in a script) and log into it: end it, marked failed.
        wandb = sys.modules.get("wandb")
        if wandb is not None and wandb.run is not None:
            wandb.run.finish(exit_code=1)
        lines = message(e).splitlines() if is_user_error(e) else [f"{type(e).__name__}: {e}"]
        job.error = lines[0] if lines else type(e).__name__


def _swept_keys(config: DictConfig) -> list[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    return [o.get_key_element() for o in overrides if o.is_sweep_override()]


# --- Hydra's callback ---


def task_config(config: DictConfig) -> Config:
    """The run's Config from Hydra's whole config (what the task function gets: all but the hydra node)."""
    config = copy.deepcopy(config)
    with read_write(config), open_dict(config):
        del config["hydra"]
    return OmegaConf.to_object(config)


class LaunchCallback(Callback):
    """Hydra calls these after composing the config and before it writes anything for the run."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        with exit_on_error(status=2):
            cfg = task_config(config)
            validate(cfg)
            if is_main_process():
                take(Path(config.hydra.run.dir), cfg.train)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Each job's config is validated as the job starts (train.py): a bad swept value fails that job alone.
        with exit_on_error(status=2):
            JOBS.clear()
            SWEPT[:] = _swept_keys(config)
            if is_main_process():
                take(Path(config.hydra.sweep.dir), task_config(config).train, sweep=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        failed = [job for job in JOBS if job.error is not None]
        if failed:
            lines = [f"error: {len(failed)} of {len(JOBS)} jobs failed:", *(f"  {j.name}: {j.error}" for j in failed)]
            print("\n".join(lines), file=sys.stderr, flush=True)
            raise SystemExit(1)
