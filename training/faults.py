"""What the loop does when things go wrong: stop signals and non-finite losses.

- `StopSignal`: SIGTERM (what clusters send before preemption) and SIGINT set a flag; the loop saves a checkpoint
  at the next step boundary, prints `resume_command` and returns cleanly. A second signal is not delayed: it raises
  KeyboardInterrupt.
- `NonFiniteGuard`: a step whose loss or gradient norm is NaN/inf is not applied. On CPU this is checked every
  step; on CUDA the per-step flags stay on the GPU (a check per step would stall the pipeline) and are read at the
  next log point. Policy `stop` ends the run there; `skip` tolerates up to `max_skipped_steps` such steps. Nothing
  non-finite is ever checkpointed (training/loop.py: save), so the checkpoint the error names is a good one.
"""

import os
import shlex
import signal
import sys
from pathlib import Path
from types import FrameType

import torch
import yaml


class StopSignal:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignal":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # asked twice: stop now
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name


class NonFiniteError(FloatingPointError):
    """Training produced NaN/inf; the message names the step and the last good checkpoint."""

    user_error = True  # its message names the fix: train.py prints it as one `error:` line (training/launch.py)


class NonFiniteGuard:
    def __init__(self, policy: str, max_skipped: int) -> None:
        self.policy, self.max_skipped = policy, max_skipped
        self.pending: list[tuple[int, torch.Tensor]] = []  # (step, bad flag) not yet read back
        self.skipped: list[int] = []

    def bad(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """A 0-d bool tensor: this step's loss or gradients are not finite."""
        return ~(torch.isfinite(loss) & torch.isfinite(grad_norm))

    def record(self, step: int, bad: torch.Tensor) -> None:
        self.pending.append((step, bad))

    def check(self, last_checkpoint: str | None) -> list[int]:
        """Read the pending flags (synchronises); returns the newly skipped steps, raises when the policy says so.
        last_checkpoint: the latest checkpoint saved or resumed from, None if there is none."""
        if not self.pending:
            return []
        flags = torch.stack([b for _, b in self.pending]).tolist()
        new = [step for (step, _), bad in zip(self.pending, flags, strict=True) if bad]
        self.pending.clear()
        self.skipped += new
        if new and (self.policy == "stop" or len(self.skipped) > self.max_skipped):
            why = "" if self.policy == "stop" else f" ({len(self.skipped)} non-finite steps > max_skipped_steps)"
            # A resumed run takes its learning rate from its own config (training/optim.py: keep_hyperparameters).
            retry = (f"Last good checkpoint: {last_checkpoint}. Resume from it (train.resume=...) with a lower "
                     "train.learning_rate" if last_checkpoint else
                     "No checkpoint was saved before it: start again with a lower train.learning_rate")
            other = ("set train.nonfinite=skip to skip such steps" if self.policy == "stop" else
                     "raise train.max_skipped_steps")
            raise NonFiniteError(f"the loss or gradients became NaN/inf at step {new[0]}{why}; that step was not "
                                 f"applied. {retry}, or {other}.")
        return new


def resume_command(run_dir: Path, world_size: int) -> str:
    """The command that continues the run in `run_dir`, in that directory, from its checkpoints/last.pt: this run's
    command-line overrides, which Hydra records in <run_dir>/.hydra/overrides.yaml, with train.resume pointing at
    the run. Without that record (the loop was called from Python), the keys to add to the same overrides."""
    keys = [f"hydra.run.dir={run_dir}", f"train.resume={run_dir}"]
    recorded = run_dir / ".hydra" / "overrides.yaml"
    if not recorded.is_file():
        return f"the same overrides with train.resume={shlex.quote(str(run_dir))}"
    overrides = [o for o in yaml.safe_load(recorded.read_text()) or []
                 if o.split("=", 1)[0].lstrip("+~") != "train.resume"]
    script = sys.argv[0] if sys.argv[0].endswith(".py") else "train.py"
    launcher = ["python"]
    if world_size > 1:  # one node's processes (a checkpoint resumes on any number of them)
        launcher = ["torchrun", f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', world_size)}"]
    return " ".join(map(shlex.quote, [*launcher, script, *overrides, *keys]))
