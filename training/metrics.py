"""Training metrics: one producer, many sinks.

The loop hands `MetricsLogger.log` a dict keyed by the names below; the logger writes it to the console (through
the progress bar), to `<run_dir>/metrics.jsonl` and to wandb (offline by default, so no account is needed).
Throughput is measured between synchronised log points; MFU uses the peak-FLOPS table below; which SDPA kernel ran
is found by profiling one step (`detect_sdpa_kernel`, also used by the benchmark scripts). Under torchrun only rank 0
writes (the other ranks get a `NullLogger`).

metrics.jsonl holds one JSON object per log call, in strict JSON (a NaN/inf value is written as null), as do
summary.json and the console's `summary: {...}` lines. A run resumed in its own directory keeps the lines up to the
step it resumed from and logs the later steps anew, so no step appears twice; one resumed in a new directory starts
its file there. A resumed run continues the wandb run of its checkpoint (whose id every checkpoint keeps).

A write that fails (a full disk) raises an OSError naming the file. On a run's way out after an error, the logger's
own failed writes are dropped, so that the run's error is the one reported (`close_on_error`).
"""

import json
import math
import os
import resource
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import torch
from tqdm import tqdm

from training.checkpoint import atomic_write
from training.config import WandbConfig

T = TypeVar("T")

TRAIN_LOSS = "train/loss"
VAL_LOSS = "val/loss"
LR = "train/lr"
TOKENS_PER_SEC = "perf/tokens_per_sec"  # all GPUs together
TOKENS_PER_SEC_PER_GPU = "perf/tokens_per_sec_per_gpu"
TRAINED_TOKENS_PER_SEC = "perf/trained_tokens_per_sec"  # the tokens the loss is on (not prompts, not padding)
MFU = "perf/mfu"  # per GPU
PEAK_RESERVED = "mem/peak_reserved_gib"
PEAK_ALLOCATED = "mem/peak_allocated_gib"
PEAK_RSS = "mem/peak_rss_gib"
SKIPPED_STEPS = "train/skipped_steps"  # steps not applied because their loss or gradients were NaN/inf

# Dense (no sparsity) tensor-core peak in FLOP/s for 16-bit operands; fp32 work runs on TF32 at half that rate.
# Checked in order: the first substring of torch.cuda.get_device_name() that matches wins.
PEAK_FLOPS_BF16: list[tuple[str, float]] = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),
]


def peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of one GPU for this dtype, or None if the GPU is not in the table (MFU is then omitted)."""
    for needle, flops in PEAK_FLOPS_BF16:
        if needle in device_name:
            return flops if dtype in (torch.bfloat16, torch.float16) else flops / 2
    return None


def flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int, frozen: int = 0) -> float:
    """Training FLOPs per token (forward + backward), PaLM appendix B, as nanoGPT: 6N for the weights plus
    12·L·H·hs·T for the attention scores and their product with V (counted in full, as nanoGPT does). `frozen` of the
    n_params (a LoRA run's base) get no weight gradient: 4 per parameter (the forward and the input gradient)."""
    return 6 * n_params - 2 * frozen + 12 * n_layer * n_head * head_dim * seq_len


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak memory since the last call (CUDA peaks are reset here); on CPU the process's peak RSS."""
    if device.type == "cuda":
        stats = {
            PEAK_RESERVED: torch.cuda.max_memory_reserved(device) / 2**30,
            PEAK_ALLOCATED: torch.cuda.max_memory_allocated(device) / 2**30,
        }
        torch.cuda.reset_peak_memory_stats(device)
        return stats
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {PEAK_RSS: kib / 2**20 if sys.platform != "darwin" else kib / 2**30}


# Which SDPA kernel ran: the dispatcher op (works on CPU and under torch.compile's extern calls) or, failing that,
# the CUDA kernel name. Checked in order: the first match wins.
_SDPA_SIGNATURES: list[tuple[str, str]] = [
    ("flex_attention", "flex"),  # packed rows on a GPU (model/attention.py: sdpa_attention)
    ("_scaled_dot_product_cudnn_attention", "cudnn"),
    ("_scaled_dot_product_flash_attention", "flash"),
    ("_scaled_dot_product_efficient_attention", "efficient"),
    ("_scaled_dot_product_attention_math", "math"),
    ("cudnn_generated_fort_native_sdpa", "cudnn"),
    ("flash_fwd", "flash"),
    ("fmha_cutlass", "efficient"),
]


def sdpa_kernel_from_names(names: set[str]) -> tuple[str, list[str]]:
    """Map profiler event names to flash/efficient/cudnn/math (or flex: FlexAttention, for packed rows); returns
    (kernel, the names that decided it)."""
    for needle, kernel in _SDPA_SIGNATURES:
        hits = sorted(n for n in names if needle in n)
        if hits:
            return kernel, hits
    return "unknown", []


# Kineto, the C++ library under torch.profiler, writes log lines of its own straight to the process's stderr: a
# "USDT: ... profiler_start" / "profiler_stop" pair around every trace (torch 2.13), and, on a CUDA build of torch
# with no usable GPU, "ERROR: ... gpuGetDeviceCount failed with code 35" (no driver; 100: no device), as it reads the
# GPUs' properties for the trace even when only CPU activity is recorded. torch sets kineto's threshold to ERROR,
# which lets both through (kineto's levels: VERBOSE 0, INFO 1, WARNING 2, STAGE 3, ERROR 4, USDT 5), unless
# KINETO_LOG_LEVEL is set: kineto reads that once per process, when the first profiler starts. Above every level, it
# silences kineto; what kineto could report only concerns the trace, and a failed trace shows as kernel "unknown".
_KINETO_SILENT = "6"


@contextmanager
def _quiet_kineto() -> Iterator[None]:
    """KINETO_LOG_LEVEL set to silence kineto while a profiler starts, unless the user chose a level. The variable is
    removed again afterwards (kineto keeps the level it read), so processes started later do not inherit it."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = _KINETO_SILENT
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


def detect_sdpa_kernel(fn: Callable[[], T]) -> tuple[T, str, list[str]]:
    """Run fn (e.g. one training step) under torch.profiler: (its result, the SDPA kernel it used, the evidence).

    The profiler, rather than a lighter hook such as a TorchDispatchMode, because it also sees the ops that a
    torch.compile'd step calls and, on a GPU, the CUDA kernels; kineto's own log lines are silenced (_quiet_kineto),
    so a CPU run's console shows no "ERROR" for what is no error. A process whose profiler already started before
    (kineto fixes its level at the first start) keeps the level it had."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with _quiet_kineto(), warnings.catch_warnings():
        # torch 2.11 warns at a profiler's start that it "clears events at the end of each cycle": one cycle is all
        # this needs, and the warning would be one more line on a training run's console.
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events", category=UserWarning)
        with torch.profiler.profile(activities=activities) as prof:
            result = fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    return result, *sdpa_kernel_from_names({e.name for e in prof.events()})


class Throughput:
    """Tokens/sec between synchronised log points. The loop calls start() once warm-up steps are over, count()
    after every step, rate() at log points and restart() after work that is not training (evals). count(trained)
    also adds up the step's trained tokens (a device tensor: read at rate() only), whose rate rate() leaves in
    trained_rate."""

    def __init__(self, device: torch.device, tokens_per_step: int) -> None:
        self.device, self.tokens_per_step = device, tokens_per_step
        self.t0: float | None = None
        self.steps = 0
        self.trained: torch.Tensor | int = 0
        self.trained_rate: float | None = None

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self.t0, self.steps, self.trained = self._now(), 0, 0

    def restart(self) -> None:
        if self.t0 is not None:
            self.start()

    def count(self, trained: torch.Tensor | None = None) -> None:
        if self.t0 is not None:
            self.steps += 1
            if trained is not None:
                self.trained = self.trained + trained

    def rate(self) -> float | None:
        """Tokens/sec since the last (re)start, or None while warming up; restarts the window."""
        if self.t0 is None or self.steps == 0:
            return None
        now = self._now()
        rate = self.steps * self.tokens_per_step / (now - self.t0)
        self.trained_rate = float(self.trained) / (now - self.t0) if torch.is_tensor(self.trained) else None
        self.t0, self.steps, self.trained = now, 0, 0
        return rate


def finite_or_null(value: Any) -> Any:
    """value with every NaN/inf float replaced by None: JSON has no such numbers (json.dumps would write a bare NaN,
    which strict parsers reject), and null keeps "no finite value" readable everywhere."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(v) for v in value]
    return value


def json_line(record: dict[str, Any]) -> str:
    return json.dumps(finite_or_null(record), allow_nan=False) + "\n"


@contextmanager
def naming(path: Path) -> Iterator[None]:
    """An OSError raised inside names path: a write to an open file raises one without a file name."""
    try:
        yield
    except OSError as e:
        e.filename = e.filename or str(path)
        raise


def keep_records(path: Path, last_step: int) -> None:
    """Keep the records of steps <= last_step in a metrics.jsonl (rewritten atomically; none if last_step is 0): a
    run resumed from its checkpoint at last_step logs the later steps again, and the file keeps one line per step."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the last line of a killed run may be torn
            continue
        if record["step"] <= last_step:
            kept.append(json_line(record))
    atomic_write(path, lambda f: f.write("".join(kept).encode()))


class MetricsLogger:
    """Console + progress bar, JSON lines and wandb, all fed the same metric names. The summary (run facts such as
    the attention backend and the SDPA kernel that ran, and end-of-run figures) goes to wandb's run summary, the
    console and <run_dir>/summary.json.

    kept_steps: the records of an existing metrics.jsonl kept (steps <= kept_steps; 0: start the file afresh).
    wandb_id: the wandb run to continue (that of the checkpoint a run resumes from), or None for a new one."""

    def __init__(self, run_dir: Path, config: dict[str, Any], wandb_cfg: WandbConfig, total_steps: int,
                 initial_step: int, kept_steps: int = 0, wandb_id: str | None = None) -> None:
        self.run_dir = run_dir
        keep_records(run_dir / "metrics.jsonl", kept_steps)
        self.jsonl = (run_dir / "metrics.jsonl").open("a")
        import wandb  # imported here: the benchmark scripts use this module's metrics without a wandb run

        # resume="allow": continue the run of that id (offline too: the new offline-run-*-<id> folder carries the id
        # and `wandb sync` appends it to that run), or create it if it is not there.
        self.run = wandb.init(project=wandb_cfg.project, name=wandb_cfg.name, group=wandb_cfg.group,
                              mode=wandb_cfg.mode.value, dir=str(run_dir), config=config, id=wandb_id,
                              resume="allow" if wandb_id else None)
        self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True, file=sys.stdout)
        self.values: dict[str, Any] = {}

    @property
    def wandb_id(self) -> str | None:
        """The wandb run's id: checkpoints keep it, so that a resumed run continues the same wandb run."""
        return self.run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)
        with naming(self.run_dir / "metrics.jsonl"):
            self.jsonl.write(json_line({"step": step, **metrics}))
            self.jsonl.flush()
        self.bar.write(f"step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        brief = {TRAIN_LOSS: "loss", TOKENS_PER_SEC: "tok/s", PEAK_RESERVED: "GiB", PEAK_RSS: "rss_GiB"}
        self.bar.set_postfix({short: f"{metrics[k]:.4g}" for k, short in brief.items() if k in metrics})

    def note(self, text: str) -> None:
        """A message for the person running the job (on the console, above the progress bar)."""
        self.bar.write(text)

    def advance(self) -> None:
        self.bar.update(1)

    def summary(self, values: dict[str, Any]) -> None:
        """Record run facts; they also go into the wandb config, so runs can be grouped by them."""
        self.values.update(values)
        self.run.summary.update(values)
        self.run.config.update(values, allow_val_change=True)
        self.bar.write("summary: " + json.dumps(finite_or_null(values), allow_nan=False))

    def close(self, exit_code: int = 0) -> dict[str, Any]:
        """Write summary.json (atomically: a failed write leaves the previous one) and end the wandb run (exit_code 1:
        marked failed), also when a write fails."""
        self.bar.close()
        try:
            with naming(self.run_dir / "metrics.jsonl"):
                self.jsonl.close()
            summary = json.dumps(finite_or_null(self.values), indent=2, allow_nan=False) + "\n"
            atomic_write(self.run_dir / "summary.json", lambda f: f.write(summary.encode()))
        finally:
            self.run.finish(exit_code=exit_code)
        return self.values


@contextmanager
def close_on_error(logger: "MetricsLogger | NullLogger") -> Iterator[None]:
    """An error raised inside ends the logger's records first (metrics.jsonl, summary.json, the wandb run, marked
    failed), then propagates. A write of the logger's that fails meanwhile (the disk that failed a checkpoint is
    full) is dropped: the error to report is the one that ended the run."""
    try:
        yield
    except BaseException:
        with suppress(OSError):
            logger.close(exit_code=1)
        raise


class NullLogger:
    """MetricsLogger's stand-in on ranks other than 0: a run has one writer. Keeps the summary, which train returns."""

    wandb_id = None

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def advance(self) -> None:
        pass

    def summary(self, values: dict[str, Any]) -> None:
        self.values.update(values)

    def close(self, exit_code: int = 0) -> dict[str, Any]:
        return self.values
