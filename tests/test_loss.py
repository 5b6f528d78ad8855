"""chunked_cross_entropy (CPU) against the plain path F.cross_entropy(F.linear(h, weight)): loss and gradients in fp32
and under autocast, ignored rows, weight tying, frozen inputs, torch.compile, and what it materialises."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from model.loss import IGNORE_INDEX, chunked_cross_entropy

V, C = 50, 16


def plain(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w), t, ignore_index=IGNORE_INDEX)


def chunked(chunk_tokens: int):
    return lambda h, w, t: chunked_cross_entropy(h, w, t, chunk_tokens)


def inputs(n: int, v: int = V, ignore_every: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, w = torch.randn(n, C), torch.randn(v, C) / C**0.5
    t = torch.randint(0, v, (n,))
    t[1::ignore_every] = IGNORE_INDEX  # row 0 always counts
    return h, w, t


def loss_and_grads(fn, h, w, t, dtype=None, grad_scale: float = 1.0) -> list[torch.Tensor]:
    """fn's loss and (h, w) grads with inputs cast to dtype; grad_scale stands for a GradScaler's loss scale."""
    h, w = (x.detach().to(dtype or x.dtype).requires_grad_() for x in (h, w))
    loss = fn(h, w, t)
    (loss * grad_scale).backward()
    return [loss.detach(), h.grad / grad_scale, w.grad / grad_scale]


def assert_within_twice_the_plain_error(out: list[torch.Tensor], plain_out: list[torch.Tensor],
                                        ref: list[torch.Tensor]) -> None:
    """flash-attn's rule: the error vs float64 is at most twice the plain path's own, plus a slack of 1e-6 relative."""
    for name, x, p, r in zip(("loss", "dh", "dw"), out, plain_out, ref, strict=True):
        err, plain_err = ((y.double() - r).abs().max().item() for y in (x, p))
        assert err <= 2 * plain_err + 1e-6 * r.abs().max().item(), f"{name}: {err:.3g} vs plain {plain_err:.3g}"


MATMULS = ("aten.mm", "aten.addmm", "aten.matmul", "aten.bmm")


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[int, ...], torch.dtype]] = []  # (op, output shape, dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.ops.append((str(func.overloadpacket), tuple(out.shape), out.dtype))
        return out


@pytest.mark.parametrize("n,chunk_tokens", [(1, 1), (1, 4), (7, 3), (33, 8), (32, 8), (17, 1), (5, 100)])
def test_fp32_loss_and_grads_within_twice_the_plain_paths_error_vs_float64(n, chunk_tokens):
    torch.manual_seed(n * 100 + chunk_tokens)
    h, w, t = inputs(n)
    ref = loss_and_grads(plain, h, w, t, torch.float64)
    assert_within_twice_the_plain_error(loss_and_grads(chunked(chunk_tokens), h, w, t), loss_and_grads(plain, h, w, t),
                                        ref)


def test_all_rows_ignored_gives_nan_loss_and_zero_grads_as_f_cross_entropy():
    torch.manual_seed(0)
    h, w, _ = inputs(9)
    t = torch.full((9,), IGNORE_INDEX)
    loss, dh, dw = loss_and_grads(chunked(4), h, w, t)
    ref_loss, ref_dh, ref_dw = loss_and_grads(plain, h, w, t)
    assert loss.isnan() and ref_loss.isnan()
    assert torch.equal(dh, ref_dh) and torch.equal(dw, ref_dw) and not dh.any() and not dw.any()


@pytest.mark.parametrize("dtype,grad_scale", [(torch.bfloat16, 1.0), (torch.float16, 2.0**16)], ids=["bf16", "fp16"])
def test_under_autocast_matmuls_run_in_its_dtype_and_match_the_plain_autocast_path(dtype, grad_scale):
    """Both paths round the same logits (the same low-precision matmul), the same fp32 softmax gradient and the same
    matmul outputs once each to `dtype`; they differ only in where 1/n_valid is applied and in how dW's sum is split.
    So the chunked error vs float64 must be of the plain autocast path's size: we allow twice it. fp16 runs with a
    GradScaler-like loss scale, and p/n_valid (~1/2048/2731 = 1.8e-7) lies in fp16's subnormals (spacing 6e-8): a path
    that pre-scaled its fp16 gradient by 1/n_valid, before grad_output's scale comes in, fails here (4x the error)."""
    torch.manual_seed(1)
    h, w, t = inputs(4097, v=2048)
    ref = loss_and_grads(plain, h, w, t, torch.float64)
    with torch.autocast("cpu", dtype=dtype):
        plain_out = loss_and_grads(plain, h, w, t, grad_scale=grad_scale)
        with _RecordOps() as ops:
            out = loss_and_grads(chunked(256), h, w, t, grad_scale=grad_scale)
    assert {dt for op, _, dt in ops.ops if op in MATMULS} == {dtype}  # all 3 x 17 chunks' matmuls
    assert [x.dtype for x in out] == [torch.float32] * 3  # loss in fp32; grads in the (fp32) inputs' dtype
    torch.testing.assert_close(out[0], plain_out[0], rtol=1e-5, atol=0)  # same logits, fp32 lse: only sum order
    assert_within_twice_the_plain_error(out, plain_out, ref)


def test_tied_weight_gets_the_embedding_plus_the_head_gradient():
    torch.manual_seed(2)
    idx, t = torch.randint(0, V, (2, 23))

    def grads(loss_fn) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(3)
        emb = torch.nn.Embedding(V, C)
        h = torch.tanh(emb(idx)).view(-1, C)  # (N, C): the "model" between the lookup and the head
        loss = loss_fn(h, emb.weight, t)  # the head reuses the embedding matrix, as GPT-2
        loss.backward()
        return loss.detach(), emb.weight.grad

    (loss, dw), (ref_loss, ref_dw) = grads(chunked(5)), grads(plain)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(dw, ref_dw)


def test_inputs_not_requiring_grad_get_no_grad_and_the_other_one_is_right():
    torch.manual_seed(4)
    h, w, t = inputs(11)
    for h_grad, w_grad in ((False, True), (True, False), (False, False)):
        hh, ww = h.clone().requires_grad_(h_grad), w.clone().requires_grad_(w_grad)
        loss = chunked_cross_entropy(hh, ww, t, 4)
        torch.testing.assert_close(loss, plain(h, w, t))
        if h_grad or w_grad:
            loss.backward()
        else:
            assert loss.grad_fn is None
        ref = loss_and_grads(plain, h, w, t)
        for x, needs, ref_grad in ((hh, h_grad, ref[1]), (ww, w_grad, ref[2])):
            assert (x.grad is None) != needs
            if needs:
                torch.testing.assert_close(x.grad, ref_grad)


def test_no_op_makes_more_than_chunk_tokens_rows_of_logits_and_backward_has_no_matmul():
    torch.manual_seed(5)
    h, w, t = (x.requires_grad_() if x.is_floating_point() else x for x in inputs(40))
    with _RecordOps() as fwd:
        loss = chunked_cross_entropy(h, w, t, 16)
    with _RecordOps() as bwd:
        loss.backward()
    vocab_wide = [shape for _, shape, _ in fwd.ops if len(shape) == 2 and shape[1] == V]
    assert vocab_wide and max(rows for rows, _ in vocab_wide) == 16
    assert not any(op in MATMULS for op, _, _ in bwd.ops)  # the logits are not recomputed


def test_under_no_grad_only_the_logits_matmuls_run():
    torch.manual_seed(7)
    h, w, t = (x.requires_grad_() if x.is_floating_point() else x for x in inputs(40))
    with torch.no_grad(), _RecordOps() as ops:
        loss = chunked_cross_entropy(h, w, t, 16)
    assert sum(op in MATMULS for op, _, _ in ops.ops) == 3  # one per chunk: no dh, dW work for an evaluation
    torch.testing.assert_close(loss, plain(h, w, t))


def test_compiled_call_under_bf16_autocast_gives_the_eager_loss_and_grads():
    """One inductor compile on CPU (~20 s on 2 cores, cold cache), under autocast as the training loop runs it: dynamo
    traces the autograd.Function, its autocast queries included, into one graph (fullgraph)."""
    torch.manual_seed(6)
    h, w, t = inputs(37)
    compiled = torch.compile(chunked_cross_entropy, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loss_and_grads(lambda h, w, t: compiled(h, w, t, 8), h, w, t)
        eager = loss_and_grads(chunked(8), h, w, t)
    for x, ref in zip(out, eager, strict=True):
        torch.testing.assert_close(x, ref, atol=1e-6, rtol=1e-5)  # bf16 matmuls in both: fp32 ones are 2e-4..1e-3 off


def test_chunk_tokens_below_one_is_refused():
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_cross_entropy(torch.randn(2, C), torch.randn(V, C), torch.zeros(2, dtype=torch.long), 0)
