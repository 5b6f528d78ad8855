"""train.py as a command (training/launch.py, training/rundir.py, training/resume.py, training/config.py: validate):
unique run directories locked by their run, refused launches that change nothing, overwrite that moves the earlier
records aside, every numeric key range-checked, user errors as one `error:` line with exit status 2 (refused launch)
or 1 (failed run), config mistakes reported before torch is imported, and multirun sweeps that outlive a failed
job."""

import errno
import json
import os
import re
import socket
import subprocess
import sys
import time
import typing
from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from helpers import make_cfg
from hydra import compose, initialize_config_dir

from model import GPTConfig
from model.config import LoRAConfig
from training.config import RANGES, Config, config_warnings, validate
from training.launch import LaunchCallback, is_user_error
from training.resume import resume_point
from training.rundir import LOCK, RunDirInUseError, claim, lock_run_dir, run_suffix

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "train.batch_size=4",
        "train.max_steps=2", "train.eval_batches=2", "train.warmup_steps=2", "data.max_documents=20",
        "wandb.mode=disabled", "train.device=cpu"]
HEAVY = ("torch", "datasets", "wandb")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data cache for the module's runs: the tiny stdlib data is prepared once."""
    return tmp_path_factory.mktemp("cache")


def cli(cache: Path, *args: str, flags: tuple[str, ...] = (), env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess:
    command = [sys.executable, "train.py", *flags, *TINY, f"data.cache_dir={cache}", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def a_gone_pid() -> int:
    """The PID of a process that has ended."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)


def used_run_dir(path: Path) -> Path:
    """A run directory as a finished run leaves it (the files' contents do not matter to the checks)."""
    files = {".hydra/config.yaml": "old config", ".hydra/overrides.yaml": "- old=1", "metrics.jsonl": "old\n",
             "checkpoints/last.pt": "old checkpoint", "summary.json": "{}", "wandb/offline-run/x": "old"}
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


def snapshot(path: Path) -> dict[str, tuple[bytes, int] | None]:
    """Every file (its bytes and modification time) and folder (None) under path."""
    return {str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in path.rglob("*")}


def contents(files: dict[str, tuple[bytes, int] | None]) -> dict[str, bytes]:
    return {name: entry[0] for name, entry in files.items() if entry is not None}


# --- 1. run directories: unique per launch, one live run each ---


def test_default_run_and_sweep_dirs_get_a_fresh_suffix_per_launch():
    dirs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "train.py", "--cfg", "hydra", "--resolve"], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, check=True).stdout
        hydra = yaml.safe_load(out)["hydra"]
        assert re.fullmatch(r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-[0-9a-f]{6}", hydra["run"]["dir"]), hydra["run"]
        assert re.fullmatch(r"multirun/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-[0-9a-f]{6}", hydra["sweep"]["dir"])
        dirs.append(hydra["run"]["dir"])
    assert dirs[0][-6:] != dirs[1][-6:]  # different launches, even within one second


def test_the_processes_of_one_torchrun_job_share_the_suffix(monkeypatch):
    suffix = run_suffix.__wrapped__  # uncached: as a fresh process computes it
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    ranks_of_job_1 = {suffix(), suffix()}
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")
    assert len(ranks_of_job_1) == 1 and suffix() not in ranks_of_job_1
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id: the ranks' common parent decides
    assert suffix() == suffix()


def test_a_torchrun_job_writes_one_default_run_dir(tmp_path, cache):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "train.py"), *TINY, f"data.cache_dir={cache}"]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = tmp_path.glob("outputs/*/*")  # one directory, shared by the two ranks
    assert {p.name for p in run.iterdir()} >= {".hydra", "checkpoints", "metrics.jsonl"} and not (run / LOCK).exists()
    assert "earlier run" not in proc.stderr and not list(run.glob("replaced-*"))  # no rank wrote before the claim


def test_under_torchrun_rank_0_alone_writes_hydras_files(tmp_path, monkeypatch):
    # A train.log of rank 1, made before rank 0 claims the directory, would be taken for an earlier run's record.
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        whole = compose("config", overrides=[f"hydra.run.dir={tmp_path}"], return_hydra_config=True)
    whole.hydra.runtime.output_dir = str(tmp_path)  # as Hydra sets it when the run starts
    for rank, log, subdir in (("0", str(tmp_path / f"{whole.hydra.job.name}.log"), ".hydra"), ("1", os.devnull, None)):
        monkeypatch.setenv("RANK", rank)
        assert (whole.hydra.job_logging.handlers.file.filename, whole.hydra.output_subdir) == (log, subdir)


def test_a_run_dir_locked_by_a_live_run_is_refused_and_left_untouched(tmp_path, cache):
    run = tmp_path / "run"
    lock, _ = lock_run_dir(run)
    try:
        before = snapshot(run)
        proc = cli(cache, f"hydra.run.dir={run}")
        assert proc.returncode == 2, proc.stderr
        assert f"error: {run} is in use by a live run (pid {os.getpid()} on {socket.gethostname()}" in proc.stderr
        assert snapshot(run) == before
    finally:
        lock.release()
    assert not (run / LOCK).exists()


def test_without_flock_a_lock_is_judged_by_the_pid_it_names_on_this_host(tmp_path, monkeypatch):
    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "no locks available")

    monkeypatch.setattr("training.rundir.fcntl.flock", no_flock)
    here, gone = socket.gethostname(), a_gone_pid()
    for holder, refused in (({"pid": os.getppid(), "host": here}, True), ({"pid": 1, "host": "elsewhere"}, True),
                            ({"pid": gone, "host": here}, False)):
        run = tmp_path / str(len(list(tmp_path.iterdir())))
        run.mkdir()
        (run / LOCK).write_text(json.dumps(holder))
        if refused:
            with pytest.raises(RunDirInUseError, match=f"pid {holder['pid']} on {holder['host']}"):
                lock_run_dir(run)
        else:
            lock, note = lock_run_dir(run)
            assert note.startswith(f"note: took over the lock of a run that is gone (pid {gone}")
            lock.release()


def test_only_rank_0_of_a_torchrun_job_locks_and_claims(tmp_path, monkeypatch):
    run = used_run_dir(tmp_path / "run")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):  # Hydra's whole config, as the
        whole = compose("config", overrides=[f"hydra.run.dir={run}"], return_hydra_config=True)  # callback gets it
    lock, _ = lock_run_dir(run)
    try:
        monkeypatch.setenv("RANK", "1")
        LaunchCallback().on_run_start(whole)  # the rank of a job whose rank 0 holds the lock: no refusal
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(SystemExit) as refused:
            LaunchCallback().on_run_start(whole)
        assert refused.value.code == 2
    finally:
        lock.release()


# --- 2. a used run directory: refused untouched, continued, or its records moved aside ---


def test_a_refused_launch_leaves_the_used_run_dir_byte_for_byte_untouched(tmp_path, cache):
    run = used_run_dir(tmp_path / "run")
    before = snapshot(run)
    proc = cli(cache, f"hydra.run.dir={run}")
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {run} already holds a run's checkpoints")
    assert "train.resume=auto" in proc.stderr and "train.overwrite=true" in proc.stderr
    assert snapshot(run) == before


def test_overwrite_takes_over_a_stale_lock_moves_the_earlier_records_aside_and_starts_clean_ones(tmp_path, cache):
    run = used_run_dir(tmp_path / "run")
    before = snapshot(run)
    # The lock file of a run that was killed: its process is gone (and with it the flock it held).
    gone = a_gone_pid()
    (run / LOCK).write_text(json.dumps({"pid": gone, "host": socket.gethostname(), "since": "then"}))
    proc = cli(cache, f"hydra.run.dir={run}", "train.overwrite=true")
    assert proc.returncode == 0, proc.stderr
    assert f"note: took over the lock of a run that is gone (pid {gone} on" in proc.stderr
    assert not (run / LOCK).exists()  # released at exit
    (aside,) = run.glob("replaced-*")
    assert f"moved .hydra, checkpoints, metrics.jsonl, summary.json, wandb to {aside}" in proc.stderr
    assert contents(snapshot(aside)) == contents(before)  # all of it, as it was
    assert "old" not in (run / "metrics.jsonl").read_text()
    assert "train.overwrite=true" in (run / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.parametrize(
    "files, resume, overwrite, outcome",
    [([], None, False, "kept"),
     (["checkpoints/last.pt"], None, False, "already holds a run's checkpoints"),
     (["checkpoints/last.pt"], "auto", False, "kept"),  # continues its own run
     (["checkpoints/last.pt"], "{run}", False, "kept"),
     (["checkpoints/last.pt"], "{run}/checkpoints/last.pt", False, "kept"),
     (["checkpoints/last.pt"], "{relative_run}", False, "kept"),  # the same directory, however it is written
     (["checkpoints/last.pt"], "{other}", False, "already holds a run's checkpoints"),  # another run's, into this dir
     (["checkpoints/last.pt", ".hydra/config.yaml"], None, True, "moved"),
     (["checkpoints/last.pt"], "{other}", True, "moved"),
     (["metrics.jsonl", ".hydra/config.yaml"], None, False, "moved"),  # an earlier run without checkpoints
     (["metrics.jsonl"], "auto", False, "moved"),  # auto with nothing to continue: a fresh start
     ([], "{tmp}/missing", False, "no checkpoint at"),
     (["checkpoints/best.pt", "checkpoints/last.pt"], "{run}/checkpoints/best.pt", True, "lies among the records"),
     # a sharded checkpoint (an FSDP2 run's directory) counts as one
     (["checkpoints/last.dcp/.metadata"], None, False, "already holds a run's checkpoints"),
     (["checkpoints/last.dcp/.metadata"], "auto", False, "kept"),
     (["checkpoints/last.dcp/.metadata"], "{run}", False, "kept"),
     (["checkpoints/last.dcp/.metadata"], "{run}/checkpoints/last.dcp", False, "kept"),
     # killed while writing its first last.pt: it continues from its best.pt
     (["checkpoints/best.pt", "checkpoints/.last.pt.0123456789abcdef.tmp"], "auto", False, "kept")],
)
def test_claim_continues_refuses_or_moves_aside_as_resume_and_overwrite_say(tmp_path, files, resume, overwrite,
                                                                           outcome):
    run, other = tmp_path / "run", tmp_path / "other" / "checkpoints" / "last.pt"
    for path in [run / f for f in files] + [other]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    run.mkdir(exist_ok=True)
    resume = resume and resume.format(run=run, relative_run=os.path.relpath(run), other=other.parents[1], tmp=tmp_path)
    before = snapshot(run)
    if outcome in ("kept", "moved"):
        note = claim(run, resume, overwrite)
        assert (note is None) == (outcome == "kept")
        moved = {k.split("/", 1)[1] for k in contents(snapshot(run)) if k.startswith("replaced-")}
        assert moved == (set(contents(before)) if outcome == "moved" else set())
    else:
        with pytest.raises((FileExistsError, ValueError), match=outcome):
            claim(run, resume, overwrite)
        assert snapshot(run) == before


def test_a_run_dir_resumes_from_the_newest_of_its_last_and_best_checkpoints(tmp_path):
    # An eval writes best, then last: a run killed between the two has a best newer than its last.
    last, best = tmp_path / "checkpoints" / "last.pt", tmp_path / "checkpoints" / "best.pt"
    best.parent.mkdir()
    for path in (last, best):
        path.write_text("x")
    for last_time, best_time, newest in ((1, 2, best), (2, 1, last), (1, 1, last)):  # a tie: last
        os.utime(last, ns=(last_time, last_time))
        os.utime(best, ns=(best_time, best_time))
        assert resume_point(tmp_path, "auto", False) == newest == resume_point(tmp_path, str(tmp_path), False)


def test_a_valid_but_unlikely_schedule_is_warned_of(tmp_path):
    assert config_warnings(make_cfg(tmp_path).train) == []
    (warmup,) = config_warnings(make_cfg(tmp_path, "train.warmup_steps=30", "train.max_steps=10").train)
    assert warmup.startswith("train.warmup_steps=30 > train.max_steps=10: the learning rate never reaches")
    (decay,) = config_warnings(make_cfg(tmp_path, "train.warmup_steps=30", "train.lr_decay_steps=20").train)
    assert decay.startswith("train.lr_decay_steps=20 < train.warmup_steps=30: the cosine ends before the warm-up")


def test_claim_of_a_sweep_dir_looks_at_its_job_dirs(tmp_path):
    sweep = tmp_path / "sweep"
    for name in ("0/checkpoints/last.pt", "0/.hydra/config.yaml", "1/metrics.jsonl", "multirun.yaml"):
        (sweep / name).parent.mkdir(parents=True, exist_ok=True)
        (sweep / name).write_text("x")
    with pytest.raises(FileExistsError, match="already holds a sweep's checkpoints.*hydra.sweep.dir"):
        claim(sweep, None, False, sweep=True)
    assert claim(sweep, "auto", False, sweep=True) is None
    claim(sweep, None, True, sweep=True)
    (aside,) = sweep.glob("replaced-*")
    assert sorted(p.name for p in sweep.iterdir()) == [aside.name]
    assert sorted(p.name for p in aside.iterdir()) == ["0", "1", "multirun.yaml"]


# --- 3. numeric ranges ---


@pytest.mark.parametrize(
    "override, message",
    [("model.n_head=0", "model.n_head must be >= 1, got 0"),
     ("train.grad_clip=-1", "train.grad_clip must be >= 0 (0 disables clipping), got -1.0"),
     ("train.weight_decay=-5", "train.weight_decay must be >= 0, got -5.0"),
     ("model.n_kv_head=0", "model.n_kv_head must be >= 1, got 0"),  # 0 is not null (one kv head per query head)
     ("model.vocab_size=0", "model.vocab_size must be >= 1, got 0"),
     ("train.lr_decay_steps=0", "train.lr_decay_steps must be >= 1, got 0"),
     ("model.dropout=1.0", "model.dropout must be in [0, 1), got 1.0"),
     ("train.beta2=1", "train.beta2 must be in [0, 1), got 1.0"),
     ("train.min_lr_ratio=1.5", "train.min_lr_ratio must be in [0, 1], got 1.5"),
     ("train.learning_rate=nan", "train.learning_rate must be > 0, got nan"),
     ("model.norm_eps=0", "model.norm_eps must be > 0, got 0.0"),
     ("model.loss_chunk_tokens=-1", "model.loss_chunk_tokens must be >= 0"),
     ("train.seed=-1", "train.seed must be in [0, 18446744073709551615]"),
     ("train.perf_warmup_steps=1", "train.perf_warmup_steps must be >= 2 (the first step compiles"),
     ("train.max_skipped_steps=-1", "train.max_skipped_steps must be >= 0"),
     ("data.val_fraction=1.0", "data.val_fraction must be in (0, 1)"),
     ("data.max_documents=0", "data.max_documents must be >= 1"),
     ("data.num_proc=0", "data.num_proc must be >= 1")],
)
def test_an_out_of_range_value_is_refused_naming_the_key_and_the_range(tmp_path, override, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        validate(make_cfg(tmp_path, override))


def test_every_numeric_key_of_the_schema_has_a_range():
    numeric = set()
    model_ranges = {f"model.{f.name}" for f in fields(GPTConfig) if f.metadata["range"] is not None}
    model_ranges |= {f"lora.{f.name}" for f in fields(LoRAConfig) if f.metadata.get("range") is not None}

    def walk(schema: type, prefix: str) -> None:  # nested sections too (train.fsdp)
        for name, kind in typing.get_type_hints(schema).items():
            if hasattr(kind, "__dataclass_fields__"):
                walk(kind, f"{prefix}{name}.")
            kinds = set(typing.get_args(kind)) - {type(None)} or {kind}  # Optional[int] -> {int}
            if kinds & {int, float}:
                numeric.add(f"{prefix}{name}")

    for section in fields(Config):
        if hasattr(section.type, "__dataclass_fields__"):
            walk(section.type, f"{section.name}.")
    ranged = RANGES.keys() | model_ranges  # the model's and LoRA's keys carry theirs (model/config.py)
    assert numeric - ranged == set()
    assert ranged - numeric == set()  # no stale entries
    assert not any(key.startswith("model.") for key in RANGES)  # one home for each key's range


def test_gpt_config_refuses_zero_key_value_heads_instead_of_reading_it_as_null():
    with pytest.raises(ValueError, match="model.n_kv_head must be >= 1, got 0"):
        GPTConfig(n_layer=1, n_head=2, n_embd=8, block_size=4, vocab_size=11, n_kv_head=0)


# --- 4. errors: one line for user errors, tracebacks for bugs ---


@pytest.mark.parametrize(
    "override, first_line",
    [("train.batch_sise=8", "error: Could not override 'train.batch_sise'."),
     ("attention=flashy", "error: In 'config': Could not find 'attention/flashy'"),
     ("train.grad_clip=-1", "error: train.grad_clip must be >= 0 (0 disables clipping), got -1.0"),
     ("model.n_kv_head=3", "error: model.n_kv_head=3 must divide model.n_head=2 (each key-value head serves the same "
      "number of query heads)")],  # a rule across keys
)
def test_a_config_error_is_an_error_line_and_exit_status_2_before_anything_is_written(tmp_path, cache, override,
                                                                                       first_line):
    proc = cli(cache, override, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and proc.stderr.splitlines()[0] == first_line, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_hydra_full_error_shows_the_traceback_of_a_user_error(cache):
    proc = cli(cache, "train.grad_clip=-1", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 2 and "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.rstrip().endswith("ValueError: train.grad_clip must be >= 0 (0 disables clipping), got -1.0")


@pytest.mark.parametrize(
    "raised, printed",
    [("ValueError('model.block_size=4096 is longer than the data')",
      "error: model.block_size=4096 is longer than the data\n"),
     ("RuntimeError('a bug')", "RuntimeError: a bug\n")],
)
def test_a_failed_run_prints_a_user_error_alone_and_a_bug_with_its_traceback_exit_status_1(tmp_path, raised,
                                                                                           printed):
    # train.py with a training loop whose `train` raises (imported as the real one is: after validation)
    script = ("import runpy, sys, types\n"
              f"def train(*args, **kwargs):\n    raise {raised}\n"
              "sys.modules['training.loop'] = types.SimpleNamespace(train=train)\n"
              f"sys.argv = ['train.py', 'hydra.run.dir={tmp_path / 'run'}']\n"
              "runpy.run_path('train.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.endswith(printed), proc.stderr
    bug = raised.startswith("RuntimeError")
    assert ("Traceback (most recent call last)" in proc.stderr) == bug and "Error executing job" not in proc.stderr


def test_the_projects_own_error_classes_are_user_errors_and_other_exceptions_bugs():
    from data.tokenizers import DataUnavailableError
    from model.pretrained import HubUnavailableError, PretrainedError
    from training.checkpoint import CheckpointError
    from training.faults import NonFiniteError

    for error in (CheckpointError, PretrainedError, HubUnavailableError, DataUnavailableError, NonFiniteError,
                  ValueError, FileExistsError):
        assert is_user_error(error("a message naming the fix")), error
    assert not is_user_error(RuntimeError("a bug")) and not is_user_error(KeyError("a bug"))


# --- 5. fast feedback ---


@pytest.mark.parametrize("override", ["train.batch_sise=8", "train.grad_clip=-1", "model.n_head=0"])
def test_a_config_mistake_is_reported_before_torch_datasets_or_wandb_are_imported(override):
    script = ("import atexit, runpy, sys\n"
              f"atexit.register(lambda: print('heavy:', [m for m in {HEAVY!r} if m in sys.modules]))\n"
              f"sys.argv = ['train.py', '{override}']\n"
              "runpy.run_path('train.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr
    assert "heavy: []" in proc.stdout


# --- 6. multirun ---


def test_a_failed_multirun_job_does_not_stop_the_sweep_which_then_fails_naming_it(tmp_path, cache):
    # Job 0 fails inside the loop (the model's shapes are checked as it is built), job 1 trains.
    proc = cli(cache, "model.n_embd=31,32", f"hydra.sweep.dir={tmp_path / 'm'}", flags=("-m",))
    assert proc.returncode == 1, proc.stderr
    assert "error: 1 of 2 jobs failed:\n  #0 (model.n_embd=31): model.n_embd=31 must be divisible by model.n_head=2" \
        in proc.stderr
    assert json.loads((tmp_path / "m" / "1" / "summary.json").read_text())["steps"] == 2
    assert not (tmp_path / "m" / "0" / "summary.json").exists()


@pytest.mark.parametrize("override, message", [
    ("attention.sdpa_backend=cudnn", "attention.sdpa_backend=cudnn does not apply; set attention.sdpa_backend=auto"),
    ("model.dropout=0.1", "FlexAttention, which has no attention dropout, but model.dropout=0.1"),
])
def test_packed_rows_on_sdpa_refuse_a_pinned_kernel_and_dropout_naming_the_fix(tmp_path, override, message):
    chat = ["data=chat_local", "data.data_files=[chats.jsonl]", "attention=sdpa"]
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(make_cfg(tmp_path, *chat, override))
    validate(make_cfg(tmp_path, *chat, override, "data.packing=false"))  # one example per row: fine


def test_the_ranks_of_a_torchrun_job_date_their_run_directory_alike_however_late_they_start(tmp_path):
    """Each rank's Hydra makes the directory hydra.run.dir names: under torchrun its date and time are the launching
    agent's start (the ranks' parent), not each rank's own, so a rank started a second late names the same one."""
    code = "from training.rundir import run_start; print(run_start())"
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "job", "PYTHONPATH": str(ROOT)}
    starts = []
    for _ in range(2):
        starts.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                     check=True).stdout)
        time.sleep(1.1)
    assert starts[0] == starts[1]
