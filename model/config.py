"""The model's config, GPTConfig: the shapes of model/gpt.py and the few settings of a run, torch-free.

    from model import GPTConfig
    config = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=257, attention="sdpa")

It is also the `model` node of the run config (training/config.py nests it as it is, so every field here is a
`model.<key>` of train.py). Each field's metadata says what kind of key it is:

    shape   fixed by the weights: init_from's checkpoint or pretrained model sets it, and a resumed run must match it
            (a pretrained model's block_size may be cropped: model/pretrained.py)
    run     this run's choice whatever the weights: dropout, attention, sdpa_backend, loss_chunk_tokens

and, for a numeric key, its valid values (a `Range`), checked with the rules across keys in `__post_init__`: a bad
value fails where the config is built, before any work, with the key to change. The attention names are checked by
the registry of model/attention.py (GPT checks them as it is built, training/config.py: validate before a run).
"""

import math
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

FAMILIES = ("gpt2", "llama")
# rope_scaling["rope_type"] values model/rope.py implements (absent / "default": no scaling) -> the keys each needs
SCALINGS: dict[str, tuple[str, ...]] = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
SHAPE, RUN = "shape", "run"


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric key: low and high bounds (None: unbounded), each included or not."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is excluded
    high_open: bool = False
    why: str = ""  # said in the error, for a bound that is not obvious

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):  # nan and inf from the command line are never meant
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"

    def check(self, key: str, value: float | None) -> None:
        """Raise a ValueError naming key unless value is valid (None, for a key that may be null, is)."""
        if value is not None and value not in self:
            why = f" ({self.why})" if self.why else ""
            raise ValueError(f"{key} must be {self}{why}, got {value}")


AT_LEAST_0, AT_LEAST_1, POSITIVE = Range(0), Range(1), Range(0, low_open=True)
FRACTION, PROBABILITY = Range(0, 1), Range(0, 1, high_open=True)  # [0, 1] and [0, 1)


def _key(kind: str, default: Any, valid: Range | None = None) -> Any:
    return field(default=default, metadata={"kind": kind, "range": valid})


# Optional/Dict rather than `X | None`/dict: OmegaConf's structured configs read these annotations.
@dataclass
class GPTConfig:
    family: str = _key(SHAPE, "gpt2")  # gpt2 | llama (the table in model/gpt.py's docstring)
    block_size: int = _key(SHAPE, 1024, AT_LEAST_1)  # longest sequence (gpt2: learned position embeddings)
    vocab_size: Optional[int] = _key(SHAPE, None, AT_LEAST_1)  # the tokenizer's vocabulary; None: set by train.py
    pad_vocab_multiple: int = _key(SHAPE, 64, AT_LEAST_1)  # embedding rows rounded up (50257 -> 50304); 1: none
    n_layer: int = _key(SHAPE, 12, AT_LEAST_1)
    n_head: int = _key(SHAPE, 12, AT_LEAST_1)
    n_kv_head: Optional[int] = _key(SHAPE, None, AT_LEAST_1)  # key-value heads (grouped-query attention); None: n_head
    n_embd: int = _key(SHAPE, 768, AT_LEAST_1)
    bias: bool = _key(SHAPE, True)  # biases in Linear and LayerNorm, as GPT-2 (the llama family: False)
    intermediate_size: Optional[int] = _key(SHAPE, None, AT_LEAST_1)  # MLP width; None: 4·n_embd (gpt2), 8/3·n_embd
    rope_theta: float = _key(SHAPE, 10000.0, POSITIVE)  # llama: RoPE base
    rope_scaling: Optional[Dict[str, Any]] = _key(SHAPE, None)  # llama: None or {"rope_type": "llama3", ...}
    norm_eps: float = _key(SHAPE, 1e-5, POSITIVE)  # llama: RMSNorm epsilon (gpt2's LayerNorm uses 1e-5)
    qkv_bias: Optional[bool] = _key(SHAPE, None)  # biases on the q/k/v projection; None: as bias (Qwen2: True)
    tie_embeddings: bool = _key(SHAPE, True)  # the LM head shares the token embedding's weight
    dropout: float = _key(RUN, 0.0, PROBABILITY)
    attention: str = _key(RUN, "sdpa")  # a name in model/attention.py: BACKENDS (train.py: the attention group)
    sdpa_backend: str = _key(RUN, "auto")  # auto, or a kernel of model/attention.py: SDPA_BACKENDS (sdpa only)
    loss_chunk_tokens: int = _key(RUN, 0, Range(0, why="0 computes the loss over all tokens at once"))  # model/loss.py

    @property
    def padded_vocab_size(self) -> int:
        if self.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size is not set: give the tokenizer's vocabulary size")
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def mlp_width(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        return 4 * self.n_embd if self.family == "gpt2" else -(-8 * self.n_embd // 3 // 64) * 64

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.metadata["range"] is not None:
                f.metadata["range"].check(f"model.{f.name}", getattr(self, f.name))
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head}")
        if self.n_kv_head is None:  # None, not 0, means one key-value head per query head
            self.n_kv_head = self.n_head
        if self.n_kv_head > self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"model.n_kv_head={self.n_kv_head} must divide model.n_head={self.n_head} (each key-value "
                             "head serves the same number of query heads)")
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model.family={self.family!r}: choose one of {', '.join(FAMILIES)}")
        if self.family == "llama" and self.head_dim % 2:
            raise ValueError(f"rotary embeddings rotate channel pairs: the head dim n_embd / n_head = {self.head_dim} "
                             "must be even")
        scaling = (self.rope_scaling or {}).get("rope_type", "default")
        if scaling not in ("default", *SCALINGS):
            raise ValueError(f"model.rope_scaling rope_type={scaling!r} is not implemented: use one of "
                             f"{', '.join(SCALINGS)} or null")
        missing = [k for k in SCALINGS.get(scaling, ()) if k not in self.rope_scaling]
        if missing:
            raise ValueError(f"model.rope_scaling of rope_type={scaling} lacks {', '.join(missing)}")
        self.qkv_bias = self.bias if self.qkv_bias is None else self.qkv_bias


SHAPE_KEYS = tuple(f.name for f in fields(GPTConfig) if f.metadata["kind"] == SHAPE)
RUN_KEYS = tuple(f.name for f in fields(GPTConfig) if f.metadata["kind"] == RUN)


@dataclass
class LoRAConfig:
    """Low-rank adapters on the linear layers of a frozen model (model/lora.py); the run config's `lora` node."""

    rank: int = field(default=0, metadata={"range": AT_LEAST_0})  # 0: no adapters (full fine-tuning)
    alpha: float = field(default=16.0, metadata={"range": POSITIVE})  # the adapters' scale is alpha / rank
    dropout: float = field(default=0.0, metadata={"range": PROBABILITY})  # on an adapter's input
    # q, k, v, o (attention), gate, up, down (MLP; gate: llama only), or all
    targets: List[str] = field(default_factory=lambda: ["all"])

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.metadata.get("range") is not None:
                f.metadata["range"].check(f"lora.{f.name}", getattr(self, f.name))
