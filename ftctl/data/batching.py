"""Which examples each step trains on, and how they are padded into micro-batches.

The step sampler fixes the global batch of every step from the seed alone, so the same examples
train at step s whatever the world size, micro-batch size or resume point; each rank takes its
contiguous share of that global batch.

A micro-batch is laid out one of two ways: padded (one example per row, right-padded to the
longest) or packed (``data.packing``: the micro-batch's examples share rows of up to
``data.max_seq_len`` tokens; positions restart at every example, which is how the model knows to
keep attention inside each example). Either way it holds the same examples and the same trained
labels, so the loss is the same; packing only removes padding.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ftctl.data.render import IGNORE_INDEX


class StepSampler:
    def __init__(self, num_examples: int, global_batch_size: int, seed: int, shuffle: bool = True):
        self.n, self.batch, self.seed, self.shuffle = num_examples, global_batch_size, seed, shuffle

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def global_batch(self, step: int) -> List[int]:
        start = step * self.batch
        out: List[int] = []
        while len(out) < self.batch:
            epoch, offset = divmod(start + len(out), self.n)
            order = self._epoch_order(epoch)
            out.extend(order[offset : offset + self.batch - len(out)].tolist())
        return out

    def epoch(self, step: int) -> float:
        return step * self.batch / self.n

    def rank_share(self, step: int, rank: int, world_size: int) -> List[int]:
        batch = self.global_batch(step)
        per_rank = len(batch) // world_size
        return batch[rank * per_rank : (rank + 1) * per_rank]


def mixture_quotas(sizes: Sequence[int], weights: Sequence[float]) -> List[int]:
    """How many of an epoch's ``sum(sizes)`` examples each source gives: its weight's share, rounded by largest
    remainder so they add up, and at least one each (a listed source always trains)."""
    total = sum(sizes)
    exact = [total * w / sum(weights) for w in weights]
    quotas = [max(1, int(x)) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda k: (-(exact[k] - int(exact[k])), k))
    for k in by_remainder[: max(0, total - sum(quotas))]:
        quotas[k] += 1
    while sum(quotas) > total:  # the minimum of one pushed past the total: take back from the largest
        quotas[max(range(len(quotas)), key=lambda k: quotas[k])] -= 1
    return quotas


class MixtureSampler(StepSampler):
    """The step sampler over several sources (data.mixture), stored one after the other in one dataset.

    An epoch is ``sum(sizes)`` examples, of which source k gives its quota (:func:`mixture_quotas`):
    a small source is repeated, a large one is read further each epoch. Each source is read as an
    endless stream of its own seeded permutations, epoch e taking the next quota of it; the epoch's
    examples are then shuffled together (or, unshuffled, interleaved evenly). Like the plain sampler,
    every step's batch is a function of the seed, the sizes, the weights and the step alone, so a
    resumed run trains on exactly the examples an uninterrupted one would.
    """

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], global_batch_size: int, seed: int, shuffle: bool = True):
        super().__init__(sum(sizes), global_batch_size, seed, shuffle)
        self.sizes = list(sizes)
        self.starts = np.cumsum([0] + self.sizes[:-1]).tolist()
        self.quotas = mixture_quotas(sizes, weights)
        self._cached_epoch: Optional[tuple] = None

    def _source_stream(self, k: int, start: int, count: int) -> np.ndarray:
        size, out = self.sizes[k], []
        for pass_ in range(start // size, (start + count - 1) // size + 1):
            order = np.random.default_rng([self.seed, k, pass_, 1]).permutation(size) if self.shuffle else np.arange(size)
            lo, hi = max(start - pass_ * size, 0), min(start + count - pass_ * size, size)
            out.append(order[lo:hi])
        return np.concatenate(out) + self.starts[k]

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._cached_epoch is not None and self._cached_epoch[0] == epoch:
            return self._cached_epoch[1]
        parts = [self._source_stream(k, epoch * q, q) for k, q in enumerate(self.quotas)]
        order = np.concatenate(parts)
        if self.shuffle:
            order = order[np.random.default_rng([self.seed, epoch]).permutation(len(order))]
        else:  # example j of a source with quota q sits at (j + 0.5) / q of the epoch
            slots = np.concatenate([(np.arange(q) + 0.5) / q for q in self.quotas])
            order = order[np.argsort(slots, kind="stable")]
        self._cached_epoch = (epoch, order)
        return order


def sampler_for(dataset, global_batch_size: int, seed: int, shuffle: bool = True) -> StepSampler:
    """The step sampler for a dataset: mixing by weight when data.mixture built it."""
    mixture = getattr(dataset, "mixture", None)
    if mixture is not None:
        return MixtureSampler(mixture.sizes, mixture.weights, global_batch_size, seed, shuffle)
    return StepSampler(len(dataset), global_batch_size, seed, shuffle)


@dataclass
class MicroBatch:
    input_ids: "torch.Tensor"  # noqa: F821
    attention_mask: Optional["torch.Tensor"]  # noqa: F821  None when packed: position_ids mark the examples
    labels: "torch.Tensor"  # noqa: F821
    trained_tokens: int
    real_tokens: int
    position_ids: Optional["torch.Tensor"] = None  # noqa: F821  restart at 0 at every packed example
    positions: int = 0  # rows × width: every position the model computes, padding included
    # Packed only: where each example (and each row's padded tail) starts and ends in the flattened
    # rows, as varlen attention kernels take it (see ftctl.models.packed_attention), and the same
    # boundaries as host ints: each row's span lengths and the longest span. Computed here, once per
    # micro-batch, so that no attention layer has to read the device tensor back.
    cu_seq_lens: Optional["torch.Tensor"] = None  # noqa: F821
    row_lengths: Optional[Tuple[Tuple[int, ...], ...]] = None
    longest_span: int = 0
    # The flattened positions that carry a trained next-token label, and those labels: worked out
    # here on the host, because selecting them on the device with a boolean mask reads its count back.
    loss_positions: Optional["torch.Tensor"] = None  # noqa: F821
    loss_targets: Optional["torch.Tensor"] = None  # noqa: F821
    # Packed only: which of the micro-batch's examples each row holds, in row order (a packed row's
    # examples are not in input order), so per-example results can be told apart.
    packed_rows: Optional[Tuple[Tuple[int, ...], ...]] = None

    def model_inputs(self, device, packed_kernel: Optional[str] = None) -> Dict[str, "torch.Tensor"]:  # noqa: F821
        """The model's keyword inputs on ``device``; ``packed_kernel``: the packed attention the model runs, if any."""
        inputs = {"input_ids": self.input_ids.to(device, non_blocking=True)}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask.to(device, non_blocking=True)
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids.to(device, non_blocking=True)
        if self.cu_seq_lens is not None:
            cu = self.cu_seq_lens.to(device, non_blocking=True)
            longest = self.longest_span or int(self.cu_seq_lens.diff().max())
            inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
            if packed_kernel is not None:
                from ftctl.models.packed_attention import skip_mask_inputs

                inputs.update(skip_mask_inputs(device), packed_row_lengths=self.row_lengths)
        return inputs

    def pinned(self) -> "MicroBatch":
        """The same micro-batch in page-locked host memory, so copies to a GPU run asynchronously."""
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v.pin_memory() for k, v in tensors.items() if hasattr(v, "pin_memory")})


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def trained_positions(labels: np.ndarray):
    """(flattened positions whose next token trains, those next tokens) as int64 tensors."""
    import torch

    targets = np.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    flat = targets.reshape(-1)
    positions = np.flatnonzero(flat != IGNORE_INDEX)
    return torch.from_numpy(positions.astype(np.int64)), torch.from_numpy(flat[positions].copy())


def collate(examples: Sequence, pad_token_id: int, pad_to_multiple_of: int = 8) -> MicroBatch:
    """Right-pad to the longest example (rounded up); padding is masked from attention and loss."""
    import torch

    width = _round_up(max(len(ids) for ids, _ in examples), pad_to_multiple_of)
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (x, y) in enumerate(examples):
        ids[row, : len(x)] = torch.from_numpy(np.asarray(x, dtype=np.int64))
        labels[row, : len(y)] = torch.from_numpy(np.asarray(y, dtype=np.int64))
        mask[row, : len(x)] = 1
    # A label at position t is predicted from position t-1, so the first token never counts.
    trained = int((labels[:, 1:] != IGNORE_INDEX).sum())
    loss_positions, loss_targets = trained_positions(labels.numpy())
    return MicroBatch(ids, mask, labels, trained, int(mask.sum()), positions=ids.numel(),
                      loss_positions=loss_positions, loss_targets=loss_targets)


def pack_rows(lengths: Sequence[int], row_len: int) -> List[List[int]]:
    """Group example indices into as few rows of at most ``row_len`` tokens as first fit finds, balanced.

    First fit, longest first, fixes the number of rows; the examples are then dealt longest first
    to the least-filled row, which keeps the longest row (the width every row is padded to) short.
    When that deal overflows a row, the first-fit rows stand. Deterministic (ties keep input order);
    an example is never split across rows.
    """
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    rows: List[List[int]] = []
    room: List[int] = []
    for i in order:
        if lengths[i] > row_len:
            raise ValueError(f"an example of {lengths[i]} tokens does not fit a packed row of {row_len}")
        target = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if target is None:
            rows.append([])
            room.append(row_len)
            target = len(rows) - 1
        rows[target].append(i)
        room[target] -= lengths[i]
    balanced: List[List[int]] = [[] for _ in rows]
    filled = [0] * len(rows)
    for i in order:
        target = min(range(len(rows)), key=lambda r: (filled[r], r))
        balanced[target].append(i)
        filled[target] += lengths[i]
    chosen = balanced if max(filled) <= row_len else rows
    return [sorted(row) for row in chosen]


def pack_examples(examples: Sequence, row_len: int, pad_token_id: int, pad_to_multiple_of: int = 8) -> MicroBatch:
    """Pack examples into shared rows, with positions restarting per example and no attention mask.

    Without an attention mask and with restarting positions, transformers builds a block-diagonal
    causal mask (``find_packed_sequence_indices``), so no token attends across an example boundary;
    the boundaries also go along as ``cu_seq_lens`` for attention that computes each example on its
    own. The padded tail of a row is one more "example" of pad tokens that nothing trains on.
    """
    import torch

    lengths = [len(ids) for ids, _ in examples]
    rows = pack_rows(lengths, row_len)
    width = _round_up(max(sum(lengths[i] for i in row) for row in rows), pad_to_multiple_of)
    ids = np.full((len(rows), width), pad_token_id, dtype=np.int64)
    labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros((len(rows), width), dtype=np.int64)
    spans = []  # lengths of the examples and padded tails, in flattened order
    row_lengths = []
    for r, row in enumerate(rows):
        start, first_span = 0, len(spans)
        for i in row:
            x, y = examples[i]
            end = start + len(x)
            ids[r, start:end] = x
            labels[r, start:end] = y
            # An example's first token would be predicted from the previous example's last one; an
            # unpacked batch never trains it either (it has no predecessor).
            labels[r, start] = IGNORE_INDEX
            positions[r, start:end] = np.arange(len(x))
            spans.append(len(x))
            start = end
        positions[r, start:] = np.arange(width - start)
        if start < width:
            spans.append(width - start)
        row_lengths.append(tuple(spans[first_span:]))
    trained = int((labels[:, 1:] != IGNORE_INDEX).sum())
    loss_positions, loss_targets = trained_positions(labels)
    return MicroBatch(
        torch.from_numpy(ids), None, torch.from_numpy(labels), trained, sum(lengths),
        position_ids=torch.from_numpy(positions), positions=ids.size,
        cu_seq_lens=torch.from_numpy(np.concatenate([[0], np.cumsum(spans)]).astype(np.int32)),
        row_lengths=tuple(row_lengths), longest_span=max(spans), loss_positions=loss_positions, loss_targets=loss_targets,
        packed_rows=tuple(tuple(row) for row in rows),
    )


@dataclass
class StepShare:
    """One rank's part of a step: its micro-batches, and the trained tokens of the whole global batch.

    Every rank knows the global batch from the step alone (:class:`StepSampler`), so it counts the
    global batch's trained tokens itself, before the step: each micro-batch's loss is normalised by
    them before its backward, with no collective to learn them.
    """

    micro_batches: List[MicroBatch]
    global_trained_tokens: int
    units: Optional[int] = None  # what the step's loss is a mean over, when not its trained tokens (preference: examples)

    @property
    def global_units(self) -> int:
        return self.global_trained_tokens if self.units is None else self.units

    def pinned(self) -> "StepShare":
        return replace(self, micro_batches=[batch.pinned() for batch in self.micro_batches])


def trained_tokens_of(dataset, indices: Sequence[int]) -> int:
    """The trained tokens of these examples as micro-batches count them (an example's first label never trains)."""
    per_example = getattr(dataset, "trained_per_example", None)
    if per_example is not None:
        return int(per_example[np.asarray(indices, dtype=np.int64)].sum())
    return sum(int((np.asarray(dataset[i][1])[1:] != IGNORE_INDEX).sum()) for i in indices)


@dataclass(frozen=True)
class Batching:
    """How a list of example indices becomes micro-batches: ``micro_batch_size`` examples each, padded or packed."""

    micro_batch_size: int
    pad_token_id: int
    pad_to_multiple_of: int = 8
    pack_to: int = 0  # packed row length; 0 = padded rows

    @classmethod
    def from_config(cls, cfg, pad_token_id: int) -> "Batching":
        d = cfg.data
        return cls(cfg.train.micro_batch_size, pad_token_id, d.pad_to_multiple_of, d.max_seq_len if d.packing else 0)

    def step_share(self, dataset, sampler: StepSampler, step: int, rank: int, world_size: int) -> StepShare:
        """This rank's micro-batches of ``step`` and the trained tokens of the step's whole global batch."""
        return StepShare(self(dataset, sampler.rank_share(step, rank, world_size)),
                         trained_tokens_of(dataset, sampler.global_batch(step)))

    def __call__(self, dataset, indices: Sequence[int]) -> List[MicroBatch]:
        out = []
        for j in range(0, len(indices), self.micro_batch_size):
            examples = [dataset[i] for i in indices[j : j + self.micro_batch_size]]
            if self.pack_to:
                out.append(pack_examples(examples, self.pack_to, self.pad_token_id, self.pad_to_multiple_of))
            else:
                out.append(collate(examples, self.pad_token_id, self.pad_to_multiple_of))
        return out

