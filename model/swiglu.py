"""SwiGLU, silu(gate) · up, over one fused projection's output [gate | up] (the Llama family's MLP activation).

    h = swiglu(y)   # y (..., 2·W) -> (..., W)

In training, an opaque op with its own backward: kernels/swiglu.py's Triton kernels on CUDA, the same formulas in
torch elsewhere. The backward reads dh, gate and up once and writes d[gate | up] in the fused layout; a compiled graph
left to itself computes the gradient of `y.chunk(2)` as a concatenation whose kernel loads its inputs once for each
half. As an op (not an autograd.Function) it stays recomputable inside activation checkpointing under torch.compile.
Without gradients (generation) it is the plain expression, which a compiled graph fuses with its neighbours.
"""

import torch
import torch.nn.functional as F
from torch import Tensor


def _plain(y: Tensor) -> Tensor:
    gate, up = y.chunk(2, dim=-1)  # (..., W) each
    return F.silu(gate) * up


@torch.library.custom_op("gpt::swiglu", mutates_args=())
def _swiglu(y: Tensor) -> Tensor:
    """(n, 2·W) contiguous -> (n, W)."""
    if y.is_cuda:
        from kernels.swiglu import swiglu_forward  # imported on use: the model loads where triton is missing

        return swiglu_forward(y)
    return _plain(y)


@_swiglu.register_fake
def _(y: Tensor) -> Tensor:
    return y.new_empty(y.shape[0], y.shape[1] // 2)


@torch.library.custom_op("gpt::swiglu_backward", mutates_args=())
def _swiglu_backward(y: Tensor, dh: Tensor) -> Tensor:
    """d[gate | up] (n, 2·W) in y's dtype from y (n, 2·W) and dh (n, W), both contiguous."""
    if y.is_cuda:
        from kernels.swiglu import swiglu_backward

        return swiglu_backward(y, dh)
    gate, up = y.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    return torch.cat([dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig], dim=-1).to(y.dtype)


@_swiglu_backward.register_fake
def _(y: Tensor, dh: Tensor) -> Tensor:
    return torch.empty_like(y)


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Tensor], output: Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx: torch.autograd.function.FunctionCtx, dh: Tensor) -> Tensor:
    (y,) = ctx.saved_tensors
    return _swiglu_backward(y, dh.contiguous())


_swiglu.register_autograd(_backward, setup_context=_setup)


def swiglu(y: Tensor) -> Tensor:
    """silu(gate) · up for y = [gate | up] along the last dim: (..., 2·W) -> (..., W)."""
    if not (torch.is_grad_enabled() and y.requires_grad):  # inference (generation): plain ops, fused when compiled
        return _plain(y)
    h = _swiglu(y.reshape(-1, y.shape[-1]).contiguous())  # (n, W)
    return h.view(*y.shape[:-1], y.shape[-1] // 2)
