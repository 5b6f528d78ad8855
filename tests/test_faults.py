"""Faults (CPU, tiny model): SIGKILL at random moments, SIGTERM and the command it prints, NaN losses and diverged
weights (never checkpointed), failed checkpoint writes, clobbering."""

import errno
import json
import math
import multiprocessing
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import ROOT, SMALL, make_cfg, read_metrics, strict_json, train_losses, wait_for_training

from model import GPT
from training import checkpoint as ckpt
from training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from training.faults import NonFiniteError
from training.loop import train
from training.optim import lr_multiplier

# Checkpoints every step, and large enough (~20 MB with the optimizer state) that much of the run is spent writing
# them: random kills land inside writes too.
KILLABLE = ["model.n_embd=256", "model.n_head=4", "train.eval_interval=1", "train.eval_batches=1",
            "train.log_interval=1", "model.dropout=0.1", "train.dtype=fp32", "wandb.mode=disabled"]


def cli(tmp_path: Path, run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "train.py", *SMALL, *KILLABLE, f"data.cache_dir={tmp_path / 'cache'}",
            f"hydra.run.dir={run_dir}", *args]


def test_sigkill_at_random_moments_loses_nothing(tmp_path):
    # Each attempt is a real training process killed with SIGKILL. It is forked from a forkserver that has imported
    # the training code once, which saves ~10 s of imports per attempt on a 2-core machine. Not forked from this
    # interpreter: a fork of a process with running threads (torch's pools, other tests' leftovers) can inherit a
    # lock held by one of them and hang before training starts.
    run, fork = tmp_path / "run", multiprocessing.get_context("forkserver")
    fork.set_forkserver_preload(["training.loop", "torch"])
    config = lambda *o: make_cfg(tmp_path, *KILLABLE, "train.lr_decay_steps=1000", *o)  # noqa: E731
    rng = random.Random(0)
    steps_seen, kills_during_write = 0, 0
    for attempt in range(22):
        lines = len((run / "metrics.jsonl").read_text().splitlines()) if (run / "metrics.jsonl").exists() else 0
        proc = fork.Process(target=train, args=(config("train.max_steps=1000", "train.resume=auto"), run, tmp_path))
        proc.start()
        try:
            assert wait_for_training(run, proc.is_alive, lines), "the run did not (re)start training"
            if attempt % 3 == 2:  # aimed: kill as soon as a checkpoint write has begun
                deadline = time.monotonic() + 10
                while not list((run / "checkpoints").glob(".*.tmp")) and time.monotonic() < deadline:
                    time.sleep(0.001)
            else:
                time.sleep(rng.uniform(0.0, 0.4))
        finally:  # also when the assert fails: a surviving child would train on and starve the later tests
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
        kills_during_write += bool(list((run / "checkpoints").glob(".*.tmp")))
        state = load_checkpoint(run)  # the latest checkpoint always loads: never a torn or partial file
        assert state["step"] >= steps_seen
        steps_seen = state["step"]
    assert kills_during_write >= 1  # some kills hit a checkpoint write (the temp file they leave shows it)

    # The killed-and-resumed run ends bit-identical to one that was never interrupted.
    train(config(f"train.max_steps={steps_seen + 3}", "train.resume=auto"), run, root=tmp_path)
    train(config(f"train.max_steps={steps_seen + 3}"), tmp_path / "clean", root=tmp_path)
    resumed, uninterrupted = load_checkpoint(run)["model"], load_checkpoint(tmp_path / "clean")["model"]
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


def test_sigterm_saves_at_the_next_step_exits_cleanly_and_prints_the_command_that_resumes(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(cli(tmp_path, run, "train.max_steps=100000", "train.eval_interval=1000000"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_for_training(run, lambda: proc.poll() is None, 3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM"
    stopped = summary["stopped_at_step"]
    assert load_checkpoint(run)["step"] == stopped < 100000
    assert f"latest checkpoint: {run / 'checkpoints' / 'last.pt'} (step {stopped})" in out

    # The printed command is this run's overrides (as Hydra recorded them) resuming in its own directory.
    command = shlex.split(out.split("To continue this run:\n", 1)[1].splitlines()[0])
    overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
    assert command[:2] == ["python", "train.py"]
    assert command[2:] == [*overrides, f"hydra.run.dir={run}", f"train.resume={run}"]
    # ...and it works (with an end in sight): the run continues from the step it stopped at.
    command = [sys.executable, *command[1:]]
    command = [f"train.max_steps={stopped + 2}" if a.startswith("train.max_steps=") else a for a in command]
    resumed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] == stopped and summary["steps"] == stopped + 2
    assert sorted(train_losses(run)) == list(range(1, stopped + 3))


def nan_at(monkeypatch: pytest.MonkeyPatch, bad_calls: set[int]) -> None:
    """Make the model's loss NaN on the given forward calls (counted from 1, training and eval alike)."""
    forward, calls = GPT.forward, [0]

    def poisoned(self, idx, targets=None, **kwargs):
        logits, loss = forward(self, idx, targets, **kwargs)
        calls[0] += 1
        return logits, (loss * float("nan") if calls[0] in bad_calls and loss is not None else loss)

    monkeypatch.setattr(GPT, "forward", poisoned)


def test_nan_loss_stops_the_run_naming_the_step_and_checkpoint(tmp_path, monkeypatch):
    # eval_interval=3 with eval_batches=2: forward calls 1-3 are steps 1-3, 4-5 the eval, 6 is step 4, 7 step 5.
    nan_at(monkeypatch, {7})
    cfg = make_cfg(tmp_path, "train.max_steps=10", "train.eval_interval=3", "train.log_interval=100")
    with pytest.raises(NonFiniteError, match=r"at step 5;.*not applied.*checkpoints/last.pt \(step 3\)"):
        train(cfg, tmp_path / "run", root=tmp_path)
    assert load_checkpoint(tmp_path / "run")["step"] == 3  # nothing non-finite was ever checkpointed


def test_nan_steps_are_skipped_not_applied_and_bounded(tmp_path, monkeypatch):
    applied = []
    step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: applied.append(1) or step(self, *a, **k))
    nan_at(monkeypatch, {2, 5})
    cfg = make_cfg(tmp_path, "train.max_steps=8", "train.eval_interval=100", "train.nonfinite=skip")
    summary = train(cfg, tmp_path / "run", root=tmp_path)
    assert summary["skipped_steps"] == [2, 5] and len(applied) == 6 and math.isfinite(summary["final/train_loss"])
    assert all(torch.isfinite(p).all() for p in load_checkpoint(tmp_path / "run")["model"].values())

    nan_at(monkeypatch, set(range(3, 100)))
    cfg = make_cfg(tmp_path, "train.max_steps=20", "train.nonfinite=skip", "train.max_skipped_steps=4")
    with pytest.raises(NonFiniteError, match="5 non-finite steps > max_skipped_steps"):
        train(cfg, tmp_path / "run2", root=tmp_path)


def test_nan_advice_holds_resuming_with_a_lower_learning_rate_runs_at_that_rate(tmp_path, monkeypatch):
    nan_at(monkeypatch, {7})  # step 5, as above
    common = ["train.eval_interval=3", "train.log_interval=1", "train.lr_decay_steps=10"]
    with pytest.raises(NonFiniteError, match=r"Resume from it \(train.resume=...\) with a lower train.learning_rate"):
        train(make_cfg(tmp_path, *common, "train.max_steps=10"), tmp_path / "run", root=tmp_path)
    monkeypatch.undo()
    cfg = make_cfg(tmp_path, *common, "train.max_steps=6", "train.learning_rate=1e-4",
                   f"train.resume={tmp_path / 'run'}")
    train(cfg, tmp_path / "retry", root=tmp_path)
    lrs = {m["step"]: m["train/lr"] for m in read_metrics(tmp_path / "retry") if "train/lr" in m}
    assert sorted(lrs) == [4, 5, 6]  # the checkpoint of step 3, continued at 1e-4 (the first run had 1e-3)
    assert all(lrs[s] == pytest.approx(1e-4 * lr_multiplier(s - 1, cfg.train), rel=1e-12) for s in lrs), lrs


def test_nan_before_any_checkpoint_names_none_and_does_not_advise_resuming(tmp_path, monkeypatch):
    nan_at(monkeypatch, {2})
    with pytest.raises(NonFiniteError) as e:
        train(make_cfg(tmp_path, "train.max_steps=10", "train.eval_interval=3"), tmp_path / "run", root=tmp_path)
    assert "at step 2;" in str(e.value) and "No checkpoint was saved before it" in str(e.value)
    assert "Resume" not in str(e.value) and not (tmp_path / "run" / "checkpoints").exists()


def poison_weights_after(monkeypatch: pytest.MonkeyPatch, applied_steps: int) -> None:
    """Make the weights diverge: after that many applied optimizer steps the token embedding becomes inf (so every
    later loss is NaN, and these steps are skipped)."""
    step, calls = torch.optim.AdamW.step, [0]

    def diverging(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == applied_steps:
            self.param_groups[0]["params"][0].data.fill_(float("inf"))
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", diverging)


def test_diverged_weights_under_nonfinite_skip_are_never_checkpointed(tmp_path, monkeypatch, capsys):
    poison_weights_after(monkeypatch, 4)  # steps 1-4 applied, 5-9 NaN and skipped; evals (and saves) at 3, 6, 9
    cfg = make_cfg(tmp_path, "train.max_steps=9", "train.eval_interval=3", "train.nonfinite=skip",
                   "train.max_skipped_steps=100")
    summary = train(cfg, tmp_path / "run", root=tmp_path)
    assert summary["skipped_steps"] == [5, 6, 7, 8, 9] and math.isnan(summary["final/val_loss"])
    for name in ("last.pt", "best.pt"):
        state = load_checkpoint(tmp_path / "run" / "checkpoints" / name)
        assert state["step"] == 3 and all(torch.isfinite(p).all() for p in state["model"].values())
    last = f"{tmp_path / 'run' / 'checkpoints' / 'last.pt'} (step 3)"
    assert summary["last_checkpoint"] == last
    refused = "not saving checkpoints/last.pt at step 6: the weights are not finite (NaN/inf); the last good"
    assert f"{refused} checkpoint stays {last}" in capsys.readouterr().out


def test_a_non_finite_val_loss_is_not_checkpointed(tmp_path, monkeypatch):
    nan_at(monkeypatch, {4})  # forward calls 1-3 are steps 1-3, 4-5 the eval at step 3: its loss is NaN
    summary = train(make_cfg(tmp_path, "train.max_steps=3", "train.eval_interval=3"), tmp_path / "run",
                    root=tmp_path)
    assert not (tmp_path / "run" / "checkpoints").exists() and summary["last_checkpoint"] is None


def test_metrics_jsonl_and_summary_are_strict_json_with_null_for_nan(tmp_path, monkeypatch):
    nan_at(monkeypatch, {1})  # step 1's loss: logged, and the summary's first/train_loss
    cfg = make_cfg(tmp_path, "train.max_steps=3", "train.log_interval=1", "train.nonfinite=skip")
    train(cfg, tmp_path / "run", root=tmp_path)
    records = [strict_json(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] is None for r in records if "train/loss" in r] == [True, False, False]
    assert strict_json((tmp_path / "run" / "summary.json").read_text())["first/train_loss"] is None


def test_failed_checkpoint_writes_leave_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / "checkpoints" / "last.pt"
    save_checkpoint({"step": 1}, path)
    before = path.read_bytes()

    def disk_full(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint({"step": 2}, path)
    monkeypatch.undo()

    def read_only(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(ckpt.os, "open", read_only)  # creating the temporary file fails
    with pytest.raises(PermissionError):
        save_checkpoint({"step": 3}, path)
    monkeypatch.undo()
    assert path.read_bytes() == before and [p.name for p in path.parent.iterdir()] == ["last.pt"]


def test_a_run_directory_is_not_clobbered(tmp_path):
    run = tmp_path / "run"
    train(make_cfg(tmp_path, "train.max_steps=2"), run, root=tmp_path)
    before = (run / "checkpoints" / "last.pt").read_bytes()
    with pytest.raises(FileExistsError, match="train.resume=auto"):
        train(make_cfg(tmp_path, "train.max_steps=2"), run, root=tmp_path)
    assert (run / "checkpoints" / "last.pt").read_bytes() == before
    assert train(make_cfg(tmp_path, "train.max_steps=4", "train.resume=auto"), run, root=tmp_path)["steps"] == 4
    assert train(make_cfg(tmp_path, "train.max_steps=1", "train.overwrite=true"), run, root=tmp_path)["steps"] == 1


def test_resume_refuses_a_changed_run_and_overwrites_nothing(tmp_path):
    run = tmp_path / "run"
    train(make_cfg(tmp_path, "train.max_steps=2"), run, root=tmp_path)
    before = (run / "checkpoints" / "last.pt").read_bytes()
    with pytest.raises(CheckpointError, match="data.max_documents: checkpoint 20 vs run 10"):
        train(make_cfg(tmp_path, "data.max_documents=10", f"train.resume={run}"), tmp_path / "b", root=tmp_path)
    (tmp_path / "torn.pt").write_bytes(before[: len(before) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        train(make_cfg(tmp_path, f"train.resume={tmp_path / 'torn.pt'}"), tmp_path / "c", root=tmp_path)
    assert (run / "checkpoints" / "last.pt").read_bytes() == before
    assert not (tmp_path / "b" / "checkpoints").exists() and not (tmp_path / "c" / "checkpoints").exists()


@pytest.mark.skipif(os.name != "posix", reason="signals")
def test_second_signal_interrupts_immediately():
    from training.faults import StopSignal

    with StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
