"""Batches of token windows from prepared token files (see data/prepare.py), and of whole examples (data/sft.py).

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

ExampleLoader has the same interface for instruction and chat data: examples packed into rows (data.packing), or one
example per row, right-padded (below).
"""

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from data.config import Overlong
from data.prepare import PreparedData
from data.sft import Examples, PreparedExamples
from model.loss import IGNORE_INDEX


@dataclass
class Batch:
    """One micro-batch on the loader's device: the inputs and the targets they predict, (B, T) int64 each. A target
    equal to model/loss.py's IGNORE_INDEX is not trained on (the loss is the mean over the others). positions (B, T),
    for packed rows only: each token's position in its example (0 at an example's first token), which the model
    uses for its position embeddings and to keep attention within each example (GPT.forward(positions=...))."""

    x: torch.Tensor
    y: torch.Tensor
    positions: torch.Tensor | None = None


class TokenLoader:
    def __init__(self, data: PreparedData, block_size: int, batch_size: int, device: str | torch.device,
                 seed: int, vocab_size: int | None = None, rank: int = 0, world_size: int = 1):
        _check_vocab(data, vocab_size)
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
        return _to_device(windows[:, :-1].copy(), windows[:, 1:].copy(), self.device)

    def epoch_batches(self) -> int:
        """Global batches in an epoch: as many windows as the train split has tokens (train.epochs)."""
        return -(-len(self.splits["train"]) // (self.batch_size * self.world_size * self.block_size))

    def state_dict(self) -> dict:
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        if "step" not in state:
            raise ValueError("the checkpoint's loader read examples (data.format=instruction|chat), this run reads "
                             "token windows of text (data.format=text): resume with the checkpoint's data settings, or "
                             "start anew from its weights with init_from=<checkpoint>")
        self.seed, self.step = int(state["seed"]), int(state["step"])


class ExampleLoader:
    """Batches of instruction or chat examples (data/sft.py). An example enters a row as its first block_size + 1
    tokens (data.overlong=truncate; drop leaves longer ones out): n tokens give n - 1 inputs and the targets they
    predict, the next tokens where the example's mask trains them and IGNORE_INDEX elsewhere, so the prompt never
    counts in the loss. An example left with no trained target is dropped; both are counted (`summary`).

    packing=False: one example per row, right-padded with the end-of-text token (its targets IGNORE_INDEX); under
    causal attention the padding after an example never changes its logits. packing=True: several examples per row,
    one after another, placed by best-fit decreasing (`pack`), with Batch.positions restarting at 0 for each, so the
    model runs each example as if alone in its row. The rows of an epoch are shuffled; the share of row positions that
    hold example tokens is `summary`'s data/packing_fill.

    Training reads the train rows epoch after epoch, each epoch a permutation drawn from (seed, epoch) (packed: of the
    examples before packing, then of the rows). Under data parallelism the global batch is the next batch_size ×
    world_size rows of that stream and rank r keeps [r·B, (r+1)·B), as TokenLoader's windows: 2 ranks × B read exactly
    the rows of 1 rank × 2B. The state is the epoch and the position in it, the same on every rank: a run resumes
    mid-epoch exactly, on any world size.
    """

    def __init__(self, data: PreparedExamples, block_size: int, batch_size: int, device: str | torch.device,
                 seed: int, vocab_size: int | None = None, rank: int = 0, world_size: int = 1,
                 overlong: Overlong | str = Overlong.truncate, packing: bool = False):
        _check_vocab(data, vocab_size)
        self.block_size, self.batch_size, self.packing = block_size, batch_size, packing
        self.device = torch.device(device)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.pad, self.data_key = data.eot_token, data.dir.name
        self.examples: dict[str, Examples] = {}
        self.kept: dict[str, np.ndarray] = {}  # the ids of the examples each split serves
        self.sizes: dict[str, np.ndarray] = {}  # each example's (input, target) pairs in a row: min(length, T + 1) - 1
        self.counts = dict.fromkeys(("truncated", "dropped_overlong", "dropped_untrained"), 0)
        for split in ("train", "val"):
            examples = self.examples[split] = data.examples(split)
            longer = examples.lengths > block_size + 1
            dropped = longer if Overlong(overlong) == Overlong.drop else np.zeros_like(longer)
            untrained = ~dropped & (examples.first >= np.minimum(examples.lengths, block_size + 1))
            self.kept[split] = np.flatnonzero(~dropped & ~untrained)
            self.sizes[split] = np.minimum(examples.lengths, block_size + 1) - 1
            self.counts["truncated"] += int((longer & ~dropped & ~untrained).sum())
            self.counts["dropped_overlong"] += int(dropped.sum())
            self.counts["dropped_untrained"] += int(untrained.sum())
        self.starts = {split: examples.starts for split, examples in self.examples.items()}
        self.val_rows = self._rows("val", self.kept["val"])
        self.rows_per_epoch = len(self._rows("train", self.kept["train"])) if packing else len(self.kept["train"])
        n_train, n_val = len(self.kept["train"]), len(self.kept["val"])
        # A (global) batch of distinct rows must fit; otherwise a batch would repeat an example
        if self.rows_per_epoch < batch_size * world_size or n_val == 0:
            rows = f" in {self.rows_per_epoch} packed rows" if packing else ""
            raise ValueError(
                f"{n_train} train{rows} and {n_val} val examples are left ({self.describe_drops()}), but a batch takes "
                f"train.batch_size{' × world size' if world_size > 1 else ''} = {batch_size * world_size} rows and "
                "val needs one: lower train.batch_size, or give more examples (data.data_files, data.max_documents, "
                "data.val_fraction, a larger model.block_size)")
        self.seen = 0  # train rows read so far, over all ranks: with the seed it fixes the next global batch
        self._epochs: dict[int, list[np.ndarray]] = {}  # epoch -> its rows, for the epochs in use

    def next_batch(self) -> Batch:
        n_global = self.batch_size * self.world_size
        rows = self._train_rows(self.seen + np.arange(n_global))
        self.seen += n_global
        return self._batch("train", rows[self.rank * self.batch_size : (self.rank + 1) * self.batch_size])

    def eval_batches(self, split: str, n_batches: int) -> Iterator[Batch]:
        """The split's rows in order, each once: at most n_batches global batches, fewer for a split that needs
        fewer; the rows past its end are empty (their targets all IGNORE_INDEX), so no example counts twice."""
        rows = self.val_rows if split == "val" else self._rows(split, self.kept[split])
        n_global = self.batch_size * self.world_size
        empty = np.empty(0, dtype=np.int64)
        for b in range(min(n_batches, -(-len(rows) // n_global))):  # the same count on every rank
            at = b * n_global + self.rank * self.batch_size + np.arange(self.batch_size)
            yield self._batch(split, [rows[i] if i < len(rows) else empty for i in at.tolist()])

    def epoch_batches(self) -> int:
        """Global batches in an epoch: each train example once (train.epochs)."""
        return -(-self.rows_per_epoch // (self.batch_size * self.world_size))

    def state_dict(self) -> dict:
        n = self.rows_per_epoch
        return {"seed": self.seed, "epoch": self.seen // n, "position": self.seen % n, "data": self.data_key,
                "packing": self.packing}

    def load_state_dict(self, state: dict) -> None:
        if "epoch" not in state:
            raise ValueError("the checkpoint's loader read token windows of text (data.format=text), this run reads "
                             "examples (data.format=instruction|chat): resume with the checkpoint's data settings, or "
                             "start anew from its weights with init_from=<checkpoint>")
        if state["data"] != self.data_key:
            raise ValueError(f"the checkpoint read the prepared examples {state['data']}, this run's are "
                             f"{self.data_key} (the data or their settings changed), so its position in the epoch "
                             "does not apply here: resume with the same data, or start anew from its weights with "
                             "init_from=<checkpoint>")
        if state.get("packing", False) != self.packing:
            raise ValueError(f"the checkpoint read {'packed' if state.get('packing') else 'padded'} rows, this run "
                             f"data.packing={str(self.packing).lower()}: resume with the checkpoint's data.packing, or "
                             "start anew from its weights with init_from=<checkpoint>")
        self.seed = int(state["seed"])
        self.seen = int(state["epoch"]) * self.rows_per_epoch + int(state["position"])

    def summary(self) -> dict[str, int | float]:
        """The examples served and those cut or left out (both splits), and the packed rows' fill, as the run's
        summary records them."""
        counts: dict[str, int | float] = {
            "data/train_examples": len(self.kept["train"]), "data/val_examples": len(self.kept["val"]),
            **{f"data/{name}_examples": count for name, count in self.counts.items()}}
        if self.packing:
            pairs = int(self.sizes["train"][self.kept["train"]].sum())
            counts["data/train_rows"] = self.rows_per_epoch
            counts["data/packing_fill"] = round(pairs / (self.rows_per_epoch * self.block_size), 4)
        return counts

    def describe_drops(self) -> str:
        """The examples cut or left out, in words (the run's note)."""
        limit = f"model.block_size + 1 = {self.block_size + 1} tokens"
        parts = [f"{self.counts['truncated']} truncated to {limit}",
                 f"{self.counts['dropped_overlong']} dropped as longer than {limit}",
                 f"{self.counts['dropped_untrained']} dropped with no trained token left"]
        said = [part for part, count in zip(parts, self.counts.values(), strict=True) if count]
        return ", ".join(said) or f"none longer than {limit}"

    def _rows(self, split: str, ids: np.ndarray) -> list[np.ndarray]:
        """The examples ids (in this order) as rows: packed (`pack`), or one per row."""
        if self.packing:
            return pack(ids, self.sizes[split], self.block_size)
        return [ids[i : i + 1] for i in range(len(ids))]

    def _train_rows(self, positions: np.ndarray) -> list[np.ndarray]:
        """The train rows at these positions of the stream of epochs."""
        epochs, within = np.divmod(positions, self.rows_per_epoch)
        for epoch in set(self._epochs) - set(epochs.tolist()):
            del self._epochs[epoch]
        for epoch in np.unique(epochs).tolist():
            if epoch not in self._epochs:
                rng = np.random.default_rng([self.seed, epoch])
                rows = self._rows("train", self.kept["train"][rng.permutation(len(self.kept["train"]))])
                if self.packing:  # best-fit decreasing placed the longest first: shuffle the rows too
                    rows = [rows[i] for i in rng.permutation(len(rows))]
                self._epochs[epoch] = rows
        return [self._epochs[e][i] for e, i in zip(epochs.tolist(), within.tolist(), strict=True)]

    def _batch(self, split: str, rows: list[np.ndarray]) -> Batch:
        """One row per entry of `rows` (example ids, in order; empty: a row of padding), inputs padded with the
        end-of-text token; packed, with each token's position in its example (the padding after the last example is
        one more, never trained)."""
        examples, starts, T = self.examples[split], self.starts[split], self.block_size
        x = np.full((len(rows), T), self.pad, dtype=np.int64)
        y = np.full((len(rows), T), IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros((len(rows), T), dtype=np.int64)
        for row, ids in enumerate(rows):
            at = 0
            for i in ids.tolist():
                start, n = starts[i], min(int(examples.lengths[i]), T + 1)
                tokens = examples.tokens[start : start + n].astype(np.int64)
                trained = examples.mask[start + 1 : start + n].astype(bool)
                x[row, at : at + n - 1] = tokens[:-1]
                y[row, at : at + n - 1] = np.where(trained, tokens[1:], IGNORE_INDEX)
                positions[row, at : at + n - 1] = np.arange(n - 1)
                at += n - 1
            positions[row, at:] = np.arange(T - at)
        return _to_device(x, y, self.device, positions if self.packing else None)


def pack(ids: np.ndarray, sizes: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Best-fit decreasing: the examples ids, longest first (ties in the given order), each into the fullest row it
    still fits (sizes[i] positions of `capacity`), else a new row. Rows come out in the order they were opened."""
    order = ids[np.argsort(-sizes[ids], kind="stable")]
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free positions, row) of the rows not yet full, sorted
    for i in order.tolist():
        n = int(sizes[i])
        j = bisect.bisect_left(room, (n, -1))  # the row with the least room that still fits n
        if j == len(room):
            rows.append([i])
            free, r = capacity - n, len(rows) - 1
        else:
            free, r = room.pop(j)
            rows[r].append(i)
            free -= n
        if free > 0:
            bisect.insort(room, (free, r))
    return [np.array(row, dtype=np.int64) for row in rows]


def _check_vocab(data: PreparedData, vocab_size: int | None) -> None:
    if vocab_size is not None and data.max_token_id >= vocab_size:
        raise ValueError(
            f"the {data.encoding} token files hold ids up to {data.max_token_id}, but model.vocab_size is "
            f"{vocab_size}: set model.vocab_size to at least {data.max_token_id + 1} (the encoding has "
            f"{data.vocab_size})"
        )


def _to_device(x: np.ndarray, y: np.ndarray, device: torch.device, positions: np.ndarray | None = None) -> Batch:
    arrays = [torch.from_numpy(a) for a in (x, y, positions) if a is not None]
    if device.type == "cuda":
        # page-locked host memory lets the copy run asynchronously, overlapping the previous step's compute
        arrays = [a.pin_memory().to(device, non_blocking=True) for a in arrays]
    else:
        arrays = [a.to(device) for a in arrays]
    return Batch(*arrays)
