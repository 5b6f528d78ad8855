"""Autoregressive generation: a key/value cache, next-token sampling (temperature, top-k, top-p) and a token stream.

`GPT.generate` collects the stream; sample.py prints it as it comes.

    from model.generate import stream
    for token in stream(model, idx, max_new_tokens=100, temperature=0.8, top_p=0.95):   # idx: (B, T) prompt ids
        ...                                                                               # token: (B, 1)

With the cache (use_cache=True, the default) the prompt is run once (prefill: causal self-attention over the
prompt, keys and values stored) and every further token is one query attending to the cached keys (decode: no mask
needed, all cached tokens are in its past), so a step costs O(T) instead of a full forward over the context.

The cache is bounded by block_size, the model's context (GPT-2's learned position embeddings end there): it never
holds more than block_size tokens, nor more than the prompt and the new tokens need. When the context outgrows it,
the window slides: the cache is refilled from the last block_size tokens, which is exactly what generation without
the cache sees, so both give the same tokens. Past that point each step re-runs a full window (no faster than
without the cache); the cache pays off for contexts up to block_size.

Decode steps call the attention backend with causal=False, except attention=triton: its kernel takes only equal
query and key lengths, so those steps run on SDPA (model/attention.py: get_decode_attention); the prefill and the
uncached path use the kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from model.gpt import GPT


class LayerCache:
    """One layer's keys and values, in buffers preallocated to max_len tokens (no reallocation per step)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0  # tokens cached
        self.k: Tensor | None = None  # (B, n_kv_head, max_len, hs), allocated on first use like the keys
        self.v: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the keys and values (B, n_kv_head, T, hs) of the next T tokens; return those of every cached token,
        (B, n_kv_head, length, hs). The prompt goes into an empty cache in one piece, then tokens come one at a time:
        the two cases the attention layer knows how to mask."""
        T = k.size(2)
        if self.length and T != 1:
            raise ValueError(f"the KV cache holds {self.length} tokens: feed one token at a time, not {T}")
        if self.length + T > self.max_len:
            raise ValueError(f"the KV cache holds {self.length} tokens: {T} more exceed its {self.max_len}")
        if self.k is None or self.v is None:
            B, nkv, _, hs = k.shape
            self.k = k.new_empty(B, nkv, self.max_len, hs)
            self.v = v.new_empty(B, nkv, self.max_len, hs)
        start, self.length = self.length, self.length + T
        self.k[:, :, start : self.length] = k
        self.v[:, :, start : self.length] = v
        return self.k[:, :, : self.length], self.v[:, :, : self.length]  # (B, n_kv_head, length, hs) views


class KVCache:
    """Keys and values of the tokens seen so far, one LayerCache per transformer block."""

    def __init__(self, n_layer: int, max_len: int) -> None:
        self.layers = [LayerCache(max_len) for _ in range(n_layer)]

    @property
    def length(self) -> int:
        return self.layers[0].length


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None) -> Tensor:
    """The next token (B, 1) from logits (B, vocab). temperature 0 is greedy (argmax); otherwise softmax of
    logits / temperature, restricted to the top_k most likely tokens and to the smallest set whose probability
    reaches top_p (nucleus sampling), drawn with torch's global RNG (torch.manual_seed makes it repeatable)."""
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
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)  # (B, 1)


@torch.no_grad()
def stream(model: GPT, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, use_cache: bool = True) -> Iterator[Tensor]:
    """Yield max_new_tokens tokens, each (B, 1), after the prompt idx (B, T). Prompts longer than block_size are
    cropped to their last block_size tokens. Dropout applies in training mode: call model.eval() first."""
    block_size = model.config.block_size
    # The cache holds what this call can use, at most block_size tokens: a model with a long context (Llama-3.2:
    # 131,072 positions) would otherwise allocate its whole context in every layer.
    capacity = min(block_size, idx.size(1) + max_new_tokens)
    cache: KVCache | None = None
    for _ in range(max_new_tokens):
        if not use_cache:
            logits = model.next_token_logits(idx[:, -block_size:])
        elif cache is None or cache.length == capacity:
            # Prefill: the prompt, or (window full) the last block_size tokens, the context the uncached path sees.
            cache = KVCache(model.config.n_layer, capacity)
            logits = model.next_token_logits(idx[:, -block_size:], cache)
        else:
            logits = model.next_token_logits(idx[:, -1:], cache)  # decode: only the newest token is not cached yet
        next_id = sample_next(logits, temperature, top_k, top_p)  # (B, 1)
        idx = torch.cat((idx, next_id), dim=1)
        yield next_id
