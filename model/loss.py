"""Fused linear cross-entropy: the LM head and the loss in row chunks, never the full (N, V) logits.

`chunked_cross_entropy(h, weight, targets, chunk_tokens)` equals
`F.cross_entropy(F.linear(h, weight), targets, ignore_index=ignore_index)`, gradients included, but holds at most
`chunk_tokens` rows of logits at a time. The forward computes each chunk's loss and, right away, its gradient
(softmax - one-hot) -> dh rows and a running dW, so backward only scales the saved dh and dW by grad_output: the
logits are never recomputed (the idea of Liger-Kernel's fused linear cross-entropy). Under torch.autocast the
matmuls run in the autocast dtype, as F.linear's would, and the softmax in fp32, as F.cross_entropy's does.

    loss = chunked_cross_entropy(h.view(-1, C), lm_head.weight, targets.view(-1), chunk_tokens=4096)
"""

import torch
from torch import Tensor

IGNORE_INDEX = -100  # a target that counts no loss (PyTorch's default ignore_index, Hugging Face's label for "none")


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int, ignore_index: int) -> Tensor:
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        hc, wc = h.to(dtype), weight.to(dtype)  # the casts autocast would make for F.linear
        need_dh, need_dw = ctx.needs_input_grad[:2]
        valid = targets != ignore_index  # (N,)
        safe_targets = torch.where(valid, targets, 0)  # (N,) gatherable even where ignored
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        # fp32 accumulators; they hold the gradient of the *summed* loss: 1/n_valid and grad_output come in backward,
        # so the low-precision g below stays in [-1, 1] (an fp16 g pre-scaled by 1/n_valid would underflow)
        dh = torch.empty(h.shape, dtype=torch.float32, device=h.device) if need_dh else None  # (N, C)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_dw else None  # (V, C)
        for s in range(0, h.shape[0], chunk_tokens):
            hs, ts, vs = hc[s : s + chunk_tokens], safe_targets[s : s + chunk_tokens], valid[s : s + chunk_tokens]
            logits = (hs @ wc.T).float()  # (n, V): the only vocabulary-wide tensor, in fp32 as F.cross_entropy's
            target_logits = logits.gather(1, ts[:, None])  # (n, 1)
            row_max = logits.amax(dim=1, keepdim=True)  # (n, 1)
            p = logits.sub_(row_max).exp_()  # (n, V) unnormalised softmax, in place: logsumexp would need a 2nd buffer
            row_sum = p.sum(dim=1, keepdim=True)  # (n, 1)
            loss += ((row_max + row_sum.log() - target_logits).squeeze(1) * vs).sum()
            if need_dh or need_dw:
                g = p.div_(row_sum)  # (n, V) softmax
                if torch.compiler.is_compiling():
                    # - one-hot as a select: inductor fuses it, the mask and the cast into the softmax's pass, which
                    # a scatter (a mutation) would split into three passes over (n, V)
                    one_hot = torch.arange(g.shape[1], device=g.device) == ts[:, None]  # (n, V), never materialised
                    g = torch.where(one_hot, g - 1.0, g) * vs[:, None]
                else:  # eager: in place, no (n, V) temporaries
                    g.scatter_add_(1, ts[:, None], torch.full_like(row_sum, -1.0)).mul_(vs[:, None])
                g = g.to(dtype)  # the gradient matmuls in autocast's dtype, as autograd would run F.linear's backward
                if need_dh:
                    dh[s : s + chunk_tokens] = g @ wc  # (n, C)
                if need_dw:
                    dw += g.T @ hs  # (V, C)
        n_valid = valid.sum()  # a tensor: no host sync, no graph break
        ctx.save_for_backward(dh, dw, n_valid)
        ctx.dtypes = h.dtype, weight.dtype
        return loss / n_valid  # nan when every row is ignored, as F.cross_entropy

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        dh, dw, n_valid = ctx.saved_tensors
        scale = grad_loss / n_valid.clamp(min=1)  # all rows ignored: zero gradients, as F.cross_entropy
        h_dtype, w_dtype = ctx.dtypes
        dh = (dh * scale).to(h_dtype) if dh is not None else None
        dw = (dw * scale).to(w_dtype) if dw is not None else None
        return dh, dw, None, None, None


def chunked_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int,
                          ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean cross-entropy of F.linear(h, weight) (h (N, C), weight (V, C)) against targets (N,) over the rows whose
    target is not ignore_index, computed `chunk_tokens` rows at a time."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not torch.is_grad_enabled():  # evaluation: needs_input_grad ignores grad mode, and would still ask for grads
        h, weight = h.detach(), weight.detach()
    return _FusedLinearCrossEntropy.apply(h, weight, targets, chunk_tokens, ignore_index)
