"""The launch of train.py: the config checked and the run directory taken before Hydra writes anything, and one way
out for every error.

`LaunchCallback` (conf/config.yaml: hydra.callbacks) runs after Hydra composed the config and before Hydra writes
anything (Hydra's run_job then makes the directory and writes .hydra/ into it): it validates the config and takes
the directory (training/rundir.py). Errors leave through `fail`: a user error (a message naming what to change) as
`error: <message>` on stderr, anything else with its traceback; exit status 2 when the launch is refused (nothing
ran), 1 when the run failed. HYDRA_FULL_ERROR=1 shows the traceback of user errors too. A full disk, a read-only
filesystem or a missing permission is a user error, named by its file (`DISK_ERRORS`). A multirun job that fails
is reported and recorded (`sweep_job`), the sweep goes on, and it ends with the list of failed jobs and status 1.

Only this module, training/rundir.py, training/resume.py and the config modules are imported before the config is
known to be good: no torch, datasets or wandb.
"""

import copy
import errno
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from training.config import Config, validate
from training.rundir import is_main_process, take

# The user's own HYDRA_FULL_ERROR, read before `run_cli` sets it for Hydra.
TRACEBACKS = os.environ.get("HYDRA_FULL_ERROR") == "1"
# The OSErrors whose fix is the user's, on the file they name: what to do about each.
DISK_ERRORS = {
    errno.ENOSPC: "free space there",
    errno.EDQUOT: "free space there or raise the quota",
    errno.EROFS: "make its filesystem writable",
    errno.EACCES: "check its permissions",
    errno.EPERM: "check its permissions",
}


# --- errors ---


def is_user_error(exc: BaseException) -> bool:
    """An error whose message says what to change (a key, a value, a file): ValueError, FileExistsError, Hydra's and
    OmegaConf's config errors, an OSError of DISK_ERRORS, and the project's own error classes, which say so by a class
    attribute `user_error = True` (CheckpointError, WriteError, PretrainedError, DataUnavailableError,
    NonFiniteError, RunDirInUseError, DeviceError). Any other exception is a bug."""
    return (isinstance(exc, (ValueError, FileExistsError, HydraException, OmegaConfBaseException))
            or isinstance(exc, OSError) and exc.errno in DISK_ERRORS or getattr(exc, "user_error", False) is True)


def message(exc: BaseException) -> str:
    """The message of a user error, as Hydra prints a config error: its own, then its OmegaConf cause's; an OSError
    of DISK_ERRORS as `<reason>: <file>: <what to do>` (unless it is a project's error, with a message of its own)."""
    if isinstance(exc, OSError) and exc.errno in DISK_ERRORS and not getattr(exc, "user_error", False):
        where = f": {exc.filename}" if exc.filename else ""
        fix = f"{DISK_ERRORS[exc.errno]}, or use another directory (hydra.run.dir, data.cache_dir)"
        return f"{exc.strerror}{where}: {fix}"
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
