"""Where the persistent Gluon forward's time per work item goes: cycle stamps of each phase of every item (a tile of
128 query rows of one head), read back from the kernel itself, on Hopper.

Run from the repository root on an H100 or H200:

    python scripts/trace_forward.py                                  # dense, packed and window rows at D = 128
    python scripts/trace_forward.py --cases dense:6,20,1536 packed:512 window:2048 --variants default \\
        FLASH_ATTN_O_IN_K=0

With FLASH_ATTN_TRACE_ITEMS=N the kernel records, for each program's first N items (kernels/flash_gluon.py:
_persistent_consumer, _persistent_producer), the multiprocessor's cycle counter at these points:

    consumer: start | Q landed | first S = Q Kᵀ done | its softmax done | key loop done | last P V done | O stored
    producer: start | first K issued | Q issued (after the consumers freed it) | every K/V issued

Each consumer phase is reported as the median over all traced items (µs, from the cycles and the global timer's
nanoseconds over the same span), per key tile of the item where it scales with them; `item` is the time from one
item's start to the next's. The traced kernel runs a few stamps more than the one that ships (same code otherwise).
Cases: dense:B,H,T (causal, --heads-kv a divisor of H via dense:B,H/H_kv,T), packed:L (4 rows of 16,384 tokens,
all examples of L tokens, 32/8 heads at D = 128, 15/5 at other head dims), lognormal (median 400, sigma 1),
window:W (1 x 16 x 16,384, window (W, 0)). --head-dim other than 128 (e.g. 64) forces the Gluon kernels on
(FLASH_ATTN_GLUON=1), which run there only when asked for.
--variants compares settings of the kernel's environment knobs side by side in the same process (e.g. `default
FLASH_ATTN_O_IN_K=0`): for each, the forward's GPU ms by CUDA-graph replay (untraced; medians of --rounds rounds that
alternate the variants) and the phases traced. Writes results.json and results.md to --out and prints the table.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import document_bounds, flash_attention, launch  # noqa: E402
from scripts.common import default_out, env_vars, graph_replay_ms, run_meta, write_report  # noqa: E402

PHASES = ["Q wait", "first S", "first softmax", "key loop", "last P V", "O store", "to next item"]


def case_inputs(spec: str, seed: int, D: int) -> tuple[tuple[torch.Tensor, ...], dict]:
    """(q, k, v) of head dim D and the flash_attention keywords of one case."""
    kind, _, arg = spec.partition(":")
    torch.manual_seed(seed)
    if kind == "dense":
        B, heads, T = arg.split(",")
        H, _, H_kv = heads.partition("/")
        B, H, T, H_kv = int(B), int(H), int(T), int(H_kv or H)
        shapes, kwargs = [(B, H, T), (B, H_kv, T), (B, H_kv, T)], {}
    elif kind in ("packed", "lognormal"):
        B, T = 4, 16384
        rng = np.random.default_rng(seed)
        rows = []
        for _ in range(B):
            row, left = [], T
            while left:
                n = int(arg) if kind == "packed" else int(np.clip(round(rng.lognormal(np.log(400), 1.0)), 1, T))
                row.append(min(n, left))
                left -= row[-1]
            rows.append(row)
        positions = torch.from_numpy(np.stack([np.concatenate([np.arange(n) for n in r]) for r in rows])).cuda()
        H, H_kv = (32, 8) if D == 128 else (15, 5)
        shapes, kwargs = [(B, H, T), (B, H_kv, T), (B, H_kv, T)], {"documents": document_bounds(positions)}
    elif kind == "window":
        shapes, kwargs = [(1, 16, 16384)] * 3, {"window": (int(arg), 0)}
    else:
        raise SystemExit(f"unknown case {spec!r}: use dense:B,H[/H_kv],T, packed:L, lognormal or window:W")
    q, k, v = (torch.randn(*s, D, device="cuda", dtype=torch.bfloat16) for s in shapes)
    return (q, k, v), kwargs


def phases(trace: torch.Tensor) -> dict:
    """Median µs of each consumer phase over every traced item, and the items' key tiles."""
    t = trace.cpu().numpy()  # (programs, 3, items, 8)
    cons, prod = t[:, :2], t[:, 2]
    used = cons[..., 0] != 0  # items that ran
    tiles = np.broadcast_to(prod[:, None, :, 4], cons.shape[:3])
    # cycles -> µs: the global timer (ns, slot 7) against the cycle counter (slot 0) across each warpgroup's items
    rates = []
    for p in range(cons.shape[0]):
        for w in range(2):
            idx = np.flatnonzero(used[p, w])
            if len(idx) > 1 and cons[p, w, idx[-1], 7] > cons[p, w, idx[0], 7]:
                rates.append((cons[p, w, idx[-1], 0] - cons[p, w, idx[0], 0]) / (cons[p, w, idx[-1], 7] -
                                                                                 cons[p, w, idx[0], 7]))
    ghz = statistics.median(rates)
    us = lambda cycles: float(np.median(cycles)) / ghz / 1e3  # noqa: E731
    d = np.diff(cons[..., :7], axis=-1)  # (programs, 2, items, 6): the six phases within an item
    nxt = np.full(cons.shape[:3], np.nan)
    nxt[..., :-1] = np.where(used[..., 1:], cons[..., 1:, 0] - cons[..., :-1, 6], np.nan)
    row = {"GHz": ghz, "items": int(used.sum()), "tiles per item": float(np.median(tiles[used]))}
    for i, name in enumerate(PHASES[:6]):
        row[name] = us(d[..., i][used])
    row["key loop per tile"] = us((d[..., 3] / np.maximum(tiles - 1, 1))[used & (tiles > 1)])
    gaps = nxt[used & ~np.isnan(nxt)]
    row["to next item"] = us(gaps) if gaps.size else float("nan")
    whole = np.where(used[..., 1:], cons[..., 1:, 0] - cons[..., :-1, 0], np.nan)
    row["item"] = us(whole[~np.isnan(whole)])
    row["producer: Q issued after start"] = us((prod[..., 2] - prod[..., 0])[prod[..., 0] != 0])
    return row


def variant_env(variant: str) -> dict[str, str]:
    """`default` (the environment as it is) or NAME=VALUE[,NAME=VALUE...]."""
    return {} if variant == "default" else dict(item.split("=", 1) for item in variant.split(","))


def add_options(p: argparse.ArgumentParser, topic: str) -> None:
    """The options the trace scripts share: --variants, --rounds, --seed, --out (default outputs/bench/<topic>-...)."""
    p.add_argument("--variants", nargs="+", default=["default"], help="default, or NAME=VALUE[,NAME=VALUE...]")
    p.add_argument("--rounds", type=int, default=3, help="timing rounds, the variants alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--head-dim", type=int, default=128, help="other than 128: with FLASH_ATTN_GLUON=1")
    p.add_argument("--out", type=Path, default=None, help=f"default: a fresh outputs/bench/{topic}-<time>/")


def gluon_env(head_dim: int) -> dict[str, str]:
    """The environment that runs the Gluon kernels at this head dim (auto runs them at D = 128)."""
    return {} if head_dim == 128 else {"FLASH_ATTN_GLUON": "1"}


def call_ms(call, replays: int) -> float:
    """GPU ms of one call (a forward, or a forward and backward), by CUDA-graph replay of ~20 ms of calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    n = max(1, min(200, int(20 / max(start.elapsed_time(end), 1e-3))))
    with torch.cuda.stream(torch.cuda.Stream()):  # graphs are captured off the default stream
        return graph_replay_ms(lambda n: [call() for _ in range(n)], n, replays=replays)


def variant_ms(call, variants: list[str], rounds: int) -> dict[str, float]:
    """Median GPU ms of `call` under each variant's environment: all compiled and warmed first, then `rounds` rounds
    that alternate the variants, so drift on the GPU falls on all of them alike."""
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    for variant in variants:  # compile, then warm
        with env_vars(variant_env(variant)):
            for _ in range(3):
                call()
    for _ in range(rounds):
        for variant in variants:
            with env_vars(variant_env(variant)):
                times[variant].append(call_ms(call, 5))
    return {variant: statistics.median(ms) for variant, ms in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["dense:6,20,1536", "dense:4,16,4096", "dense:1,16,16384",
                                                   "packed:512", "packed:2048", "lognormal", "window:2048"])
    p.add_argument("--items", type=int, default=64, help="items traced per program")
    add_options(p, "trace-forward")
    args = p.parse_args()
    out = args.out or default_out("trace-forward")
    results = {"meta": run_meta(torch.device("cuda"), items=args.items, variants=args.variants,
                                head_dim=args.head_dim), "cases": {}}
    for spec in args.cases:
        (q, k, v), kwargs = case_inputs(spec, args.seed, args.head_dim)
        forward = functools.partial(flash_attention, q, k, v, causal=True, **kwargs)
        with env_vars(gluon_env(args.head_dim)):
            ms = variant_ms(forward, args.variants, args.rounds)
            for variant in args.variants:
                with env_vars({**variant_env(variant), "FLASH_ATTN_TRACE_ITEMS": str(args.items)}):
                    forward()
                    torch.cuda.synchronize()
                row = {"forward ms": ms[variant], **phases(launch.last_forward_trace)}
                results["cases"][f"{spec} {variant}"] = row
                write_report(out, results)
                print(spec, variant, json.dumps(row), flush=True)
    cols = ["forward ms", "tiles per item", "item", *PHASES[:4], "key loop per tile", "last P V", "O store",
            "to next item", "producer: Q issued after start"]
    lines = ["| case, variant | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, row in results["cases"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")
    table = "\n".join(lines)
    meta = results["meta"]
    markdown = (f"Persistent Gluon forward on {meta['device']} (torch {meta['torch']}, triton {meta['triton']}, "
                f"{meta['date']}, D = {args.head_dim}): forward GPU ms by CUDA-graph replay, then the phases of "
                f"each work item, µs, medians over every traced item\n\n{table}\n")
    write_report(out, results, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
