"""FSDP2 at world size 1 against the plain single-GPU step: what sharding costs when there is nothing to shard over.

FSDP2 on one GPU runs every hook, all-gather and reduce-scatter of a sharded run with no other rank to wait for, so its
gap to the plain step is the host and copy overhead that a multi-GPU run adds to its communication. For each case (a
model preset with a batch shape) and variant, this script builds the model (random weights), wraps it as train.py
does (training/distributed.py: wrap, in a process group of this process alone) and runs the step of
training/loop.py: train_step (bf16 autocast, backward, the gradient clip, fused AdamW with the on-device skip flag,
zero_grad), over --grad-accum micro-batches per step (gradients synchronised in the last).
After --warmup steps (compilation), it measures:

- tokens/s and MFU over --steps steps between synchronised points, peak reserved memory over the whole cell;
- host ms/step: how long the Python step takes to return when the GPU queue is empty at its start (the CPU's own
  work; when it exceeds the GPU time, the GPU waits on the host);
- under torch.profiler (--profile-steps steps): GPU busy ms/step (the union of kernel intervals on all streams), the
  kernels by category, and the CPU ms of FSDP2's own ranges (FSDP::pre_forward, FSDP::post_backward_reduce, ...) per
  step and per sharded unit;
- torch.compile's graphs and graph breaks;
- with --cprofile-steps N, cProfile's table of the Python functions with the most own time over N more steps
  (FSDP2's hooks by function: where a host-bound step spends its CPU time).

Variants: `plain` (the model compiled whole, train.distributed=none) or FSDP2, named `fsdp-model` (the whole model
compiled around its hooks) or `fsdp-blocks` (each block compiled alone: train.fsdp.compile_blocks), every block its own
unit, resharded after forward (the behaviour before train.fsdp existed), and changed by suffixes: `-auto`/`-never`
(train.fsdp.reshard_after_forward), `-prefetch` (prefetch=1), `-unitN` (blocks_per_unit=N; 0 sizes the units),
`-localopt` (local_optimizer), `-units` (compile_units: each unit one graph), `-fp32gather` (gather_fp32: fp32
weights gathered, autocast casts them in the graphs), `-multi` (the reshard policy of a run on
several GPUs: `auto` then keeps only the last unit gathered, as it did at world size 1 before `auto` kept every unit
there). Any variant with the suffix `-nogc` runs its timed steps with Python's automatic garbage collection off, as the
loop's train.gc_interval does between its collections. The defaults of train.fsdp are
`fsdp-blocks-auto-unit0-localopt-units`. Every step runs its backward on the calling thread, as train.py does
(train.autograd_multithreading=false); --autograd-multithreading runs it on autograd's device thread instead.

    # H200: GPT-2 124M (B16, T1024), gpt2-xl (B8, T1024) and Llama-3.2-1B shapes (B8, T2048)
    python scripts/bench_fsdp.py
    python scripts/bench_fsdp.py --cases gpt2:16:1024 --variants plain-nogc,fsdp-blocks-auto-unit0-localopt-units-nogc
    python scripts/bench_fsdp.py --cases gpt2:16:1024 --variants plain-nogc,fsdp-blocks-auto-unit0-localopt-units-nogc \
        --grad-accum 4
    # CPU smoke test (CI)
    python scripts/bench_fsdp.py --device cpu --cases tiny:2:32 --variants plain,fsdp-blocks --no-compile \
        --warmup 1 --steps 1 --profile-steps 1 --out /tmp/fsdp

Each cell runs in a process of its own (spawned), so that nothing of an earlier cell (compiled code, FSDP2's hooks
and buffers kept alive by reference cycles, allocator segments) reaches its timing or its peak memory.

Writes results.json (after every cell) and results.md to --out (default: a fresh outputs/bench/fsdp-<date>_<time>/).
"""

import argparse
import gc
import multiprocessing
import socket
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import GPT  # noqa: E402
from scripts.common import (  # noqa: E402
    add_autograd_thread_option,
    attempt,
    backward_thread,
    cprofile_table,
    default_out,
    fmt,
    run_meta,
    write_report,
)
from scripts.profile_step import category, preset_config  # noqa: E402
from training import distributed  # noqa: E402
from training.config import Distributed, FsdpConfig, Reshard, TrainConfig  # noqa: E402
from training.metrics import flops_per_token, peak_flops  # noqa: E402
from training.optim import ShardAdamW, apply_step, build_optimizer, clip_gradients, is_fused  # noqa: E402

# A variant's name: `plain`, `fsdp-model` or `fsdp-blocks`, then any of these suffixes (unit with a number), and
# last -nogc, the only suffix of plain (parse_variant)
OPTIONS = ("auto", "never", "prefetch", "unit", "localopt", "units", "fp32gather", "multi")
DEFAULT_VARIANTS = "plain-nogc,fsdp-blocks-auto,fsdp-blocks-auto-unit0-localopt-units-nogc"  # plain, before, defaults
# FSDP2's ranges of each unit's hooks (its post-backward has none of its own: these three parts)
HOOKS = ("pre_forward", "post_forward", "pre_backward", "post_backward_accumulate", "post_backward_reshard",
         "post_backward_reduce")
CASES = "gpt2:16:1024,gpt2-xl:8:1024,llama-3.2-1b:8:2048"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=CASES, help="comma list of preset:batch:seq_len (conf/model/<preset>.yaml)")
    p.add_argument("--variants", type=variant_list, default=variant_list(DEFAULT_VARIANTS),
                   help="comma list of plain, fsdp-model, fsdp-blocks, each with optional suffixes -auto|-never "
                        "(reshard policy; default always), -prefetch, -unitN (blocks per unit; 0: sized by "
                        "parameters), -localopt, -units (a graph per unit), -fp32gather (fp32 weights gathered), "
                        "-multi (a multi-GPU run's reshard policy), -nogc")
    p.add_argument("--attention", default="sdpa")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--cprofile-steps", type=int, default=0, help="steps under cProfile (0: none), after the others")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per step (each of the case's batch), gradients reduced in the last")
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    add_autograd_thread_option(p)
    p.add_argument("--budget", type=float, default=0, help="seconds: start no cell after this many (0: no limit)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def parse_variant(name: str) -> tuple[FsdpConfig | None, bool]:
    """(the FSDP settings of a variant, None for plain; whether Python's automatic garbage collection is off while
    it is timed). `fsdp-blocks-never-unit4-localopt`: FsdpConfig(reshard_after_forward=never, blocks_per_unit=4,
    local_optimizer=True)."""
    parts = name.split("-")
    nogc = parts[-1] == "nogc"
    parts = parts[:-1] if nogc else parts
    if parts == ["plain"]:
        return None, nogc
    if parts[:2] not in (["fsdp", "model"], ["fsdp", "blocks"]):
        raise ValueError(f"unknown variant {name}: it is plain, or starts with fsdp-model or fsdp-blocks")
    fsdp = FsdpConfig(reshard_after_forward=Reshard.always, blocks_per_unit=1, prefetch=0,  # the names' settings,
                      compile_blocks=parts[1] == "blocks", local_optimizer=False, compile_units=False)  # not defaults
    for suffix in parts[2:]:
        option = suffix.rstrip("0123456789")
        number = suffix.removeprefix(option)  # -unitN only
        if option not in OPTIONS or bool(number) != (option == "unit"):
            raise ValueError(f"unknown suffix -{suffix} in {name}: choose from -auto, -never, -prefetch, -unitN, "
                             "-localopt, -units, -fp32gather, -multi, -nogc")
        if option in ("auto", "never"):
            fsdp.reshard_after_forward = Reshard(option)
        elif option == "unit":
            fsdp.blocks_per_unit = int(number)
        elif option == "prefetch":
            fsdp.prefetch = 1
        elif option == "units":
            fsdp.compile_units = True
        elif option == "fp32gather":
            fsdp.gather_fp32 = True
        elif option == "multi":
            pass  # not a setting: the world size build_step gives the reshard policy
        else:
            fsdp.local_optimizer = True
    return fsdp, nogc


def variant_list(text: str) -> list[str]:
    """An argparse type: a comma list of variant names, each checked by parse_variant."""
    names = text.split(",")
    for name in names:
        try:
            parse_variant(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    return names


def join_world_of_one(device: torch.device) -> None:
    """A process group of this process alone (what `torchrun --nproc_per_node=1` would set up), on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def build_step(preset: str, batch: int, seq_len: int, variant: str, args: argparse.Namespace
               ) -> tuple[Callable[[list[float] | None], None], GPT, float]:
    """The step of one cell, its model, and its training FLOPs per token."""
    config = preset_config(preset, seq_len, args.attention)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with device:
        model = GPT(config)
    c = config
    flops = flops_per_token(model.num_params(), c.n_layer, c.n_head, c.head_dim, seq_len)
    fsdp, _ = parse_variant(variant)
    ctx = distributed.Context(Distributed.fsdp if fsdp else Distributed.none, device)
    policy_ctx = replace(ctx, world_size=2) if "multi" in variant.split("-") else ctx  # only wrap sees it
    parallel, step_model = distributed.wrap(model, policy_ctx, dtype, args.compile, fsdp)
    train = TrainConfig(distributed=Distributed.fsdp, fsdp=fsdp) if fsdp else TrainConfig()
    optimizer = build_optimizer(model, train, device.type)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    fold = is_fused(optimizer) and (fsdp is None or isinstance(optimizer, ShardAdamW))  # as training/loop.py: build
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    x = torch.randint(0, config.vocab_size, (batch, seq_len), device=device)
    y = torch.randint(0, config.vocab_size, (batch, seq_len), device=device)

    def step(marks: list[float] | None = None) -> None:  # training/loop.py: train_step
        mark = marks.append if marks is not None else lambda t: None
        for micro in range(args.grad_accum):  # the marks time the last micro-batch's forward and backward
            last = micro == args.grad_accum - 1
            with distributed.gradient_sync(parallel, last):
                with autocast:
                    _, loss = step_model(x, y, return_logits=False)
                if last:
                    mark(time.perf_counter())
                (loss / args.grad_accum).backward()
        mark(time.perf_counter())
        params = [p for p in model.parameters() if p.grad is not None]
        norm = clip_gradients(optimizer, params, 1.0, fold=fold)
        bad = ctx.any(~(torch.isfinite(loss.detach()) & torch.isfinite(distributed.full_tensor(norm))))
        apply_step(optimizer, scaler, skip=bad)
        optimizer.zero_grad(set_to_none=True)
        mark(time.perf_counter())

    return step, model, flops


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals, in the intervals' unit."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def trace_summary(prof: torch.profiler.profile, n_steps: int, n_units: int) -> dict[str, Any]:
    """GPU busy time, kernel time by category and FSDP2's CPU ranges, per step."""
    kernels, by_cat, fsdp = [], defaultdict(float), defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation:
            kernels.append((e.time_range.start, e.time_range.end))
            kind = "collective" if "nccl" in e.name.lower() else category(e.name)  # FSDP2's copies: copy/fill
            by_cat[kind] += e.device_time / 1e3 / n_steps
        elif e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("FSDP::"):
            fsdp[e.name.split(" ")[0]] += e.cpu_time_total / 1e3 / n_steps  # "FSDP::pre_forward (transformer.h.3)"
    fsdp_total = sum(fsdp.get(f"FSDP::{hook}", 0.0) for hook in HOOKS)  # the hooks, not the ranges inside them
    return {"gpu_busy_ms": union_length(kernels) / 1e3 / n_steps, "kernel_ms_by_category": dict(by_cat),
            "fsdp_cpu_ms": dict(fsdp), "fsdp_cpu_ms_per_unit": fsdp_total / n_units if fsdp else 0.0}


def run_cell(case: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One cell, measured in a fresh process of its own."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(cell, case, variant, args).result()


def cell(case: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """measure() in this process, in a process group of its own, or why it failed (common.attempt)."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    join_world_of_one(device)
    try:
        with torch.autograd.set_multithreading_enabled(args.autograd_multithreading):  # as training/loop.py: run
            return attempt(lambda: measure(case, variant, args))
    finally:
        dist.destroy_process_group()


def measure(case: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    preset, batch, seq_len = case.split(":")
    fsdp, nogc = parse_variant(variant)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    step, model, flops = build_step(preset, int(batch), int(seq_len), variant, args)
    for _ in range(args.warmup):
        step()
    sync(device)
    warmup_s = time.perf_counter() - t0
    if nogc:
        gc.collect()
        gc.disable()
    host, phases = [], []
    for _ in range(args.steps):  # the host's own time: the queue is empty as each step starts
        marks = [time.perf_counter()]
        step(marks)
        host.append(marks[-1] - marks[0])
        phases.append([b - a for a, b in zip(marks, marks[1:], strict=False)])
        sync(device)
    t = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(device)
    wall_ms = (time.perf_counter() - t) * 1e3 / args.steps
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            step()
        sync(device)
    cprofile = cprofile_table(step, args.cprofile_steps, 40, lambda: sync(device)) if args.cprofile_steps else None
    gc.enable()
    tokens_per_sec = args.grad_accum * int(batch) * int(seq_len) / (wall_ms / 1e3)
    peak = peak_flops(torch.cuda.get_device_name(device), torch.bfloat16) if device.type == "cuda" else None
    blocks = list(model.transformer.h)
    units = -(-len(blocks) // distributed.blocks_per_unit(blocks, fsdp)) + 1 if fsdp else 0
    result = {"case": case, "variant": variant, "status": "ok", "tokens_per_sec": tokens_per_sec,
              "mfu": tokens_per_sec * flops / peak if peak else None, "step_ms": wall_ms,
              "host_ms": sorted(host)[len(host) // 2] * 1e3,
              # forward, backward, clip + optimizer + zero_grad: medians of each phase's host time
              "host_phases_ms": [sorted(p)[len(p) // 2] * 1e3 for p in zip(*phases, strict=True)],
              "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None,
              "warmup_s": warmup_s, "graphs": counters["stats"]["unique_graphs"],
              "frames_compiled": counters["frames"]["ok"], "graph_breaks": sum(counters["graph_break"].values()),
              "graph_break_reasons": list(counters["graph_break"])[:5],
              **trace_summary(prof, args.profile_steps, max(units, 1)), "cprofile": cprofile}
    return result


def plain_rates(cells: list[dict[str, Any]]) -> dict[tuple[str, bool], float]:
    """(case, garbage collection off) -> the median tokens/s of the case's plain cells of that kind: what "vs plain"
    divides by (a variant against the plain step with the same garbage collection, else the other)."""
    rates = defaultdict(list)
    for c in cells:
        fsdp, nogc = parse_variant(c["variant"])
        if fsdp is None and c["status"] == "ok":
            rates[c["case"], nogc].append(c["tokens_per_sec"])
    return {key: statistics.median(values) for key, values in rates.items()}


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [f"FSDP2 at world size 1 against the plain step on {meta['device']} (torch {meta['torch']}, "
             f"{meta['date']}), attention={meta['attention']}, {meta['dtype']}, "
             f"{'compiled' if meta['compile'] else 'eager'}, {meta['steps']} measured steps after {meta['warmup']}"
             f"{f' of {g} micro-batches' if (g := meta.get('grad_accum', 1)) > 1 else ''}, "
             f"the backward on {backward_thread(meta)}.",
             "",
             "| case | variant | tokens/s | vs plain | MFU | step ms | host ms | host fwd / bwd / opt ms | GPU busy ms "
             "| FSDP CPU ms/unit | graphs / breaks | peak reserved GiB |", "|---" * 12 + "|"]
    plain = plain_rates(results["cells"])
    for c in sorted(results["cells"], key=lambda c: c["case"]):  # stable: variants in run order
        if c["status"] != "ok":
            lines.append(f"| {c['case']} | {c['variant']} | {c['status']} |" + " |" * 9)
            continue
        nogc = parse_variant(c["variant"])[1]
        base = plain.get((c["case"], nogc)) or plain.get((c["case"], not nogc))
        ratio = c["tokens_per_sec"] / base if base else None
        lines.append(f"| {c['case']} | {c['variant']} | {c['tokens_per_sec']:,.0f} | {fmt(ratio, '.3f')}× | "
                     f"{fmt(c['mfu'], '.1%')} | {c['step_ms']:.1f} | {c['host_ms']:.1f} | "
                     f"{' / '.join(f'{ms:.1f}' for ms in c['host_phases_ms'])} | {c['gpu_busy_ms']:.1f} | "
                     f"{c['fsdp_cpu_ms_per_unit']:.2f} | {c['graphs']} / {c['graph_breaks']} | "
                     f"{fmt(c['peak_reserved_gib'], '.2f')} |")
    for c in results["cells"]:
        if c.get("cprofile"):
            lines += ["", f"## cProfile: {c['case']} {c['variant']}, {meta['cprofile_steps']} steps", "```",
                      c["cprofile"].strip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out = args.out or default_out("fsdp")
    device = torch.device(args.device)
    dtype = "bf16" if device.type == "cuda" else "fp32"
    results = {"meta": run_meta(device, attention=args.attention, dtype=dtype, compile=args.compile,
                                warmup=args.warmup, steps=args.steps, grad_accum=args.grad_accum,
                                cprofile_steps=args.cprofile_steps,
                                autograd_multithreading=args.autograd_multithreading), "cells": []}
    start = time.perf_counter()
    for variant in args.variants:  # variant by variant, so that a --budget leaves out the last variants of every case
        for case in args.cases.split(","):
            if args.budget and time.perf_counter() - start > args.budget:
                results["cells"].append({"case": case, "variant": variant, "status": "not run (budget)"})
                continue
            results["cells"].append({"case": case, "variant": variant, **run_cell(case, variant, args)})
            print(results["cells"][-1], flush=True)
            write_report(out, results)
    text = markdown(results)
    write_report(out, results, text)
    print(text)
    return results


if __name__ == "__main__":
    main()
