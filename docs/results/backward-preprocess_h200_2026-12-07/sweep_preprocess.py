"""Sweep the Gluon backward's preprocess (Δ = rowsum(dO ∘ O) and a zeroed fp32 dQ accumulator) over rows per program
and warps, against zero_() plus a Δ-only kernel, and time the cast of the accumulator into dQ. Needs a CUDA GPU.

    python docs/results/backward-preprocess_h200_2026-12-07/sweep_preprocess.py   # writes preprocess.json here
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from kernels.flash_kernels import _bwd_preprocess_kernel, _tile_ptrs  # noqa: E402

SHAPES = [(4, 32, 16384, 128), (1, 16, 16384, 128), (16, 12, 1024, 64), (4, 32, 4096, 64), (8, 16, 2048, 128)]


@triton.jit
def _delta_only(Out, DO, DELTA, so_b, so_h, so_t, so_d, sd_b, sd_h, sd_t, sd_d, H, T,
                HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    h = tl.program_id(1)
    b = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < T
    o = tl.load(_tile_ptrs(Out, b, h, rows, so_b, so_h, so_t, so_d, HEAD_DIM=HEAD_DIM), mask=ok[:, None], other=0.0)
    do = tl.load(_tile_ptrs(DO, b, h, rows, sd_b, sd_h, sd_t, sd_d, HEAD_DIM=HEAD_DIM), mask=ok[:, None], other=0.0)
    tl.store(DELTA + (b * H + h).to(tl.int64) * T + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


def graph_ms(fn: Callable[[], None], calls: int = 20, replays: int = 15) -> float:
    """Median ms per call of `calls` back-to-back calls captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def sweep(B: int, H: int, T: int, D: int) -> dict:
    o = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # the model's layout
    do = torch.randn_like(o)
    delta = torch.empty(B, H, T, device="cuda", dtype=torch.float32)
    acc = torch.empty(B * H * T * D + 4, device="cuda", dtype=torch.float32)  # dQ's sums and the 4-byte work queue
    ref = (o.float() * do.float()).sum(-1)
    cells = {}

    def fused(block: int, warps: int) -> None:
        _bwd_preprocess_kernel[(triton.cdiv(T, block), H, B)](o, do, delta, acc, *o.stride(), *do.stride(), H, T,
                                                               HEAD_DIM=D, BLOCK=block, num_warps=warps)

    def memset_and_delta(block: int, warps: int) -> None:
        acc.zero_()
        _delta_only[(triton.cdiv(T, block), H, B)](o, do, delta, *o.stride(), *do.stride(), H, T, HEAD_DIM=D,
                                                   BLOCK=block, num_warps=warps)

    for block in (16, 32, 64, 128):
        for warps in (2, 4, 8):
            if block * D > 128 * 128 and warps < 4:
                continue
            acc.fill_(1.0)
            fused(block, warps)
            torch.cuda.synchronize()
            assert torch.allclose(delta, ref, atol=1e-2, rtol=1e-3) and acc[:-3].abs().max().item() == 0
            cells[f"fused b{block} w{warps}"] = graph_ms(lambda b=block, w=warps: fused(b, w))
    for block in (32, 64, 128):
        for warps in (4, 8):
            cells[f"memset+delta b{block} w{warps}"] = graph_ms(lambda b=block, w=warps: memset_and_delta(b, w))
    cells["memset only"] = graph_ms(acc.zero_)
    dq = torch.empty(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    cells["cast dq.copy_(acc)"] = graph_ms(lambda: dq.copy_(acc[:-4].view(B, H, T, D)))
    return {"shape": [B, H, T, D], "GB": (2 * o.numel() * 2 + acc.numel() * 4) / 1e9, "cells": cells}


def main() -> None:
    rows = []
    for shape in SHAPES:
        row = sweep(*shape)
        rows.append(row)
        shipped = row["cells"]["fused b64 w4"]
        print(shape, f"{row['GB']:.3f} GB, as it ships {shipped:.4f} ms ({row['GB'] / shipped:.2f} TB/s)", flush=True)
        torch.cuda.empty_cache()
    out = Path(__file__).with_name("preprocess.json")
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
