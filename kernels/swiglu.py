"""SwiGLU, h = silu(gate) · up over a fused projection's output y = [gate | up], forward and backward as Triton kernels
that read each input once.

    from kernels.swiglu import swiglu_forward, swiglu_backward
    h = swiglu_forward(y)        # y (n, 2·W) contiguous -> (n, W), y's dtype
    dy = swiglu_backward(y, dh)  # dh (n, W) contiguous -> d[gate | up] (n, 2·W), y's dtype

d gate = dh · up · σ(gate) · (1 + gate · (1 − σ(gate))), d up = dh · silu(gate); fp32 math, rounded once.
model/swiglu.py uses them on CUDA; they run on CPU tensors under TRITON_INTERPRET=1 (tests).
"""

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program


@triton.jit
def _swiglu_forward(y_ptr, h_ptr, W, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < W
    gate = tl.load(y_ptr + row * 2 * W + cols, inside).to(tl.float32)
    up = tl.load(y_ptr + row * 2 * W + W + cols, inside).to(tl.float32)
    tl.store(h_ptr + row * W + cols, (gate * tl.sigmoid(gate) * up).to(h_ptr.dtype.element_ty), inside)


@triton.jit
def _swiglu_backward(y_ptr, dh_ptr, dy_ptr, W, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < W
    gate = tl.load(y_ptr + row * 2 * W + cols, inside).to(tl.float32)
    up = tl.load(y_ptr + row * 2 * W + W + cols, inside).to(tl.float32)
    dh = tl.load(dh_ptr + row * W + cols, inside).to(tl.float32)
    sig = tl.sigmoid(gate)
    out = dy_ptr.dtype.element_ty
    tl.store(dy_ptr + row * 2 * W + cols, (dh * up * sig * (1 + gate * (1 - sig))).to(out), inside)
    tl.store(dy_ptr + row * 2 * W + W + cols, (dh * gate * sig).to(out), inside)


def _check(y: torch.Tensor, *others: torch.Tensor) -> None:
    if y.dim() != 2 or y.shape[1] % 2 or not all(t.is_contiguous() for t in (y, *others)):
        raise ValueError(f"swiglu: y must be a contiguous (n, 2·W), dh a contiguous (n, W), got "
                         f"{[tuple(t.shape) for t in (y, *others)]}")


def swiglu_forward(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up (n, W) for y = [gate | up] (n, 2·W), contiguous."""
    _check(y)
    n, width = y.shape[0], y.shape[1] // 2
    h = y.new_empty(n, width)
    _swiglu_forward[(n, triton.cdiv(width, BLOCK))](y, h, width, BLOCK)
    return h


def swiglu_backward(y: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    """d[gate | up] (n, 2·W) for y (n, 2·W) and dh (n, W), both contiguous."""
    _check(y, dh)
    n, width = dh.shape
    dy = torch.empty_like(y)
    _swiglu_backward[(n, triton.cdiv(width, BLOCK))](y, dh, dy, width, BLOCK)
    return dy
