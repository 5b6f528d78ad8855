"""Every environment variable the kernel package reads, in one place (docs/kernel.md has the table).

    TRITON_INTERPRET=1             run the kernels on CPU tensors through Triton's interpreter (the CPU tests do)
    FLASH_ATTN_TMA=auto|1|0        stream tiles through TMA tensor descriptors: auto = 16-bit inputs at D = 128 on
                                   Hopper (sm_90), where it measured faster; 1 = wherever the GPU has TMA; 0 = never
    FLASH_ATTN_GLUON=auto|1|0      the Gluon kernels (kernels/flash_gluon.py: warp-specialised forward, one-pass
                                   backward): auto = 16-bit inputs at D = 128 on Hopper, bounds included, and the
                                   backward at D = 64 for plain causal attention over 2048 keys or more, where they
                                   measured faster (the backward not under torch.use_deterministic_algorithms);
                                   1 = both at D = 64 too; 0 = never
    FLASH_ATTN_PERSISTENT=auto|1|0 the Gluon forward as one program per multiprocessor, each walking many tiles of
                                   query rows (auto and 1), where it measured faster; 0 = one program per tile
    FLASH_ATTN_PERSISTENT_ORDER=fold|stride
                                   how the persistent forward deals its tiles: fold = two at a time, a head's causal
                                   tiles paired last with first, last but one with second, ..., so every pair is the
                                   same work (default: it measured faster); stride = program p takes tiles p, p + P,
                                   p + 2P, ... (causal: each head's last tile first)
    FLASH_ATTN_PINGPONG=1|0        1: the persistent Gluon forward's two consumer warpgroups take turns issuing their
                                   matmuls, so one's softmax runs while the other's matmuls hold the tensor cores
                                   (FlashAttention-3's ping-pong; default: it measured faster); 0 = each issues when
                                   ready
    FLASH_ATTN_PERSISTENT_BACKWARD=auto|1|0|queue
                                   the warp-specialised Gluon backward as one program per multiprocessor, each walking
                                   many key tiles, dealt as FLASH_ATTN_PERSISTENT_ORDER says: auto = plain attention
                                   (no packed rows or window), where it measured faster; 1 = with bounds too; 0 = one
                                   program per key tile; queue = persistent everywhere, each program taking its next
                                   key tile from a work queue (an atomic counter) when it is free
    FLASH_ATTN_WS_BACKWARD=auto|1|0
                                   the Gluon backward warp-specialised, 128 keys per program over two consumer
                                   warpgroups and a TMA producer, instead of one warpgroup over 64 keys: auto and 1 =
                                   wherever the Gluon backward runs (it measured faster at D = 128 and 64); 0 = never
    FLASH_ATTN_DROPOUT_RNG=philox|hash
                                   the random bytes of the dropout mask (Triton kernels): philox = Philox4x32-7, one
                                   call per 16 elements; hash = a 32-bit hash per 2 × 2 block, which the dK/dV kernel
                                   makes in its own (transposed) layout instead of exchanging it, and which the Gluon
                                   kernels make too (default: it measured faster). Each draws a different mask from
                                   the same seed
    FLASH_ATTN_O_IN_K=1|0          1: the persistent Gluon forward stages each tile's O in its last K tile and waits
                                   for its store under the next tile's first matmul, so the next tile's Q loads while
                                   this one finishes (measured level or faster); 0: O through the Q tile
    FLASH_ATTN_ROTATE=0|1          1: the persistent Gluon forward (with FLASH_ATTN_O_IN_K=1) issues each tile's last
                                   P V in one turn with the next tile's first S = Q Kᵀ, so the tile's O normalisation
                                   and store run under that matmul (outputs bit for bit the same); 0 (default): one
                                   tile after the other, faster on most rows measured. Traced calls
                                   (FLASH_ATTN_TRACE_ITEMS) run the unrotated order, whose phases the trace names
    FLASH_ATTN_BY_EXAMPLE=0|1      1: the warp-specialised Gluon backward of bounded attention (packed rows; at
                                   D = 64 too, under FLASH_ATTN_GLUON=auto) as one program per multiprocessor, each
                                   walking whole examples, their key tiles in order, so each dQ row is finished in
                                   the kernel (no zeroing or cast of an fp32 accumulator); 0 (default): one program
                                   per key tile. Not yet measured
    FLASH_ATTN_BY_EXAMPLE_MAX=N    under FLASH_ATTN_BY_EXAMPLE=1, examples longer than N tokens (default 1024) are
                                   walked one key tile per work item, their dQ summed in the fp32 accumulator (zeroed
                                   and cast for their rows only), so that one long example does not hold up the rest
    FLASH_ATTN_TRACE_ITEMS=N       N > 0: the persistent Gluon forward records cycle stamps of the phases of each
                                   program's first N work items, and the warp-specialised backward with one program
                                   per key tile those of each warpgroup's first N steps (scripts/trace_forward.py,
                                   scripts/trace_backward.py read them); default 0
    FLASH_ATTN_AUTOTUNE=1|0        0: launch the first config of each tuning table instead of autotuning
    FLASH_ATTN_DIRECT_LAUNCH=1|0   0: every launch goes through Triton's standard launch path (more host time)

FLASH_ATTN_TMA, FLASH_ATTN_GLUON, FLASH_ATTN_PERSISTENT(_ORDER, _BACKWARD), FLASH_ATTN_PINGPONG,
FLASH_ATTN_WS_BACKWARD, FLASH_ATTN_DROPOUT_RNG, FLASH_ATTN_O_IN_K, FLASH_ATTN_ROTATE, FLASH_ATTN_BY_EXAMPLE(_MAX)
and FLASH_ATTN_TRACE_ITEMS
are read at each call, so a benchmark can compare both paths in one process; the others once, at import (as Triton
itself decides at import whether kernels are interpreted). A value that is not one of those listed raises ValueError
naming the variable.
"""

import os

_TRUE = ("1", "true", "yes", "on", "y")
_FALSE = ("0", "false", "no", "off", "n")


def _flag(name: str, default: str) -> bool:
    value = os.environ.get(name, default).lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={value!r}: use 1 or 0")


# Triton's own reading of the variable: anything but a true value leaves the interpreter off.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE
DIRECT_LAUNCH: bool = _flag("FLASH_ATTN_DIRECT_LAUNCH", "1")
AUTOTUNE: bool = _flag("FLASH_ATTN_AUTOTUNE", "1")


def _mode(name: str, extra: tuple[str, ...] = ()) -> str:
    """'auto', 'on' or 'off' from an auto|1|0 variable, or one of its extra values."""
    value = os.environ.get(name, "auto").lower()
    if value == "auto" or value in extra:
        return value
    if value in _TRUE:
        return "on"
    if value in _FALSE:
        return "off"
    options = ("auto", "1", "0", *extra)
    raise ValueError(f"{name}={value!r}: use {', '.join(options[:-1])} or {options[-1]}")


def tma_mode() -> str:
    """'auto', 'on' or 'off' (FLASH_ATTN_TMA)."""
    return _mode("FLASH_ATTN_TMA")


def gluon_mode() -> str:
    """'auto', 'on' or 'off' (FLASH_ATTN_GLUON)."""
    return _mode("FLASH_ATTN_GLUON")


def persistent_mode() -> str:
    """'auto', 'on' or 'off' (FLASH_ATTN_PERSISTENT)."""
    return _mode("FLASH_ATTN_PERSISTENT")


def ws_backward_mode() -> str:
    """'auto', 'on' or 'off' (FLASH_ATTN_WS_BACKWARD)."""
    return _mode("FLASH_ATTN_WS_BACKWARD")


DROPOUT_GENERATORS = {"philox": 1, "hash": 2}  # the kernels' DROPOUT constexpr for each generator (0: no dropout)


def dropout_rng() -> int:
    """The dropout generator's DROPOUT constexpr (FLASH_ATTN_DROPOUT_RNG): 1 = philox, 2 = hash (default)."""
    value = os.environ.get("FLASH_ATTN_DROPOUT_RNG", "hash").lower()
    if value not in DROPOUT_GENERATORS:
        raise ValueError(f"FLASH_ATTN_DROPOUT_RNG={value!r}: use philox or hash")
    return DROPOUT_GENERATORS[value]


def persistent_backward_mode() -> str:
    """'auto', 'on', 'off' or 'queue' (FLASH_ATTN_PERSISTENT_BACKWARD)."""
    return _mode("FLASH_ATTN_PERSISTENT_BACKWARD", extra=("queue",))


def persistent_fold() -> bool:
    """Whether the persistent forward deals its tiles in folded pairs (FLASH_ATTN_PERSISTENT_ORDER=fold, the default)
    rather than one at a time (stride)."""
    value = os.environ.get("FLASH_ATTN_PERSISTENT_ORDER", "fold").lower()
    if value not in ("fold", "stride"):
        raise ValueError(f"FLASH_ATTN_PERSISTENT_ORDER={value!r}: use fold or stride")
    return value == "fold"


def pingpong() -> bool:
    """Whether the persistent Gluon forward's consumer warpgroups take turns issuing their matmuls
    (FLASH_ATTN_PINGPONG, default 1)."""
    return _flag("FLASH_ATTN_PINGPONG", "1")


def o_in_k() -> bool:
    """Whether the persistent Gluon forward stages each work item's O in its last K tile (FLASH_ATTN_O_IN_K, default
    1) instead of its Q tile."""
    return _flag("FLASH_ATTN_O_IN_K", "1")


def rotate() -> bool:
    """Whether the persistent Gluon forward issues each tile's last P V together with the next tile's first S
    (FLASH_ATTN_ROTATE, default 0); it stages O in K, so it needs FLASH_ATTN_O_IN_K=1."""
    on = _flag("FLASH_ATTN_ROTATE", "0")
    if on and not o_in_k():
        raise ValueError("FLASH_ATTN_ROTATE=1 stages each tile's O in its last K tile: leave FLASH_ATTN_O_IN_K at 1")
    return on


def by_example() -> bool:
    """Whether the Gluon backward of bounded attention walks whole examples per program, finishing dQ in the kernel
    (FLASH_ATTN_BY_EXAMPLE, default 0)."""
    return _flag("FLASH_ATTN_BY_EXAMPLE", "0")


def by_example_max() -> int:
    """The longest example the by-example backward walks as one work item, in tokens (FLASH_ATTN_BY_EXAMPLE_MAX,
    default 1024); longer ones go one key tile per item."""
    value = os.environ.get("FLASH_ATTN_BY_EXAMPLE_MAX", "1024")
    if not value.isdigit():
        raise ValueError(f"FLASH_ATTN_BY_EXAMPLE_MAX={value!r}: use a whole number of tokens")
    return int(value)


def trace_items() -> int:
    """How many work items per program the persistent Gluon forward traces, and steps per warpgroup the
    warp-specialised backward with one program per key tile (FLASH_ATTN_TRACE_ITEMS, default 0: off)."""
    value = os.environ.get("FLASH_ATTN_TRACE_ITEMS", "0")
    if not value.isdigit():
        raise ValueError(f"FLASH_ATTN_TRACE_ITEMS={value!r}: use a whole number of items (0: off)")
    return int(value)
