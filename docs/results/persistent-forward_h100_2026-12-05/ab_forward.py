"""Forward and fwd+bwd GPU time of our kernel at D = 128 (D = 64 with --d64) under chosen FLASH_ATTN_GLUON and
FLASH_ATTN_PERSISTENT settings, side by side in one process: dense rows, packed rows and a sliding window.

    python docs/results/persistent-forward_h100_2026-12-05/ab_forward.py OUT.json LABEL MODES [--d64]

MODES is a comma list of `[GLUON-]PERSISTENT` settings, e.g. `0,1` (FLASH_ATTN_PERSISTENT=0, then 1) or `0-0,1-1`.
KROOT=<checkout> times the kernels of another checkout (the kernels read no FLASH_ATTN_PERSISTENT before it existed).
Each cell: CUDA-graph replay, median of 7 replays of 10 forwards or 5 forward+backwards, bf16; `out` is the sum of one
output, equal across settings when they compute the same bits.
"""

import functools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, os.environ.get("KROOT", str(ROOT)))
sys.path.insert(1, str(ROOT))
import torch  # noqa: E402

from kernels import document_bounds, flash_attention  # noqa: E402
from scripts.bench_varlen import pack_rows, parse_lengths, positions_of  # noqa: E402
from scripts.common import graph_replay_ms  # noqa: E402

out_path, label, modes = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
d64 = "--d64" in sys.argv
HD = 64 if d64 else 128
cases = []  # (name, B, H, H_kv, T, causal, bounds)
for B, H, Hkv, T, causal in [(1, 16, 16, 16384, True), (4, 16, 16, 4096, True), (4, 32, 8, 4096, True),
                             (8, 16, 16, 2048, False), (6, 20, 20, 1536, True), (16, 12, 12, 1024, True)]:
    cases.append((f"dense {B},{H}/{Hkv},{T},{HD},{int(causal)}", B, H, Hkv, T, causal, {}))
H, Hkv = (15, 5) if d64 else (32, 8)
for spec in ["lognormal:400:1.0", "fixed:512", "fixed:2048"]:
    positions = positions_of(pack_rows(parse_lengths(spec), 4, 16384, 0)).cuda()
    cases.append((f"packed {spec} 4x16384 {H}/{Hkv}", 4, H, Hkv, 16384, True,
                  {"documents": document_bounds(positions)}))
cases.append(("window 2048 1x16384 16", 1, 16, 16, 16384, True, {"window": (2048, 0)}))


def forwards(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool, bounds: dict,
             n: int) -> None:
    for _ in range(n):
        flash_attention(q, k, v, causal=causal, **bounds)


def forward_backwards(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool, bounds: dict,
                      n: int) -> None:
    for _ in range(n):
        torch.autograd.grad(flash_attention(q, k, v, causal=causal, **bounds), (q, k, v), do)


side = torch.cuda.Stream()  # graphs are captured off the default stream
side.wait_stream(torch.cuda.current_stream())
torch.cuda.set_stream(side)
results = {}
for name, B, H, Hkv, T, causal, bounds in cases:
    torch.manual_seed(0)
    q = torch.randn(B, H, T, HD, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, T, HD, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, T, HD, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    args = (q, k, v, torch.randn_like(q), causal, bounds)
    for mode in modes:
        gluon, _, persistent = mode.rpartition("-")
        os.environ["FLASH_ATTN_GLUON"], os.environ["FLASH_ATTN_PERSISTENT"] = gluon or "auto", persistent

        forward_backwards(*args, 2)  # compiles and plans outside the capture
        torch.cuda.synchronize()
        cell = {"fwd": round(graph_replay_ms(functools.partial(forwards, *args), 10, 7), 4),
                "fwd_bwd": round(graph_replay_ms(functools.partial(forward_backwards, *args), 5, 7), 4),
                "out": flash_attention(q, k, v, causal=causal, **bounds).float().sum().item()}
        results[f"{name} | {label}{mode}"] = cell
        print(name, label + mode, cell, flush=True)
Path(out_path).write_text(json.dumps(results, indent=1))
