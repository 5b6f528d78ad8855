"""Which SDPA kernel ran (training/metrics.py: detect_sdpa_kernel), on CPU: the kernel named from the profiler's
events, kineto's log lines kept off a training run's console, the user's KINETO_LOG_LEVEL left alone. The logger's
summary in strict JSON everywhere, and its way out of a run that failed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, strict_json

from model.attention import get_attention, naive_attention
from training.config import WandbConfig, WandbMode
from training.metrics import MetricsLogger, close_on_error, detect_sdpa_kernel, sdpa_kernel_from_names


def logger(run_dir: Path) -> MetricsLogger:
    return MetricsLogger(run_dir, {}, WandbConfig(mode=WandbMode.disabled), total_steps=3, initial_step=0)


def test_detect_sdpa_kernel_names_the_kernel_that_ran_on_cpu():
    q = torch.randn(1, 2, 8, 16)
    assert detect_sdpa_kernel(lambda: get_attention("sdpa")(q, q, q, causal=True))[1] == "flash"
    assert detect_sdpa_kernel(lambda: get_attention("sdpa", "math")(q, q, q, causal=True))[1] == "math"
    assert detect_sdpa_kernel(lambda: naive_attention(q, q, q, causal=True))[1] == "unknown"


def test_detect_sdpa_kernel_restores_the_environment_and_keeps_a_users_kineto_log_level(monkeypatch):
    q = torch.randn(1, 2, 8, 16)
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    detect_sdpa_kernel(lambda: get_attention("sdpa")(q, q, q, causal=True))
    assert "KINETO_LOG_LEVEL" not in os.environ  # set only while the profiler starts: child processes never see it
    monkeypatch.setenv("KINETO_LOG_LEVEL", "1")
    assert detect_sdpa_kernel(lambda: get_attention("sdpa")(q, q, q, causal=True))[1] == "flash"
    assert os.environ["KINETO_LOG_LEVEL"] == "1"


def test_cpu_sdpa_training_run_reports_its_kernel_with_no_profiler_lines_on_the_console(tmp_path):
    """The loop profiles its 2nd step with detect_sdpa_kernel; kineto (C++, under torch.profiler) writes straight to
    the process's file descriptors, so only a child process's captured output shows its "USDT ... profiler_start"
    and "ERROR ... gpuGetDeviceCount" lines (the latter on CUDA builds of torch without a GPU)."""
    command = [sys.executable, "train.py", "attention=sdpa", "model.n_layer=1", "model.n_head=2", "model.n_embd=32",
               "model.block_size=32", "train.batch_size=4", "train.max_steps=3", "train.eval_batches=1",
               "train.device=cpu", "wandb.mode=disabled", "data.max_documents=10",
               f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}  # kineto's default, as a user has it
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "ERROR" not in output and "USDT" not in output, output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["sdpa_kernel"] == "flash"
    assert summary["sdpa_kernel_evidence"][0] == "aten::_scaled_dot_product_flash_attention_for_cpu"


def test_sdpa_kernel_names_map_to_backends():
    assert sdpa_kernel_from_names({"aten::_scaled_dot_product_cudnn_attention", "aten::mm"})[0] == "cudnn"
    assert sdpa_kernel_from_names({"void pytorch_flash::flash_fwd_kernel<...>"})[0] == "flash"
    assert sdpa_kernel_from_names({"fmha_cutlassF_bf16_aligned_64x64_rf_sm80"})[0] == "efficient"
    assert sdpa_kernel_from_names({"cudnn_generated_fort_native_sdpa_sm90_flash_fprop"})[0] == "cudnn"


def test_console_summary_lines_are_strict_json_with_null_for_nan(tmp_path, capsys):
    run = logger(tmp_path)
    run.summary({"final/val_loss": float("nan"), "best/val_loss": float("inf"), "skipped_steps": [1]})
    run.close(exit_code=1)  # a failed run's summary too
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("summary: "))
    assert strict_json(line.removeprefix("summary: ")) == {"final/val_loss": None, "best/val_loss": None,
                                                           "skipped_steps": [1]}
    assert strict_json((tmp_path / "summary.json").read_text())["final/val_loss"] is None


def test_the_error_that_ends_a_run_is_the_one_raised_when_the_loggers_own_writes_fail_on_the_way_out(tmp_path):
    run = logger(tmp_path)
    run.log(1, {"train/loss": 1.0})
    (tmp_path / "summary.json").mkdir()  # its last write fails (as it would on the full disk that ended the run)
    with pytest.raises(OSError, match="the checkpoint's write failed"), close_on_error(run):
        raise OSError(28, "the checkpoint's write failed")
    assert strict_json((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "train/loss": 1.0}
