"""Which examples each step trains on, and how they are padded into micro-batches.

The step sampler fixes the global batch of every step from the seed alone, so the same examples
train at step s whatever the world size, micro-batch size or resume point; each rank takes its
contiguous share of that global batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

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


@dataclass
class MicroBatch:
    input_ids: "torch.Tensor"  # noqa: F821
    attention_mask: "torch.Tensor"  # noqa: F821
    labels: "torch.Tensor"  # noqa: F821
    trained_tokens: int
    real_tokens: int


def collate(examples: Sequence, pad_token_id: int, pad_to_multiple_of: int = 8) -> MicroBatch:
    """Right-pad to the longest example (rounded up); padding is masked from attention and loss."""
    import torch

    longest = max(len(ids) for ids, _ in examples)
    width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (x, y) in enumerate(examples):
        ids[row, : len(x)] = torch.from_numpy(np.asarray(x, dtype=np.int64))
        labels[row, : len(y)] = torch.from_numpy(np.asarray(y, dtype=np.int64))
        mask[row, : len(x)] = 1
    # A label at position t is predicted from position t-1, so the first token never counts.
    trained = int((labels[:, 1:] != IGNORE_INDEX).sum())
    return MicroBatch(ids, mask, labels, trained, int(mask.sum()))


def micro_batches(dataset, indices: Sequence[int], micro_batch_size: int, pad_token_id: int, pad_to_multiple_of: int):
    return [
        collate([dataset[i] for i in indices[j : j + micro_batch_size]], pad_token_id, pad_to_multiple_of)
        for j in range(0, len(indices), micro_batch_size)
    ]
