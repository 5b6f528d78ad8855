"""Faults (CPU, tiny model): SIGKILL at random moments, SIGTERM and the command it prints, NaN losses and diverged
weights (never checkpointed), failed checkpoint writes (a full disk, a read-only one), damaged checkpoints (a flipped
bit), clobbering."""

import errno
import json
import math
import multiprocessing
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
import torch
import yaml
from helpers import ROOT, SMALL, make_cfg, read_metrics, strict_json, train_losses, wait_for_training

from model import GPT
from training import checkpoint as ckpt
from training import distributed, launch
from training.checkpoint import CheckpointError, WriteError, load_checkpoint, save_checkpoint
from training.config import Distributed
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
        if not (run / "checkpoints" / "last.pt").exists():  # killed before its first checkpoint was published
            assert steps_seen == 0, "a published checkpoint disappeared"
            continue  # nothing to lose yet: the next attempt starts afresh
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


class FullDisk:
    """A file on a disk that is full after `room` more bytes: a write past them fails with ENOSPC."""

    def __init__(self, f: typing.IO[bytes], room: int) -> None:
        self.f, self.room = f, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def fill_the_disk(monkeypatch: pytest.MonkeyPatch, after_saves: int = 0) -> None:
    """torch.save writes onto a FullDisk after that many saves (its zip writer then raises a RuntimeError of its own
    over the OSError, as on a real full disk)."""
    save, saves = torch.save, [0]

    def saving(obj, f, *args, **kwargs):
        saves[0] += 1
        return save(obj, FullDisk(f, 1000) if saves[0] > after_saves else f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", saving)


def test_a_failed_checkpoint_write_leaves_the_previous_one_and_names_it_and_the_free_space(tmp_path, monkeypatch):
    path = tmp_path / "checkpoints" / "last.pt"
    save_checkpoint({"step": 1}, path)
    before = path.read_bytes()

    fill_the_disk(monkeypatch)
    with pytest.raises(WriteError) as full:
        save_checkpoint({"step": 2, "w": torch.zeros(1024)}, path)
    monkeypatch.undo()
    assert re.fullmatch(rf"could not write the checkpoint {re.escape(str(path))}: No space left on device \([\d.]+ "
                        r"\w+ free on its filesystem; the checkpoint needs about 4.0 KiB\); the previous checkpoint "
                        rf"{re.escape(str(path))} is intact", str(full.value))

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(ckpt.os, "open", read_only)  # creating the temporary file fails
    with pytest.raises(WriteError, match=f"{re.escape(str(path))}: Read-only file system; the previous checkpoint"):
        save_checkpoint({"step": 3}, path)
    with pytest.raises(WriteError, match="there was no checkpoint .*best.pt before"):
        save_checkpoint({"step": 3}, path.parent / "best.pt")
    monkeypatch.undo()
    assert path.read_bytes() == before and [p.name for p in path.parent.iterdir()] == ["last.pt"]
    assert launch.is_user_error(full.value)


def test_a_full_disk_ends_the_run_with_one_error_line_and_the_previous_checkpoint_loads(tmp_path, monkeypatch,
                                                                                        capsys):
    fill_the_disk(monkeypatch, after_saves=2)  # the checkpoints of step 2 (best.pt, last.pt) are written
    run = tmp_path / "run"
    (run / "summary.json").mkdir(parents=True)  # the logger's last write on the way out fails too
    with pytest.raises(WriteError) as error:
        train(make_cfg(tmp_path, "train.max_steps=4", "train.eval_interval=2", "wandb.mode=disabled"), run,
              root=tmp_path)
    monkeypatch.undo()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        launch.fail(error.value, status=1)  # train.py's way out of a failed run
    err = capsys.readouterr().err
    assert exit.value.code == 1 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert re.fullmatch(r"error: could not write the checkpoint .*: No space left on device \(.* free on its "
                        r"filesystem; the checkpoint needs about .*\); the previous checkpoint .* is intact\n", err)
    assert load_checkpoint(run)["step"] == 2 and not list((run / "checkpoints").glob(".*"))  # no temporary file


def test_disk_errors_elsewhere_are_one_error_line_naming_the_file_and_the_fix(capsys):
    with pytest.raises(SystemExit) as exit:
        launch.fail(OSError(errno.EROFS, "Read-only file system", "/runs/a/metrics.jsonl"), status=1)
    assert exit.value.code == 1
    assert capsys.readouterr().err == ("error: Read-only file system: /runs/a/metrics.jsonl: make its filesystem "
                                       "writable, or use another directory (hydra.run.dir, data.cache_dir)\n")
    assert not launch.is_user_error(OSError(errno.EIO, "Input/output error"))  # not the user's to fix: a traceback


def flip_a_bit(path: Path, tensor: torch.Tensor) -> None:
    """Flip one bit in the middle of the tensor's bytes in the file that holds them."""
    data = bytearray(path.read_bytes())
    at = data.find(tensor.numpy().tobytes())
    assert at >= 0
    data[at + tensor.nbytes // 2] ^= 0x04
    path.write_bytes(data)


def test_a_flipped_bit_in_a_checkpoint_is_refused_on_resume_and_init_from_naming_the_other_checkpoint(tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    train(make_cfg(tmp_path, "train.max_steps=2", "train.eval_interval=2", "wandb.mode=disabled"), tmp_path / "run",
          root=tmp_path)
    last = checkpoints / "last.pt"
    moment = next(iter(load_checkpoint(last)["optimizer"]["state"].values()))["exp_avg"]
    flip_a_bit(last, moment)
    assert load_checkpoint(last, verify=False)["step"] == 2  # torch.load notices nothing
    damaged = rf"{re.escape(str(last))} is damaged: .*/data/\d+ failed the check against the CRC32 checksums .*; use " \
              rf"another checkpoint \(train.resume=... or init_from=...\): {re.escape(str(checkpoints / 'best.pt'))}$"
    for key in (f"train.resume={last}", f"init_from={last}"):
        with pytest.raises(CheckpointError, match=damaged):
            train(make_cfg(tmp_path, key, "wandb.mode=disabled"), tmp_path / "new", root=tmp_path)
    assert not (tmp_path / "new" / "checkpoints").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: no process group
def test_a_sharded_checkpoint_records_its_shards_crc32s_refuses_a_flipped_bit_and_survives_a_full_disk(tmp_path,
                                                                                                       monkeypatch):
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    ctx, path = distributed.Context(Distributed.none, torch.device("cpu")), tmp_path / "checkpoints" / "last.dcp"
    state = {"scheduler": {}, "step": 1, "rng": {}, "loader": {}, "config": {}, "best_val_loss": 1.0}
    distributed.save_sharded(ctx, model, optimizer, state, path)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(distributed.dcp.filesystem, "_write_item", disk_full)
    with pytest.raises(WriteError, match=r"No space left on device .*; the previous checkpoint .*last.dcp is intact"):
        distributed.save_sharded(ctx, model, optimizer, {**state, "step": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1 and len(list(path.parent.iterdir())) == 2  # the link and its directory

    shard = path / "__0_0.distcp"
    flip_a_bit(shard, optimizer.state[model.weight]["exp_avg"])
    for load in (lambda: load_checkpoint(path), lambda: distributed.load_sharded(model, optimizer, path)):
        with pytest.raises(CheckpointError, match=r"last.dcp is damaged: __0_0.distcp failed the check"):
            load()


def test_bench_checkpoint_reports_save_and_load_times_with_and_without_verification_as_json(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_checkpoint

    out = tmp_path / "results.json"
    bench_checkpoint.main(["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--vocab-size", "32", "--block-size",
                           "8", "--repeats", "1", "--device", "cpu", "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["n_params"] > 0 and results["file_bytes"] > 0 and results["save_s"] > 0
    for key in ("load_s", "load_verified_s", "verify_s", "verify_gb_per_s"):
        assert set(results[key]) == {"warm", "cold"} and all(v > 0 for v in results[key].values())
    assert results["meta"]["n_layer"] == 1 and list(tmp_path.iterdir()) == [out]  # the checkpoint is deleted


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
