"""Dropout for LoRA inputs that is cheap on CPUs: the same Bernoulli masks, a fraction of the random-number cost.

torch draws dropout's Bernoulli numbers on the CPU one element at a time from a serial mt19937
(the vectorised MKL path is taken on Intel CPUs only), about 12 ns per element: with LoRA's seven
dropouts per layer that costs more than the adapters' matmuls, and it does not speed up with
threads. :class:`BitsDropout` draws one 64-bit number per four elements instead, from numpy's
SFC64 (twice as fast as torch's 64-bit ``random_``, whose mt19937 makes two 32-bit draws for each),
seeded per call by one draw from torch's generator, so ``torch.manual_seed`` and a checkpoint's RNG
state still fix every mask. It reads each number as four uniform 16-bit integers, drops an element
when its integer falls in the lowest p share of the range (p rounded to a multiple of 1/65536) and
scales the kept ones by 1/(1-p), as nn.Dropout does. For backward it keeps a 1-byte mask where
nn.Dropout keeps fp32 noise (the fused LoRA path keeps the 16-bit numbers instead, see
ftctl.methods.fused_lora). The mask is uint8, not bool: a float tensor times a bool tensor takes
torch's slow type-promotion path on CPUs (about 4x the time of the same product with uint8). On other devices it is plain ``F.dropout``, whose fused
kernels are fast already.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

INT16_VALUES = 1 << 16


class BitsDropout(torch.nn.Module):
    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability {p} is not in [0, 1)")
        self.p = p
        # An int16 drawn uniformly is below this with probability p (rounded to a multiple of 1/65536).
        self.threshold = round(p * INT16_VALUES) - INT16_VALUES // 2

    def active_on(self, x: torch.Tensor) -> bool:
        """Whether :meth:`keep_mask` applies: training, p > 0 and a CPU tensor."""
        return self.training and self.p > 0.0 and x.device.type == "cpu"

    def random_bits(self, x: torch.Tensor) -> torch.Tensor:
        """Uniform int16 values shaped like ``x``; an element is kept where its value is >= ``threshold``."""
        n = x.numel()
        seed = int(torch.randint(0, 1 << 62, ()))
        # 64 random bits per word, read as four uniform int16 values.
        words = np.random.SFC64(seed).random_raw((n + 3) // 4).view(np.int16)
        return torch.from_numpy(words)[:n].view(x.shape)

    def keep_mask(self, x: torch.Tensor, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """1 where an element of ``x`` is kept (probability 1 - p), else 0."""
        return keep_from_bits(self.random_bits(x), self.threshold, dtype)

    @property
    def scale(self) -> float:
        return 1.0 / (1.0 - self.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, training=True)
        return (x * self.keep_mask(x)).mul_(self.scale)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def keep_from_bits(bits: torch.Tensor, threshold: int, dtype: torch.dtype) -> torch.Tensor:
    keep = torch.empty(bits.shape, dtype=dtype, device=bits.device)
    return torch.ge(bits, threshold, out=keep)


def use_bits_dropout(model: torch.nn.Module) -> int:
    """Replace the nn.Dropout modules of peft's LoRA layers (``lora_dropout``) by :class:`BitsDropout`; returns how many."""
    replaced = 0
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(dropouts, torch.nn.ModuleDict):
            continue
        for name, dropout in list(dropouts.items()):
            if type(dropout) is torch.nn.Dropout and dropout.p > 0:
                dropouts[name] = BitsDropout(dropout.p)
                replaced += 1
    return replaced
