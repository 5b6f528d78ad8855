"""Host time per eager attention call: our kernel against SDPA, phase by phase, and where ours spends it.

Run from the repository root on a machine with a CUDA GPU:

    python scripts/bench_host_time.py                                   # default shapes -> outputs/bench/host-time-*/
    python scripts/bench_host_time.py --shapes 32,12,512,64,1 --methods triton,sdpa-cudnn --out /tmp/host

A shape is B,H,T,D,causal or B,H/H_kv,T,D,causal, as in scripts/bench_attention.py. For each shape it runs loops of
--calls calls with no synchronisation inside and reports the median over --loops rounds of the wall time per call:
while the GPU queue absorbs the kernels, that is the Python, dispatch and launch time of one call. Each round times
every method and phase once, so a host that slows down for a while slows all of them alike. Phases:

  fwd-nograd     the forward under torch.no_grad()
  fwd            the forward with autograd recording (the graph is dropped)
  fwdbwd         out = f(q, k, v); out.backward(do), the backward on autograd's device thread (PyTorch's default)
  fwdbwd-1thread the same with torch.autograd.set_multithreading_enabled(False): the backward on the calling thread
                 (as train.py runs it: train.autograd_multithreading=false)

The same run measures the GPU time of one fwd+bwd (calls captured back to back in a CUDA graph) and reports the
eager rate as a fraction of it, GPU time / max(host time, GPU time): below 1, eager calls run at the host's pace.
Methods: those of scripts/bench_attention.py listed in METHODS, and `sdpa-flash-python`, SDPA's FlashAttention-2
kernels called from a plain Python torch.autograd.Function (the host time of any Python-level attention function,
whatever its kernels). The same run profiles --profile-calls fwd+bwd calls of ours with cProfile (single-thread
autograd, so the backward is seen) and lists the functions with the most own time. Results: host.json and host.md
in --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.bench_attention import PINNED, forward_fn, gpu_ms, parse_shape  # noqa: E402
from scripts.common import (  # noqa: E402
    NotAvailable,
    choice_list,
    cprofile_table,
    default_out,
    run_meta,
    write_report,
)

DEFAULT_SHAPES = ["32,12,512,64,1", "16,12,1024,64,1"]
METHODS = ["triton", "sdpa-default", *PINNED, "sdpa-flash-python"]
PHASES = ["fwd-nograd", "fwd", "fwdbwd", "fwdbwd-1thread"]


class PythonSDPA(torch.autograd.Function):
    """SDPA's FlashAttention-2 forward and backward kernels behind a plain Python autograd.Function (no dropout)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        o, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal)
        ctx.save_for_backward(q, k, v, o, lse, seed, offset)
        ctx.args = cum_q, cum_k, max_q, max_k, causal
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor) -> tuple:
        q, k, v, o, lse, seed, offset = ctx.saved_tensors
        cum_q, cum_k, max_q, max_k, causal = ctx.args
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset)
        return *grads, None


def method_fn(method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool) -> Callable[[], torch.Tensor]:
    if method == "sdpa-flash-python":
        if k.shape[1] != q.shape[1]:
            raise NotAvailable("grouped-query heads: SDPA's flash kernel takes equal head counts")
        return lambda: PythonSDPA.apply(q, k, v, causal)
    return forward_fn(method, q, k, v, causal)


def loop_us(fn: Callable[[], object], calls: int, multithreading: bool = True) -> float:
    """Wall time per call of `calls` calls of fn, µs, synchronised only before; the backward of each on autograd's
    device thread, or (multithreading False) on this one."""
    torch.cuda.synchronize()
    with torch.autograd.set_multithreading_enabled(multithreading):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - start) / calls * 1e6


def phases(fwd: Callable[[], torch.Tensor], do: torch.Tensor, grads: list[torch.Tensor]) -> dict[str, Callable]:
    def no_grad() -> None:
        with torch.no_grad():
            fwd()

    def step() -> None:
        fwd().backward(do)
        for t in grads:
            t.grad = None

    return {"fwd-nograd": no_grad, "fwd": fwd, "fwdbwd": step, "fwdbwd-1thread": step}


def measure_shape(methods: list[str], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                  causal: bool, calls: int, loops: int) -> dict[str, dict]:
    """Each method's median host µs per phase over `loops` interleaved rounds, its GPU µs per fwd+bwd, and the eager
    rate as a fraction of the GPU rate; {"error": ...} where a method cannot run the shape."""
    timed, res = {}, {}
    stream = torch.cuda.Stream()  # CUDA graphs cannot capture the legacy default stream
    for method in methods:
        try:
            fwd = method_fn(method, q, k, v, causal)
            fwd().backward(do)  # compiles and autotunes outside the timed loops
            timed[method] = phases(fwd, do, [q, k, v])
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                res[method] = {"gpu-fwdbwd": gpu_ms(lambda f=fwd: f().backward(do), [q, k, v]) * 1e3}
            torch.cuda.current_stream().wait_stream(stream)
        except (RuntimeError, NotAvailable) as e:
            res[method] = {"error": str(e).splitlines()[0]}
    samples = {(m, p): [] for m in timed for p in PHASES}
    for round_ in range(loops + 1):  # the first round warms up
        for method, fns in timed.items():
            for phase, fn in fns.items():
                us = loop_us(fn, calls, multithreading=phase != "fwdbwd-1thread")
                if round_:
                    samples[(method, phase)].append(us)
    torch.cuda.synchronize()
    for (method, phase), values in samples.items():
        res[method][phase] = statistics.median(values)
    for method in timed:
        gpu = res[method]["gpu-fwdbwd"]
        for phase in ("fwdbwd", "fwdbwd-1thread"):
            res[method][f"rate-{phase}"] = gpu / max(res[method][phase], gpu)
    return res


def profile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool, calls: int,
            top: int) -> str:
    """cProfile's table of our fwd+bwd, single-thread autograd, sorted by own time."""
    step = phases(forward_fn("triton", q, k, v, causal), do, [q, k, v])["fwdbwd"]
    with torch.autograd.set_multithreading_enabled(False):
        step()
        torch.cuda.synchronize()
        table = cprofile_table(step, calls, top)  # the calls back to back, as an eager loop makes them
        torch.cuda.synchronize()
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="B,H,T,D,causal (causal 1 or 0)")
    parser.add_argument("--methods", type=choice_list(METHODS), default=METHODS,
                        help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--calls", type=int, default=50, help="calls per timed loop")
    parser.add_argument("--loops", type=int, default=15, help="timed rounds; the median is reported")
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
             "", "Eager/GPU: the eager fwd+bwd rate as a fraction of the GPU-time rate, GPU / max(host, GPU).", "",
             "| B,H,T,D | causal | method | fwd-nograd | fwd | fwdbwd | fwdbwd-1thread | GPU fwdbwd | eager/GPU | "
             "eager/GPU, 1-thread |", "|---|---|---|---|---|---|---|---|---|---|"]
    profiles = []
    for text in args.shapes:
        B, H, H_kv, T, D, causal = parse_shape(text)
        torch.manual_seed(0)
        q = torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(B, H_kv, T, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        do = torch.randn_like(q)
        for method, res in measure_shape(methods, q, k, v, do, causal, args.calls, args.loops).items():
            results["rows"].append({"shape": text, "method": method, **res})
            cells = [res["error"]] if "error" in res else [
                *(f"{res[p]:.1f}" for p in (*PHASES, "gpu-fwdbwd")),
                *(f"{res[f'rate-{p}']:.2f}" for p in ("fwdbwd", "fwdbwd-1thread"))]
            lines.append(f"| {B},{H}/{H_kv},{T},{D} | {'yes' if causal else 'no'} | {method} | {' | '.join(cells)} |")
            print(lines[-1], flush=True)
        if args.profile_calls and "triton" in methods:
            profiles += ["", f"## cProfile of ours, {text}: {args.profile_calls} fwd+bwd calls, single-thread autograd",
                         "", "```", profile(q, k, v, do, causal, args.profile_calls, args.top), "```"]
    write_report(out, results, "\n".join(lines + profiles) + "\n", name="host")
    print("\n".join(lines + profiles))


if __name__ == "__main__":
    main()
