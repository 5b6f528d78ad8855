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
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight transformers GPT2LMHeadModel (byte vocabulary, 64 positions) saved with save_pretrained.
    Weights are drawn wider than GPT-2's init (0.02) so that greedy decoding does not collapse onto one token."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=257, n_positions=64, initializer_range=0.5,
                        bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        model.transformer.wte.weight.normal_(0.0, 1.0)
        model.transformer.wpe.weight.normal_(0.0, 1.0)
    path = tmp_path_factory.mktemp("hf_gpt2")
    model.save_pretrained(path, safe_serialization=True)
    return path
