"""Which SDPA kernel ran (training/metrics.py: detect_sdpa_kernel), on CPU: the kernel named from the profiler's
events, kineto's log lines kept off a training run's console, the user's KINETO_LOG_LEVEL left alone."""

import json
import os
import subprocess
import sys

import torch
from helpers import ROOT

from model.attention import get_attention, naive_attention
from training.metrics import detect_sdpa_kernel, sdpa_kernel_from_names


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
