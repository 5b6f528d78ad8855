"""Benchmark decode attention alone: our split-KV kernel (`kernels.flash_decode`) against PyTorch's SDPA.

Run from the repository root on a machine with a CUDA GPU:

    python scripts/bench_decode.py                                # default shapes, bf16 -> outputs/bench/decode-<time>/
    python scripts/bench_decode.py --shapes 16,32/8,8192,128 1,12,1024,64 --out /tmp/bench
    python scripts/bench_decode.py --methods ours,sdpa-default --num-splits 16    # force our split count
    TRITON_INTERPRET=1 python scripts/bench_decode.py --shapes 2,4/2,48,32        # CPU smoke run (interpreter)

A shape is B,Hq/Hkv,S,D, or B,H,S,D when Hq = Hkv: one query per sequence (Tq = 1) against a cache of S keys that
every row fills (lengths = S), the steady state of batched decoding. SDPA gets q (B, Hq, 1, D) and k, v
(B, Hkv, S, D) holding exactly those S keys, is_causal=False, enable_gqa when Hq != Hkv. Methods:

  ours               kernels.flash_decode, with the split count it picks (or --num-splits)
  sdpa-default       SDPA's own choice; the kernel that ran is found with torch.profiler (model/attention.py)
  sdpa-<kernel>      SDPA pinned to one of flash, efficient, cudnn, math; n/a if it cannot run the shape

For every shape and method: the median GPU time per call, the KV cache read per second (2·B·Hkv·S·D·bytes per
element / time; the query and output are negligible) and that as a percentage of the GPU's peak memory bandwidth
(--peak-bw, default the H200's 4.8e12 B/s). GPU time is measured as scripts/bench_attention.py does: calls captured
back to back in one CUDA graph and replayed, so no method waits for its host. A decode step reads a layer's cache
from HBM (the other layers' caches and weights pass through L2 in between), so the calls cycle through enough copies
of the cache that together they exceed twice the L2 cache. Per shape it also reports our speed over the best SDPA
method's (its time over ours: > 1 means ours is faster), the kernel SDPA's default picked, our split plan, and the
max abs difference of our output from SDPA default's.

On CPU (TRITON_INTERPRET=1, for tests) times are wall-clock medians of a few eager calls, meaningless as
performance. Results go to --out (default: a fresh folder under outputs/bench/) as bench.json and bench.md, with the
device, versions, date and command; the markdown table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import env, flash_decode  # noqa: E402
from kernels.decode import decode_plan  # noqa: E402
from model.attention import SDPA_BACKENDS, pinned_sdpa  # noqa: E402
from scripts.common import NotAvailable, attempt, choice_list, default_out, fmt, graph_replay_ms, run_meta, write_report  # noqa: E402
from training.metrics import detect_sdpa_kernel  # noqa: E402

DEFAULT_SHAPES = ["16,32/8,8192,128", "64,32/8,4096,128", "1,32/8,32768,128", "16,12,2048,64", "1,12,1024,64"]
PINNED = {f"sdpa-{name}": name for name in SDPA_BACKENDS}  # method -> SDPA kernel
METHODS = ["ours", "sdpa-default", *PINNED]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
H200_PEAK_BW = 4.8e12  # B/s, HBM3e
CPU_CALLS = 3  # timed eager calls per method on CPU
MAX_CACHE_COPIES = 64  # tiny caches stay L2-resident rather than take thousands of copies


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """B,Hq/Hkv,S,D or B,H,S,D -> (B, Hq, Hkv, S, D)."""
    B, heads, S, D = text.split(",")
    Hq, _, Hkv = heads.partition("/")
    return int(B), int(Hq), int(Hkv or Hq), int(S), int(D)


def label(row: dict) -> str:
    heads = row["Hq"] if row["Hkv"] == row["Hq"] else f"{row['Hq']}/{row['Hkv']}"
    return f"{row['B']},{heads},{row['S']},{row['D']}"


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA's own choice of kernel: one query per row against every cached key."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=k.shape[1] != q.shape[1])


def call(method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
         num_splits: int | None) -> Callable[[], torch.Tensor]:
    """A zero-argument decode-attention call of `method` on one cache."""
    if method == "ours":
        return lambda: flash_decode(q, k, v, lengths, num_splits=num_splits)
    if method == "sdpa-default":
        return lambda: sdpa(q, k, v)
    attend = pinned_sdpa(PINNED[method])

    def pinned() -> torch.Tensor:
        try:
            return attend(q, k, v, causal=False)
        except RuntimeError as e:  # the pinned kernel rejects these inputs
            raise NotAvailable(str(e).splitlines()[0]) from e

    return pinned


def l2_bytes(device: torch.device) -> int:
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 * 2**20


def gpu_us(calls: list[Callable[[], object]], rep_ms: float = 50.0, max_calls: int = 2000, replays: int = 10) -> float:
    """Median GPU µs per call: about rep_ms worth of calls (cycling through `calls`, one per cache copy; at most
    max_calls) captured back to back in one CUDA graph on the current stream, then replayed `replays` times."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for fn in calls:
        fn()
    end.record()
    torch.cuda.synchronize()
    per_call_ms = max(start.elapsed_time(end) / len(calls), 1e-4)
    n = len(calls) * max(1, min(max_calls, int(rep_ms / per_call_ms)) // len(calls))

    def cycle(n: int) -> None:
        for i in range(n):
            calls[i % len(calls)]()

    return graph_replay_ms(cycle, n, replays) * 1e3


def cpu_us(calls: list[Callable[[], object]]) -> float:
    """Median wall-clock µs of CPU_CALLS eager calls (CPU runs: a smoke test, not a measurement)."""
    times = []
    for _ in range(CPU_CALLS):
        t0 = time.perf_counter()
        calls[0]()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def inputs(row: dict, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, list[tuple], torch.Tensor]:
    """q (B, Hq, 1, D), copies of the (k, v) cache (B, Hkv, S, D) totalling more than twice the L2 cache on a GPU
    (at most MAX_CACHE_COPIES; one on CPU), lengths (B,) = S."""
    B, Hq, Hkv, S, D = (row[key] for key in ("B", "Hq", "Hkv", "S", "D"))
    copies = min(MAX_CACHE_COPIES, math.ceil(2 * l2_bytes(device) / row["kv_bytes"])) if device.type == "cuda" else 1
    q = torch.randn(B, Hq, 1, D, device=device, dtype=dtype)
    caches = [tuple(torch.randn(B, Hkv, S, D, device=device, dtype=dtype) for _ in range(2)) for _ in range(copies)]
    return q, caches, torch.full((B,), S, device=device, dtype=torch.int32)


def measure(method: str, q: torch.Tensor, caches: list[tuple], lengths: torch.Tensor, num_splits: int | None,
            row: dict, peak_bw: float) -> dict:
    calls = [call(method, q, k, v, lengths, num_splits) for k, v in caches]
    calls[0]()  # first call: compiles, plans, or finds the method cannot run the shape (NotAvailable)
    us = gpu_us(calls) if q.is_cuda else cpu_us(calls)
    bytes_per_s = row["kv_bytes"] / (us * 1e-6)
    return {"us": us, "bytes_per_s": bytes_per_s, "pct_peak_bw": 100 * bytes_per_s / peak_bw}


def run(shapes: list[tuple], methods: list[str], dtype: torch.dtype, device: torch.device, num_splits: int | None,
        peak_bw: float, out_dir: Path, meta: dict) -> dict:
    """Shape-major; the report files are rewritten after every shape, so a run cut short keeps what it measured."""
    element = torch.finfo(dtype).bits // 8
    rows = [{"B": B, "Hq": Hq, "Hkv": Hkv, "S": S, "D": D, "kv_bytes": 2 * B * Hkv * S * D * element, "methods": {}}
            for B, Hq, Hkv, S, D in shapes]
    report = {"meta": meta, "rows": rows}
    stream = torch.cuda.Stream() if device.type == "cuda" else None  # CUDA graphs cannot capture the legacy stream
    for row in rows:
        torch.manual_seed(0)
        q, caches, lengths = inputs(row, dtype, device)
        k, v = caches[0]
        if stream is not None:  # the inputs were written on the default stream: the side stream waits for them
            stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            row["plan"] = dataclasses.asdict(decode_plan(q, k, num_splits))
            row["max_abs_diff_vs_sdpa"] = (flash_decode(q, k, v, lengths, num_splits=num_splits).float()
                                           - sdpa(q, k, v).float()).abs().max().item()
            row["sdpa_default_kernel"] = detect_sdpa_kernel(functools.partial(sdpa, q, k, v))[1]
            for method in methods:
                res = attempt(functools.partial(measure, method, q, caches, lengths, num_splits, row, peak_bw))
                row["methods"][method] = res
                print(f"[{label(row)}] {method}: {summary(res)}", flush=True)
        del q, caches, lengths, k, v
        if device.type == "cuda":
            torch.cuda.empty_cache()
        add_ratios(row)
        write_report(out_dir, report, name="bench")
    write_report(out_dir, report, render_markdown(report), name="bench")
    return report


def add_ratios(row: dict) -> None:
    """The fastest SDPA method and our speed over it (its time / ours), where both ran."""
    timed = {m: res["us"] for m, res in row["methods"].items() if m.startswith("sdpa") and "us" in res}
    if timed:
        row["best_sdpa"] = min(timed, key=timed.get)
        ours = row["methods"].get("ours", {})
        if "us" in ours:
            row["ours_over_best_sdpa"] = timed[row["best_sdpa"]] / ours["us"]


def summary(res: dict) -> str:
    if "status" in res:
        return res["status"] + (f" ({res['reason'][:120]})" if "reason" in res else "")
    return f"{res['us']:.1f} µs, {res['bytes_per_s'] / 1e12:.2f} TB/s ({res['pct_peak_bw']:.0f} % of peak)"


def cell(res: dict | None) -> str:
    """µs and TB/s of a method, or its status."""
    if res is None:
        return "–"
    if "status" in res:
        return res["status"]
    return f"{res['us']:.1f} ({res['bytes_per_s'] / 1e12:.2f})"


def render_markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# Decode attention benchmark: {meta['device']}", "",
             f"{meta['date']} · torch {meta['torch']} · triton {meta['triton']} · CUDA {meta['cuda']} · dtype "
             f"{meta['dtype']} · Tq = 1, every row's cache full (lengths = S) · median µs per call ({meta['timing']}) "
             f"and, in parentheses, KV cache TB/s = 2·B·Hkv·S·D·bytes / time · peak {meta['peak_bw'] / 1e12:.1f} "
             "TB/s", "",
             "| B,Hq/Hkv,S,D | KV MiB | ours µs (TB/s) | % of peak | splits | SDPA default µs (kernel) | "
             + " | ".join(f"{m} µs" for m in PINNED) + " | ours / best SDPA | max abs diff vs SDPA |",
             "|---|---|---|---|---|---|" + "---|" * len(PINNED) + "---|---|"]
    for row in report["rows"]:
        m = row["methods"]
        ours, default = m.get("ours"), m.get("sdpa-default")
        pct = fmt(ours.get("pct_peak_bw") if ours else None, ".0f")
        kernel = f" ({row['sdpa_default_kernel']})" if "sdpa_default_kernel" in row else ""
        best = (f"{row['ours_over_best_sdpa']:.2f} ({row['best_sdpa']})" if "ours_over_best_sdpa" in row else "–")
        lines.append(f"| {label(row)} | {row['kv_bytes'] / 2**20:.1f} | {cell(ours)} | {pct} | "
                     f"{row.get('plan', {}).get('n_splits', '–')} | {cell(default)}{kernel} | "
                     + " | ".join(cell(m.get(p)) for p in PINNED)
                     + f" | {best} | {fmt(row.get('max_abs_diff_vs_sdpa'), '.1e')} |")
    lines += ["", "ours / best SDPA: the fastest SDPA method's time over ours (> 1: ours is faster). n/a: that SDPA "
              "kernel cannot run the shape."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="B,Hq/Hkv,S,D (or B,H,S,D)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--methods", type=choice_list(METHODS), default=METHODS,
                        help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--num-splits", type=int, default=None, help="force our split count (default: its own)")
    parser.add_argument("--peak-bw", type=float, default=H200_PEAK_BW, help="peak memory bandwidth, B/s")
    parser.add_argument("--out", type=Path, default=None, help="default: a fresh folder under outputs/bench/")
    args = parser.parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif env.INTERPRET:
        device = torch.device("cpu")
    else:
        sys.exit("bench_decode.py needs a CUDA GPU (or TRITON_INTERPRET=1 for a CPU smoke run)")
    out = args.out or default_out("decode")
    timing = ("GPU time: calls back to back in a CUDA graph, cycling through cache copies larger than L2"
              if device.type == "cuda" else "CPU wall-clock time of eager calls through the interpreter (not a "
              "measurement)")
    meta = run_meta(device, dtype=args.dtype, num_splits=args.num_splits, peak_bw=args.peak_bw, timing=timing)
    report = run([parse_shape(s) for s in args.shapes], args.methods, DTYPES[args.dtype], device, args.num_splits,
                 args.peak_bw, out, meta)
    print(render_markdown(report))


if __name__ == "__main__":
    main()
