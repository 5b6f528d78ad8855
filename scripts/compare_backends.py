"""Compare attention backends end to end: training throughput and memory of the whole model, per sequence length.

Each cell (backend × sequence length × eager/compiled) is one `python train.py` run in its own process, so an
out-of-memory is a result ("OOM" in the table) and every cell starts with clean CUDA memory statistics. A cell runs
`--warmup` steps (compilation included) and then `--steps` measured steps; tokens/sec is the median over log windows
of the measured steps, peak reserved/allocated memory the largest over the run (`torch.cuda.max_memory_*`).
Backends: every backend of the registry in model/attention.py (naive, sdpa: torch's choice, triton, ...), and sdpa
pinned to each of its kernels as sdpa:<kernel> (flash, efficient, cudnn, math); by default all but sdpa:math.

    # H200: GPT-2 124M, tokens per step held at 16k (B = 16384 / T), eager and compiled
    python scripts/compare_backends.py --seq-lens 256,512,1024,2048,4096,8192,16384
    # GPT-2 124M at B=16, T=1024 only (the throughput acceptance run)
    python scripts/compare_backends.py --seq-lens 1024 --backends naive,sdpa,triton
    # CPU smoke test (what CI runs, with TRITON_INTERPRET=1 for the triton backend)
    python scripts/compare_backends.py --model tiny --vocab-size 0 --device cpu --dtype fp32 --seq-lens 16,32 \
        --tokens-per-step 64 --modes eager --steps 2 --warmup 2 --out /tmp/cmp

Writes results.json, results.md and two plots (tokens_per_sec.png, peak_reserved.png) to --out (default: a fresh
outputs/bench/compare-backends-<date>_<time>/; results worth keeping go to docs/results/); results.json is
rewritten after every cell, so an interrupted sweep keeps what it measured. With `--wandb offline|online` every cell
is also a wandb run in one group. `--gpus 0,1` runs cells concurrently, one per listed GPU (each process sees only
its GPU): a sweep finishes N times sooner, at the price of N processes sharing the host's CPUs.
"""

import argparse
import concurrent.futures
import datetime
import json
import os
import queue
import sys
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model.attention import BACKENDS, SDPA_BACKENDS  # noqa: E402
from scripts.common import choice_list, default_out, fmt, run_meta, run_train, write_report  # noqa: E402
from training.device import DTYPES  # noqa: E402

AGREE_RTOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 1e-2}  # first-step loss vs the reference backend
MEMORY_LABEL = {"peak_reserved_gib": "peak reserved GiB", "peak_rss_gib": "peak RSS GiB"}


# Left out of the default sweep: SDPA's reference kernel materialises the scores, as naive does, only slower.
NOT_BY_DEFAULT = {"sdpa:math"}


def backend_choices() -> list[str]:
    """--backends' choices, in the order of table rows and plot legends: the registry's backends (model/attention.py),
    sdpa followed by sdpa:<kernel> for each SDPA kernel it can be pinned to."""
    choices = []
    for name in BACKENDS:
        choices.append(name)
        if name == "sdpa":
            choices += [f"sdpa:{kernel}" for kernel in SDPA_BACKENDS]
    return choices


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    choices = backend_choices()
    backends = choice_list(choices)
    p.add_argument("--model", default="gpt2", help="model preset (conf/model/)")
    p.add_argument("--backends", type=backends, default=[b for b in choices if b not in NOT_BY_DEFAULT],
                   help=f"comma-separated, of {','.join(choices)} (default: all but {','.join(NOT_BY_DEFAULT)})")
    p.add_argument("--seq-lens", default="256,512,1024,2048,4096,8192,16384")
    p.add_argument("--tokens-per-step", type=int, default=16384, help="batch size = tokens-per-step / T (min 1)")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--compiled-backends", type=backends, default=None,
                   help="backends of the compiled cells (default: --backends); compiling costs ~1 min per cell")
    p.add_argument("--gpus", default="", help="GPU indices to run cells on concurrently (default: one at a time)")
    p.add_argument("--report", default="", help="run nothing: write the table and plots of these results.json "
                   "files (comma-separated; their cells merged, e.g. an interrupted sweep and its rest; a cell "
                   "in a later file replaces the same cell in an earlier one)")
    p.add_argument("--steps", type=int, default=50, help="measured steps per cell")
    p.add_argument("--warmup", type=int, default=5,
                   help="steps before measuring (>= 2: step 1 compiles, step 2 is profiled for the SDPA kernel)")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--device", default="auto")
    p.add_argument("--data", default="stdlib", help="data preset; the offline default needs no network")
    p.add_argument("--vocab-size", type=int, default=50257,
                   help="model vocabulary (GPT-2's by default, whatever the data's tokenizer); 0 = the data's")
    p.add_argument("--wandb", default="disabled", choices=["disabled", "offline", "online"])
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    p.add_argument("--out", type=Path, default=default_out("compare-backends"))
    p.add_argument("overrides", nargs="*", help="extra train.py overrides for every cell")
    return p.parse_args(argv)


def cell_overrides(args: argparse.Namespace, backend: str, seq_len: int, mode: str, group: str) -> list[str]:
    name, _, pinned = backend.partition(":")
    batch = max(1, args.tokens_per_step // seq_len)
    out = [f"model={args.model}", f"attention={name}", f"data={args.data}", f"model.block_size={seq_len}",
           f"train.batch_size={batch}", f"train.max_steps={args.warmup + args.steps}",
           f"train.perf_warmup_steps={args.warmup}", f"train.log_interval={args.log_interval}",
           f"train.eval_interval={args.warmup + args.steps}", "train.eval_batches=1", "train.save_checkpoints=false",
           f"train.compile={mode == 'compiled'}", f"train.dtype={args.dtype}", f"train.device={args.device}",
           f"wandb.mode={args.wandb}", f"wandb.group={group}", f"wandb.name={backend}-T{seq_len}-{mode}"]
    if pinned:
        out.append(f"attention.sdpa_backend={pinned}")
    if args.vocab_size:
        out.append(f"model.vocab_size={args.vocab_size}")
    return out + args.overrides


def run_cell(args: argparse.Namespace, backend: str, seq_len: int, mode: str, group: str, work: Path,
             gpu: str | None = None) -> dict:
    cell = {"backend": backend, "seq_len": seq_len, "mode": mode, "batch_size": max(1, args.tokens_per_step // seq_len)}
    run_dir = work / f"{backend.replace(':', '-')}-T{seq_len}-{mode}"
    command = [sys.executable, "train.py", *cell_overrides(args, backend, seq_len, mode, group),
               f"hydra.run.dir={run_dir}"]
    env = {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else None
    return {**cell, **run_train(command, run_dir, args.timeout, env)}


def cells_to_run(args: argparse.Namespace) -> list[tuple[str, int, str]]:
    """(backend, T, mode) in the order given: modes, then sequence lengths, then backends."""
    todo = []
    for mode in args.modes.split(","):
        backends = args.compiled_backends if mode == "compiled" and args.compiled_backends else args.backends
        for seq_len in map(int, args.seq_lens.split(",")):
            todo += [(backend, seq_len, mode) for backend in backends]
    return todo


def run_cells(args: argparse.Namespace, group: str, work: Path, save) -> list[dict]:
    """Every cell, one process each: one at a time, or concurrently one per GPU of --gpus. save(cells) is called
    after each cell."""
    cells: list[dict] = []

    def done(cell: dict) -> None:
        print(json.dumps(cell), flush=True)
        cells.append(cell)
        save(cells)

    free: queue.Queue[str | None] = queue.Queue()  # GPUs not running a cell; None: the default device
    for gpu in args.gpus.split(",") if args.gpus else [None]:
        free.put(gpu)

    def on_free_gpu(backend: str, seq_len: int, mode: str) -> dict:
        gpu = free.get()
        try:
            cell = run_cell(args, backend, seq_len, mode, group, work, gpu)
            return cell if gpu is None else {**cell, "gpu": gpu}
        finally:
            free.put(gpu)

    with concurrent.futures.ThreadPoolExecutor(max_workers=free.qsize()) as pool:
        for future in concurrent.futures.as_completed([pool.submit(on_free_gpu, *c) for c in cells_to_run(args)]):
            done(future.result())
    return cells


def check_agreement(cells: list[dict], dtype: str) -> None:
    """Same seed ⇒ same init and first batch: each cell's first-step loss must match the reference backend's
    (naive if it ran, else the first backend that did) within the dtype's tolerance."""
    for key in {(c["seq_len"], c["mode"]) for c in cells}:
        group = [c for c in cells if (c["seq_len"], c["mode"]) == key and c["status"] == "ok"]
        if not group:
            continue
        ref = next((c for c in group if c["backend"] == "naive"), group[0])
        for c in group:
            diff = abs(c["first_loss"] - ref["first_loss"])
            c["agrees"] = diff <= AGREE_RTOL[dtype] * abs(ref["first_loss"])
            c["agreement"] = f"vs {ref['backend']}: Δ={diff:.2e}"


def rank(backend: str) -> int:
    """Position of a backend in tables and legends: backend_choices(), then any other backend (from --report)."""
    order = backend_choices()
    return order.index(backend) if backend in order else len(order)


def markdown(cells: list[dict], meta: dict) -> str:
    mem_key = "peak_reserved_gib" if any(c.get("peak_reserved_gib") for c in cells) else "peak_rss_gib"
    lines = [f"Attention backends, end to end: {meta['model']} on {meta['device']}, {meta['dtype']}, "
             f"{meta['tokens_per_step']} tokens/step, {meta['steps']} measured steps after {meta['warmup']} "
             f"(torch {meta['torch']}, triton {meta['triton']}, {meta['date']}"
             + (f"; {meta['gpus_in_parallel']} cells ran at a time, one per GPU" if meta["gpus_in_parallel"] > 1
                else "") + ").", "",
             f"| mode | T | B | backend | tokens/s | vs naive | MFU | {MEMORY_LABEL[mem_key]} | "
             "peak allocated GiB | first loss | final loss | SDPA kernel | agrees |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(cells, key=lambda c: (c["mode"], c["seq_len"], rank(c["backend"]))):
        if c["status"] != "ok":
            lines.append(f"| {c['mode']} | {c['seq_len']} | {c['batch_size']} | {c['backend']} | {c['status']} |"
                         + " |" * 8)
            continue
        naive = next((n for n in cells if n["backend"] == "naive" and n["status"] == "ok"
                      and (n["seq_len"], n["mode"]) == (c["seq_len"], c["mode"])), None)
        speedup = c["tokens_per_sec"] / naive["tokens_per_sec"] if naive and c["tokens_per_sec"] else None
        agrees = "✓" if c.get("agrees") else f"MISMATCH ({c.get('agreement')})"
        lines.append(
            f"| {c['mode']} | {c['seq_len']} | {c['batch_size']} | {c['backend']} | {fmt(c['tokens_per_sec'], ',.0f')}"
            f" | {fmt(speedup, '.2f')}{'×' if speedup else ''} | {fmt(c['mfu'], '.1%')} | {fmt(c[mem_key], '.2f')} | "
            f"{fmt(c['peak_allocated_gib'], '.2f')} | {c['first_loss']:.4f} | {c['final_loss']:.4f} | "
            f"{c['sdpa_kernel'] or '–'} | {agrees} |")
    return "\n".join(lines) + "\n"


def plot(cells: list[dict], key: str, ylabel: str, path: Path, logy: bool) -> None:
    """One colour per backend, solid for compiled and dashed for eager; an OOM is marked at its T."""
    fig, ax = plt.subplots(figsize=(10, 5))
    backends = sorted({c["backend"] for c in cells}, key=lambda b: (rank(b), b))
    colours = {b: plt.get_cmap("tab10")(i % 10) for i, b in enumerate(backends)}
    for mode, style in (("compiled", "-"), ("eager", "--")):
        for backend in backends:
            points = sorted((c["seq_len"], c[key]) for c in cells if c["backend"] == backend and c["mode"] == mode
                            and c["status"] == "ok" and c.get(key))
            if points:
                ax.plot(*zip(*points, strict=True), style, color=colours[backend], marker="o",
                        label=f"{backend} ({mode})")
    ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    for t, backend in sorted({(c["seq_len"], c["backend"]) for c in cells if c["status"] == "OOM"}):
        ax.annotate(f"{backend} OOM", (t, 0.02), xycoords=("data", "axes fraction"), rotation=90, fontsize=8,
                    va="bottom", ha="center", color=colours[backend])
    ax.set_xlabel("sequence length T")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: no point hidden
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(cells: list[dict], meta: dict, out: Path) -> dict[str, Any]:
    """The final results: results.json and results.md (also printed), and the two plots."""
    check_agreement(cells, meta["dtype"])
    results = {"meta": meta, "partial": False, "cells": cells}
    table = markdown(cells, meta)
    write_report(out, results, table)
    plot(cells, "tokens_per_sec", "training tokens/sec", out / "tokens_per_sec.png", logy=False)
    mem_key = "peak_reserved_gib" if any(c.get("peak_reserved_gib") for c in cells) else "peak_rss_gib"
    plot(cells, mem_key, MEMORY_LABEL[mem_key], out / "peak_reserved.png", logy=True)
    print(table)
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.report:
        runs = [json.loads(Path(path).read_text()) for path in args.report.split(",")]
        # a cell re-run in a later file replaces the earlier measurement
        cells = list({(c["backend"], c["seq_len"], c["mode"]): c for run in runs for c in run["cells"]}.values())
        return report(cells, runs[-1]["meta"], args.out)
    group = f"compare-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    meta = run_meta(model=args.model, dtype=args.dtype, tokens_per_step=args.tokens_per_step, steps=args.steps,
                    warmup=args.warmup, wandb_group=group,
                    gpus_in_parallel=len(args.gpus.split(",")) if args.gpus else 1)

    def save(cells: list[dict]) -> None:  # after every cell: an interrupted sweep keeps what it measured
        meta["device"] = next((c["device"] for c in cells if c.get("device")), "unknown")  # as the cells report it
        write_report(args.out, {"meta": meta, "partial": True, "cells": cells})

    with tempfile.TemporaryDirectory(prefix="compare-") as work:
        cells = run_cells(args, group, Path(work), save)
    return report(cells, meta, args.out)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
