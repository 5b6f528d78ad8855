"""Autoregressive generation: a static KV cache with per-row lengths, next-token sampling (temperature, top-k, top-p),
a token stream, and the decode step replayed as a CUDA graph.

`GPT.generate` collects the stream; sample.py prints it as it comes.

    from model.generate import stream
    for token in stream(model, idx, max_new_tokens=100, temperature=0.8, top_p=0.95):   # idx: (B, T) prompt ids
        ...                                                                               # token: (B, 1)
    stream(model, idx, 100, lengths=[5, 9, 7])   # prompts of different lengths, right-padded into idx, one batch
    stream(model, idx, 100, stop_tokens=[2])     # ends once every row has produced token 2 (cut each row there)

With the cache (use_cache=True, the default) the prompts are run once (prefill: causal self-attention over the
right-padded prompts, whose padding no real token attends to; keys and values stored), then every further token is
one query per row attending to its row's cached keys (decode), so a step costs O(T) instead of a full forward.

The cache is static: every layer's keys and values live in buffers of max_len tokens allocated at the prefill, each
row's tokens at its own positions 0..length-1, and a decode step writes its keys at each row's length. Nothing moves
and no shape changes from one step to the next, which is what lets a CUDA graph capture the step: on a GPU the second
decode step is captured (the first one ran eagerly, compiling and autotuning what it needs), with sampling inside,
and every later step is one graph replay, free of Python and of per-kernel launch costs. compile=True fuses the
step's kernels with torch.compile before it is captured.

The cache holds at most block_size tokens, the model's context (GPT-2's learned position embeddings end there), nor
more than the longest prompt and the new tokens need. When a row's context outgrows it, the window slides: the cache
is refilled from each row's last block_size tokens, which is exactly what generation without the cache sees, so
both give the same tokens. Past that point each step re-runs a full window (no faster than without the cache).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from model.gpt import GPT


class KVCache:
    """Keys and values of every layer in static buffers, and the number of tokens cached per row.

    Prefill (the cache is empty): `model.next_token_logits(idx, cache, lengths)` stores the keys and values of the
    right-padded prompts idx (B, T) at positions 0..T-1 and sets each row's length. Decode (the cache is filled):
    `model.next_token_logits(tokens, cache)` with tokens (B, Tq) writes them at positions lengths..lengths+Tq-1 of each
    row, attends, and advances the lengths. Lengths live on the device, so that no step waits for the GPU: the caller
    keeps every row within max_len (stream does; an index past the buffer fails in the write)."""

    def __init__(self, n_layer: int, max_len: int) -> None:
        self.max_len = max_len
        self.layers = [LayerCache(self) for _ in range(n_layer)]
        self.lengths: Tensor | None = None  # (B,) int64: tokens cached per row
        self.positions: Tensor | None = None  # (B, Tq): positions of the tokens being decoded (set per forward)
        self.filled = False  # False: the next forward is a prefill

    def reset(self) -> None:
        """Empty the cache, keeping its buffers (a CUDA graph captured over them stays valid)."""
        self.filled = False

    def prefilled(self, lengths: Tensor) -> None:
        """Record the prompts' lengths (B,) after a prefill, in place once the buffer exists."""
        if self.lengths is None:
            self.lengths = lengths.clone()
        else:
            self.lengths.copy_(lengths)
        self.filled = True


class LayerCache:
    """One layer's keys and values, (B, n_kv_head, max_len, hs) each, allocated at the first prefill."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def prefill(self, k: Tensor, v: Tensor) -> None:
        """Store the keys and values (B, n_kv_head, T, hs) of positions 0..T-1."""
        B, nkv, T, hs = k.shape
        if self.k is None or self.v is None:
            # zeros, not empty: the masked backends multiply unwritten values by zero weights, and 0 · NaN is NaN
            self.k = k.new_zeros(B, nkv, self.cache.max_len, hs)
            self.v = v.new_zeros(B, nkv, self.cache.max_len, hs)
        self.k[:, :, :T] = k
        self.v[:, :, :T] = v

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the keys and values (B, n_kv_head, Tq, hs) of the tokens at the cache's positions (B, Tq) of each
        row; return the whole buffers (B, n_kv_head, max_len, hs), which the decode attention reads up to the
        positions."""
        assert self.k is not None and self.v is not None and self.cache.positions is not None, "prefill first"
        rows = torch.arange(k.size(0), device=k.device)[:, None]  # (B, 1)
        # Indexed by (rows, :, positions) the buffer is (B, Tq, n_kv_head, hs).
        self.k[rows, :, self.cache.positions] = k.transpose(1, 2)
        self.v[rows, :, self.cache.positions] = v.transpose(1, 2)
        return self.k, self.v


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None) -> Tensor:
    """The next token (B, 1) from logits (B, vocab). temperature 0 is greedy (argmax); otherwise softmax of
    logits / temperature, restricted to the top_k most likely tokens and to the smallest set whose probability
    reaches top_p (nucleus sampling), drawn with torch's global RNG (torch.manual_seed makes it repeatable).

    The draw is argmax(p / e) with e ~ Exponential(1) per token, which picks token i with probability p_i exactly
    as torch.multinomial would, but is a few element-wise kernels with no host synchronisation: a CUDA graph can
    hold it."""
    if temperature < 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0.0:
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
    logits = logits.float() / temperature  # fp32: bf16 logits would round the probabilities of close tokens together
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, vocab)
        probs = sorted_logits.softmax(dim=-1)
        # A token is dropped when the more likely ones already reach top_p; the most likely token always stays.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = F.softmax(logits, dim=-1)  # (B, vocab)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1, keepdim=True)  # (B, 1)


class DecodeStep:
    """The decode step, tokens (B, 1) -> next tokens (B, 1): eager, or (CUDA, cuda_graph) replayed as a CUDA graph
    captured at the second call, the first having run eagerly to compile and autotune what the step launches."""

    def __init__(self, model: GPT, cache: KVCache, sample: Callable[[Tensor], Tensor], cuda_graph: bool,
                 compile: bool) -> None:
        self.logits = torch.compile(model.next_token_logits, fullgraph=True, dynamic=False) if compile \
            else model.next_token_logits
        self.cache, self.sample, self.cuda_graph = cache, sample, cuda_graph
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tokens: Tensor | None = None  # the graph's input and output buffers
        self.next: Tensor | None = None

    def step(self, tokens: Tensor) -> Tensor:
        return self.sample(self.logits(tokens, self.cache))

    def __call__(self, tokens: Tensor) -> Tensor:
        self.calls += 1
        if not (self.cuda_graph and tokens.is_cuda) or self.calls == 1:
            return self.step(tokens)
        if self.graph is None:
            self.tokens, self.graph = tokens.clone(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # records the kernels without running them: replayed below
                self.next = self.step(self.tokens)
        assert self.tokens is not None and self.next is not None
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.next.clone()  # the next replay overwrites its buffer


def right_pad(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Token rows of different lengths as one right-padded batch (B, max length) and their lengths (B,)."""
    lengths = torch.tensor([len(r) for r in rows], device=rows[0].device)
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True), lengths


@torch.no_grad()
def stream(model: GPT, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, use_cache: bool = True, lengths: list[int] | None = None,
           cuda_graph: bool = True, compile: bool = False,
           stop_tokens: Collection[int] | None = None) -> Iterator[Tensor]:
    """Yield max_new_tokens tokens, each (B, 1), after the prompts idx (B, T): row b's prompt is idx[b, :lengths[b]]
    (default: all of idx). Prompts longer than block_size are cropped to their last block_size tokens. On a GPU the
    decode steps replay a CUDA graph (cuda_graph=False: run eagerly), fused by torch.compile first if compile. Dropout
    applies in training mode: call model.eval() first.

    stop_tokens: stop after the step at which every row has produced one of them; until then the tokens are those
    of a run without stop_tokens. A row that produced one earlier goes on generating until then: cut each row at its
    first. Checking costs one host synchronisation per step."""
    B, T = idx.shape
    lengths = lengths or [T] * B
    if len(lengths) != B or not all(1 <= n <= T for n in lengths):
        raise ValueError(f"lengths must give each of the {B} prompts a length in 1..{T}, got {lengths}")
    block_size = model.config.block_size
    prompts = [idx[b, :n] for b, n in enumerate(lengths)]
    generated: list[Tensor] = []  # (B, 1) each

    def windows() -> tuple[Tensor, Tensor, list[int]]:
        """Each row's last block_size tokens, right-padded (B, T'), their lengths (B,) and the longest."""
        new = torch.cat(generated, dim=1) if generated else idx[:, :0]  # (B, steps)
        ctx, n = right_pad([torch.cat((p, new[b]))[-block_size:] for b, p in enumerate(prompts)])
        return ctx, n, ctx.size(1)

    def sample(logits: Tensor) -> Tensor:
        return sample_next(logits, temperature, top_k, top_p)

    # The cache holds what this call can use, at most block_size tokens: a model with a long context (Llama-3.2:
    # 131,072 positions) would otherwise allocate its whole context in every layer.
    capacity = min(block_size, max(lengths) + max_new_tokens)
    cache = KVCache(model.config.n_layer, capacity) if use_cache else None
    decode = DecodeStep(model, cache, sample, cuda_graph, compile) if cache is not None else None
    longest = 0  # cached tokens of the longest row (kept on the host: no step reads the device's lengths)
    stop = torch.tensor(sorted(stop_tokens), device=idx.device) if stop_tokens else None
    stopped = torch.zeros(B, 1, dtype=torch.bool, device=idx.device)  # rows that have produced a stop token
    for _ in range(max_new_tokens):
        if cache is None or decode is None:
            ctx, n, _ = windows()
            next_id = sample(model.next_token_logits(ctx, lengths=n))
        elif not cache.filled or longest == capacity:
            # Prefill: the prompts, or (window full) each row's last block_size tokens, as the uncached path sees.
            cache.reset()
            ctx, n, longest = windows()
            next_id = sample(model.next_token_logits(ctx, cache, n))
        else:
            next_id = decode(generated[-1])  # decode: only the newest token is not cached yet
            longest += 1
        generated.append(next_id)
        yield next_id
        if stop is not None:
            stopped |= torch.isin(next_id, stop)
            if stopped.all():
                return
