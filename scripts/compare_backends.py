"""Compare attention backends end to end: training throughput and memory of the whole model, per sequence length.

Each cell (backend × sequence length × eager/compiled) is one `python train.py` run in its own process, so an
out-of-memory is a result ("OOM" in the table) and every cell starts with clean CUDA memory statistics. A cell runs
`--warmup` steps (compilation included) and then `--steps` measured steps; tokens/sec is the median over log windows
of the measured steps, peak reserved/allocated memory the largest over the run (`torch.cuda.max_memory_*`).
Backends: naive, sdpa (torch's choice), sdpa:<flash|efficient|cudnn|math> (pinned), triton.

    # H200: GPT-2 124M, tokens per step held at 16k (B = 16384 / T), eager and compiled
    python scripts/compare_backends.py --seq-lens 256,512,1024,2048,4096,8192,16384
    # GPT-2 124M at B=16, T=1024 only (the throughput acceptance run)
    python scripts/compare_backends.py --seq-lens 1024 --backends naive,sdpa,triton
    # CPU smoke test (what CI runs, with TRITON_INTERPRET=1 for the triton backend)
    python scripts/compare_backends.py --model tiny --vocab-size 0 --device cpu --dtype fp32 --seq-lens 16,32 \
        --tokens-per-step 64 --modes eager --steps 2 --warmup 2 --out /tmp/cmp

Writes results.json, results.md and two plots (tokens_per_sec.png, peak_reserved.png) to --out; results.json is
rewritten after every cell, so an interrupted sweep keeps what it measured. With `--wandb offline|online` every cell
is also a wandb run in one group. `--gpus 0,1` runs cells concurrently, one per listed GPU (each process sees only
its GPU): a sweep finishes N times sooner, at the price of N processes sharing the host's CPUs.
"""

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import queue
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
AGREE_RTOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 1e-2}  # first-step loss vs the reference backend
MEMORY_LABEL = {"peak_reserved_gib": "peak reserved GiB", "peak_rss_gib": "peak RSS GiB"}
ORDER = ["naive", "sdpa", "sdpa:flash", "sdpa:efficient", "sdpa:cudnn", "sdpa:math", "triton"]  # table rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2", help="model preset (conf/model/)")
    p.add_argument("--backends", default="naive,sdpa,sdpa:flash,sdpa:efficient,sdpa:cudnn,triton")
    p.add_argument("--seq-lens", default="256,512,1024,2048,4096,8192,16384")
    p.add_argument("--tokens-per-step", type=int, default=16384, help="batch size = tokens-per-step / T (min 1)")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--compiled-backends", default=None,
                   help="backends of the compiled cells (default: --backends); compiling costs ~1 min per cell")
    p.add_argument("--gpus", default="", help="GPU indices to run cells on concurrently (default: one at a time)")
    p.add_argument("--report", default="", help="run nothing: write the table and plots of these results.json "
                   "files (comma-separated; their cells merged, e.g. an interrupted sweep and its rest; a cell "
                   "in a later file replaces the same cell in an earlier one)")
    p.add_argument("--steps", type=int, default=50, help="measured steps per cell")
    p.add_argument("--warmup", type=int, default=5,
                   help="steps before measuring (>= 2: step 1 compiles, step 2 is profiled for the SDPA kernel)")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--device", default="auto")
    p.add_argument("--data", default="stdlib", help="data preset; the offline default needs no network")
    p.add_argument("--vocab-size", type=int, default=50257,
                   help="model vocabulary (GPT-2's by default, whatever the data's tokenizer); 0 = the data's")
    p.add_argument("--wandb", default="disabled", choices=["disabled", "offline", "online"])
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    p.add_argument("--out", default=str(ROOT / "docs" / "compare_backends"))
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


def failure(log: str) -> str:
    """What a failed cell reports: OOM, or the last line of its error."""
    if "OutOfMemoryError" in log or "out of memory" in log:
        return "OOM"
    errors = re.findall(r"^\w*(?:Error|Exception): .*$", log, flags=re.MULTILINE)
    return "error: " + (errors[-1][:300] if errors else log.strip()[-300:] or "no output")


def run_train(command: list[str], run_dir: Path, timeout: int, env: dict[str, str] | None = None) -> dict:
    """Run one training process (`python train.py ...` or torchrun) whose run directory is run_dir; returns
    {"status": "ok", **metrics of its summary.json} or {"status": "OOM" | "error: ..."}."""
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        ok, log = proc.returncode == 0, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired:
        ok, log = False, f"timed out after {timeout} s"
    if not ok:
        return {"status": failure(log)}
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"status": "ok",
            "tokens_per_sec": summary.get("perf/tokens_per_sec_median"),
            "mfu": summary.get("perf/mfu_median"),
            "peak_reserved_gib": summary.get("mem/peak_reserved_gib_max"),
            "peak_allocated_gib": summary.get("mem/peak_allocated_gib_max"),
            "peak_rss_gib": summary.get("mem/peak_rss_gib_max"),
            "first_loss": summary["first/train_loss"],
            "final_loss": summary["final/train_loss"],
            "sdpa_kernel": summary.get("sdpa_kernel"),
            "device": summary.get("device")}


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
            todo += [(backend, seq_len, mode) for backend in backends.split(",")]
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


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def rank(backend: str) -> int:
    """Position of a backend in tables and legends: ORDER, then any other backend."""
    return ORDER.index(backend) if backend in ORDER else len(ORDER)


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


def write_report(cells: list[dict], meta: dict, out: Path) -> None:
    check_agreement(cells, meta["dtype"])
    (out / "results.json").write_text(json.dumps({"meta": meta, "partial": False, "cells": cells}, indent=2) + "\n")
    table = markdown(cells, meta)
    (out / "results.md").write_text(table)
    plot(cells, "tokens_per_sec", "training tokens/sec", out / "tokens_per_sec.png", logy=False)
    mem_key = "peak_reserved_gib" if any(c.get("peak_reserved_gib") for c in cells) else "peak_rss_gib"
    plot(cells, mem_key, MEMORY_LABEL[mem_key], out / "peak_reserved.png", logy=True)
    print(table)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report:
        runs = [json.loads(Path(path).read_text()) for path in args.report.split(",")]
        # a cell re-run in a later file replaces the earlier measurement
        cells = list({(c["backend"], c["seq_len"], c["mode"]): c for run in runs for c in run["cells"]}.values())
        write_report(cells, runs[-1]["meta"], out)
        return {"meta": runs[-1]["meta"], "partial": False, "cells": cells}
    group = f"compare-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    meta = {"model": args.model, "dtype": args.dtype, "tokens_per_step": args.tokens_per_step,
            "steps": args.steps, "warmup": args.warmup, "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), "wandb_group": group,
            "cuda": torch.version.cuda, "gpus_in_parallel": len(args.gpus.split(",")) if args.gpus else 1}

    def save(cells: list[dict]) -> None:  # after every cell: an interrupted sweep keeps what it measured
        meta["device"] = next((c["device"] for c in cells if c.get("device")), "unknown")
        (out / "results.json").write_text(json.dumps({"meta": meta, "partial": True, "cells": cells}, indent=2)
                                          + "\n")

    with tempfile.TemporaryDirectory(prefix="compare-") as work:
        cells = run_cells(args, group, Path(work), save)
    write_report(cells, meta, out)
    return {"meta": meta, "partial": False, "cells": cells}


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
