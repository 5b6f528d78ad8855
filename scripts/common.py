"""What the benchmark scripts share: run metadata, report files, number formatting, train.py cells, output folders
and the NCCL settings of multi-GPU launches.

The scripts run from the repository root as `python scripts/<name>.py`; each puts the root on sys.path and imports
what it needs from here:

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from scripts.common import default_out, run_meta, write_report

A run writes to a fresh folder under outputs/ (`default_out`); results worth keeping are copied to
docs/results/<topic>_<gpu>_<date>/ by hand, with the command recorded in their metadata.
"""

import argparse
import contextlib
import cProfile
import datetime
import importlib.metadata
import io
import json
import math
import os
import pstats
import re
import shlex
import statistics
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
# NVLink multicast off (NVLS in NCCL, and torch's symmetric memory): shared multi-GPU hosts require it.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def default_out(topic: str) -> Path:
    """A fresh folder for one run's results, outputs/bench/<topic>-<YYYY-mm-dd_HH-MM-SS> (local time), so that no run
    writes over another's or over the committed results in docs/results/."""
    return ROOT / "outputs" / "bench" / f"{topic}-{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}"


def run_meta(device: torch.device | str | None = None, **settings: Any) -> dict[str, Any]:
    """What every results file records: the device (a torch.device is looked up: a GPU's model name, or "cpu"; a
    string is taken as that name), the torch, triton and CUDA versions, the UTC date-time and the command line, then
    the run's settings. Leave the device out when the measurement runs in other processes (train.py cells): their
    summaries name it."""
    if isinstance(device, torch.device):
        device = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    return {**({"device": device} if device is not None else {}), "torch": torch.__version__, "triton": triton,
            "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": shlex.join(["python", *sys.argv]), **settings}


def add_autograd_thread_option(parser: argparse.ArgumentParser) -> None:
    """--autograd-multithreading / --no-autograd-multithreading: whether backwards run on autograd's device thread
    (PyTorch's default) or on the calling thread; the default is how train.py runs them (train.autograd_multithreading).
    The script records the choice in its run_meta as autograd_multithreading."""
    from training.config import TrainConfig

    parser.add_argument("--autograd-multithreading", action=argparse.BooleanOptionalAction,
                        default=TrainConfig.autograd_multithreading,
                        help="backwards on autograd's device thread (PyTorch's default) instead of the calling thread; "
                             "default: as train.py runs them (train.autograd_multithreading)")


def backward_thread(meta: dict[str, Any]) -> str:
    """Where a run's backwards ran, from its run_meta; results without the setting predate it and ran on autograd's
    device thread."""
    return "the calling thread" if meta.get("autograd_multithreading") is False else "autograd's device thread"


def write_report(out: Path, results: dict[str, Any], markdown: str | None = None, name: str = "results") -> None:
    """Write results as <out>/<name>.json and, if given, the markdown as <out>/<name>.md (out is created). Scripts
    call it after every measurement with the results so far and without markdown, so that an interrupted run keeps
    what it measured, and once at the end with the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    if markdown is not None:
        (out / f"{name}.md").write_text(markdown)


def fmt(value: float | None, spec: str) -> str:
    """value formatted by spec for a table cell; "–" for a missing or NaN value."""
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


class NotAvailable(Exception):
    """A benchmarked method cannot run this shape (e.g. an SDPA kernel pinned where it does not apply)."""


def attempt(measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """measure()'s result, or what a table shows instead: status n/a (NotAvailable), OOM, or error with the first
    line of the exception (its traceback printed), so that one failing method does not end a sweep."""
    try:
        return measure()
    except NotAvailable as e:
        return {"status": "n/a", "reason": str(e)}
    except torch.cuda.OutOfMemoryError:
        return {"status": "OOM"}
    except Exception as e:  # report and carry on with the other methods
        traceback.print_exc()
        return {"status": "error", "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}


@contextlib.contextmanager
def env_vars(values: dict[str, str]):
    """os.environ with `values` set inside the block, restored after it (the kernels read their FLASH_ATTN_* modes at
    each call)."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def graph_replay_ms(calls: Callable[[int], None], n: int, replays: int = 10) -> float:
    """Median GPU ms per call: `calls(n)` (n calls back to back) captured in one CUDA graph on the current stream, then
    replayed `replays` times, so no call waits for Python or its launch."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.current_stream()):
        calls(n)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n)
    return statistics.median(times)


def cprofile_table(call: Callable[[], None], calls: int, top: int, between: Callable[[], None] = lambda: None) -> str:
    """cProfile's table of `calls` calls (each followed, unprofiled, by `between`), sorted by own time, top rows."""
    profiler = cProfile.Profile()
    for _ in range(calls):
        profiler.enable()
        call()
        profiler.disable()
        between()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def choice_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list whose items must be among choices (read when the argument is)."""

    def parse(text: str) -> list[str]:
        allowed = list(choices)
        unknown = [item for item in text.split(",") if item not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}: choose from {', '.join(allowed)}")
        return text.split(",")

    return parse


def failure(log: str) -> str:
    """What a failed cell reports: OOM, or the last line of its error."""
    if "OutOfMemoryError" in log or "out of memory" in log:
        return "OOM"
    # train.py's one-line report of a user error ("error: <message>"), or a traceback's last line
    errors = re.findall(r"^(?:error: (.*)|(\w*(?:Error|Exception): .*))$", log, flags=re.MULTILINE)
    last = next(filter(None, errors[-1])) if errors else log.strip()[-300:] or "no output"
    return "error: " + last[:300].rstrip()  # a table cell keeps no trailing space


def run_train(command: list[str], run_dir: Path, timeout: int, env: dict[str, str] | None = None,
              extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one training process (`python train.py ...` or torchrun) whose run directory is run_dir; returns
    {"status": "ok", **metrics of its summary.json, and the summary keys `extra` maps result names to} or
    {"status": "OOM" | "error: ..."}. Its console output is kept in <run_dir>/process.log, a timed-out process's too."""
    status = None
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        log = proc.stdout + proc.stderr
        status = None if proc.returncode == 0 else failure(log)
    except subprocess.TimeoutExpired as e:
        log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        status = f"error: timed out after {timeout} s"
        log += "\n" + status
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "process.log").write_text(log)
    if status is not None:
        return {"status": status}
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"status": "ok",
            "tokens_per_sec": summary.get("perf/tokens_per_sec_median"),
            "mfu": summary.get("perf/mfu_median"),
            "peak_reserved_gib": summary.get("mem/peak_reserved_gib_max"),
            "peak_allocated_gib": summary.get("mem/peak_allocated_gib_max"),
            "peak_rss_gib": summary.get("mem/peak_rss_gib_max"),
            "first_loss": summary["first/train_loss"],
            "final_loss": summary["final/train_loss"],
            "sdpa_kernel": summary.get("sdpa_kernel"),
            "device": summary.get("device"),
            **{name: summary.get(key) for name, key in (extra or {}).items()}}
