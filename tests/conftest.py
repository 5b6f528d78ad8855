"""Shared pytest setup: the repo root on sys.path, and the `gpu` marker skipped on machines without CUDA."""

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# One intra-op thread: the tests' tensors are tiny, and two OpenMP threads spinning against another busy process on
# a 2-core CI machine make small matmuls ~100x slower.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"  # for the subprocesses the tests start


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
