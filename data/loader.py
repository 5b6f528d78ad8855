"""Batches of token windows from prepared token files (see data/prepare.py).

    loader = TokenLoader(prepare_dataset(cfg), block_size=256, batch_size=32, device="cuda", seed=0)
    batch = loader.next_batch()                    # B random train windows: batch.x, and batch.y, x shifted by one
    for batch in loader.eval_batches("val", 20):   # the same sequential windows on every call
        ...

Training batches are random windows drawn from a numpy RNG keyed by (seed, batch number). Under data parallelism
every rank draws the same GLOBAL batch of batch_size × world_size windows and keeps its own slice
[rank·B, (rank+1)·B): the ranks read different windows, and 2 ranks × B read exactly the windows of 1 rank × 2B, so
a multi-GPU run trains on the data of a single-GPU run with the same global batch (its losses agree up to float
reduction order). Drawing world_size × B starts is negligible next to the copy of B windows. Resuming needs only the
batch count (`state_dict`): it is the same on every rank, so a checkpoint resumes on any world size.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from data.prepare import PreparedData


@dataclass
class Batch:
    """One micro-batch on the loader's device: the inputs and the targets they predict, (B, T) int64 each. A target
    equal to model/loss.py's IGNORE_INDEX is not trained on (the loss is the mean over the others)."""

    x: torch.Tensor
    y: torch.Tensor


class TokenLoader:
    def __init__(self, data: PreparedData, block_size: int, batch_size: int, device: str | torch.device,
                 seed: int, vocab_size: int | None = None, rank: int = 0, world_size: int = 1):
        if vocab_size is not None and data.max_token_id >= vocab_size:
            raise ValueError(
                f"the {data.encoding} token files hold ids up to {data.max_token_id}, but model.vocab_size is "
                f"{vocab_size}: set model.vocab_size to at least {data.max_token_id + 1} (the encoding has "
                f"{data.vocab_size})"
            )
        self.splits = {split: data.tokens(split) for split in ("train", "val")}
        more_text = "give more text (data.max_documents, data.data_files, data.val_fraction)"
        for split, tokens in self.splits.items():
            if len(tokens) < block_size + 1:
                raise ValueError(
                    f"the {split} split holds {len(tokens)} tokens, but a window needs model.block_size + 1 = "
                    f"{block_size + 1}: lower model.block_size or {more_text}"
                )
            # A (global) batch of distinct windows must fit; otherwise every batch would repeat the same text.
            if len(tokens) < batch_size * world_size * block_size + 1:
                raise ValueError(
                    f"the {split} split holds {len(tokens)} tokens, fewer than one batch of train.batch_size × "
                    f"model.block_size{' × world size' if world_size > 1 else ''} = "
                    f"{batch_size * world_size * block_size} (+1): lower train.batch_size or {more_text}"
                )
        self.block_size, self.batch_size = block_size, batch_size
        self.device = torch.device(device)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.step = 0  # training batches drawn so far: with the seed it fixes the next global batch

    def next_batch(self) -> Batch:
        tokens = self.splits["train"]
        rng = np.random.default_rng([self.seed, self.step])
        self.step += 1
        starts = rng.integers(0, len(tokens) - self.block_size, size=self.batch_size * self.world_size)  # global batch
        return self._batch(tokens, starts[self.rank * self.batch_size : (self.rank + 1) * self.batch_size])

    def eval_batches(self, split: str, n_batches: int) -> Iterator[Batch]:
        tokens = self.splits[split]
        B, T = self.batch_size, self.block_size
        for b in range(n_batches):
            windows = (np.arange(b * B, (b + 1) * B) * self.world_size + self.rank)  # rank r: every world_size-th
            # consecutive windows from the start; past the end they wrap round (a short split is reused)
            yield self._batch(tokens, windows * T % (len(tokens) - T))

    def _batch(self, tokens: np.memmap, starts: np.ndarray) -> Batch:
        windows = tokens[starts[:, None] + np.arange(self.block_size + 1)].astype(np.int64)
        x, y = torch.from_numpy(windows[:, :-1].copy()), torch.from_numpy(windows[:, 1:].copy())
        if self.device.type == "cuda":
            # page-locked host memory lets the copy run asynchronously, overlapping the previous step's compute
            return Batch(x.pin_memory().to(self.device, non_blocking=True),
                         y.pin_memory().to(self.device, non_blocking=True))
        return Batch(x.to(self.device), y.to(self.device))

    def state_dict(self) -> dict:
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.step = int(state["seed"]), int(state["step"])
