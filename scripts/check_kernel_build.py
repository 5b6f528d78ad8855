"""Compile the Triton FlashAttention kernels for a GPU architecture without a GPU (Triton's ahead-of-time path).

Run from the repository root, on any machine with Triton installed (no GPU needed; not under TRITON_INTERPRET=1):

    python scripts/check_kernel_build.py                 # sm_90 (H100/H200): every kernel, D = 64 and 128, bf16
    python scripts/check_kernel_build.py --arch 80 --head-dims 64

The CPU tests run the kernels through the Triton interpreter, which accepts some code that the compiler rejects (and the
reverse). This builds each kernel of kernels/flash_kernels.py (forward, dQ, dK/dV, each with pointer loads and with TMA
descriptors; multi-head, grouped-query, with dropout (both generators), with bounds (packed rows, windows) causal and
not) with the first autotune config of its table, ragged, down to the GPU binary, and prints one line per build,
`ok|FAIL | <kernel> D=<head dim> | <seconds> | <details>`, the details saying whether the instructions expected on that
architecture were emitted (wgmma and, for the TMA variants, cp.async.bulk.tensor on Hopper), the shared memory the
build takes (smem, bytes) and, from the binary's resource report, its registers per thread at entry (regs; a
warp-specialised kernel moves them between its partitions later) and its stack frame (stack, bytes: nonzero means
registers spilled to local memory). On sm_90 it also builds the Gluon kernels
(kernels/flash_gluon.py: the warp-specialised forward, per tile and persistent, and the one-pass backward, one
warpgroup over 64 keys and warp-specialised over 128, multi-head and grouped-query, with bounds causal and not, and
the warp-specialised backward by example) and the backward's preprocess and dQ cast kernels; the details add whether
dQ is added by the copy engine (cp.reduce.async.bulk). Last, kernels/swiglu.py's two kernels. Exit status 1 if any
build fails.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("check_kernel_build.py compiles for a GPU: run it without TRITON_INTERPRET=1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels import flash_kernels, launch, swiglu  # noqa: E402

FP32_BUFFERS = {"LSE", "DELTA", "DQ_ACC"}  # the kernels' fp32 statistics and dQ sums; other tensors are bf16
FP32_SCALARS = {"qk_scale", "sm_scale", "grad_scale"}
INTS = {"B", "H", "H_KV", "T", "W", "threshold"}  # sizes and the dropout threshold
SEEDS = {"SEED", "TRACE"}  # the dropout seed, one int64; the persistent forward's phase stamps, int64
BOUNDS = {"KV_START", "KV_END", "Q_START", "Q_END"}  # bounded attention (packed rows, windows), int32
COUNTERS = {"QUEUE", "SEGMENTS"}  # the persistent backward's work queue; the by-example backward's examples, int32
FLAGS = {"ZERO_ROWS", "ROWS"}  # the by-example backward's rows of long examples, int8


def signature(kernel: triton.JITFunction) -> dict[str, str]:
    """Triton types of the kernel's runtime arguments: strides and sizes, scales, and tensors (the rest)."""
    sig = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            sig[name] = "constexpr"
        elif name.startswith("stride") or name in INTS:
            sig[name] = "i32"
        elif name in SEEDS:
            sig[name] = "*i64"
        elif name in BOUNDS or name in COUNTERS:
            sig[name] = "*i32"
        elif name in FLAGS:
            sig[name] = "*i8"
        elif name in FP32_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "*fp32" if name in FP32_BUFFERS else "*bf16"
    return sig


def compile_for(kernel: triton.JITFunction, values: dict, warps: int, stages: int, target: GPUTarget,
                source: type = ASTSource, **options) -> tuple[bool, str]:
    """Build one kernel with these constexpr values (and compiler options); (ok, details or the compiler's
    message)."""
    names = kernel.arg_names
    values = {**values, "num_warps": warps} if "num_warps" in names else values
    # Specialized as a launch of contiguous, aligned tensors is: the head dim's strides are 1, which Triton makes
    # constexprs, and pointers and the other strides are multiples of 16 (what a build's registers and shared memory
    # depend on)
    values = {**{n: 1 for n in names if n.startswith("stride") and n.endswith("d")}, **values}
    sig = {n: "constexpr" if n in values else t for n, t in signature(kernel).items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or (n.startswith("stride") and n not in values)}
    src = source(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in values.items() if k in names},
                 attrs=attrs)
    try:
        compiled = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages, **options})
    except Exception as e:  # report the compiler's message and carry on with the other builds
        return False, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
    ptx = compiled.asm.get("ptx", "")
    details = f"wgmma={'wgmma' in ptx} tma={'cp.async.bulk.tensor' in ptx}"
    details += " reduce=True" if "cp.reduce.async.bulk" in ptx else ""
    return True, details + f" smem={compiled.metadata.shared}" + resources(compiled.asm["cubin"])


def resources(cubin: bytes) -> str:
    """' regs=<per thread> stack=<bytes>' from cuobjdump's resource report of a binary."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True,
                                text=True, check=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+)", report)
    return f" regs={usage[1]} stack={usage[2]}"


def build(kernel: triton.JITFunction, constexprs: dict, table: launch.Tuning, head_dim: int,
          target: GPUTarget) -> tuple[bool, str]:
    block_m, block_n, warps, stages = table[(max(64, head_dim), False)][0]  # the default config for this D, bf16
    values = {**constexprs, "BLOCK_M": block_m, "BLOCK_N": block_n, "HEAD_DIM": head_dim}
    return compile_for(kernel, values, warps, stages, target)


def builds_of_the_gluon_kernels(head_dim: int, target: GPUTarget) -> list[tuple[str, bool, str]]:
    """The Gluon forward and one-pass backward as kernels/launch.py launches them, and the backward's Triton
    preprocess kernel."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels import flash_gluon

    fwd_values = dict(HEAD_DIM=head_dim, BLOCK_N=flash_gluon.FWD_BLOCK_N, STAGES=flash_gluon.FWD_STAGES)
    forward = lambda group, docs=False, causal=True, dropout=0, kernel=flash_gluon._fwd_kernel, **more: compile_for(
        kernel, {**fwd_values, "GROUP": group, "DOCS": docs, "CAUSAL": causal, "DROPOUT": dropout, **more},
        flash_gluon.FWD_NUM_WARPS, 1, target, GluonASTSource, maxnreg=flash_gluon.WS_MAXNREG)
    persistent = functools.partial(forward, kernel=flash_gluon._fwd_persistent_kernel, FOLD=False, PINGPONG=False,
                                   O_IN_K=True, ROTATE=False, TRACE_ITEMS=0)
    gluon_values = dict(HEAD_DIM=head_dim, BLOCK_M=flash_gluon.BLOCK_M, BLOCK_N=flash_gluon.BLOCK_N)
    one_pass = lambda group, docs=False, causal=True, dropout=0: compile_for(
        flash_gluon._bwd_kernel, {**gluon_values, "GROUP": group, "DOCS": docs, "CAUSAL": causal, "DROPOUT": dropout},
        flash_gluon.NUM_WARPS, 1, target, GluonASTSource)
    ws = lambda group, docs=False, causal=True, dropout=0, trace=0: compile_for(
        flash_gluon._bwd_ws_kernel, {**gluon_values, "BLOCK_N": flash_gluon.WS_BLOCK_N, "GROUP": group, "DOCS": docs,
                                     "CAUSAL": causal, "DROPOUT": dropout, "TRACE_STEPS": trace},
        flash_gluon.NUM_WARPS, 1, target, GluonASTSource, maxnreg=flash_gluon.WS_MAXNREG)
    ws_persistent = lambda group, docs=False, dropout=0, fold=True, queued=False: compile_for(
        flash_gluon._bwd_ws_persistent_kernel, {**gluon_values, "BLOCK_N": flash_gluon.WS_BLOCK_N, "GROUP": group,
                                                "DOCS": docs, "CAUSAL": True, "DROPOUT": dropout, "FOLD": fold,
                                                "QUEUED": queued},
        flash_gluon.NUM_WARPS, 1, target, GluonASTSource, maxnreg=flash_gluon.WS_MAXNREG)
    by_example = lambda group, causal=True, dropout=0: compile_for(
        flash_gluon._bwd_ws_example_kernel, {**gluon_values, "BLOCK_N": flash_gluon.WS_BLOCK_N, "GROUP": group,
                                             "CAUSAL": causal, "DROPOUT": dropout},
        flash_gluon.NUM_WARPS, 1, target, GluonASTSource, maxnreg=flash_gluon.WS_MAXNREG)
    return [
        ("Gluon forward", *forward(1)),
        ("Gluon forward, GQA 4", *forward(4)),
        ("Gluon forward, packed rows GQA 4", *forward(4, docs=True)),
        ("Gluon forward, bounded full GQA 4", *forward(4, docs=True, causal=False)),
        ("Gluon forward, hashed dropout GQA 4", *forward(4, dropout=2)),
        ("Gluon persistent forward", *persistent(1)),
        ("Gluon persistent forward, packed rows GQA 4", *persistent(4, docs=True)),
        ("Gluon persistent forward, bounded full GQA 4", *persistent(4, docs=True, causal=False)),
        ("Gluon persistent forward, hashed dropout packed rows", *persistent(1, docs=True, dropout=2)),
        ("Gluon persistent forward, folded order", *persistent(1, FOLD=True)),
        ("Gluon persistent forward, ping-pong", *persistent(1, FOLD=True, PINGPONG=True)),
        ("Gluon persistent forward, ping-pong packed rows GQA 4", *persistent(4, docs=True, FOLD=True, PINGPONG=True)),
        ("Gluon persistent forward, traced", *persistent(1, FOLD=True, PINGPONG=True, TRACE_ITEMS=4)),
        ("Gluon persistent forward, O in Q", *persistent(1, FOLD=True, PINGPONG=True, O_IN_K=False)),
        ("Gluon persistent forward, O in Q packed rows GQA 4", *persistent(4, docs=True, FOLD=True, PINGPONG=True,
                                                                          O_IN_K=False)),
        ("Gluon persistent forward, rotated", *persistent(1, FOLD=True, PINGPONG=True, ROTATE=True)),
        ("Gluon persistent forward, rotated packed rows GQA 4", *persistent(4, docs=True, FOLD=True, PINGPONG=True,
                                                                            ROTATE=True)),
        ("Gluon persistent forward, rotated bounded full, dropout", *persistent(1, docs=True, causal=False, dropout=2,
                                                                                FOLD=True, PINGPONG=True, ROTATE=True)),
        ("Gluon persistent forward, rotated without ping-pong", *persistent(1, ROTATE=True)),
        ("backward preprocess", *compile_for(flash_kernels._bwd_preprocess_kernel,
                                             dict(HEAD_DIM=head_dim, BLOCK=64, ZERO=1), 4, 1, target)),
        ("backward preprocess, long examples' rows", *compile_for(flash_kernels._bwd_preprocess_kernel,
                                                                  dict(HEAD_DIM=head_dim, BLOCK=64, ZERO=2), 4, 1,
                                                                  target)),
        ("dQ cast of long examples' rows", *compile_for(flash_kernels._cast_rows_kernel,
                                                        dict(HEAD_DIM=head_dim, BLOCK=64), 4, 1, target)),
        ("one-pass backward", *one_pass(1)),
        ("one-pass backward, GQA 4", *one_pass(4)),
        ("one-pass backward, packed rows GQA 4", *one_pass(4, docs=True)),
        ("one-pass backward, bounded full GQA 4", *one_pass(4, docs=True, causal=False)),
        ("one-pass backward, hashed dropout GQA 4", *one_pass(4, dropout=2)),
        ("ws backward", *ws(1)),
        ("ws backward, GQA 4", *ws(4)),
        ("ws backward, packed rows GQA 4", *ws(4, docs=True)),
        ("ws backward, bounded full GQA 4", *ws(4, docs=True, causal=False)),
        ("ws backward, hashed dropout GQA 4", *ws(4, dropout=2)),
        ("ws backward, traced packed rows GQA 4", *ws(4, docs=True, trace=4)),
        ("persistent ws backward", *ws_persistent(1)),
        ("persistent ws backward, packed rows GQA 4", *ws_persistent(4, docs=True)),
        ("persistent ws backward, hashed dropout GQA 4, stride order", *ws_persistent(4, dropout=2, fold=False)),
        ("persistent ws backward, work queue", *ws_persistent(1, queued=True)),
        ("persistent ws backward, packed rows GQA 4, work queue", *ws_persistent(4, docs=True, queued=True)),
        ("by-example ws backward, packed rows GQA 4", *by_example(4)),
        ("by-example ws backward, bounded full, hashed dropout", *by_example(1, causal=False, dropout=2)),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for sm_90")
    p.add_argument("--head-dims", default="64,128")
    args = p.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    kernels = [
        ("forward", flash_kernels._fwd_kernel, launch.FWD_TUNING),
        ("dQ", flash_kernels._bwd_dq_kernel, launch.DQ_TUNING),
        ("dK/dV", flash_kernels._bwd_dkdv_kernel, launch.DKDV_TUNING),
    ]
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    failed = 0
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        # (label, group, dropout generator (0: none), bounds (packed rows, windows), causal)
        variants = [("", 1, 0, False, True), (", GQA 4", 4, 0, False, True),
                    (", dropout", 1, 1, False, True), (", hashed dropout", 1, 2, False, True),
                    (", packed rows GQA 4", 4, 0, True, True), (", bounded full GQA 4", 4, 0, True, False)]
        for (name, kernel, table), use_tma, (variant, group, dropout, docs, causal) in itertools.product(
                kernels, (False, True), variants):
            t0 = time.time()
            constexprs = dict(CAUSAL=causal, RAGGED_T=True, UPCAST=False, PRECISION="tf32", USE_TMA=use_tma,
                              GROUP=group, DROPOUT=dropout, DOCS=docs)
            ok, detail = build(kernel, constexprs, table, head_dim, target)
            failed += not ok
            label = f"{name}{', TMA' if use_tma else ''}{variant} D={head_dim}"
            print(f"{'ok  ' if ok else 'FAIL'} | {label:<36} | {time.time() - t0:5.1f} s | {detail}", flush=True)
        if args.arch == 90:
            t0 = time.time()
            for name, ok, detail in builds_of_the_gluon_kernels(head_dim, target):
                failed += not ok
                label = f"{name} D={head_dim}"
                print(f"{'ok  ' if ok else 'FAIL'} | {label:<30} | {time.time() - t0:5.1f} s | {detail}", flush=True)
    for name, kernel in (("swiglu forward", swiglu._swiglu_forward), ("swiglu backward", swiglu._swiglu_backward)):
        t0 = time.time()
        ok, detail = compile_for(kernel, {"BLOCK": swiglu.BLOCK}, 4, 1, target)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} | {name:<36} | {time.time() - t0:5.1f} s | {detail}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
