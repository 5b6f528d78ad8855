"""The training loop on CPU: config validation, loss goes down, metrics reach wandb, the step's loss as the mean over
its trained tokens, checkpoints and exact resume, resume with changed hyperparameters, metrics.jsonl and wandb across
a resume, the clip and the skippable optimizer step (training/optim.py)."""

import gc
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import ROOT, SMALL, make_cfg, read_metrics, strict_json, train_losses
from hydra.errors import ConfigCompositionException, MissingConfigException

from data import Batch
from model.loss import IGNORE_INDEX
from training import distributed
from training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from training.config import Distributed
from training.loop import Run, ScheduledGC, build, evaluate, plan, train, train_step
from training.metrics import (
    PEAK_RSS,
    TRAIN_LOSS,
    TRAINED_TOKENS_PER_SEC,
    VAL_LOSS,
    Throughput,
    flops_per_token,
    peak_flops,
)
from training.optim import apply_step, clip_gradients, lr_multiplier


@pytest.mark.parametrize(
    "override, key",
    [("train.batch_sise=8", "batch_sise"), ("train.device=gpu", "train.device"), ("model.n_layer=four", "n_layer"),
     ("wandb.mode=sometimes", "wandb.mode")],
)
def test_unknown_keys_and_bad_values_fail_at_composition_naming_the_key(tmp_path, override, key):
    with pytest.raises(ConfigCompositionException) as e:
        make_cfg(tmp_path, override)
    assert key in str(e.value) + str(e.value.__cause__)


def test_unknown_attention_preset_lists_the_choices(tmp_path):
    with pytest.raises(MissingConfigException, match="naive"):
        make_cfg(tmp_path, "attention=flashy")


@pytest.mark.parametrize(
    "overrides, message",
    [(["train.max_steps=0"], "train.max_steps"), (["train.learning_rate=-1"], "train.learning_rate"),
     (["attention.name=flashy"], r"attention.name='flashy': choose one of naive, sdpa, triton"),
     (["attention.sdpa_backend=fast"], r"attention.sdpa_backend='fast': choose one of auto, flash"),
     (["attention=naive", "attention.sdpa_backend=math"], "only applies to attention=sdpa"),
     (["train.dtype=bf17"], r"train.dtype='bf17': choose one of auto, bf16, fp16, fp32"),
     (["model.n_embd=31"], "model.n_embd"), (["model.block_size=10000000"], "model.block_size")],
)
def test_invalid_values_fail_before_training_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        train(make_cfg(tmp_path, *overrides), tmp_path / "run", root=tmp_path)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_few_steps_lower_the_loss_and_log_every_metric(tmp_path):
    run = tmp_path / "run"
    cfg = make_cfg(tmp_path, "train.max_steps=40", "train.log_interval=5", "train.eval_interval=20",
                   "train.learning_rate=3e-3", "train.perf_warmup_steps=2")
    summary = train(cfg, run, root=tmp_path)
    losses = train_losses(run)
    assert losses[40] < losses[5] - 0.5, losses
    assert summary["best/val_loss"] < math.log(257)
    assert summary["attention"] == "sdpa" and summary["sdpa_kernel"] == "flash"  # CPU flash kernel
    logged = {k for m in read_metrics(run) for k in m}
    assert {TRAIN_LOSS, VAL_LOSS, "train/lr", "perf/tokens_per_sec", TRAINED_TOKENS_PER_SEC, PEAK_RSS} <= logged
    # text: every target is trained on, so both rates are one number
    rates = [(m[TRAINED_TOKENS_PER_SEC], m["perf/tokens_per_sec"]) for m in read_metrics(run)
             if TRAINED_TOKENS_PER_SEC in m]
    assert rates and all(trained == every for trained, every in rates)
    assert (run / "checkpoints" / "last.pt").is_file() and (run / "checkpoints" / "best.pt").is_file()
    assert json.loads((run / "summary.json").read_text())["sdpa_kernel"] == "flash"

    # The offline wandb run holds the same metric names and the summary.
    (wandb_file,) = run.glob("wandb/offline-run-*/run-*.wandb")
    history_keys, summary_keys = set(), set()
    for record in finished_wandb_records(wandb_file):
        if record.WhichOneof("record_type") == "history":
            history_keys |= {item.key or "/".join(item.nested_key) for item in record.history.item}
        elif record.WhichOneof("record_type") == "summary":
            summary_keys |= {item.key or "/".join(item.nested_key) for item in record.summary.update}
    assert {TRAIN_LOSS, VAL_LOSS, "train/lr", "perf/tokens_per_sec", PEAK_RSS} <= history_keys
    assert {"attention", "sdpa_kernel"} <= summary_keys


def finished_wandb_records(path: Path, timeout: float = 60) -> list:
    """The records of an offline run file once wandb has finished writing it: its service process writes the file on
    its own schedule, and can still be at it after wandb.finish() has returned (seen: a 7-byte file, header only)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = list(wandb_records(path))
            if any(r.WhichOneof("record_type") == "exit" for r in records):  # the last record wandb writes
                return records
        except Exception:  # a record cut short by the writer
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout} s"
        time.sleep(0.1)


def wandb_records(path: Path) -> Iterator:
    """The protobuf records of an offline run file (.wandb: a LevelDB-style log of 32 KiB blocks after a 7-byte
    header; each chunk has a 7-byte header: crc32 (4), length (2, little endian), type (1: full, 2-4: first/middle/
    last piece of a record))."""
    from wandb.proto import wandb_internal_pb2

    raw, pos, pending = path.read_bytes(), 7, b""
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(raw[pos + 4 : pos + 6], "little"), raw[pos + 6]
        pending += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def built_run(tmp_path: Path, name: str, *overrides: str) -> Run:
    """The loop's objects for a CPU run (training/loop.py: build), as train() makes them."""
    cfg = make_cfg(tmp_path, "wandb.mode=disabled", "train.device=cpu", *overrides)
    ctx = distributed.Context(Distributed.none, torch.device("cpu"))
    return build(cfg, tmp_path / name, ctx, torch.float32, plan(cfg, tmp_path / name, tmp_path, ctx))


def fixed_batches(n: int, batch_size: int, ignored: float, seed: int = 0) -> list[Batch]:
    """n micro-batches of (batch_size, 32) random tokens, a fraction `ignored` of the targets IGNORE_INDEX (each
    micro-batch keeps a different number: the micro-batches' token counts differ)."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(n):
        x = torch.randint(0, 257, (batch_size, 32), generator=g)
        y = torch.randint(0, 257, (batch_size, 32), generator=g)
        y[torch.rand(y.shape, generator=g) < ignored * (i + 1) / n] = IGNORE_INDEX
        batches.append(Batch(x, y))
    return batches


def feed(run: Run, batches: list[Batch]) -> None:
    stream = iter(batches)
    run.loader.next_batch = lambda: next(stream)


def test_a_step_where_every_token_counts_computes_the_floats_of_a_mean_of_micro_batch_means(tmp_path):
    batches = fixed_batches(3, 4, ignored=0.0)
    run = built_run(tmp_path, "a", "train.grad_accum_steps=3", "train.grad_clip=0")
    reference = built_run(tmp_path, "b", "train.grad_clip=0")
    feed(run, batches)
    loss, _ = train_step(run)
    # The loop before token-normalisation: backward of each micro-batch's mean / grad_accum_steps.
    total = torch.zeros(())
    for batch in batches:
        _, mean = reference.model(batch.x, batch.y, return_logits=False)
        (mean / 3).backward()
        total += mean.detach()
    assert torch.equal(loss, total / 3)
    reference.optimizer.step()
    for ours, theirs in zip(run.model.parameters(), reference.model.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_grad_accumulation_of_masked_micro_batches_equals_one_batch_of_them_all(tmp_path):
    """The step's loss is the mean over all its trained tokens: 3 micro-batches of 2 sequences, each with a different
    number of ignored targets, train as one batch of 6 (a mean of per-micro-batch means would weight them alike)."""
    batches = fixed_batches(3, 2, ignored=0.6)
    run = built_run(tmp_path, "a", "train.grad_accum_steps=3", "train.batch_size=2")
    whole = built_run(tmp_path, "b", "train.batch_size=6")
    feed(run, batches)
    feed(whole, [Batch(torch.cat([b.x for b in batches]), torch.cat([b.y for b in batches]))])
    loss, whole_loss = train_step(run)[0], train_step(whole)[0]
    counts = [int((b.y != IGNORE_INDEX).sum()) for b in batches]
    assert len(set(counts)) == 3 and torch.allclose(loss, whole_loss, rtol=1e-6, atol=0)
    for ours, theirs in zip(run.model.parameters(), whole.model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_val_loss_is_the_mean_over_the_trained_tokens_of_all_eval_batches(tmp_path):
    run = built_run(tmp_path, "a")
    batches = fixed_batches(2, 4, ignored=0.5)
    run.loader.eval_batches = lambda split, n: iter(batches)
    evaluate(run, 1)
    with torch.no_grad():  # every row of the padded vocabulary, as the model's loss has them
        logits = [run.model.lm_head(run.model.hidden_states(b.x)) for b in batches]
    losses = [torch.nn.functional.cross_entropy(lg.flatten(0, 1), b.y.flatten(), ignore_index=IGNORE_INDEX,
                                                reduction="sum") for lg, b in zip(logits, batches, strict=True)]
    expected = sum(losses) / sum(int((b.y != IGNORE_INDEX).sum()) for b in batches)
    assert run.val_loss == pytest.approx(expected.item(), rel=1e-6)


def test_model_attention_is_set_by_the_attention_group_not_directly(tmp_path):
    from training.config import validate

    validate(make_cfg(tmp_path, "attention=naive"))  # the group sets model.attention too
    with pytest.raises(ValueError, match="use attention=<name>"):
        validate(make_cfg(tmp_path, "model.attention=naive"))


@pytest.mark.parametrize("attention", ["sdpa", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"))])
def test_resume_continues_exactly(tmp_path, attention):
    # 10 steps + 10 resumed steps give the losses of 20 uninterrupted steps (CPU, fp32, dropout on: RNG restored;
    # attention=triton draws its dropout seeds from the same generator).
    common = ["train.log_interval=1", "train.eval_interval=5", "train.lr_decay_steps=20", "model.dropout=0.1",
              "train.dtype=fp32", f"attention={attention}"]
    full = train_losses_after(tmp_path, "full", *common, "train.max_steps=20")
    train_losses_after(tmp_path, "first", *common, "train.max_steps=10")
    resumed = train_losses_after(tmp_path, "second", *common, "train.max_steps=20",
                                 f"train.resume={tmp_path / 'first'}")
    assert sorted(resumed) == list(range(11, 21))
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)


def train_losses_after(tmp_path: Path, name: str, *overrides: str) -> dict[int, float]:
    train(make_cfg(tmp_path, *overrides), tmp_path / name, root=tmp_path)
    return train_losses(tmp_path / name)


def test_activation_checkpointing_recomputes_blocks_and_keeps_the_losses_of_a_run(tmp_path, monkeypatch):
    """train.activation_checkpointing reaches the model: blocks run under torch.utils.checkpoint (3 steps × 3 or 1 of
    the 3 blocks), with the same losses, bit for bit, dropout on."""
    import model.gpt

    calls = []
    original = model.gpt.checkpoint
    monkeypatch.setattr(model.gpt, "checkpoint", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    common = ["train.max_steps=3", "train.log_interval=1", "train.dtype=fp32", "model.dropout=0.1",
              "model.n_layer=3", "train.eval_interval=100", "wandb.mode=disabled"]
    reference = train_losses_after(tmp_path, "none", *common)
    assert not calls
    for mode, blocks in (("selective", 1), ("full", 3)):
        calls.clear()
        assert train_losses_after(tmp_path, mode, *common, f"train.activation_checkpointing={mode}") == reference
        assert len(calls) == 3 * blocks, mode


def test_resume_runs_the_configs_lr_schedule_betas_and_weight_decay_and_keeps_the_adam_state(tmp_path, capsys):
    common = ["train.log_interval=1", "train.eval_interval=5", "train.dtype=fp32"]
    train(make_cfg(tmp_path, *common, "train.max_steps=10", "train.lr_decay_steps=20"), tmp_path / "a", root=tmp_path)
    changed = ["train.learning_rate=1e-4", "train.weight_decay=0.01", "train.beta1=0.8", "train.beta2=0.9",
               "train.warmup_steps=12", "train.lr_decay_steps=30", "train.min_lr_ratio=0.5"]
    cfg = make_cfg(tmp_path, *common, *changed, "train.max_steps=14", f"train.resume={tmp_path / 'a'}")
    capsys.readouterr()
    train(cfg, tmp_path / "b", root=tmp_path)

    # Every resumed step, the first one included, runs this config's schedule: still warming up to 1e-4.
    lrs = {m["step"]: m["train/lr"] for m in read_metrics(tmp_path / "b") if "train/lr" in m}
    assert sorted(lrs) == [11, 12, 13, 14]
    assert all(lrs[s] == pytest.approx(1e-4 * lr_multiplier(s - 1, cfg.train), rel=1e-12) for s in lrs), lrs
    optimizer = load_checkpoint(tmp_path / "b")["optimizer"]
    for group, decay in zip(optimizer["param_groups"], (0.01, 0.0), strict=True):
        assert group["weight_decay"] == decay and tuple(group["betas"]) == (0.8, 0.9) and group["initial_lr"] == 1e-4
    assert all(state["step"] == 14 for state in optimizer["state"].values())  # AdamW's state continued, not reset
    (note,) = [line for line in capsys.readouterr().out.replace("\r", "\n").splitlines() if "resuming" in line]
    assert note.startswith(f"resuming {tmp_path / 'a' / 'checkpoints' / 'last.pt'} (step 10) with ")
    assert "train.learning_rate 0.001 -> 0.0001, " in note and "train.weight_decay 0.1 -> 0.01, " in note
    assert "train.min_lr_ratio 0.1 -> 0.5" in note and "train.resume" not in note


def test_resume_in_its_own_run_dir_logs_each_step_once_and_continues_the_wandb_run(tmp_path):
    # A run checkpointed at step 3 logs steps 4-6, then is "killed" before its next checkpoint: last.pt goes back
    # to the step-3 one. Resuming it in place replaces the lines of steps 4-6 instead of adding a second copy.
    run, common = tmp_path / "run", ["train.log_interval=1", "train.eval_interval=3", "train.lr_decay_steps=6"]
    train(make_cfg(tmp_path, *common, "train.max_steps=3"), run, root=tmp_path)
    shutil.copy(run / "checkpoints" / "last.pt", tmp_path / "step3.pt")
    train(make_cfg(tmp_path, *common, "train.max_steps=6", "train.resume=auto"), run, root=tmp_path)
    killed = train_losses(run)
    shutil.copy(tmp_path / "step3.pt", run / "checkpoints" / "last.pt")
    train(make_cfg(tmp_path, *common, "train.max_steps=6", "train.resume=auto"), run, root=tmp_path)

    records = [strict_json(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lines = [(r["step"], tuple(sorted(r))) for r in records]
    assert len(lines) == len(set(lines)), lines  # no step logged twice with the same keys
    assert train_losses(run) == killed and sorted(killed) == [1, 2, 3, 4, 5, 6]  # exact resume: the same losses

    # Three segments, one wandb run: each offline folder carries the checkpoint's run id, the later two marked as
    # resuming it (`wandb sync` appends them to that run).
    runs = sorted((next(r.run for r in finished_wandb_records(f) if r.WhichOneof("record_type") == "run")
                   for f in run.glob("wandb/offline-run-*/run-*.wandb")), key=lambda r: r.start_time.ToMicroseconds())
    assert len(runs) == 3 and {r.run_id for r in runs} == {load_checkpoint(run)["wandb_id"]}
    assert [r.resume for r in runs] == [False, True, True]


def test_resume_at_max_steps_trains_nothing_past_it_or_with_another_seed_is_refused_and_summaries_tell_apart(
        tmp_path, capsys):
    run, common = tmp_path / "run", ["train.eval_interval=2", "train.log_interval=1", "wandb.mode=disabled"]
    first = train(make_cfg(tmp_path, *common, "train.max_steps=2", "train.resume=auto"), run, root=tmp_path)
    assert f"train.resume=auto found no checkpoint in {run}: starting afresh" in capsys.readouterr().out
    records = {name: (run / name).read_bytes() for name in ("summary.json", "metrics.jsonl", "checkpoints/last.pt")}

    # At train.max_steps already: the run is complete, nothing is written, and its summary is the one it wrote.
    again = train(make_cfg(tmp_path, *common, "train.max_steps=2", "train.resume=auto"), run, root=tmp_path)
    assert "is at step 2 = train.max_steps: the run is complete" in capsys.readouterr().out
    assert again == strict_json(records["summary.json"].decode()) and again["steps"] == 2
    assert {name: (run / name).read_bytes() for name in records} == records
    with pytest.raises(CheckpointError, match=r"\(step 2\) up to train.max_steps=1: .* above 2 to train on"):
        train(make_cfg(tmp_path, *common, "train.max_steps=1", "train.resume=auto"), run, root=tmp_path)
    with pytest.raises(CheckpointError, match="train.seed: checkpoint 1337 vs run 7"):
        train(make_cfg(tmp_path, *common, "train.max_steps=3", "train.resume=auto", "train.seed=7"), run, root=tmp_path)

    # Resumed, the summary names the run's first loss (step 1's) and this launch's (step 3's) apart.
    resumed = train(make_cfg(tmp_path, *common, "train.max_steps=3", "train.resume=auto"), run, root=tmp_path)
    losses = train_losses(run)
    assert (resumed["first/train_loss"], resumed["resumed/first_train_loss"]) == (losses[1], losses[3])
    assert first["first/train_loss"] == losses[1] and "resumed/first_train_loss" not in first and resumed["steps"] == 3


def test_train_epochs_sets_max_steps_to_the_steps_that_read_the_train_data_that_often(tmp_path):
    cfg = make_cfg(tmp_path, "train.epochs=3", "train.grad_accum_steps=2", "wandb.mode=disabled")
    p = plan(cfg, tmp_path / "run", tmp_path, distributed.Context(Distributed.none, torch.device("cpu")))
    batches = math.ceil(len(p.loader.splits["train"]) / (cfg.train.batch_size * cfg.model.block_size))  # an epoch's
    assert p.loader.epoch_batches() == batches and cfg.train.max_steps == math.ceil(3 * batches / 2)


def test_checkpoints_are_written_with_the_umask_mode(tmp_path):
    previous = os.umask(0o027)
    try:
        save_checkpoint({"step": 1}, tmp_path / "a.pt")
        os.umask(0o002)
        save_checkpoint({"step": 1}, tmp_path / "b.pt")
    finally:
        os.umask(previous)
    assert (tmp_path / "a.pt").stat().st_mode & 0o777 == 0o640  # a team (group) can read it, as any new file
    assert (tmp_path / "b.pt").stat().st_mode & 0o777 == 0o664


def test_checkpoints_are_plain_and_validated(tmp_path):
    run = tmp_path / "run"
    train(make_cfg(tmp_path, "train.max_steps=2"), run, root=tmp_path)
    state = load_checkpoint(run)  # a run directory means its checkpoints/last.pt; loaded with weights_only=True
    assert state["step"] == 2 and not any(k.startswith("_orig_mod.") for k in state["model"])
    assert not list((run / "checkpoints").glob("*.tmp"))

    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(tmp_path / "garbage.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a"):
        load_checkpoint(tmp_path / "foreign.pt")
    torch.save({k: v for k, v in state.items() if k != "optimizer"}, tmp_path / "incomplete.pt")
    with pytest.raises(CheckpointError, match="incomplete.pt lacks optimizer: it is not a complete"):
        load_checkpoint(tmp_path / "incomplete.pt")
    with pytest.raises(CheckpointError, match="model.n_layer: checkpoint 2 vs run 3"):
        train(make_cfg(tmp_path, "model.n_layer=3", f"train.resume={run}"), tmp_path / "other", root=tmp_path)


def test_checkpoint_write_is_atomic(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint({"step": 1}, path)

    class Boom:
        def __reduce__(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint({"step": 2, "bad": Boom()}, path)
    assert torch.load(path, weights_only=True)["step"] == 1  # the previous checkpoint is intact
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_sharded_checkpoint_is_published_atomically_and_a_failed_write_leaves_the_previous(tmp_path, monkeypatch):
    """training/distributed.py: save_sharded, in one process: <name>.dcp is a symlink switched by a rename to the
    complete new directory; a write that fails leaves the previous checkpoint, and the next save clears its debris."""
    import torch.distributed.checkpoint as dcp

    from model import GPT, GPTConfig
    from training.checkpoint import FORMAT, REQUIRED_KEYS
    from training.resume import is_sharded

    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=11))
    optimizer = torch.optim.AdamW(model.parameters())
    ctx = distributed.Context(Distributed.none, torch.device("cpu"))
    extras = {k: 0 for k in REQUIRED_KEYS - {"format", "model", "optimizer", "step"}}
    path = tmp_path / "last.dcp"
    distributed.save_sharded(ctx, model, optimizer, {**extras, "step": 1}, path)
    first = path.resolve()
    assert path.is_symlink() and is_sharded(path) and load_checkpoint(path)["format"] == FORMAT
    with torch.no_grad():
        model.transformer.wte.weight.add_(1.0)
    real_save = dcp.save

    def torn_save(state, checkpoint_id, **kw):
        real_save(state, checkpoint_id=checkpoint_id, **kw)
        raise OSError("disk full")  # the shards are written, the checkpoint is not complete

    monkeypatch.setattr(dcp, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        distributed.save_sharded(ctx, model, optimizer, {**extras, "step": 2}, path)
    assert path.resolve() == first and load_checkpoint(path)["step"] == 1
    monkeypatch.setattr(dcp, "save", real_save)
    distributed.save_sharded(ctx, model, optimizer, {**extras, "step": 3}, path)
    state = load_checkpoint(path)
    assert state["step"] == 3 and torch.equal(state["model"]["transformer.wte.weight"], model.transformer.wte.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["last.dcp", path.resolve().name])  # debris gone
    assert not first.exists()


def test_init_from_our_checkpoint_trains_with_this_runs_attention(tmp_path):
    train(make_cfg(tmp_path, "train.max_steps=2"), tmp_path / "a", root=tmp_path)
    ckpt = tmp_path / "a" / "checkpoints" / "last.pt"
    summary = train(make_cfg(tmp_path, "train.max_steps=1", f"init_from={ckpt}", "attention=naive"), tmp_path / "b",
                    root=tmp_path)
    assert summary["attention"] == "naive"


def test_init_from_a_sharded_checkpoint_starts_from_the_weights_of_its_pt_form(tmp_path):
    from model import GPT, GPTConfig
    from training.optim import build_optimizer

    cfg = make_cfg(tmp_path, "train.max_steps=2")
    train(cfg, tmp_path / "a", root=tmp_path)
    state = load_checkpoint(tmp_path / "a")
    model = GPT(GPTConfig(**state["model_config"]))
    model.load_state_dict(state["model"])
    rest = {k: v for k, v in state.items() if k not in ("format", "model", "optimizer")}
    ctx = distributed.Context(Distributed.none, torch.device("cpu"))
    distributed.save_sharded(ctx, model, build_optimizer(model, cfg.train, "cpu"), rest, tmp_path / "a.dcp")
    first = [train(make_cfg(tmp_path, "train.max_steps=1", f"init_from={source}"), tmp_path / name,
                   root=tmp_path)["first/train_loss"] for source, name in ((tmp_path / "a.dcp", "b"),
                                                                            (tmp_path / "a" / "checkpoints" / "last.pt",
                                                                             "c"))]
    assert first[0] == first[1]


def test_scheduled_gc_turns_automatic_collection_off_collecting_young_every_interval_and_all_on_request(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation))
    with ScheduledGC(3) as collector:
        assert not gc.isenabled()
        for step in range(7):
            collector.step(step)
        collector.full()
    assert gc.isenabled() and calls == [2, 1, 1, 1, 2]  # on entry; steps 0, 3, 6; the eval point's
    calls.clear()
    with ScheduledGC(0) as collector:  # Python's automatic collection, untouched
        assert gc.isenabled()
        collector.step(0)
        collector.full()
    assert gc.isenabled() and calls == []


def test_a_run_with_gc_interval_trains_with_automatic_collection_off_and_restores_it(tmp_path, monkeypatch):
    enabled = []
    step = train_step
    monkeypatch.setattr("training.loop.train_step", lambda r: (enabled.append(gc.isenabled()), step(r))[1])
    train(make_cfg(tmp_path, "train.max_steps=3", "train.gc_interval=2"), tmp_path / "run", root=tmp_path)
    assert enabled == [False] * 3 and gc.isenabled()


@pytest.mark.parametrize("threads", [False, True])
def test_the_steps_run_with_the_configured_autograd_multithreading_and_restore_it(tmp_path, monkeypatch, threads):
    seen = []
    step = train_step
    monkeypatch.setattr("training.loop.train_step",
                        lambda r: (seen.append(torch._C._is_multithreading_enabled()), step(r))[1])
    train(make_cfg(tmp_path, "train.max_steps=2", f"train.autograd_multithreading={threads}"), tmp_path / "run",
          root=tmp_path)
    assert seen == [threads] * 2 and torch._C._is_multithreading_enabled()


def test_lr_schedule_warmup_then_cosine(tmp_path):
    t = make_cfg(tmp_path, "train.warmup_steps=10", "train.max_steps=110", "train.min_lr_ratio=0.1").train
    assert lr_multiplier(0, t) == pytest.approx(0.1) and lr_multiplier(9, t) == pytest.approx(1.0)
    assert lr_multiplier(60, t) == pytest.approx(0.55)
    assert lr_multiplier(110, t) == pytest.approx(0.1) and lr_multiplier(500, t) == pytest.approx(0.1)


@pytest.mark.parametrize("max_norm", [0.05, 1e6, 0.0])  # clipping active, inactive, disabled
def test_clip_folded_into_fused_adamw_equals_clip_grad_norm(max_norm):
    """fold=True hands the clip to fused AdamW as grad_scale; the parameters must follow clip_grad_norm_'s."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in models]
    # clip_grad_norm_, folded into the optimizer, and (for contrast) not clipped at all
    for _ in range(3):
        norms = []
        for model, opt, (clip, fold) in zip(models, opts, ((max_norm, False), (max_norm, True), (0.0, False)),
                                            strict=True):
            (model(x) ** 2).sum().mul(10).backward()
            norms.append(clip_gradients(opt, list(model.parameters()), clip, fold=fold))
            apply_step(opt, torch.amp.GradScaler("cpu", enabled=False), skip=torch.tensor(False))
            opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(norms[0], norms[1])
    reference, folded, unclipped = (list(m.parameters()) for m in models)
    for a, b in zip(reference, folded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    differs = any(not torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(reference, unclipped, strict=True))
    assert differs == (max_norm == 0.05)  # the clip really acted when the norm exceeded it


@pytest.mark.parametrize("fused", [False, True])  # False: skip is read on the host; True: fused AdamW's found_inf
@pytest.mark.parametrize("skip", [False, True])
def test_apply_step_updates_the_parameters_unless_skipped(fused, skip):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    model(torch.randn(3, 4)).sum().backward()
    clip_gradients(optimizer, list(model.parameters()), 0.01, fold=fused)  # fused: the clip rides along as grad_scale
    before = [p.detach().clone() for p in model.parameters()]
    apply_step(optimizer, torch.amp.GradScaler("cpu", enabled=False), skip=torch.tensor(skip))
    updated = [not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)]
    assert updated == [not skip] * 2
    assert not {"found_inf", "grad_scale"} & optimizer.__dict__.keys()  # nothing left for the next step to apply


def test_peak_flops_table_and_flops_per_token():
    assert peak_flops("NVIDIA H200", torch.bfloat16) == 989e12
    assert peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 156e12
    assert peak_flops("Some Future GPU", torch.bfloat16) is None
    assert flops_per_token(1000, 2, 4, 8, 16) == 6 * 1000 + 12 * 2 * 4 * 8 * 16


def test_throughput_counts_only_after_start():
    meter = Throughput(torch.device("cpu"), tokens_per_step=100)
    meter.count()
    assert meter.rate() is None  # still warming up
    meter.start()
    meter.count()
    meter.count()
    assert meter.rate() > 0 and meter.rate() is None  # the window restarts at each reading


def run_cli(tmp_path: Path, *args: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    command = [sys.executable, "train.py", *flags, *SMALL, f"data.cache_dir={tmp_path / 'cache'}", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_cli_run_writes_its_run_dir_and_multirun_one_run_per_backend(tmp_path):
    single = run_cli(tmp_path, "train.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert single.returncode == 0, single.stderr
    run = tmp_path / "run"
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "checkpoints" / "last.pt").is_file()
    assert list(run.glob("wandb/offline-run-*"))

    multi = run_cli(tmp_path, "attention=naive,sdpa", "train.max_steps=2", f"hydra.sweep.dir={tmp_path / 'm'}",
                    flags=("-m",))
    assert multi.returncode == 0, multi.stderr
    attentions = sorted(json.loads(p.read_text())["attention"] for p in (tmp_path / "m").glob("*/summary.json"))
    assert attentions == ["naive", "sdpa"]


def test_cli_rejects_a_typo_before_any_work(tmp_path):
    bad = run_cli(tmp_path, "train.max_step=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert bad.returncode != 0 and "max_step" in bad.stderr
    assert not (tmp_path / "cache").exists()
