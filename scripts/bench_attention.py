"""Benchmark attention implementations on a CUDA GPU: our Triton kernel against PyTorch's.

Run from the repository root on a machine with a CUDA GPU:

    python scripts/bench_attention.py                          # default shapes, bf16 -> outputs/bench/attention-<time>/
    python scripts/bench_attention.py --shapes 8,12,2048,64,1 4,16,4096,128,0 --dtype fp16 --out /tmp/bench
    python scripts/bench_attention.py --methods triton,triton-notma,sdpa-flash,sdpa-cudnn
    python scripts/bench_attention.py --shapes 8,15/5,2048,64,1 4,32/8,4096,128,1     # grouped-query attention

A shape is B,H,T,D,causal (causal 1/0), or B,H/H_kv,T,D,causal with H_kv key-value heads (grouped-query attention;
SDPA and Flex run with enable_gqa, naive repeats the key-value heads). For every shape and method it times forward,
backward and forward+backward twice, as medians in ms, and converts them to TFLOP/s (forward 4*B*H*T^2*D, halved when
causal; backward 2.5x, forward+backward 3.5x the forward):

  GPU time   the calls are captured back to back (no L2 flush) in one CUDA graph and replayed, so no method waits for
             its Python or launch overhead. This is the kernels' speed (the headline table).
  eager      `triton.testing.do_bench`: one call at a time from Python, L2 flushed before each. Where a method's host
             time per call exceeds its GPU time (small shapes, a Python autograd.Function), this measures the host.
             The backward runs on the calling thread, as train.py runs it (train.autograd_multithreading=false);
             --autograd-multithreading runs it on autograd's device thread, PyTorch's default.

It also records the peak memory of one eager forward+backward: its inputs (q, k, v, dO) plus the most it allocates
on top of them (`torch.cuda.max_memory_allocated`, reset before, minus what was allocated before). Methods:

  triton             our kernel, `kernels.flash_attention`
  triton-tma         the same with FLASH_ATTN_TMA=1 (TMA descriptors at every head dim; default: D = 128 on Hopper)
  triton-notma       the same with FLASH_ATTN_TMA=0 (pointer loads only)
  triton-nogluon     the same with FLASH_ATTN_GLUON=0 (the Triton kernels everywhere; default: the Gluon forward
                     and one-pass backward at D = 128 on Hopper)
  triton-per-tile    the same with FLASH_ATTN_PERSISTENT=0 (the Gluon forward as one program per tile of query rows)
  triton-persistent  the same with FLASH_ATTN_PERSISTENT=1 (the Gluon forward as one program per multiprocessor)
  triton-persistent-fold, triton-persistent-stride
                     the same, its tiles dealt in folded pairs, or one at a time (FLASH_ATTN_PERSISTENT_ORDER=fold
                     or stride; default: folded pairs without bounds)
  triton-bwd64       the same with FLASH_ATTN_WS_BACKWARD=0 (the Gluon backward as one warpgroup over 64 keys)
  triton-bwd-ws      the same with FLASH_ATTN_WS_BACKWARD=1 (the Gluon backward warp-specialised over 128 keys)
  triton-bwd-persistent, triton-bwd-per-tile
                     the same with FLASH_ATTN_PERSISTENT_BACKWARD=1 or 0 (that backward as one program per
                     multiprocessor, or one per key tile; default: per multiprocessor without bounds)
  triton-gluon       the same with FLASH_ATTN_GLUON=1 (the Gluon kernels at D = 64 too)
  triton-no-pingpong the same with FLASH_ATTN_PINGPONG=0 (the persistent Gluon forward's two consumer warpgroups
                     issue their matmuls when ready instead of taking turns)
  triton-o-in-q      the same with FLASH_ATTN_O_IN_K=0 (the persistent Gluon forward stages each tile's O in its Q
                     tile, so the next tile's Q loads only after this one's store; default: in its last K tile)
  triton-rotate      the same with FLASH_ATTN_ROTATE=1 (the persistent Gluon forward issues each tile's last P V in
                     one turn with the next tile's first S = Q Kᵀ)
  triton-dropout     our kernel with attention dropout (--dropout-p, default 0.1), to set against `triton`
  triton-dropout-philox
                     the same with FLASH_ATTN_DROPOUT_RNG=philox (the mask's bytes from Philox4x32-7, one call per 16
                     elements; default: a hash per 2 x 2 block, made in each kernel's own layout)
  sdpa-flash-dropout SDPA's FlashAttention-2 kernel with the same dropout, to set against `sdpa-flash`
  sdpa-cudnn-dropout SDPA's cuDNN kernel with the same dropout, to set against `sdpa-cudnn`
  naive              the model's from-scratch backend (model/attention.py), scores in the input dtype
  sdpa-<kernel>      SDPA pinned to one kernel of model/attention.py's SDPA_BACKENDS (flash, efficient, cudnn,
                     math); n/a if it cannot run the shape
  sdpa-default       SDPA's own choice; the kernel that ran is found with torch.profiler
  flex               torch.compile'd FlexAttention with a causal block mask

A method that cannot run a shape is reported as "n/a", one that runs out of memory as "OOM". Our output and gradients
are also compared with SDPA's (relative L2 difference, reported as `check`). Results go to --out (default: a fresh
folder under outputs/bench/) as bench.json, bench.md and bench.png (with GPU name, torch/triton versions, date and
the command); the markdown table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import flash_attention  # noqa: E402
from kernels.launch import AUTOTUNED  # noqa: E402
from model.attention import SDPA_BACKENDS, naive_attention, pinned_sdpa  # noqa: E402
from scripts.common import (
    NotAvailable,
    add_autograd_thread_option,
    attempt,
    backward_thread,
    choice_list,
    default_out,
    env_vars,
    graph_replay_ms,
    run_meta,
    write_report,  # noqa: E402
)
from training.metrics import detect_sdpa_kernel  # noqa: E402

DEFAULT_SHAPES = ["16,12,1024,64,1", "8,12,2048,64,1", "4,16,4096,128,1", "1,16,16384,128,1", "16,12,1024,64,0"]
# our kernel's variants: method -> the environment it runs under
TRITON_VARIANTS = {"triton": {}, "triton-tma": {"FLASH_ATTN_TMA": "1"}, "triton-notma": {"FLASH_ATTN_TMA": "0"},
                   "triton-nogluon": {"FLASH_ATTN_GLUON": "0"}, "triton-per-tile": {"FLASH_ATTN_PERSISTENT": "0"},
                   "triton-persistent": {"FLASH_ATTN_PERSISTENT": "1"},
                   "triton-persistent-fold": {"FLASH_ATTN_PERSISTENT": "1", "FLASH_ATTN_PERSISTENT_ORDER": "fold"},
                   "triton-persistent-stride": {"FLASH_ATTN_PERSISTENT": "1", "FLASH_ATTN_PERSISTENT_ORDER": "stride"},
                   "triton-bwd64": {"FLASH_ATTN_WS_BACKWARD": "0"}, "triton-bwd-ws": {"FLASH_ATTN_WS_BACKWARD": "1"},
                   "triton-bwd-persistent": {"FLASH_ATTN_PERSISTENT_BACKWARD": "1"},
                   "triton-bwd-per-tile": {"FLASH_ATTN_PERSISTENT_BACKWARD": "0"},
                   "triton-bwd-queue": {"FLASH_ATTN_PERSISTENT_BACKWARD": "queue"},
                   "triton-gluon": {"FLASH_ATTN_GLUON": "1"}, "triton-no-pingpong": {"FLASH_ATTN_PINGPONG": "0"},
                   "triton-o-in-q": {"FLASH_ATTN_O_IN_K": "0"}, "triton-rotate": {"FLASH_ATTN_ROTATE": "1"},
                   "triton-dropout": {}, "triton-dropout-philox": {"FLASH_ATTN_DROPOUT_RNG": "philox"}}
PINNED = {f"sdpa-{name}": name for name in SDPA_BACKENDS}  # method -> SDPA kernel
METHODS = ["triton", *PINNED, "sdpa-default", "naive", "triton-tma", "triton-notma", "triton-nogluon",
           "triton-per-tile", "triton-persistent", "triton-persistent-fold", "triton-persistent-stride",
           "triton-bwd64", "triton-bwd-ws", "triton-bwd-persistent", "triton-bwd-per-tile", "triton-bwd-queue",
           "triton-gluon", "triton-no-pingpong", "triton-o-in-q", "triton-rotate", "triton-dropout",
           "triton-dropout-philox",
           "sdpa-flash-dropout", "sdpa-cudnn-dropout", "flex"]
# method -> attention dropout (--dropout-p)
DROPOUT_P = {"triton-dropout": 0.1, "triton-dropout-philox": 0.1, "sdpa-flash-dropout": 0.1,
             "sdpa-cudnn-dropout": 0.1}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


_flex_compiled: Callable | None = None


def flex_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Callable[[], torch.Tensor]:
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if causal:
        T = q.shape[-2]
        block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, B=None, H=None, Q_LEN=T,
                                       KV_LEN=T, device=q.device)
    return lambda: _flex_compiled(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """SDPA's own choice of kernel (grouped-query inputs with enable_gqa)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])


def forward_fn(method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               causal: bool) -> Callable[[], torch.Tensor]:
    """A zero-argument forward for `method` (its backward runs through autograd)."""
    if method in TRITON_VARIANTS:
        return lambda: flash_attention(q, k, v, causal=causal, dropout_p=DROPOUT_P.get(method, 0.0))
    if method == "naive":
        return lambda: naive_attention(q, k, v, causal=causal)
    if method == "flex":
        return flex_forward(q, k, v, causal)
    if method == "sdpa-default":
        return lambda: sdpa(q, k, v, causal)
    attend = pinned_sdpa(PINNED[method.removesuffix("-dropout")])

    def pinned() -> torch.Tensor:
        try:
            return attend(q, k, v, causal=causal, dropout_p=DROPOUT_P.get(method, 0.0))
        except RuntimeError as e:  # the pinned kernel rejects these inputs
            raise NotAvailable(str(e).splitlines()[0]) from e

    return pinned


def sdpa_default_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool) -> str:
    """Which kernel SDPA picks by itself (training/metrics.py: detect_sdpa_kernel, from the profiler's names)."""
    return detect_sdpa_kernel(lambda: sdpa(q, k, v, causal).backward(do))[1]


def eager_ms(fn: Callable[[], object], grads: list[torch.Tensor]) -> float:
    """Median ms per call of fn, called one at a time from Python (module docstring)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median")


def gpu_ms(fn: Callable[[], object], grads: list[torch.Tensor], rep_ms: float = 100.0, replays: int = 10) -> float:
    """Median GPU ms per call of fn: ~rep_ms worth of calls captured back to back in one CUDA graph, on the current
    stream (the one the method's forward ran on, which the backward's kernels go to), then replayed `replays` times.
    (`triton.testing.do_bench_cudagraph` captures on a stream of its own, which a backward of an earlier forward does
    not follow.)"""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def calls(n: int) -> None:
        for _ in range(n):
            for t in grads:
                t.grad = None
            fn()

    start.record()
    calls(5)
    end.record()
    torch.cuda.synchronize()
    return graph_replay_ms(calls, max(1, int(rep_ms / max(start.elapsed_time(end) / 5, 1e-3))), replays)


def measure(method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool,
            stream: torch.cuda.Stream) -> dict:
    """Times and peak memory of `method` on a side stream (CUDA graphs cannot capture the legacy default stream). One
    stream serves the whole run: cuBLAS keeps a workspace per stream for the life of the process."""
    fwd = forward_fn(method, q, k, v, causal)
    grads = [q, k, v]
    stream.wait_stream(torch.cuda.current_stream())  # the inputs were written on the default stream
    with env_vars(TRITON_VARIANTS.get(method, {})), torch.cuda.stream(stream):
        out = fwd()  # first call: compiles / autotunes outside the timed region
        out.backward(do, retain_graph=True)

        def step() -> None:
            fwd().backward(do)

        phases = {"fwd": fwd, "bwd": lambda: out.backward(do, retain_graph=True), "fwdbwd": step}
        res = {"eager_ms": {phase: eager_ms(fn, grads) for phase, fn in phases.items()},
               "gpu_ms": {phase: gpu_ms(fn, grads) for phase, fn in phases.items()}}
        out = None  # frees the retained graph before the memory measurement
        for t in grads:
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        # the step's inputs plus what it allocates, not buffers that outlive calls (such as cuBLAS's workspace)
        res["extra_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
        res["peak_mib"] = sum(t.nbytes for t in (q, k, v, do)) / 2**20 + res["extra_mib"]
    return res


def measure_row(method: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool,
                flops: float, stream: torch.cuda.Stream) -> dict:
    """`measure` with TFLOP/s, the kernel SDPA's default picked, and (triton without dropout) the check against SDPA."""
    res = measure(method, q, k, v, do, causal, stream)
    res["gpu_tflops"] = to_tflops(res["gpu_ms"], flops)
    res["eager_tflops"] = to_tflops(res["eager_ms"], flops)
    if method == "sdpa-default":
        res["backend"] = sdpa_default_kernel(q, k, v, do, causal)
    if method.startswith("triton") and method not in DROPOUT_P:  # dropout: random, no fixed answer
        res["check"] = check_against_sdpa(q, k, v, do, causal, TRITON_VARIANTS[method])
    return res


def relative_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def check_against_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool,
                       variant: dict[str, str]) -> dict:
    """Relative L2 difference of our O, dQ, dK, dV from SDPA's (both in the input dtype: ~1e-3..1e-2 is rounding)."""
    results = []
    for fn in (lambda: flash_attention(q, k, v, causal=causal),
               lambda: sdpa(q, k, v, causal)):
        for t in (q, k, v):
            t.grad = None
        with env_vars(variant):
            o = fn()
            o.backward(do)
        results.append((o.detach(), q.grad, k.grad, v.grad))
    for t in (q, k, v):
        t.grad = None
    return {name: relative_diff(a, b) for name, a, b in zip(("O", "dQ", "dK", "dV"), *results, strict=True)}


def autotune_report() -> dict:
    """Chosen config per autotune key, and the last tuning's per-config timings, for each of our kernels."""
    report = {}
    for name, kernel in AUTOTUNED.items():
        report[name] = {
            "best": {str(key): str(cfg) for key, cfg in kernel.cache.items()},
            "last_timings_ms": {str(cfg): [round(x, 4) for x in t] if isinstance(t, list) else t
                                for cfg, t in (getattr(kernel, "configs_timings", None) or {}).items()},
        }
    return report


def parse_shape(text: str) -> tuple[int, int, int, int, int, bool]:
    """B,H,T,D,causal or, for grouped-query attention, B,H/H_kv,T,D,causal -> (B, H, H_kv, T, D, causal)."""
    B, heads, T, D, causal = text.split(",")
    H, _, H_kv = heads.partition("/")
    return int(B), int(H), int(H_kv or H), int(T), int(D), bool(int(causal))


def label(row: dict) -> str:
    heads = row["H"] if row["H_kv"] == row["H"] else f"{row['H']}/{row['H_kv']}"
    return f"{row['B']},{heads},{row['T']},{row['D']}"


def inputs(row: dict, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q (B, H, T, D), k and v (B, H_kv, T, D), requiring gradients, and dO (B, H, T, D)."""
    B, H, H_kv, T, D = (row[k] for k in ("B", "H", "H_kv", "T", "D"))
    q, k, v = (torch.randn(B, h, T, D, device="cuda", dtype=dtype, requires_grad=True) for h in (H, H_kv, H_kv))
    return q, k, v, torch.randn(B, H, T, D, device="cuda", dtype=dtype)


def fwd_flops(B: int, H: int, T: int, D: int, causal: bool) -> float:
    return 4.0 * B * H * T * T * D / (2 if causal else 1)


def to_tflops(ms: dict[str, float], flops: float) -> dict[str, float]:
    """Per-phase TFLOP/s from per-phase ms; `flops` is the forward's, backward is 2.5x and fwd+bwd 3.5x that."""
    return {phase: factor * flops / ms[phase] * 1e-9 for phase, factor in (("fwd", 1.0), ("bwd", 2.5), ("fwdbwd", 3.5))}


def run(shapes: list[tuple], methods: list[str], dtype: torch.dtype, out_dir: Path, meta: dict) -> dict:
    """Method-major, so that a run cut short loses the last methods (flex is last) rather than the last shapes; the
    report files are rewritten after every method."""
    rows = [{"B": B, "H": H, "H_kv": H_kv, "T": T, "D": D, "causal": causal,
             "fwd_flops": fwd_flops(B, H, T, D, causal), "methods": {}} for B, H, H_kv, T, D, causal in shapes]
    report = {"meta": meta, "rows": rows}
    stream = torch.cuda.Stream()
    # One untimed pass of the first method on the first shape: the first timed measurement of a run was the only one
    # whose fwd+bwd exceeded its fwd + bwd (row 1, triton, in every run before this warm-up pass was added).
    with contextlib.suppress(Exception):
        measure(methods[0], *inputs(rows[0], dtype), rows[0]["causal"], stream)
    for method in methods:
        for row in rows:
            causal, flops = row["causal"], row["fwd_flops"]
            torch.manual_seed(0)  # every method sees the same inputs
            q, k, v, do = inputs(row, dtype)
            t0 = time.time()
            res = attempt(functools.partial(measure_row, method, q, k, v, do, causal, flops, stream))
            del q, k, v, do
            torch.cuda.empty_cache()
            res["wall_s"] = round(time.time() - t0, 1)
            row["methods"][method] = res
            print(f"[{label(row)},{'causal' if causal else 'full'}] {method}: {summary(res)}", flush=True)
        if method.startswith("triton"):
            report["autotune"] = autotune_report()
        write_reports(report, out_dir)
    return report


def write_reports(report: dict, out_dir: Path) -> None:
    write_report(out_dir, report, render_markdown(report), name="bench")
    render_plot(report, out_dir / "bench.png")


def summary(res: dict) -> str:
    if "status" in res:
        return res["status"] + (f" ({res['reason'][:120]})" if "reason" in res else "")
    ms, tf = res["gpu_ms"], res["gpu_tflops"]
    return (f"GPU time: fwd {ms['fwd']:.3f} ms ({tf['fwd']:.0f} TF/s), bwd {ms['bwd']:.3f} ms ({tf['bwd']:.0f}), "
            f"fwd+bwd {ms['fwdbwd']:.3f} ms ({tf['fwdbwd']:.0f}); eager fwd+bwd {res['eager_ms']['fwdbwd']:.3f} ms; "
            f"peak {res['peak_mib']:.0f} MiB" + (f", check {res['check']}" if "check" in res else ""))


def cell(res: dict | None, key: str, group: str | None = None, fmt: str = "{:.0f}") -> str:
    """res[group][key] (or res[key]) formatted, or the method's status ("n/a", "OOM"), or "–" if it did not run."""
    if res is None:
        return "–"
    if "status" in res:
        return res["status"]
    return fmt.format(res[group][key] if group else res[key])


def render_markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# Attention benchmark: {meta['device']}", "",
             f"{meta['date']} · torch {meta['torch']} · triton {meta['triton']} · CUDA {meta['cuda']} · "
             f"dtype {meta['dtype']} · medians · TFLOP/s with forward = 4·B·H·T²·D (halved if causal), backward = "
             "2.5×, fwd+bwd = 3.5× forward · GPU time: CUDA-graph replay, calls back to back; eager: one Python "
             "call at a time (`do_bench`, host time included where it exceeds GPU time), the backward on "
             f"{backward_thread(meta)}", "",
             "## fwd+bwd TFLOP/s in GPU time; ratios of triton's speed over SDPA's, in GPU time and eager", "",
             "Eager ratios are against SDPA default: a pinned backend adds the `sdpa_kernel` context manager's host "
             "time to every eager call.", "",
             "| B,H,T,D | causal | triton | SDPA-FA2 | SDPA-cuDNN | SDPA default (backend) | Flex | triton/FA2 | "
             "triton/cuDNN | eager: triton/FA2 | eager: triton/default | peak MiB triton / SDPA default |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        m = row["methods"]
        tri, fa2, cudnn, default = m.get("triton"), m.get("sdpa-flash"), m.get("sdpa-cudnn"), m.get("sdpa-default")

        def ratio(a: dict | None, b: dict | None, timing: str) -> str:
            if not a or not b or "status" in a or "status" in b:
                return "–"
            return f"{b[f'{timing}_ms']['fwdbwd'] / a[f'{timing}_ms']['fwdbwd']:.2f}"

        backend = f" ({default['backend']})" if default and "backend" in default else ""
        peak = f"{cell(tri, 'peak_mib')} / {cell(default, 'peak_mib')}"
        tflops = " | ".join(cell(res, "fwdbwd", "gpu_tflops") for res in (tri, fa2, cudnn))
        lines.append(f"| {label(row)} | {'yes' if row['causal'] else 'no'} | "
                     f"{tflops} | {cell(default, 'fwdbwd', 'gpu_tflops')}{backend} | "
                     f"{cell(m.get('flex'), 'fwdbwd', 'gpu_tflops')} | {ratio(tri, fa2, 'gpu')} | "
                     f"{ratio(tri, cudnn, 'gpu')} | {ratio(tri, fa2, 'eager')} | {ratio(tri, default, 'eager')} | "
                     f"{peak} |")
    lines += ["", "## All methods (ms; TFLOP/s in GPU time)", "",
              "| B,H,T,D | causal | method | fwd | bwd | fwd+bwd | fwd TF/s | bwd TF/s | fwd+bwd TF/s | eager fwd | "
              "eager bwd | eager fwd+bwd | peak MiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    phases = ("fwd", "bwd", "fwdbwd")
    for row in report["rows"]:
        for method, res in row["methods"].items():
            cells = ([cell(res, p, "gpu_ms", "{:.3f}") for p in phases] + [cell(res, p, "gpu_tflops") for p in phases]
                     + [cell(res, p, "eager_ms", "{:.3f}") for p in phases] + [cell(res, "peak_mib")])
            lines.append(f"| {label(row)} | {'yes' if row['causal'] else 'no'} | "
                         f"{method} | " + " | ".join(cells) + " |")
    checks = [(row, method, res["check"]) for row in report["rows"] for method, res in row["methods"].items()
              if "check" in res]
    if checks:
        lines += ["", "Relative L2 difference of triton's O / dQ / dK / dV from SDPA default's (same dtype):", ""]
        for row, method, c in checks:
            lines.append(f"- {label(row)} causal={row['causal']} {method}: "
                         + ", ".join(f"{k} {v:.1e}" for k, v in c.items()))
    return "\n".join(lines) + "\n"


def render_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    methods = [m for m in METHODS if any(m in r["methods"] for r in rows)]
    labels = [f"{label(r)}\n{'causal' if r['causal'] else 'full'}" for r in rows]
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(rows)), 5))
    for i, method in enumerate(methods):
        values = [r["methods"].get(method, {}).get("gpu_tflops", {}).get("fwdbwd", 0.0) for r in rows]
        ax.bar([x + i * width for x in range(len(rows))], values, width, label=method)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(rows))], labels)
    ax.set_ylabel("fwd+bwd TFLOP/s (GPU time)")
    meta = report["meta"]
    ax.set_title(f"Attention fwd+bwd, {meta['dtype']}, {meta['device']} (torch {meta['torch']}, "
                 f"triton {meta['triton']})")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="B,H,T,D,causal (causal 1 or 0)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--dropout-p", type=float, default=0.1, help="attention dropout of the *-dropout methods")
    parser.add_argument("--methods", type=choice_list(METHODS), default=METHODS,
                        help=f"comma-separated subset of {','.join(METHODS)}")
    add_autograd_thread_option(parser)
    parser.add_argument("--out", type=Path, default=None, help="default: a fresh folder under outputs/bench/")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU")
    DROPOUT_P.update({method: args.dropout_p for method in DROPOUT_P})
    out = args.out or default_out("attention")
    out.mkdir(parents=True, exist_ok=True)
    meta = run_meta(torch.device("cuda"), dtype=args.dtype, dropout_p=args.dropout_p,
                    flash_attn_env={k: v for k, v in os.environ.items() if k.startswith("FLASH_ATTN")},
                    autograd_multithreading=args.autograd_multithreading)
    with torch.autograd.set_multithreading_enabled(args.autograd_multithreading):
        report = run([parse_shape(s) for s in args.shapes], args.methods, DTYPES[args.dtype], out, meta)
    print(render_markdown(report))


if __name__ == "__main__":
    main()
