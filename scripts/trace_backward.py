"""Where the warp-specialised Gluon backward's time per step goes (one step: 64 query rows of one head against a
program's 128 keys): cycle stamps of each phase of every step, read back from the kernel itself, on Hopper.

Run from the repository root on an H100 or H200:

    python scripts/trace_backward.py                                 # dense, packed and window rows at D = 128
    python scripts/trace_backward.py --cases packed:512 window:2048 --variants default FLASH_ATTN_PERSISTENT_BACKWARD=1

With FLASH_ATTN_TRACE_ITEMS=N the backward with one program per key tile (kernels/flash_gluon.py: _ws_step; the
script sets FLASH_ATTN_PERSISTENT_BACKWARD=0 for the traced call, which bounded rows run anyway) records, for each
consumer warpgroup's first N steps, the multiprocessor's cycle counter at these points:

    start | Q, dO, LSE, Δ landed | Sᵀ = K Qᵀ done | Pᵀ and dSᵀ computed | both warpgroups' dSᵀ stored |
    dV, dK and dQ matmuls done | the last step's dQ has left the stage | this step's dQ addition issued

Each phase is reported as the median over all traced steps (µs: the cycles at the rate the traced forward of the same
call measured, scripts/trace_forward.py), `step` is the time from one step's start to the next's, and `steps per
program` the median number of steps of a key tile. --variants times fwd+bwd (CUDA-graph replay, the backward as it
ships) with knob settings side by side, as scripts/trace_forward.py times the forward. Cases as trace_forward.py's.
Writes results.json and results.md to --out and prints the table.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import flash_attention, launch  # noqa: E402
from scripts.common import default_out, env_vars, run_meta, write_report  # noqa: E402
from scripts.trace_forward import add_options, case_inputs, gluon_env, phases, variant_env, variant_ms  # noqa: E402

PHASES = ["Q wait", "S", "P and dS", "dS exchange", "dV dK dQ", "dQ stage free", "dQ add", "to next step"]


def fwd_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, kwargs: dict) -> None:
    """One forward and backward, the gradients dropped first (as a training step's zero_grad(set_to_none=True))."""
    for x in (q, k, v):
        x.grad = None
    flash_attention(q, k, v, causal=True, **kwargs).backward(do)


def step_phases(trace: torch.Tensor, ghz: float) -> dict:
    """Median µs of each phase over every traced step of every program and warpgroup."""
    t = trace.cpu().numpy().reshape(-1, trace.shape[-2], 8)  # (programs x warpgroups, steps, 8)
    used = t[..., 0] != 0
    us = lambda cycles: float(np.median(cycles)) / ghz / 1e3  # noqa: E731
    d = np.diff(t, axis=-1)  # (.., steps, 7): the seven phases within a step
    row = {"GHz": ghz, "steps": int(used.sum()), "steps per program": float(np.median(used.sum(-1)[used.any(-1)]))}
    for i, name in enumerate(PHASES[:7]):
        row[name] = us(d[..., i][used])
    later = used[:, 1:] & used[:, :-1]
    row["to next step"] = us((t[:, 1:, 0] - t[:, :-1, 7])[later])
    row["step"] = us((t[:, 1:, 0] - t[:, :-1, 0])[later])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["dense:6,20,1536", "dense:4,16,4096", "packed:512", "packed:2048",
                                                   "lognormal", "window:2048"])
    p.add_argument("--steps", type=int, default=64, help="steps traced per program and warpgroup")
    add_options(p, "trace-backward")
    args = p.parse_args()
    out = args.out or default_out("trace-backward")
    results = {"meta": run_meta(torch.device("cuda"), steps=args.steps, variants=args.variants,
                                head_dim=args.head_dim), "cases": {}}
    for spec in args.cases:
        (q, k, v), kwargs = case_inputs(spec, args.seed, args.head_dim)
        for x in (q, k, v):
            x.requires_grad_()
        do = torch.randn_like(q)

        step = functools.partial(fwd_bwd, q, k, v, do, kwargs)

        with env_vars(gluon_env(args.head_dim)):
            ms = variant_ms(step, args.variants, args.rounds)
            for variant in args.variants:
                with env_vars({**variant_env(variant), "FLASH_ATTN_TRACE_ITEMS": str(args.steps),
                               "FLASH_ATTN_PERSISTENT_BACKWARD": "0"}):
                    step()
                    torch.cuda.synchronize()
                ghz = phases(launch.last_forward_trace)["GHz"]
                row = {"fwd+bwd ms": ms[variant], **step_phases(launch.last_backward_trace, ghz)}
                results["cases"][f"{spec} {variant}"] = row
                write_report(out, results)
                print(spec, variant, json.dumps(row), flush=True)
    cols = ["fwd+bwd ms", "steps per program", "step", *PHASES]
    lines = ["| case, variant | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for name, row in results["cases"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")
    meta = results["meta"]
    markdown = (f"Warp-specialised Gluon backward on {meta['device']} (torch {meta['torch']}, triton {meta['triton']}, "
                f"{meta['date']}, D = {args.head_dim}): fwd+bwd GPU ms by CUDA-graph replay, then the phases of "
                f"each step, µs, medians over every traced step\n\n" + "\n".join(lines) + "\n")
    write_report(out, results, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
