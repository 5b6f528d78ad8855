"""Host time per eager attention call: our kernel against SDPA, phase by phase, and where ours spends it.

Run from the repository root on a machine with a CUDA GPU:

    python scripts/bench_host_time.py                                   # default shapes -> outputs/bench/host-time-*/
    python scripts/bench_host_time.py --shapes 32,12,512,64,1 --methods triton,sdpa-cudnn --out /tmp/host

A shape is B,H,T,D,causal or B,H/H_kv,T,D,causal, as in scripts/bench_attention.py. For each shape and method it
runs loops of --calls calls with no synchronisation inside and reports the median over --loops loops of the wall time
per call: while the GPU queue absorbs the kernels, that is the Python, dispatch and launch time of one call. Phases:

  fwd-nograd     the forward under torch.no_grad()
  fwd            the forward with autograd recording (the graph is dropped)
  fwdbwd         out = f(q, k, v); out.backward(do), the backward on autograd's device thread (PyTorch's default)
  fwdbwd-1thread the same with torch.autograd.set_multithreading_enabled(False): the backward on the calling thread

Where a phase's host time exceeds the call's GPU time, eager calls run at the host's pace. The same run profiles
--profile-calls fwd+bwd calls of ours with cProfile (single-thread autograd, so the backward is seen) and lists the
functions with the most own time. Results: host.json and host.md in --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.bench_attention import PINNED, forward_fn, parse_shape  # noqa: E402
from scripts.common import NotAvailable, choice_list, default_out, run_meta, write_report  # noqa: E402

DEFAULT_SHAPES = ["32,12,512,64,1", "16,12,1024,64,1"]
METHODS = ["triton", "sdpa-default", *PINNED]


def host_us(fn: Callable[[], object], calls: int, loops: int) -> float:
    """Median over `loops` of the wall time per call of `calls` calls of fn, µs, synchronised only between loops."""
    times = []
    for _ in range(loops + 1):  # the first loop warms up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times[1:])


def phases(fwd: Callable[[], torch.Tensor], do: torch.Tensor, grads: list[torch.Tensor]) -> dict[str, Callable]:
    def no_grad() -> None:
        with torch.no_grad():
            fwd()

    def step() -> None:
        fwd().backward(do)
        for t in grads:
            t.grad = None

    return {"fwd-nograd": no_grad, "fwd": fwd, "fwdbwd": step}


def measure(method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool,
            calls: int, loops: int) -> dict[str, float]:
    grads = [q, k, v]
    try:
        fwd = forward_fn(method, q, k, v, causal)
        fwd().backward(do)  # compiles and autotunes outside the timed loops
    except (RuntimeError, NotAvailable) as e:
        return {"error": str(e).splitlines()[0]}
    timed = phases(fwd, do, grads)
    res = {name: host_us(fn, calls, loops) for name, fn in timed.items()}
    with torch.autograd.set_multithreading_enabled(False):
        res["fwdbwd-1thread"] = host_us(timed["fwdbwd"], calls, loops)
    return res


def profile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool, calls: int,
            top: int) -> str:
    """cProfile's table of our fwd+bwd, single-thread autograd, sorted by own time."""
    step = phases(forward_fn("triton", q, k, v, causal), do, [q, k, v])["fwdbwd"]
    with torch.autograd.set_multithreading_enabled(False):
        step()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            step()
        profiler.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="B,H,T,D,causal (causal 1 or 0)")
    parser.add_argument("--methods", type=choice_list(METHODS), default=METHODS,
                        help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--calls", type=int, default=50, help="calls per timed loop")
    parser.add_argument("--loops", type=int, default=15, help="timed loops; the median is reported")
    parser.add_argument("--profile-calls", type=int, default=200, help="fwd+bwd calls of ours under cProfile (0: none)")
    parser.add_argument("--top", type=int, default=40, help="functions listed from each profile")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or default_out("host-time")
    methods = args.methods
    device = torch.device("cuda")
    results: dict = {"meta": run_meta(device, calls=args.calls, loops=args.loops), "rows": []}
    lines = ["# Host time per eager attention call (µs, median)", "",
             f"{results['meta']['device']}, torch {torch.__version__}, bf16. Command: `{results['meta']['command']}`",
             "", "| B,H,T,D | causal | method | fwd-nograd | fwd | fwdbwd | fwdbwd-1thread |",
             "|---|---|---|---|---|---|---|"]
    profiles = []
    for text in args.shapes:
        B, H, H_kv, T, D, causal = parse_shape(text)
        torch.manual_seed(0)
        q = torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(B, H_kv, T, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        do = torch.randn_like(q)
        for method in methods:
            res = measure(method, q, k, v, do, causal, args.calls, args.loops)
            results["rows"].append({"shape": text, "method": method, **res})
            cells = [res.get("error", "")] if "error" in res else [
                f"{res[p]:.1f}" for p in ("fwd-nograd", "fwd", "fwdbwd", "fwdbwd-1thread")]
            lines.append(f"| {B},{H}/{H_kv},{T},{D} | {'yes' if causal else 'no'} | {method} | {' | '.join(cells)} |")
            print(lines[-1], flush=True)
        if args.profile_calls and "triton" in methods:
            profiles += ["", f"## cProfile of ours, {text}: {args.profile_calls} fwd+bwd calls, single-thread autograd",
                         "", "```", profile(q, k, v, do, causal, args.profile_calls, args.top), "```"]
    write_report(out, results, "\n".join(lines + profiles) + "\n", name="host")
    print("\n".join(lines + profiles))


if __name__ == "__main__":
    main()
