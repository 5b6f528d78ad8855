"""SwiGLU (model/swiglu.py and the Triton backward of kernels/swiglu.py) against float64 autograd: fp32 and bf16,
awkward widths (W = 1, odd, not a multiple of the kernel's block), one row, non-contiguous inputs."""

import pytest
import torch
import torch.nn.functional as F
from helpers import ATOL, within_tolerance

from model.swiglu import swiglu

SHAPES = [(1, 1, 2), (3, 5, 2 * 7), (2, 2 * 1100)]  # (..., 2·W)


def reference(y: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) · up and its gradient by autograd, in y's dtype."""
    y = y.detach().requires_grad_(True)
    gate, up = y.chunk(2, dim=-1)
    h = F.silu(gate) * up
    return h, torch.autograd.grad(h, y, dh)[0]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_and_its_gradient_err_at_most_twice_pytorchs_own_against_float64(shape, dtype):
    y = torch.randn(*shape[:-1], shape[-1] + 3, dtype=torch.float64)[..., : shape[-1]]  # a strided [gate | up]
    dh = torch.randn(*shape[:-1], shape[-1] // 2, dtype=torch.float64)
    exact = reference(y, dh)
    torch_own = reference(y.to(dtype), dh.to(dtype))
    y_ours = y.to(dtype).requires_grad_(True)
    h = swiglu(y_ours)
    ours = (h, torch.autograd.grad(h, y_ours, dh.to(dtype))[0])
    for o, t, e in zip(ours, torch_own, exact, strict=True):
        assert o.dtype == dtype and o.shape == e.shape
        ok, msg = within_tolerance(o, e, t, ATOL[dtype])
        assert ok, msg
    with torch.no_grad():  # generation's path: the plain expression
        assert torch.equal(swiglu(y.to(dtype)), torch_own[0])


@pytest.mark.parametrize("shape", [(1, 2 * 1), (5, 2 * 7), (3, 2 * 1100)])
def test_the_triton_kernels_write_every_output_within_twice_pytorchs_error(shape):
    import triton

    from kernels import env
    from kernels import swiglu as kernel

    if not env.INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (or a GPU test run)")
    y = torch.randn(shape, dtype=torch.float64)
    dh = torch.randn(shape[0], shape[1] // 2, dtype=torch.float64)
    exact, torch_own = reference(y, dh), reference(y.float(), dh.float())
    width = shape[1] // 2
    grid = (shape[0], triton.cdiv(width, kernel.BLOCK))  # the launchers' grid
    h = torch.full((shape[0], width), float("nan"))  # poisoned: an unwritten element stays NaN
    dy = torch.full(shape, float("nan"))
    kernel._swiglu_forward[grid](y.float(), h, width, kernel.BLOCK)
    kernel._swiglu_backward[grid](y.float(), dh.float(), dy, width, kernel.BLOCK)
    for o, t, e in zip((h, dy), torch_own, exact, strict=True):
        ok, msg = within_tolerance(o, e, t, ATOL[torch.float32])
        assert ok, msg
    assert torch.equal(kernel.swiglu_forward(y.float()), h)
    assert torch.equal(kernel.swiglu_backward(y.float(), dh.float()), dy)
