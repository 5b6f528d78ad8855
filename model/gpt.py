"""A decoder-only transformer in the style of nanoGPT, in two families chosen by GPTConfig.family:

    family   positions                     norm       MLP                         attention        LM head
    gpt2     learned embeddings (wpe)      LayerNorm  GELU (4·n_embd)             MHA (or GQA)     tied to wte
    llama    rotary, inside attention      RMSNorm    SwiGLU (intermediate_size)  GQA (n_kv_head)  tied or not

Both are pre-norm stacks of the same Block (x + attn(norm(x)), then x + mlp(norm(x))); `Block.__init__` and
`GPT.__init__` are where the families differ. Qwen2 is the llama family with biases on the q/k/v projection only
(qkv_bias=True, bias=False). The config, GPTConfig, lives in model/config.py. The attention layer is pluggable:
GPTConfig.attention names a backend of model/attention.py (naive, sdpa, triton).

    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=257, attention="sdpa"))
    logits, loss = model(idx, targets)   # idx, targets: (B, T) int64 -> logits (B, T, vocab_size)
                                         # targets equal to model/loss.py's IGNORE_INDEX count no loss
    out = model.generate(idx, max_new_tokens=50, temperature=0.8, top_k=200)   # (B, T + 50), with a KV cache
    gpt2 = GPT.from_pretrained("gpt2", dropout=0.1)   # Hugging Face weights (model/pretrained.py), Llama/Qwen2 too
    model.save_pretrained("out-dir")                    # back to a Hugging Face directory

Generation (KV cache, sampling) lives in model/generate.py, Hugging Face loading and export in model/pretrained.py,
rotary embeddings in model/rope.py, the chunked LM-head loss in model/loss.py.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from model.attention import get_attention, get_decode_attention, get_document_mask, get_packed_attention
from model.config import GPTConfig
from model.generate import KVCache, LayerCache, stream
from model.loss import IGNORE_INDEX, chunked_cross_entropy
from model.rope import apply_rope, rope_cos_sin
from model.swiglu import swiglu

Rope = tuple[Tensor, Tensor]  # cos, sin (T, hs) of the positions being run (model/rope.py)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.head_dim
        # fused projection: n_head query heads, then n_kv_head key heads and n_kv_head value heads
        heads = config.n_head + 2 * config.n_kv_head
        self.c_attn = nn.Linear(config.n_embd, heads * self.head_dim, bias=config.qkv_bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.attend = get_attention(config.attention, config.sdpa_backend)
        self.attend_decode = get_decode_attention(config.attention, config.sdpa_backend)
        self.attend_packed = get_packed_attention(config.attention)  # None: no packed form

    def forward(self, x: Tensor, cache: LayerCache | None = None, rope: Rope | None = None,
                documents: Any = None) -> Tensor:
        """documents: packed rows, the backend's mask of their examples (model/attention.py: DOCUMENT_MASKS)."""
        B, T, C = x.shape
        qkv = self.c_attn(x).view(B, T, self.n_head + 2 * self.n_kv_head, self.head_dim)  # (B, T, nh + 2 nkv, hs)
        if rope is not None:  # llama: rotate the query and key heads by their positions; values pass through
            n_rot = self.n_head + self.n_kv_head
            qkv = torch.cat((apply_rope(qkv[:, :, :n_rot], *rope), qkv[:, :, n_rot:]), dim=2)
        dropout_p = self.dropout if self.training else 0.0
        if self.attend_packed is not None and cache is None:  # the backend reads q, k, v from qkv in place
            y = self.attend_packed(qkv, self.n_kv_head, causal=True, dropout_p=dropout_p,
                                   documents=documents)  # (B, T, nh, hs)
            return self.resid_dropout(self.c_proj(y.view(B, T, C)))
        # Views, not copies: the triton kernel reads these strided (B, heads, T, hs) views of the fused projection.
        q, k, v = qkv.transpose(1, 2).split([self.n_head, self.n_kv_head, self.n_kv_head], dim=1)
        # q: (B, nh, T, hs); k, v: (B, nkv, T, hs)
        if cache is not None and cache.cache.filled:  # decode: the new tokens attend to their rows' cached keys
            k_cache, v_cache = cache.append(k, v)  # (B, nkv, max_len, hs)
            y = self.attend_decode(q, k_cache, v_cache, cache.cache.positions)  # (B, nh, T, hs)
        else:  # causal self-attention over the T tokens (a prompt into an empty cache: stored as well)
            if cache is not None:
                cache.prefill(k, v)
            y = self.attend(q, k, v, causal=True, dropout_p=dropout_p, documents=documents)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """GPT-2: c_proj(gelu(c_fc(x))). Llama: SwiGLU, c_proj(silu(gate) * up) with gate and up from one fused c_fc."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.swiglu = config.family == "llama"
        width = config.mlp_width
        self.c_fc = nn.Linear(config.n_embd, 2 * width if self.swiglu else width, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(width, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.recompute = False  # recompute the activation in the backward (GPT.set_activation_checkpointing: mlp)

    def forward(self, x: Tensor) -> Tensor:
        h = self.c_fc(x)  # (B, T, 2 * width) llama, (B, T, width) gpt2
        if self.recompute and self.training and torch.is_grad_enabled():
            # Keep h alone: the backward recomputes the activation, c_proj's input. Compiled, that is one elementwise
            # pass; eager re-runs c_proj's matmul as well (checkpoint replays the whole function).
            return self.dropout(checkpoint(self.down, h, use_reentrant=False))
        return self.dropout(self.down(h))

    def down(self, h: Tensor) -> Tensor:
        if self.swiglu:
            return self.c_proj(swiglu(h))  # silu(gate) * up, gate and up the halves of h
        return self.c_proj(self.gelu(h))


def norm(config: GPTConfig) -> nn.Module:
    """GPT-2: LayerNorm (with a bias if config.bias). Llama: RMSNorm, a scale but no centring and no bias."""
    if config.family == "llama":
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, bias=config.bias)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm(config)
        self.mlp = MLP(config)
        self.recompute = False  # activation checkpointing (GPT.set_activation_checkpointing)

    def forward(self, x: Tensor, cache: LayerCache | None = None, rope: Rope | None = None,
                documents: Any = None) -> Tensor:
        if self.recompute and self.training and torch.is_grad_enabled():
            # Keep only x; the backward re-runs the block (same RNG state: the same dropout masks). Inside forward,
            # so that FSDP2's hooks on the block run once: the recompute finds the weights already gathered.
            return checkpoint(self.layers, x, cache, rope, documents, use_reentrant=False)
        return self.layers(x, cache, rope, documents)

    def layers(self, x: Tensor, cache: LayerCache | None, rope: Rope | None, documents: Any = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), cache, rope, documents)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # llama has no wpe: positions enter through the rotary embeddings of each attention layer
        wpe = {"wpe": nn.Embedding(config.block_size, config.n_embd)} if config.family == "gpt2" else {}
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                **wpe,
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=norm(config),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.document_mask = get_document_mask(config.attention)
        # Runs of consecutive blocks, each called as one (x, rope, documents) -> x in place of its blocks one by one
        # (without a KV cache): FSDP2 units compiled whole (training/distributed.py: shard). None: block by block.
        self.block_runs: list[Callable[[Tensor, Rope | None, Any], Tensor]] | None = None
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer), so the residual stream's variance stays
        # O(1) however many blocks add into it (two additions per block).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the embedding lookups, which do no matmul FLOPs: the position
        embeddings, and the token embedding unless the LM head shares it."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel() if "wpe" in self.transformer else 0
            n -= 0 if self.config.tie_embeddings else self.transformer.wte.weight.numel()
        return n

    def set_activation_checkpointing(self, mode: str) -> None:
        """Trade compute for memory in training: "full" recomputes every block's activations in the backward
        instead of storing them (each block keeps only its input), "selective" every other block (the second,
        fourth, ...: torchtitan's layer-selective checkpointing at frequency 2), "mlp" only each MLP's activation
        (silu(gate) * up or GELU, the input of its down projection: B·T·width values per layer), "none" none."""
        if mode not in ("none", "mlp", "selective", "full"):
            raise ValueError(f"activation checkpointing {mode!r}: use none, mlp, selective or full")
        for i, block in enumerate(self.transformer.h):
            block.recompute = mode == "full" or (mode == "selective" and i % 2 == 1)
            block.mlp.recompute = mode == "mlp"

    @classmethod
    def from_pretrained(cls, name_or_dir: str, **overrides: Any) -> "GPT":
        """Hugging Face GPT-2, Llama or Qwen2 weights: a GPT-2 name (gpt2, gpt2-medium, gpt2-large, gpt2-xl), a hub
        id (HuggingFaceTB/SmolLM2-135M) or a local directory with config.json and safetensors (one file or shards).
        overrides: block_size (crop), dropout, attention, sdpa_backend, loss_chunk_tokens."""
        from model.pretrained import load_pretrained  # imports huggingface_hub: only when used

        return load_pretrained(name_or_dir, **overrides)

    def save_pretrained(self, out_dir: str, extra_config: dict[str, Any] | None = None) -> None:
        """A Hugging Face directory (config.json + model.safetensors) that transformers' AutoModelForCausalLM loads
        with the same logits; extra_config adds keys to config.json (e.g. the source model's eos_token_id)."""
        from model.pretrained import save_pretrained

        save_pretrained(self, out_dir, extra_config)

    def hidden_states(self, idx: Tensor, cache: KVCache | None = None, lengths: Tensor | None = None,
                      positions: Tensor | None = None) -> Tensor:
        """The final (after ln_f) hidden states (B, T, C) of idx (B, T). With an empty cache, idx are right-padded
        prompts of lengths (B,) (default: T each), stored in it; with a filled one, the tokens that follow each
        row's cached ones (positions continue from each row's length), added to it. positions (B, T), without a
        cache: packed rows, each token's position in its example (0 at an example's first token); every example
        is then run as if alone in its row (its own positions, no attention to the others)."""
        B, T = idx.shape
        filled = cache is not None and cache.filled
        if not filled and T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds model.block_size={self.config.block_size}")
        documents = None
        if positions is not None:
            if cache is not None:
                raise ValueError("positions (packed rows) are for training and evaluation, not with a KV cache")
            if self.document_mask is None:
                raise ValueError(f"attention={self.config.attention} has no mask for packed rows "
                                 "(model/attention.py: DOCUMENT_MASKS): set data.packing=false")
            pos, documents = positions, self.document_mask(positions)
        elif filled:
            assert cache.lengths is not None
            pos = cache.lengths[:, None] + torch.arange(T, device=idx.device)  # (B, T): each row's own positions
            cache.positions = pos
        else:
            if cache is not None and T > cache.max_len:
                raise ValueError(f"sequence length {T} exceeds the KV cache's max_len={cache.max_len}")
            pos = torch.arange(T, device=idx.device)[None]  # (1, T)
        x = self.transformer.wte(idx)  # (B, T, C)
        rope = None
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(pos)
        else:
            c = self.config
            rope = rope_cos_sin(pos, c.head_dim, c.rope_theta, c.rope_scaling, idx.device)  # (1 or B, T, hs) each
        x = self.transformer.drop(x)
        if self.block_runs is not None and cache is None:
            for run in self.block_runs:
                x = run(x, rope, documents)
        else:
            layer_caches = cache.layers if cache is not None else [None] * len(self.transformer.h)
            for block, layer_cache in zip(self.transformer.h, layer_caches, strict=True):
                x = block(x, layer_cache, rope, documents)
        if cache is not None and cache.filled:
            assert cache.lengths is not None
            cache.lengths += T
        elif cache is not None:
            cache.prefilled(lengths if lengths is not None else torch.full((B,), T, device=idx.device))
        return self.transformer.ln_f(x)

    def forward(self, idx: Tensor, targets: Tensor | None = None, *, return_logits: bool = True,
                positions: Tensor | None = None) -> tuple[Tensor | None, Tensor | None]:
        """(logits (B, T, vocab), loss or None). return_logits=False gives (None, loss): the training step's form.
        Under torch.compile a returned logits tensor is a graph output, and AOTAutograd then materialises a zero
        gradient for it in every backward (1.6 GB at GPT-2 124M, B=16, T=1024: ~1 ms per step on an H200).
        positions (B, T): packed rows (hidden_states)."""
        h = self.hidden_states(idx, positions=positions)  # (B, T, C)
        return self.head(h, targets, return_logits)

    def head(self, h: Tensor, targets: Tensor | None, return_logits: bool) -> tuple[Tensor | None, Tensor | None]:
        """forward's (logits, loss) of the final hidden states h (B, T, C): the LM head and the loss (a unit of its
        own for FSDP2's per-block compile, training/distributed.py: shard)."""
        if targets is not None and not return_logits and self.config.loss_chunk_tokens:
            # The same loss and gradients, but never more than loss_chunk_tokens rows of logits at once.
            loss = chunked_cross_entropy(h.view(-1, h.size(-1)), self.lm_head.weight, targets.view(-1),
                                         self.config.loss_chunk_tokens)
            return None, loss
        logits = self.lm_head(h)  # (B, T, padded_vocab)
        loss = None
        if targets is not None:
            # The padded rows are never targets; training pushes their logits down like any unused token's.
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=IGNORE_INDEX)
        return (logits[..., : self.config.vocab_size] if return_logits else None), loss

    def next_token_logits(self, idx: Tensor, cache: KVCache | None = None, lengths: Tensor | None = None) -> Tensor:
        """Logits (B, vocab) of the token after each row of idx (B, T), through the cache if given (KVCache says how).
        lengths (B,): the rows are right-padded prompts of these lengths (default: T each). The LM head runs on one
        position per row, which saves a (T, vocab) matmul per prefill."""
        h = self.hidden_states(idx, cache, lengths)  # (B, T, C)
        last = h[:, -1] if lengths is None else h[torch.arange(h.size(0), device=h.device), lengths - 1]  # (B, C)
        return self.lm_head(last)[:, : self.config.vocab_size]

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, use_cache: bool = True, cuda_graph: bool = True,
                 compile: bool = False) -> Tensor:
        """idx (B, T) followed by max_new_tokens sampled tokens: (B, T + max_new_tokens). temperature 0 is greedy;
        top_k / top_p restrict sampling (model/generate.py: sample_next). With use_cache the prompt is prefilled
        once and each new token attends to a KV cache of at most block_size tokens; the output equals use_cache=False
        (which re-runs the last block_size tokens every step). On a GPU the decode steps replay a CUDA graph
        (cuda_graph=False: eager), fused by torch.compile first with compile=True. Prompts of different lengths:
        model/generate.py's stream. Call model.eval() first if dropout > 0."""
        new = list(stream(self, idx, max_new_tokens, temperature, top_k, top_p, use_cache, cuda_graph=cuda_graph,
                          compile=compile))
        return torch.cat([idx, *new], dim=1)
