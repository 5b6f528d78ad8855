"""Checkpoint save and load times at GPT-2 XL size, with and without the integrity check (CRC32s) of load_checkpoint.

Builds a GPT of the given shapes (default: gpt2-xl, 1.56B parameters) with random weights and AdamW state (one step
on random gradients: two fp32 moments per parameter, ~18 GB in all), saves it with training.checkpoint's
save_checkpoint as the training loop does, then measures, each the median of --repeats:

    save_s             save_checkpoint: serialise, write, fsync, rename
    load_s             load_checkpoint(verify=False), then every tensor copied to --device (what a resume's
                       load_state_dict does: the memory-mapped file is read there)
    load_verified_s    the same with verify=True (load_checkpoint's default: the CRC32 check of every record first)
    verify_s           verify_checkpoint alone; verify_gb_per_s is the file's size over it

Loads are timed warm (the file in the page cache, as right after a save) and cold (its pages evicted first with
posix_fadvise(DONTNEED), which needs no root: a resume after a restart). The file is written next to --out and
deleted at the end.

    python scripts/bench_checkpoint.py                                   # gpt2-xl shapes, ~18 GB file, ~40 GB RAM
    python scripts/bench_checkpoint.py --n-layer 2 --n-embd 64 --n-head 2 --vocab-size 256 --out /tmp/ckpt.json

Writes the results as JSON to --out (default: a fresh outputs/bench/checkpoint-<date>_<time>/results.json) and prints
them.
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import GPT, GPTConfig  # noqa: E402
from scripts.common import default_out, run_meta  # noqa: E402
from training.checkpoint import load_checkpoint, rng_state, save_checkpoint, verify_checkpoint  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=48)
    p.add_argument("--n-head", type=int, default=25)
    p.add_argument("--n-embd", type=int, default=1600)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--block-size", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where loads copy to")
    p.add_argument("--out", type=Path, default=None, help="the results' JSON file")
    return p.parse_args(argv)


def checkpoint_state(config: GPTConfig) -> tuple[dict[str, Any], int]:
    """A training checkpoint's state (random weights, AdamW's moments after one step on random gradients) and the
    model's parameter count."""
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": {}, "step": 1,
             "rng": rng_state(), "loader": {}, "config": {}, "model_config": asdict(config), "best_val_loss": 1.0}
    return state, sum(p.numel() for p in model.parameters())  # the tied head counted once


def tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict | list | tuple):
        for item in value.values() if isinstance(value, dict) else value:
            yield from tensors(item)


def load(path: Path, device: torch.device, verify: bool) -> None:
    """load_checkpoint, then every tensor read into memory of the device, as a resume's load_state_dict does."""
    copies = [t.to(device, copy=True) for t in tensors(load_checkpoint(path, verify=verify))]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    del copies


def evict(path: Path) -> None:
    """Drop the file's pages from the page cache (they are clean: save_checkpoint fsyncs), so that it is read cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def median_s(fn: Callable[[], None], repeats: int, before: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def warm_and_cold(fn: Callable[[], None], path: Path, repeats: int) -> dict[str, float]:
    """fn's median time with the file in the page cache, and read from disk."""
    return {"warm": median_s(fn, repeats), "cold": median_s(fn, repeats, before=lambda: evict(path))}


def save(config: GPTConfig, path: Path, repeats: int) -> tuple[int, float]:
    """(the parameters, the median save time) of a checkpoint of this config, saved at path; its state is freed on
    return, before the loads."""
    state, n_params = checkpoint_state(config)
    return n_params, median_s(lambda: save_checkpoint(state, path), repeats)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = args.out or default_out("checkpoint") / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    path, device = out.parent / "bench_checkpoint.pt", torch.device(args.device)
    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, vocab_size=args.vocab_size,
                       block_size=args.block_size)
    settings = {k: v for k, v in vars(args).items() if k not in ("device", "out")}
    results: dict[str, Any] = {"meta": run_meta(device, **settings)}

    def record(key: str, value: Any) -> None:  # written as each is measured: a run cut short keeps what it measured
        results[key] = value
        out.write_text(json.dumps(results, indent=2) + "\n")

    try:
        n_params, save_s = save(config, path, args.repeats)
        size = path.stat().st_size
        record("n_params", n_params)
        record("file_bytes", size)
        record("save_s", save_s)
        record("verify_s", warm_and_cold(lambda: verify_checkpoint(path), path, args.repeats))
        record("verify_gb_per_s", {k: size / v / 1e9 for k, v in results["verify_s"].items()})
        record("load_s", warm_and_cold(lambda: load(path, device, verify=False), path, args.repeats))
        record("load_verified_s", warm_and_cold(lambda: load(path, device, verify=True), path, args.repeats))
    finally:
        path.unlink(missing_ok=True)
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
