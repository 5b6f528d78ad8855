"""Data-parallel scaling on one host: tokens/sec on 1 GPU against N GPUs with DDP and with FSDP2, and loss curves.

    # 2 x H200, GPT-2 124M, T=1024, bf16, compiled, per-GPU batch 16, attention sdpa and triton
    python scripts/bench_distributed.py --nproc 2 --backends sdpa,triton
    # CPU smoke test (gloo; what CI runs)
    python scripts/bench_distributed.py --nproc 2 --device cpu --model tiny --vocab-size 0 --dtype fp32 \
        --no-compile --batch-size 2 --seq-len 32 --steps 4 --warmup 2 --log-interval 2 --out /tmp/dist

Cells, one process group each (`python train.py` for one GPU, `torchrun --standalone` for N), run one at a time:
- single / ddp / fsdp for every backend, per-GPU batch --batch-size: tokens/sec (global), MFU, peak reserved memory
  of rank 0's GPU, and scaling efficiency = N-GPU tokens/sec / (N x the same backend's 1-GPU tokens/sec);
- one more 1-GPU run of the first backend at batch N x --batch-size (the global batch of the N-GPU runs, eager unless
  --reference-compiled): the loader hands each rank its slice of the same global batch, so the N-GPU loss curves
  must follow this run's up to reduction-order noise. Its curve and the gaps are in the table and loss_curves.png.

Writes results.json (after every cell), results.md and loss_curves.png to --out (default: a fresh
outputs/bench/distributed-<date>_<time>/; results worth keeping go to docs/results/). The launches keep NVLink
multicast off (NCCL_NVLS_ENABLE=0 and friends), as shared multi-GPU hosts require.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model.attention import BACKENDS  # noqa: E402
from scripts.common import NO_MULTICAST, choice_list, default_out, fmt, run_meta, run_train, write_report  # noqa: E402
from training.device import DTYPES  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="GPUs (processes) of the data-parallel runs")
    p.add_argument("--backends", type=choice_list(BACKENDS), default="sdpa,triton",
                   help=f"comma-separated, of {','.join(BACKENDS)}")
    p.add_argument("--modes", default="ddp,fsdp")
    p.add_argument("--model", default="gpt2")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--steps", type=int, default=200, help="measured steps (the loss curves span warmup + steps)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    p.add_argument("--device", default="auto")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--reference-compiled", action="store_true", help="compile the global-batch reference run too")
    p.add_argument("--data", default="stdlib")
    p.add_argument("--vocab-size", type=int, default=50257, help="0 = the data's tokenizer's")
    p.add_argument("--skip", default="", help="cells not to run: single and/or reference (comma-separated)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    p.add_argument("--out", type=Path, default=default_out("distributed"))
    p.add_argument("overrides", nargs="*", help="extra train.py overrides for every cell")
    return p.parse_args(argv)


def overrides(args: argparse.Namespace, backend: str, batch: int, compiled: bool) -> list[str]:
    # Full decay schedule over the run, so the curves have the shape of a real (short) run.
    steps = args.warmup + args.steps
    out = [f"model={args.model}", f"attention={backend}", f"data={args.data}", f"model.block_size={args.seq_len}",
           f"train.batch_size={batch}", f"train.max_steps={steps}", f"train.perf_warmup_steps={args.warmup}",
           f"train.log_interval={args.log_interval}", f"train.eval_interval={steps}", "train.eval_batches=1",
           "train.save_checkpoints=false", f"train.compile={compiled}", f"train.dtype={args.dtype}",
           f"train.device={args.device}", "wandb.mode=disabled"]
    if args.vocab_size:
        out.append(f"model.vocab_size={args.vocab_size}")
    return out + args.overrides


def run(args: argparse.Namespace, work: Path, backend: str, mode: str, nproc: int, batch: int, compiled: bool) -> dict:
    cell = {"backend": backend, "mode": mode, "gpus": nproc, "batch_per_gpu": batch, "global_batch": batch * nproc,
            "compiled": compiled}
    run_dir = work / f"{backend}-{mode}-{nproc}x{batch}"
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                if nproc > 1 else [sys.executable])
    command = [*launcher, "train.py", *overrides(args, backend, batch, compiled), f"hydra.run.dir={run_dir}"]
    if nproc > 1:
        command.append(f"train.distributed={mode}")
    result = {**cell, **run_train(command, run_dir, args.timeout, NO_MULTICAST)}
    metrics = run_dir / "metrics.jsonl"
    if result["status"] == "ok" and metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        result["loss_curve"] = [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]
    print(json.dumps({k: v for k, v in result.items() if k != "loss_curve"}), flush=True)
    return result


def summarise(cells: list[dict], nproc: int) -> None:
    """Scaling efficiency against the 1-GPU cell of the same backend; loss-curve gaps against the reference."""
    single = {c["backend"]: c for c in cells if c["mode"] == "single" and c["status"] == "ok"}
    reference = next((c for c in cells if c["mode"] == "reference" and c["status"] == "ok"), None)
    for c in cells:
        if c["status"] != "ok" or c["gpus"] == 1:
            continue
        base = single.get(c["backend"])
        if base and base["tokens_per_sec"] and c["tokens_per_sec"]:
            c["scaling_efficiency"] = c["tokens_per_sec"] / (nproc * base["tokens_per_sec"])
        if reference and c.get("loss_curve"):
            ref = dict(reference["loss_curve"])
            gaps = [abs(loss - ref[step]) for step, loss in c["loss_curve"] if step in ref]
            c["loss_gap_max"] = max(gaps) if gaps else None
            c["loss_gap_final"] = gaps[-1] if gaps else None


def markdown(cells: list[dict], meta: dict) -> str:
    lines = [f"Data-parallel scaling: {meta['model']} on {meta['nproc']}x {meta['device']}, T={meta['seq_len']}, "
             f"{meta['dtype']}, per-GPU batch {meta['batch_per_gpu']}, {meta['steps']} measured steps after "
             f"{meta['warmup']} (torch {meta['torch']}, triton {meta['triton']}, {meta['date']}).", "",
             "| attention | mode | GPUs | global batch | compiled | tokens/s | tokens/s per GPU | scaling efficiency | "
             "MFU | peak reserved GiB (rank 0) | final loss | max loss gap vs 1-GPU global batch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        if c["status"] != "ok":
            lines.append(f"| {c['backend']} | {c['mode']} | {c['gpus']} | {c['global_batch']} | {c['compiled']} | "
                         f"{c['status']} |" + " |" * 6)
            continue
        per_gpu = c["tokens_per_sec"] / c["gpus"] if c["tokens_per_sec"] else None
        lines.append(
            f"| {c['backend']} | {c['mode']} | {c['gpus']} | {c['global_batch']} | {c['compiled']} | "
            f"{fmt(c['tokens_per_sec'], ',.0f')} | {fmt(per_gpu, ',.0f')} | {fmt(c.get('scaling_efficiency'), '.1%')}"
            f" | {fmt(c['mfu'], '.1%')} | {fmt(c['peak_reserved_gib'], '.2f')} | {fmt(c['final_loss'], '.4f')} | "
            f"{fmt(c.get('loss_gap_max'), '.4f')} |")
    return "\n".join(lines) + "\n"


def plot_losses(cells: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for c in cells:
        if c.get("loss_curve") and c["global_batch"] == max(x["global_batch"] for x in cells):
            steps, losses = zip(*c["loss_curve"], strict=True)
            style = "-" if c["mode"] == "reference" else "--"
            label = f"{c['backend']} {c['mode']} ({c['gpus']} GPU, batch {c['global_batch']})"
            ax.plot(steps, losses, style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    compiled = not args.no_compile
    meta = run_meta(model=args.model, nproc=args.nproc, seq_len=args.seq_len, dtype=args.dtype,
                    batch_per_gpu=args.batch_size, steps=args.steps, warmup=args.warmup, env=NO_MULTICAST)
    cells: list[dict] = []

    def results(partial: bool) -> dict:
        meta["device"] = next((c["device"] for c in cells if c.get("device")), "unknown")  # as the cells report it
        return {"meta": meta, "partial": partial, "cells": cells}

    backends = args.backends
    with tempfile.TemporaryDirectory(prefix="dist-") as work:
        plan = [(b, "single", 1, args.batch_size, compiled) for b in backends]
        plan.append((backends[0], "reference", 1, args.batch_size * args.nproc, compiled and args.reference_compiled))
        plan += [(b, m, args.nproc, args.batch_size, compiled) for m in args.modes.split(",") for b in backends]
        for backend, mode, nproc, batch, comp in [cell for cell in plan if cell[1] not in args.skip.split(",")]:
            cells.append(run(args, Path(work), backend, mode, nproc, batch, comp))
            write_report(args.out, results(partial=True))  # an interrupted run keeps what it measured
    summarise(cells, args.nproc)
    final = results(partial=False)
    table = markdown(cells, meta)
    write_report(args.out, final, table)
    plot_losses(cells, args.out / "loss_curves.png")
    print(table)
    return final


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
