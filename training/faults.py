"""What the loop does when things go wrong: stop signals and non-finite losses.

- `StopSignal`: SIGTERM (what clusters send before preemption) and SIGINT set a flag; the loop saves a checkpoint
  at the next step boundary and returns cleanly. A second signal is not delayed: it raises KeyboardInterrupt.
- `NonFiniteGuard`: a step whose loss or gradient norm is NaN/inf is not applied. On CPU this is checked every
  step; on CUDA the per-step flags stay on the GPU (a check per step would stall the pipeline) and are read at the
  next log point. Policy `stop` ends the run there; `skip` tolerates up to `max_skipped_steps` such steps.
"""

import signal
from types import FrameType

import torch


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

    def check(self, last_checkpoint: str) -> list[int]:
        """Read the pending flags (synchronises); returns the newly skipped steps, raises when the policy says so."""
        if not self.pending:
            return []
        flags = torch.stack([b for _, b in self.pending]).tolist()
        new = [step for (step, _), bad in zip(self.pending, flags, strict=True) if bad]
        self.pending.clear()
        self.skipped += new
        if new and (self.policy == "stop" or len(self.skipped) > self.max_skipped):
            why = "" if self.policy == "stop" else f" ({len(self.skipped)} non-finite steps > max_skipped_steps)"
            raise NonFiniteError(
                f"the loss or gradients became NaN/inf at step {new[0]}{why}; that step was not applied. Last good "
                f"checkpoint: {last_checkpoint}. Resume from it (train.resume=...) with a lower train.learning_rate, "
                "or set train.nonfinite=skip to skip such steps."
            )
        return new
