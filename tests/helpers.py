"""The helpers several test files share: a small training config (make_cfg, SMALL), reading a run's metrics.jsonl,
waiting for a training subprocess, parsing markdown tables, the kernels' accuracy rule (ATOL, within_tolerance), and
a tiny tokenizer with a chat template (make_tokenizer, CHATML).
Test files import them from here (`from helpers import ...`), never from one another; shared fixtures are in
conftest.py."""

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from training.config import Config, register_configs
from training.metrics import TRAIN_LOSS

ROOT = Path(__file__).resolve().parents[1]
register_configs()

# A model and data small enough that a step takes milliseconds on two cores.
SMALL = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "train.batch_size=4",
         "data.max_documents=20", "train.eval_batches=2", "train.warmup_steps=2", "wandb.mode=offline"]


def make_cfg(tmp_path: Path, *overrides: str) -> Config:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("config", overrides=[*SMALL, f"data.cache_dir={tmp_path / 'cache'}", *overrides])
    return OmegaConf.to_object(cfg)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m[TRAIN_LOSS] for m in read_metrics(run_dir) if TRAIN_LOSS in m}


def strict_json(line: str) -> dict:
    def refuse(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


def wait_for_training(run_dir: Path, alive: Callable[[], bool], after_lines: int, timeout: float = 60) -> bool:
    """Wait until the run logs a new step (it is past start-up and training); False if it exited first."""
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and alive():
        if metrics.exists() and len(metrics.read_text().splitlines()) > after_lines:
            return True
        time.sleep(0.02)
    return False


def table_rows(markdown: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in the text, as {column header: cell}."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header, rows = lines[0], lines[2:]  # lines[1] is the |---| separator
    cells = lambda line: [cell.strip() for cell in line.strip().strip("|").split("|")]  # noqa: E731
    return [dict(zip(cells(header), cells(row), strict=True)) for row in rows]


# Absolute slack floor added to 2x PyTorch's error; far below the errors a real bug produces (see the sanity tests).
# fp32: at T=1 the exact dQ is 0 and PyTorch's softmax backward returns an exact 0, while dP - delta leaves a residue of
# a few ulps of dP (|dP| ~ 10-40): up to 2.3e-6 in 600 draws.
ATOL = {torch.float32: 5e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def within_tolerance(ours: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor, atol: float) -> tuple[bool, str]:
    """err(ours) <= 2 err(PyTorch) + atol + half an ulp of the largest reference value (the output's own rounding).

    The half ulp matters where both errors sit at the rounding floor (small D, fp16): there the ratio of two maxima is
    heavy-tailed and a fixed 2x fails about 1 run in 250 on fresh random inputs.
    """
    err = (ours.double() - ref.double()).abs().max().item()
    base = (baseline.double() - ref.double()).abs().max().item()
    atol = atol + 0.5 * torch.finfo(ours.dtype).eps * ref.abs().max().item()
    ok = bool(torch.isfinite(ours).all()) and err <= 2 * base + atol
    return ok, f"max error {err:.3g} vs 2 x PyTorch {base:.3g} + {atol:g}"


# --- a tiny tokenizer with a chat template (instruction tuning, sample.py --chat) ---

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
SENTENCES = ["the black cat sat on the red mat", "what is two plus two", "four", "be brief and kind",
             "you are a helpful assistant", "and the white dog", "it sat on the green mat too"]
# SmolLM2-Instruct's / Qwen2.5's kind: ChatML with a default system message
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nyou are a helpful assistant<|im_end|>\\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_tokenizer(folder: Path, chat_template: str | None = None, specials: list[str] = SPECIALS, **config) -> Path:
    """A byte-level BPE tokenizer.json trained on SENTENCES (no merge across a newline) with these special tokens, its
    tokenizer_config.json holding the chat template and special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(SENTENCES, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"eos_token": "<|endoftext|>", **config}
    if chat_template is not None:
        settings["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder
