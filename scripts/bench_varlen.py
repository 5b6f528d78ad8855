"""Attention of packed (variable-length) rows and of sliding windows on a CUDA GPU: our kernel against FlexAttention
and SDPA on nested jagged tensors, fwd+bwd in GPU time, bf16.

Run from the repository root on a machine with a CUDA GPU:

    python scripts/bench_varlen.py                    # 6 packed rows + 2 window rows -> outputs/bench/varlen-<time>/
    python scripts/bench_varlen.py --quick            # one small packed row and one window row: every method, quickly
    python scripts/bench_varlen.py --lengths lognormal:400:1.0 fixed:512 --heads 15/5,64 --parts packed
    python scripts/bench_varlen.py --methods ours,ours-dense,flex --parts packed --batch 8 --seq-len 8192
    python scripts/bench_varlen.py --parts window --window 4096 --window-heads 32/8,128
    python scripts/bench_varlen.py --lengths fixed:512 --heads 32/8,128 --parts packed --kernels  # + GPU ms by kernel

Packed rows (--parts packed): --batch rows of --seq-len tokens, each filled sequence by sequence with lengths drawn
from a distribution (--lengths; the row's last sequence is cut to fit; seeded by --seed), for every head config
(--heads H/H_kv,D). A length distribution is `lognormal:MEDIAN:SIGMA` (lengths rounded and clipped to [1, T]) or
`fixed:L`. The default lognormal (median 400 tokens, sigma 1.0: mean ~660, 90th percentile ~1,440, 99th ~4,100) is
our stated stand-in for instruction data, from short single-turn examples to chat dialogues of a few thousand tokens;
it is not fitted to a dataset. The JSON records the distribution and the realised lengths. Methods:

  ours                  flash_attention(q, k, v, causal=True, documents=document_bounds(positions)), q (B, Hq, T, D)
  ours-by-example       ours with FLASH_ATTN_BY_EXAMPLE=1 (the Gluon backward walks whole examples per program,
                        those over FLASH_ATTN_BY_EXAMPLE_MAX tokens one key tile per work item)
  ours-by-example-whole the same with every example walked whole (FLASH_ATTN_BY_EXAMPLE_MAX=1000000000)
  ours-varlen           flash_attention_varlen on the same tokens in flash-attn's layout, (B*T, H, D) and cu_seqlens
  ours-dense            our kernel plain causal over whole rows: the work packing avoids (leaks across sequences)
  flex                  torch.compile'd FlexAttention with a document + causal BlockMask (built outside the timing)
  sdpa-njt-<kernel>     SDPA on nested jagged tensors pinned to flash, efficient or cudnn; where NJT SDPA refuses
                        grouped-query heads, k and v are repeated inside the timed call (recorded as "gqa": "repeated")

Sliding window (--parts window): --window-batch rows of --window-seq-len tokens per --window-heads config: our
kernel with window=(--window, 0), our kernel full causal on the same shape (the ratio full/window is the window's
speed-up; its area is ~4.3x smaller at the defaults), and FlexAttention with a sliding-window causal BlockMask.

Timing: every call is a forward and a backward; the first call (compilation, autotuning) is untimed, then ~20 ms of
calls are captured back to back in one CUDA graph (scripts/common.py: graph_replay_ms) and replayed 5 times; the
median per call is reported (for a method whose calls cannot be captured: the GPU time of its kernels from
torch.profiler, and its eager time per call, marked so). TFLOP/s count the useful area only: a causal sequence of
length L has L(L+1)/2 visible (query, key) pairs (a window of `left` keys fewer), forward FLOPs = 4*Hq*D*pairs,
fwd+bwd = 3.5x forward; every method of a row is divided into the same count (ours-dense too, so its figure is what
it delivers of the useful work; its TFLOP/s on its own full causal area is reported beside it). Each method's output
is compared with ours (max |diff|, a sanity check, not a test). A method that cannot run reads n/a, one that runs out
of memory OOM; the run goes on.

Writes results.json (after every measurement) and results.md to --out (default: a fresh outputs/bench/varlen-<time>/)
and prints the markdown.
"""

from __future__ import annotations

import argparse
import collections
import functools
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import document_bounds, flash_attention, flash_attention_varlen  # noqa: E402
from scripts.common import (  # noqa: E402
    NotAvailable,
    attempt,
    choice_list,
    default_out,
    env_vars,
    fmt,
    graph_replay_ms,
    run_meta,
    write_report,
)
from scripts.profile_step import kernel_times  # noqa: E402

NJT_KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION}  # sdpa-njt-<kernel> -> the SDPA backend it pins
PACKED_METHODS = ["ours", "ours-by-example", "ours-by-example-whole", "ours-varlen", "ours-dense", "flex",
                  *(f"sdpa-njt-{k}" for k in NJT_KERNELS)]
WINDOW_METHODS = ["ours-window", "ours-causal", "flex-window"]
METHODS = PACKED_METHODS + WINDOW_METHODS
PARTS = ["packed", "window"]
DEFAULT_LENGTHS = ["lognormal:400:1.0", "fixed:512", "fixed:2048"]
DEFAULT_HEADS = ["15/5,64", "32/8,128"]
DEFAULT_WINDOW_HEADS = ["16,64", "16,128"]
# --quick: one small packed row (the first --lengths and --heads) and one small window row (the first --window-heads)
QUICK = {"batch": 2, "seq_len": 2048, "window_seq_len": 2048, "window": 512}
FWD_BWD = 3.5  # fwd+bwd FLOPs over forward FLOPs (FlashAttention-2's convention: the backward is 2.5x the forward)
TARGET_MS = 20.0  # GPU time of the calls in one captured graph; with REPLAYS replays ~100 ms per measurement
REPLAYS = 5


# ----------------------------------------------------------------------------------------------------------------------
# Lengths, packing and FLOPs (no GPU needed)
# ----------------------------------------------------------------------------------------------------------------------
def parse_lengths(text: str) -> dict[str, Any]:
    """`lognormal:MEDIAN:SIGMA` or `fixed:L` -> the distribution as a dict (an argparse type)."""
    kind, *values = text.split(":")
    try:
        if kind == "lognormal" and len(values) == 2 and float(values[0]) > 0 and float(values[1]) >= 0:
            median, sigma = float(values[0]), float(values[1])
            return {"spec": text, "kind": kind, "median": median, "sigma": sigma,
                    "mean": median * math.exp(sigma**2 / 2)}  # the lognormal's own mean, before clipping and cuts
        if kind == "fixed" and len(values) == 1 and int(values[0]) >= 1:
            return {"spec": text, "kind": kind, "length": int(values[0])}
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: use lognormal:MEDIAN:SIGMA (median > 0, sigma >= 0) or fixed:L")


def parse_heads(text: str) -> tuple[int, int, int]:
    """`H,D` or `H/H_kv,D` -> (H, H_kv, D) (an argparse type)."""
    try:
        heads, D = text.split(",")
        H, _, H_kv = heads.partition("/")
        H, H_kv, D = int(H), int(H_kv or H), int(D)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use H,D or H/H_kv,D") from None
    if min(H, H_kv, D) < 1 or H % H_kv:
        raise argparse.ArgumentTypeError(f"{text!r}: H_kv must divide H, all >= 1")
    return H, H_kv, D


def draw_length(dist: dict[str, Any], rng: np.random.Generator, T: int) -> int:
    if dist["kind"] == "fixed":
        return min(dist["length"], T)
    return int(np.clip(round(rng.lognormal(math.log(dist["median"]), dist["sigma"])), 1, T))


def pack_rows(dist: dict[str, Any], B: int, T: int, seed: int) -> list[list[int]]:
    """B rows of sequence lengths, each summing to T: sequences are drawn one after another until the row is full, the
    last one cut to fit (so a row never ends in padding, as a packed training batch of a long dataset)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(B):
        row, left = [], T
        while left:
            row.append(min(draw_length(dist, rng, T), left))
            left -= row[-1]
        rows.append(row)
    return rows


def positions_of(rows: list[list[int]]) -> torch.Tensor:
    """(B, T) int64: each token's index in its own sequence, 0 at every sequence start."""
    return torch.from_numpy(np.stack([np.concatenate([np.arange(n) for n in row]) for row in rows]))


def cu_seqlens_of(rows: list[list[int]]) -> torch.Tensor:
    """int32 cumulative lengths of all rows' sequences concatenated (0 first, B*T last): flash-attn's cu_seqlens."""
    return torch.tensor([0, *np.cumsum([n for row in rows for n in row]).tolist()], dtype=torch.int32)


def visible_pairs(length: int, left: int | None = None) -> int:
    """The (query, key) pairs causal attention over one sequence computes: L(L+1)/2, or with a sliding window of `left`
    keys before each query, the first left+1 queries' triangle plus a band of left+1 keys for each later query."""
    band = length if left is None else min(length, left + 1)
    return band * (band + 1) // 2 + (length - band) * band


def fwd_bwd_flops(lengths: Iterable[int], H: int, D: int, left: int | None = None) -> float:
    """Useful fwd+bwd FLOPs: per visible pair two D-long dot products (QK^T and PV) of 2 FLOPs per multiply-add, per
    query head, summed over the sequences; the backward 2.5x the forward."""
    return FWD_BWD * 4.0 * H * D * sum(visible_pairs(n, left) for n in lengths)


def length_stats(rows: list[list[int]], T: int) -> dict[str, Any]:
    """The realised lengths (after clipping and cuts) and the useful share of the rows' full causal area."""
    lengths = [n for row in rows for n in row]
    return {"num_seqs": len(lengths), "mean": statistics.fmean(lengths), "median": statistics.median(lengths),
            "min": min(lengths), "max": max(lengths),
            "useful_fraction": sum(map(visible_pairs, lengths)) / (len(rows) * visible_pairs(T))}


def tflops(flops: float, ms: float) -> float:
    return flops / ms * 1e-9


# ----------------------------------------------------------------------------------------------------------------------
# Inputs and methods (GPU)
# ----------------------------------------------------------------------------------------------------------------------
@dataclass
class Inputs:
    """One row's q, k, v and dO twice, with the same values: (B, H, T, D) contiguous, and the tokens layout
    (B*T, H, D) of flash-attn's varlen functions and of nested jagged tensors. q, k, v require gradients."""
    heads: tuple[torch.Tensor, ...]
    tokens: tuple[torch.Tensor, ...]


def make_inputs(B: int, T: int, H: int, H_kv: int, D: int, seed: int) -> Inputs:
    torch.manual_seed(seed)
    heads = [torch.randn(B, h, T, D, device="cuda", dtype=torch.bfloat16) for h in (H, H_kv, H_kv, H)]
    tokens = [x.transpose(1, 2).reshape(B * T, x.shape[1], D) for x in heads]
    for x in (*heads[:3], *tokens[:3]):
        x.requires_grad_()
    return Inputs(tuple(heads), tuple(tokens))


@dataclass
class Packing:
    """One packed batch's bounds in every method's form, made once (as a training step makes them once per batch)."""
    positions: torch.Tensor  # (B, T), on the GPU
    documents: tuple[torch.Tensor, torch.Tensor]  # our kernel's document_bounds(positions)
    cu_seqlens: torch.Tensor  # int32, on the GPU
    offsets: torch.Tensor  # cu_seqlens as int64: the nested tensors' offsets
    max_len: int
    min_len: int
    block_masks: dict[str, BlockMask] = field(default_factory=dict)  # FlexAttention's, built on first use

    def flex_mask(self) -> BlockMask:
        if "documents" not in self.block_masks:
            ids = (self.positions == 0).cumsum(1).to(torch.int32)  # (B, T): each token's sequence within its row

            def same_sequence_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                                     kv: torch.Tensor) -> torch.Tensor:
                return (q >= kv) & (ids[b, q] == ids[b, kv])

            B, T = ids.shape
            self.block_masks["documents"] = create_block_mask(same_sequence_causal, B, None, T, T, device="cuda")
        return self.block_masks["documents"]


def make_packing(rows: list[list[int]]) -> Packing:
    positions = positions_of(rows).cuda()
    cu_seqlens = cu_seqlens_of(rows).cuda()
    lengths = [n for row in rows for n in row]
    return Packing(positions, document_bounds(positions), cu_seqlens, cu_seqlens.long(), max(lengths),
                   min(lengths))


@dataclass
class Case:
    """One method on one row: a zero-argument forward, the tensors it differentiates, dO in its output's layout
    (tokens: (B*T, H, D), else (B, H, T, D)), and what the results should record about it."""
    forward: Callable[[], torch.Tensor]
    leaves: tuple[torch.Tensor, ...]
    do: torch.Tensor
    tokens: bool
    info: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # FLASH_ATTN_* knobs set around each call, backward included


@functools.cache
def compiled_flex() -> Callable[..., torch.Tensor]:
    """flex_attention compiled once: without compilation it runs an unfused reference that materialises the scores."""
    return torch.compile(flex_attention, dynamic=False)


def heads_case(forward: Callable[..., torch.Tensor], x: Inputs) -> Case:
    q, k, v, do = x.heads
    return Case(lambda: forward(q, k, v), (q, k, v), do, tokens=False)


def njt_forward(kernel: str, x: Inputs, packing: Packing, repeat_kv: bool) -> Callable[[], torch.Tensor]:
    """SDPA on nested jagged tensors (nseq, H, j, D) of the tokens, pinned to `kernel`; returns (B*T, H, D)."""
    backend = NJT_KERNELS[kernel]
    q, k, v, _ = x.tokens
    group = q.shape[1] // k.shape[1]

    def jagged(values: torch.Tensor) -> torch.Tensor:
        # one offsets tensor for q, k and v: nested tensors with the same offsets share their ragged dimension
        return torch.nested.nested_tensor_from_jagged(values, packing.offsets, max_seqlen=packing.max_len,
                                                      min_seqlen=packing.min_len).transpose(1, 2)

    def forward() -> torch.Tensor:
        keys, values = (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)) if repeat_kv else (k, v)
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(jagged(q), jagged(keys), jagged(values), is_causal=True,
                                               enable_gqa=group > 1 and not repeat_kv)
        return o.transpose(1, 2).values()

    return forward


def njt_case(kernel: str, x: Inputs, packing: Packing) -> Case:
    """NJT SDPA with grouped-query heads as they are (enable_gqa) if the kernel takes them in training, else with k and
    v repeated to every query head inside the call (what a user of NJT SDPA would have to do); n/a if neither runs."""
    q, k, v, do = x.tokens
    grouped = q.shape[1] != k.shape[1]
    refusals = []
    for repeat_kv in (False, True) if grouped else (False,):
        forward = njt_forward(kernel, x, packing, repeat_kv)
        try:
            forward()  # SDPA picks (or refuses) its kernel in the forward: refusals are RuntimeErrors
        except torch.cuda.OutOfMemoryError:
            raise
        except (RuntimeError, NotImplementedError) as e:
            refusals.append(f"{'k/v repeated' if repeat_kv else 'enable_gqa' if grouped else 'NJT'}: "
                            f"{str(e).strip().splitlines()[0][:200]}")
            continue
        return Case(forward, (q, k, v), do, tokens=True,
                    info={"gqa": "repeated" if repeat_kv else "native"} if grouped else {})
    raise NotAvailable("; ".join(refusals))


def packed_case(method: str, x: Inputs, packing: Packing) -> Case:
    if method == "ours":
        return heads_case(lambda q, k, v: flash_attention(q, k, v, causal=True, documents=packing.documents), x)
    if method.startswith("ours-by-example"):
        case = heads_case(lambda q, k, v: flash_attention(q, k, v, causal=True, documents=packing.documents), x)
        case.env = {"FLASH_ATTN_BY_EXAMPLE": "1"}
        if method == "ours-by-example-whole":
            case.env["FLASH_ATTN_BY_EXAMPLE_MAX"] = "1000000000"
        return case
    if method == "ours-dense":
        return heads_case(lambda q, k, v: flash_attention(q, k, v, causal=True), x)
    if method == "flex":
        mask, flex = packing.flex_mask(), compiled_flex()
        return heads_case(lambda q, k, v: flex(q, k, v, block_mask=mask, enable_gqa=True), x)
    if method == "ours-varlen":
        q, k, v, do = x.tokens
        return Case(lambda: flash_attention_varlen(q, k, v, packing.cu_seqlens, packing.max_len), (q, k, v), do,
                    tokens=True)
    return njt_case(method.removeprefix("sdpa-njt-"), x, packing)


def window_case(method: str, x: Inputs, left: int) -> Case:
    if method == "ours-window":
        return heads_case(lambda q, k, v: flash_attention(q, k, v, causal=True, window=(left, 0)), x)
    if method == "ours-causal":
        return heads_case(lambda q, k, v: flash_attention(q, k, v, causal=True), x)

    def causal_window(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (q >= kv) & (q - kv <= left)

    T = x.heads[0].shape[2]
    mask, flex = create_block_mask(causal_window, None, None, T, T, device="cuda"), compiled_flex()
    return heads_case(lambda q, k, v: flex(q, k, v, block_mask=mask, enable_gqa=True), x)


# ----------------------------------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------------------------------
def as_tokens(o: torch.Tensor, tokens: bool) -> torch.Tensor:
    """An output as (B*T, H, D), the layout every method's output is compared in."""
    return o if tokens else o.transpose(1, 2).reshape(-1, o.shape[1], o.shape[3])


def events_ms(calls: Callable[[int], None], n: int, repeats: int) -> float:
    """Median ms per call of `calls(n)` between two CUDA events, over `repeats` runs (host time counts where it exceeds
    the GPU time)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        calls(n)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n)
    return statistics.median(times)


def reset_after_failed_capture() -> None:
    """A capture that fails midway never runs its epilogue, so CUDA's default generator stays marked as capturing and
    every later random draw on the device raises; one small capture that succeeds resets it."""
    x = torch.zeros(1, device="cuda")
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        x.add_(1)


def kernel_breakdown(calls: Callable[[int], None], n: int) -> dict[str, float]:
    """GPU ms per call of each kernel of `calls(n)` by name, largest first: torch.profiler's device time (the gaps
    between kernels, which a graph replay would count, are left out)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        calls(n)
        torch.cuda.synchronize()
    totals: collections.Counter[str] = collections.Counter()
    for name, ms in kernel_times(prof, n).items():
        # "Lazy Function Loading" (the driver loading a kernel's module) showed up in a profile of SDPA's cuDNN kernels
        # on nested tensors as a device entry as long as the kernel it loaded: counting it would count that kernel twice
        if name != "Lazy Function Loading":
            totals[kernel_name(name)] += ms
    return dict(totals.most_common())


def kernel_name(name: str) -> str:
    """A kernel's name without its return type, template arguments and parameters."""
    return re.split(r"[<(]", name.removeprefix("void "))[0].strip()[:80]


def case_calls(case: Case) -> Callable[[int], None]:
    """n forward+backward calls of a case, each dropping the previous gradients first, as a training step's
    zero_grad(set_to_none=True) does."""
    def calls(n: int) -> None:
        with env_vars(case.env):
            for _ in range(n):
                for t in case.leaves:
                    t.grad = None
                case.forward().backward(case.do)

    return calls


def fwd_bwd_timing(case: Case) -> dict[str, Any]:
    """{"ms": median GPU ms of one forward+backward}: ~TARGET_MS of calls back to back in one CUDA graph, replayed
    REPLAYS times. Each call drops the previous gradients first, as a training step's zero_grad(set_to_none=True)
    does. A method whose calls cannot be captured (seen: SDPA's cuDNN kernel on nested tensors, torch 2.11) reports
    instead the GPU time of its kernels (torch.profiler) as "ms", with "timing": "kernels", and the calls' time run
    eagerly between CUDA events, host time included, as "eager_ms"."""
    calls = case_calls(case)
    n = max(1, round(TARGET_MS / max(events_ms(calls, 1, repeats=2), 1e-3)))
    try:
        return {"ms": graph_replay_ms(calls, n, REPLAYS)}
    except Exception as e:  # the capture failed
        reset_after_failed_capture()
        if isinstance(e, torch.cuda.OutOfMemoryError):
            raise
        return {"ms": sum(kernel_breakdown(calls, max(n, REPLAYS)).values()), "timing": "kernels",
                "eager_ms": events_ms(calls, n, REPLAYS),
                "capture_error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"}


def measure(case: Case, stream: torch.cuda.Stream, reference: torch.Tensor | None,
            timing: dict[str, Any] | None = None, kernels: bool = False) -> tuple[dict[str, Any], torch.Tensor]:
    """The case's fwd+bwd timing (or `timing`, measured before on the same shape), its max |diff| from the reference
    output, with `kernels` the GPU time of each of its kernels, and its output (tokens layout). On a side stream:
    CUDA graphs cannot capture the legacy default stream."""
    stream.wait_stream(torch.cuda.current_stream())  # the inputs were written on the default stream
    with torch.cuda.stream(stream), env_vars(case.env):
        out = case.forward()
        out.backward(case.do)  # first call: compiles / autotunes outside the timed region
        out = as_tokens(out.detach(), case.tokens)
        res = dict(case.info)
        if reference is not None:
            res["max_abs_diff_vs_ours"] = (out.float() - reference.float()).abs().max().item()
        for t in case.leaves:
            t.grad = None
        res.update(timing or fwd_bwd_timing(case))
        if kernels:
            res["kernels"] = kernel_breakdown(case_calls(case), REPLAYS)
    return res, out


def run_method(method: str, build: Callable[[], Case], stream: torch.cuda.Stream, outputs: dict[str, torch.Tensor],
               reference: str, timing: dict[str, Any] | None = None, kernels: bool = False) -> dict[str, Any]:
    """measure() one method; the reference method's output is kept in `outputs` for the methods after it."""
    res, out = measure(build(), stream, outputs.get(reference), timing, kernels)
    if method == reference:
        outputs[method] = out
    return res


def summary(res: dict[str, Any]) -> str:
    if "ms" not in res:
        return res["status"] + (f" ({res['reason'][:200]})" if "reason" in res else "")
    diff = res.get("max_abs_diff_vs_ours")
    return (f"{res['ms']:.3f} ms, {res['tflops']:.0f} TFLOP/s useful"
            + (f", max|diff| vs ours {diff:.1e}" if diff is not None else "")
            + (f", gqa {res['gqa']}" if "gqa" in res else "")
            + (f"; not capturable ({res['capture_error']}): ms of its kernels, {res['eager_ms']:.3f} ms eager"
               if "capture_error" in res else ""))


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key_a: str = "ms", key_b: str = "ms") -> float | None:
    """a[key_a] / b[key_b] of two methods' results, or None if either did not run."""
    return a[key_a] / b[key_b] if a and b and key_a in a and key_b in b else None


def add_packed_ratios(row: dict[str, Any]) -> None:
    """ours / flex as a speed-up (Flex's ms over ours), and the issue's measure of packing: ours' useful TFLOP/s over
    our dense kernel's TFLOP/s on its own full causal area at the same head config (goal: >= 0.9)."""
    m = row["methods"]
    row["ours_over_flex"] = ratio(m.get("flex"), m.get("ours"))
    row["useful_over_dense"] = ratio(m.get("ours"), m.get("ours-dense"), "tflops", "dense_tflops")


def add_window_ratios(row: dict[str, Any]) -> None:
    """The window's speed-up over full causal attention on the same shape (requirement: >= 3.5x), and over Flex's."""
    m = row["methods"]
    row["causal_over_window"] = ratio(m.get("ours-causal"), m.get("ours-window"))
    row["ours_over_flex"] = ratio(m.get("flex-window"), m.get("ours-window"))


class Run:
    """A run's report, rewritten to --out after every measurement, and its progress lines."""

    def __init__(self, out: Path, report: dict[str, Any]) -> None:
        self.out, self.report, self.t0 = out, report, time.time()
        self.stream = torch.cuda.Stream()  # one for the run: cuBLAS keeps a workspace per stream

    def record(self, label: str, row: dict[str, Any], method: str, res: dict[str, Any], flops: float) -> None:
        if "ms" in res:
            res["tflops"] = tflops(flops, res["ms"])
        row["methods"][method] = res
        print(f"[{time.time() - self.t0:6.1f} s] {label} {method}: {summary(res)}", flush=True)
        write_report(self.out, self.report)


def packed_rows(run: Run, args: argparse.Namespace) -> None:
    """Every --lengths distribution x --heads config, packed methods in order (ours first: the reference)."""
    methods = [m for m in PACKED_METHODS if m in args.methods]
    # ours-dense does not depend on the lengths: timed once per head config
    dense_timing: dict[tuple[int, int, int], dict[str, Any]] = {}
    for dist in args.lengths:
        rows = pack_rows(dist, args.batch, args.seq_len, args.seed)
        packing = make_packing(rows)
        lengths, stats = [n for row in rows for n in row], length_stats(rows, args.seq_len)
        for H, H_kv, D in args.heads:
            row = {"lengths": dist, "B": args.batch, "T": args.seq_len, "H": H, "H_kv": H_kv, "D": D,
                   "realised": stats, "useful_flops": fwd_bwd_flops(lengths, H, D),
                   "dense_flops": fwd_bwd_flops([args.seq_len] * args.batch, H, D), "methods": {}}
            run.report["packed"].append(row)
            x = make_inputs(args.batch, args.seq_len, H, H_kv, D, args.seed)
            outputs: dict[str, torch.Tensor] = {}
            for method in methods:
                t0 = time.time()
                build = functools.partial(packed_case, method, x, packing)
                cached = dense_timing.get((H, H_kv, D)) if method == "ours-dense" else None
                res = attempt(functools.partial(run_method, method, build, run.stream, outputs, "ours", cached,
                                                 kernels=args.kernels))
                res["wall_s"] = round(time.time() - t0, 1)
                if method == "ours-dense" and "ms" in res:
                    res["dense_tflops"] = tflops(row["dense_flops"], res["ms"])  # on its own full causal area
                    res["timing_reused"] = cached is not None  # ms from this head config's first row
                    dense_timing[(H, H_kv, D)] = {k: res[k] for k in ("ms", "timing", "eager_ms", "capture_error")
                                                  if k in res}
                run.record(row_label(row), row, method, res, row["useful_flops"])
                torch.cuda.empty_cache()
            del x, outputs
            add_packed_ratios(row)
            write_report(run.out, run.report)
            torch.cuda.empty_cache()
        del packing


def window_rows(run: Run, args: argparse.Namespace) -> None:
    """Every --window-heads config: our window, our full causal, Flex's window (ours-window first: the reference)."""
    methods = [m for m in WINDOW_METHODS if m in args.methods]
    B, T, left = args.window_batch, args.window_seq_len, args.window
    for H, H_kv, D in args.window_heads:
        row = {"B": B, "T": T, "H": H, "H_kv": H_kv, "D": D, "window": [left, 0],
               "window_flops": fwd_bwd_flops([T] * B, H, D, left), "causal_flops": fwd_bwd_flops([T] * B, H, D),
               "methods": {}}
        row["area_ratio"] = row["causal_flops"] / row["window_flops"]
        run.report["window"].append(row)
        x = make_inputs(B, T, H, H_kv, D, args.seed)
        outputs: dict[str, torch.Tensor] = {}
        for method in methods:
            t0 = time.time()
            build = functools.partial(window_case, method, x, left)
            res = attempt(functools.partial(run_method, method, build, run.stream, outputs, "ours-window",
                                            kernels=args.kernels))
            res["wall_s"] = round(time.time() - t0, 1)
            flops = row["causal_flops"] if method == "ours-causal" else row["window_flops"]
            run.record(window_label(row), row, method, res, flops)
            torch.cuda.empty_cache()
        del x, outputs
        add_window_ratios(row)
        write_report(run.out, run.report)
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------------------
def heads_label(row: dict[str, Any]) -> str:
    heads = row["H"] if row["H"] == row["H_kv"] else f"{row['H']}/{row['H_kv']}"
    return f"{heads}, D={row['D']}"


def lengths_label(dist: dict[str, Any]) -> str:
    if dist["kind"] == "fixed":
        return f"fixed {dist['length']}"
    return f"lognormal median {dist['median']:g}, σ {dist['sigma']:g}"


def row_label(row: dict[str, Any]) -> str:
    return f"[{lengths_label(row['lengths'])}; {row['B']}x{row['T']}; {heads_label(row)}]"


def window_label(row: dict[str, Any]) -> str:
    return f"[window {row['window'][0]}; {row['B']}x{row['T']}; {heads_label(row)}]"


def cell(res: dict[str, Any] | None) -> str:
    """ms (useful TFLOP/s), with † where k/v heads were repeated and ‡ where the ms are its kernels' (not capturable);
    the status if it did not run; – if not run."""
    if res is None:
        return "–"
    if "ms" not in res:
        return res["status"]
    marks = ("†" if res.get("gqa") == "repeated" else "") + ("‡" if res.get("timing") == "kernels" else "")
    return f"{res['ms']:.3f} ({res['tflops']:.0f})" + (f" {marks}" if marks else "")


def ratio_cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def render_markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [f"# Packed rows and sliding windows: {meta['device']}", "",
             f"{meta['date']} · torch {meta['torch']} · triton {meta['triton']} · CUDA {meta['cuda']} · bf16 · "
             "fwd+bwd GPU time (CUDA-graph replay, median) · TFLOP/s on the useful area: forward 4·Hq·D·Σ L(L+1)/2 "
             "(a window: its visible pairs), fwd+bwd 3.5× forward, the same count for every method of a row", ""]
    if report["packed"]:
        lines += packed_markdown(report["packed"])
    if report["window"]:
        lines += window_markdown(report["window"])
    lines += kernels_markdown([(row_label(r), r) for r in report["packed"]]
                              + [(window_label(r), r) for r in report["window"]])
    return "\n".join(lines) + "\n"


def kernels_markdown(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """With --kernels: each method's GPU ms per call by kernel, largest first (the five largest and the rest)."""
    lines = []
    for label, row in rows:
        for method, res in row["methods"].items():
            if "kernels" in res:
                top = list(res["kernels"].items())
                parts = [f"{name} {ms:.3f}" for name, ms in top[:5]]
                if len(top) > 5:
                    parts.append(f"{len(top) - 5} more {sum(ms for _, ms in top[5:]):.3f}")
                lines.append(f"| {label} | {method} | {sum(res['kernels'].values()):.3f} | " + "; ".join(parts) + " |")
    if not lines:
        return []
    return ["## GPU ms per call by kernel (torch.profiler)", "", "| row | method | sum | kernels, largest first |",
            "|---|---|---|---|", *lines, ""]


def packed_markdown(rows: list[dict[str, Any]]) -> list[str]:
    methods = [m for m in PACKED_METHODS if any(m in row["methods"] for row in rows)]
    lines = ["## Packed rows: ms (useful TFLOP/s)", "",
             "| lengths | B×T | heads | seqs | mean / median / max | useful area | " + " | ".join(methods)
             + " | ours-dense TFLOP/s, full area | ours / flex | ours useful ÷ dense TFLOP/s |",
             "|---|---|---|---|---|---|" + "---|" * len(methods) + "---|---|---|"]
    for row in rows:
        s, dense = row["realised"], row["methods"].get("ours-dense", {})
        lines.append(f"| {lengths_label(row['lengths'])} | {row['B']}×{row['T']} | {heads_label(row)} | "
                     f"{s['num_seqs']} | {s['mean']:.0f} / {s['median']:.0f} / {s['max']} | "
                     f"{s['useful_fraction']:.1%} | " + " | ".join(cell(row["methods"].get(m)) for m in methods)
                     + f" | {fmt(dense.get('dense_tflops'), '.0f')} | {ratio_cell(row.get('ours_over_flex'))} | "
                     f"{fmt(row.get('useful_over_dense'), '.2f')} |")
    lines += ["", "ours-dense is plain causal over whole rows (attends across sequences: timing only), timed once per "
              "head config. † k/v heads repeated to every query head inside the timed call (NJT SDPA took no "
              "grouped-query heads in training). ‡ its calls could not be captured in a CUDA graph: the GPU time "
              "of its kernels (torch.profiler), its eager time per call below. ours / flex: Flex's ms over ours.", ""]
    eager = [f"- {row_label(row)} {m}: {r['eager_ms']:.3f} ms per call run eagerly ({r['capture_error']})"
             for row in rows for m, r in row["methods"].items() if "eager_ms" in r]
    lines += [*eager, ""] if eager else []
    lines += diff_lines(rows, row_label)
    return lines


def window_markdown(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["## Sliding window: ms (TFLOP/s on each method's own area)", "",
             "| B×T | heads | window | causal area ÷ window area | ours-window | ours-causal | causal ÷ window ms | "
             "flex-window | ours / flex |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        m = row["methods"]
        lines.append(f"| {row['B']}×{row['T']} | {heads_label(row)} | ({row['window'][0]}, 0) | "
                     f"{row['area_ratio']:.2f} | {cell(m.get('ours-window'))} | {cell(m.get('ours-causal'))} | "
                     f"{ratio_cell(row.get('causal_over_window'))} | {cell(m.get('flex-window'))} | "
                     f"{ratio_cell(row.get('ours_over_flex'))} |")
    return [*lines, "", *diff_lines(rows, window_label)]


def diff_lines(rows: list[dict[str, Any]], label: Callable[[dict[str, Any]], str]) -> list[str]:
    """Per row, every method's max |output − ours| (bf16 outputs: ~1e-2 is rounding; ours-dense differs by design)."""
    lines = []
    for row in rows:
        diffs = [f"{m} {r['max_abs_diff_vs_ours']:.1e}" for m, r in row["methods"].items()
                 if "max_abs_diff_vs_ours" in r]
        if diffs:
            lines.append(f"- {label(row)}: " + ", ".join(diffs))
    header = ("Max |output − ours'| on the same inputs (bf16: ~1e-2 is rounding; ours-dense and ours-causal compute "
              "other attention and differ by design):")
    return [header, "", *lines, ""] if lines else []


# ----------------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", type=choice_list(PARTS), default=PARTS, help="comma list of packed,window")
    p.add_argument("--methods", type=choice_list(METHODS), default=METHODS, help=f"comma list of {','.join(METHODS)}")
    p.add_argument("--lengths", type=parse_lengths, nargs="+", default=[parse_lengths(s) for s in DEFAULT_LENGTHS],
                   help="length distributions: lognormal:MEDIAN:SIGMA or fixed:L")
    p.add_argument("--heads", type=parse_heads, nargs="+", default=[parse_heads(s) for s in DEFAULT_HEADS],
                   help="packed rows' head configs, H/H_kv,D")
    p.add_argument("--batch", type=int, default=4, help="packed rows per batch")
    p.add_argument("--seq-len", type=int, default=16384, help="tokens per packed row")
    p.add_argument("--window", type=int, default=2048, help="keys before each query in the window rows")
    p.add_argument("--window-heads", type=parse_heads, nargs="+",
                   default=[parse_heads(s) for s in DEFAULT_WINDOW_HEADS], help="window rows' head configs, H/H_kv,D")
    p.add_argument("--window-batch", type=int, default=1)
    p.add_argument("--window-seq-len", type=int, default=16384)
    p.add_argument("--seed", type=int, default=0, help="seeds the lengths and the inputs")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: B=2 rows of T=2048 with the first --lengths and --heads; one window row "
                        "(first --window-heads) of T=2048, window 512")
    p.add_argument("--kernels", action="store_true",
                   help="also record each method's GPU time per kernel (torch.profiler) and list it in the report")
    p.add_argument("--out", type=Path, default=None, help="default: a fresh folder under outputs/bench/")
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK, lengths=args.lengths[:1], heads=args.heads[:1], window_heads=args.window_heads[:1])
    if min(args.batch, args.seq_len, args.window_batch, args.window_seq_len) < 1 or args.window < 0:
        p.error("--batch, --seq-len, --window-batch and --window-seq-len must be >= 1, --window >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_varlen.py needs a CUDA GPU")
    out = args.out or default_out("varlen")
    meta = run_meta(torch.device("cuda"), dtype="bf16", parts=args.parts, methods=args.methods,
                    lengths=args.lengths, heads=args.heads, batch=args.batch, seq_len=args.seq_len,
                    window=args.window, window_heads=args.window_heads, window_batch=args.window_batch,
                    window_seq_len=args.window_seq_len, seed=args.seed, quick=args.quick, target_ms=TARGET_MS,
                    replays=REPLAYS, flash_attn_env={k: v for k, v in os.environ.items() if k.startswith("FLASH_ATTN")})
    run = Run(out, {"meta": meta, "packed": [], "window": []})
    if "packed" in args.parts:
        packed_rows(run, args)
    if "window" in args.parts:
        window_rows(run, args)
    markdown = render_markdown(run.report)
    write_report(out, run.report, markdown)
    print(markdown)
    print(f"results in {out} ({time.time() - run.t0:.0f} s)")
    return run.report


if __name__ == "__main__":
    main()
