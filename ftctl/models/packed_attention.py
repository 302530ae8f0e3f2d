"""Attention for packed micro-batches that computes each example on its own, the varlen way, on any device.

A packed row holds several examples back to back. The general way to keep them apart is a
block-diagonal mask over the whole row, but a masked SDPA computes every (query, key) pair of the
row, and the fast kernels that skip the causal half only take ``is_causal`` without a mask. With
examples a quarter of the row long, the masked kernel does about eight times the useful work.

Packed micro-batches therefore carry the example boundaries, computed once on the host by the
collator (:class:`ftctl.data.batching.PackedBoundaries`): cumulative lengths over the flattened
rows as an int32 device tensor (``cu_seq_lens_q``/``cu_seq_lens_k``, as flash-attention's varlen
kernels and transformers' padding-free path take them), the longest span as a Python int, and the
span lengths of each row as Python ints. No layer reads a device tensor back: on a GPU every such
read stalls the queue once per layer.

:func:`use_packed_attention` installs one attention function in place of ``sdpa``; which kernel it
runs is chosen once, with the model's ``attn_implementation``, by capability and precision, in
:func:`ftctl.models.attention_choice.choose_attention`:

- ``flash_varlen``: flash-attn's ``flash_attn_varlen_func`` (when flash-attn is installed, CUDA; fp16/bf16);
- ``varlen``: torch's own ``torch.nn.attention.varlen.varlen_attn`` (torch 2.10+, CUDA; fp16/bf16);
- ``flex``: FlexAttention with a per-row document mask built once per micro-batch (CUDA; forward-only on CPU);
- ``sdpa``: causal SDPA on each example's slice. On CUDA the cuDNN backend is excluded: it builds a
  new plan for every new sequence length, milliseconds of CPU per call. This is the CPU path.

Batches without boundaries (padded batches, generation) take the plain ``sdpa`` path, mask included.
:func:`record_packed_kernels` tells which kernels actually ran (the runner logs it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

#: The packed kernels, fastest first; ``auto`` picks the first that can run (see ftctl.models.attention_choice).
PACKED_KERNELS = ("flash_varlen", "varlen", "flex", "sdpa")
#: Kernels whose inputs must be fp16 or bf16.
HALF_PRECISION_ONLY = frozenset({"flash_varlen", "varlen"})
#: Kernels without attention dropout (flash-attn's and SDPA take theirs).
NO_DROPOUT = frozenset({"varlen", "flex"})
#: What each kernel needs of the machine.
KERNEL_NEEDS = {"flash_varlen": "CUDA and flash-attn", "varlen": "CUDA and torch>=2.10",
                "flex": "CUDA (FlexAttention has no CPU backward)", "sdpa": "nothing"}
_PREFIX = "ftctl_packed_"
PACKED_SDPA = _PREFIX + "sdpa"
_registered = set()
_recorders: List[set] = []


@dataclass(frozen=True)
class KernelCapabilities:
    """What the machine offers for packed attention: an input of ``choose_attention``."""

    device_type: str
    flash_attn: bool  # the flash-attn package imports
    torch_varlen: bool  # torch.nn.attention.varlen.varlen_attn exists
    flex: bool  # torch.nn.attention.flex_attention exists

    @classmethod
    def probe(cls, device_type: str) -> "KernelCapabilities":
        return cls(
            device_type,
            flash_attn=importlib.util.find_spec("flash_attn") is not None,
            torch_varlen=torch_varlen_attn() is not None,
            flex=_has_module("torch.nn.attention.flex_attention"),
        )

    def available(self, kernel: str) -> bool:
        """Whether ``kernel`` can train here (flex trains only on CUDA: it has no CPU backward)."""
        on_cuda = self.device_type == "cuda"
        return {"flash_varlen": on_cuda and self.flash_attn, "varlen": on_cuda and self.torch_varlen,
                "flex": on_cuda and self.flex, "sdpa": True}.get(kernel, False)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@contextlib.contextmanager
def record_packed_kernels():
    """Collects, into the set it yields, the packed kernels that run inside the block (compiled code is not seen)."""
    ran: set = set()
    _recorders.append(ran)
    try:
        yield ran
    finally:
        _recorders.remove(ran)


def _ran(kernel: str) -> None:
    if _recorders and not torch.compiler.is_compiling():
        for ran in _recorders:
            ran.add(kernel)


def implementation_name(kernel: str) -> str:
    return _PREFIX + kernel


def register_packed_attention(kernel: str = "sdpa") -> str:
    """Make the packed ``attn_implementation`` of ``kernel`` valid (idempotent); returns its name."""
    name = implementation_name(kernel)
    if name in _registered:
        return name
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, functools.partial(packed_attention_forward, kernel=kernel))
    # Padded batches still need their padding mask; packed ones skip mask building (see skip_mask_inputs).
    AttentionMaskInterface.register(name, sdpa_mask)
    _registered.add(name)
    return name


def use_packed_attention(model: torch.nn.Module, kernel: Optional[str] = "sdpa") -> bool:
    """Switch a model loaded with ``sdpa`` attention to the packed attention of ``kernel``; returns whether it did.

    Other implementations stay (``kernel`` None: the run chose none): flash-attention reads the same
    boundaries itself, and ``eager`` keeps the block-diagonal mask.
    """
    config = getattr(model, "config", None)
    if kernel is None or config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    config._attn_implementation = register_packed_attention(kernel)
    return True


def packed_kernel_of(module: torch.nn.Module) -> Optional[str]:
    """The packed kernel ``module`` (plain, peft- or DDP-wrapped) runs, or None without packed attention."""
    inner = module
    for _ in range(4):  # DDP / DeepSpeed keep the model in `.module`; peft and FSDP2 answer for it directly
        config = getattr(inner, "config", None)
        name = getattr(config, "_attn_implementation", None)
        if isinstance(name, str):
            return name[len(_PREFIX):] if name.startswith(_PREFIX) else None
        inner = getattr(inner, "module", None)
        if inner is None:
            return None
    return None


def skip_mask_inputs(device) -> dict:
    """Model inputs that stop transformers from building a mask for a packed micro-batch.

    Without an attention mask and with restarting positions, transformers looks for packed
    sequences in ``position_ids`` and reads the result back to the host (a queue stall on a GPU)
    to build a block-diagonal mask that packed attention never uses. A prepared 4-D mask is
    passed through as it is; packed attention ignores it when boundaries are given.
    """
    return {"attention_mask": torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)}


def example_spans(cu_seq_lens: torch.Tensor, rows: int, row_len: int) -> List[Tuple[int, int, int]]:
    """(row, start, end) of every example from cumulative lengths over the flattened rows (padding included).

    Reads the tensor on the host: for callers that pass boundaries without their row lengths.
    """
    bounds = cu_seq_lens.tolist()
    if bounds[0] != 0 or bounds[-1] != rows * row_len:
        raise ValueError(f"cu_seq_lens {bounds} do not cover {rows} rows of {row_len} positions")
    spans = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        row, offset = divmod(start, row_len)
        if end - row * row_len > row_len:
            raise ValueError(f"a packed example spans rows {row} and {row + 1}: cu_seq_lens {bounds}")
        spans.append((row, offset, offset + end - start))
    return spans


def _row_lengths_from(cu_seq_lens: torch.Tensor, rows: int, row_len: int) -> List[List[int]]:
    lengths: List[List[int]] = [[] for _ in range(rows)]
    for row, start, end in example_spans(cu_seq_lens, rows, row_len):
        lengths[row].append(end - start)
    return lengths


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    cu_seq_lens_q: Optional[torch.Tensor] = None,
    cu_seq_lens_k: Optional[torch.Tensor] = None,
    max_length_q: Optional[int] = None,
    packed_row_lengths: Optional[Sequence[Sequence[int]]] = None,
    kernel: str = "sdpa",
    **kwargs,
):
    """``sdpa_attention_forward`` with per-example causal attention when boundaries are given.

    query: (batch, heads, length, head_dim); key/value: (batch, kv_heads, length, head_dim).
    Returns (batch, length, heads, head_dim) like transformers' own SDPA path.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None or query.shape[2] != key.shape[2] or not getattr(module, "is_causal", True):
        if attention_mask is not None and attention_mask.shape[-1] != key.shape[2]:
            attention_mask = None  # the placeholder of skip_mask_inputs: causal attention, no padding
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    # Identity, not equality: comparing device tensors would read them back.
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q:
        raise ValueError("packed attention needs the same example boundaries for queries and keys")
    if kernel != "sdpa" and max_length_q is not None and not (dropout and kernel in NO_DROPOUT):
        _ran(kernel)
        if kernel == "flash_varlen":
            return _flash_varlen(query, key, value, cu_seq_lens_q, max_length_q, scaling, dropout), None
        run = {"varlen": _torch_varlen_attention, "flex": _flex_attention}[kernel]
        return run(query, key, value, cu_seq_lens_q, max_length_q, scaling), None
    _ran("sdpa")
    if packed_row_lengths is None:
        packed_row_lengths = _row_lengths_from(cu_seq_lens_q, query.shape[0], query.shape[2])
    return _per_example_sdpa(query, key, value, packed_row_lengths, dropout, scaling), None


def _per_example_sdpa(query, key, value, row_lengths, dropout, scaling):
    gqa = query.shape[1] != key.shape[1]
    rows = []
    with _sdpa_without_cudnn(query.device.type):
        # split() rather than one slice per example: its backward is one concatenation, where every
        # slice's backward would write its gradient into a zeroed tensor the size of the whole input.
        for q_row, k_row, v_row, lengths in zip(query.split(1), key.split(1), value.split(1), row_lengths):
            lengths = list(lengths)
            parts = [
                F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa)
                for q, k, v in zip(q_row.split(lengths, 2), k_row.split(lengths, 2), v_row.split(lengths, 2))
            ]
            rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous()


def _sdpa_without_cudnn(device_type: str):
    if device_type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(batch, heads, length, dim) -> (batch·length, heads, dim): the varlen kernels' packed layout."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])


def _unflat(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return out.reshape(like.shape[0], like.shape[2], like.shape[1], like.shape[3])


def _flash_varlen(query, key, value, cu, longest, scaling, dropout=0.0):
    from flash_attn import flash_attn_varlen_func

    out = flash_attn_varlen_func(_flat(query), _flat(key), _flat(value), cu, cu, longest, longest,
                                 dropout_p=dropout, softmax_scale=scaling, causal=True)
    return _unflat(out, query)


@functools.lru_cache(maxsize=1)
def torch_varlen_attn():
    """torch's varlen_attn with its causal and GQA arguments for this torch version, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    # torch 2.10 takes is_causal; 2.11 replaced it with window_size, where (-1, 0) is causal.
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params


def _torch_varlen_attention(query, key, value, cu, longest, scaling):
    varlen_attn, causal, takes_gqa = torch_varlen_attn()
    extra = dict(causal)
    if query.shape[1] != key.shape[1]:
        if takes_gqa:
            extra["enable_gqa"] = True
        else:
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = varlen_attn(_flat(query), _flat(key), _flat(value), cu, cu, longest, longest, scale=scaling, **extra)
    return _unflat(out, query)


#: FlexAttention's block size: the mask is kept per (query block, key block) pair of a row.
FLEX_BLOCK = 128


def document_block_mask(cu: torch.Tensor, rows: int, length: int, block: int = FLEX_BLOCK):
    """The causal document mask of packed rows as a FlexAttention ``BlockMask``, built from the boundaries.

    Per row, not over all rows flattened into one sequence, and without evaluating the mask at every
    (query, key) pair: each position's example id (rows × length ints) gives, per pair of blocks,
    whether the blocks share an example (computed) and whether one example covers both whole
    (computed without the mask). Memory: the ids plus rows × (length / block)² block entries, where
    a dense mask would hold (rows × length)² booleans. Nothing is read back to the host.
    """
    from torch.nn.attention.flex_attention import BlockMask

    device = cu.device
    positions = torch.arange(rows * length, device=device, dtype=cu.dtype)
    # An example never crosses a row (each row's padded tail is a span of its own), so ids of one row stay in it.
    document = torch.searchsorted(cu[1:].contiguous(), positions, right=True).to(torch.int32).view(rows, length)
    blocks = -(-length // block)
    starts = torch.arange(blocks, device=device) * block
    ends = (starts + block).clamp(max=length) - 1
    first, last = document[:, starts], document[:, ends]  # ids are non-decreasing along a row
    q, kv = torch.arange(blocks, device=device)[:, None], torch.arange(blocks, device=device)[None, :]
    # Block kv (before block q) shares an example with block q when its last id is q's first.
    touching = ((kv < q) & (last[:, None, :] == first[:, :, None])) | (kv == q)
    # Whole blocks of one example: no position needs the mask. A block cut short by the row's end stays partial.
    complete = ends - starts == block - 1
    whole = (kv < q) & (first[:, None, :] == last[:, :, None]) & complete[None, :] & complete[:, None]
    partial = touching & ~whole

    def ordered(selected):  # the selected key blocks of every query block first, in order, as flex takes them
        counts = selected.sum(-1, dtype=torch.int32)[:, None]
        indices = torch.argsort(selected.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)[:, None]
        return counts, indices

    def same_document_causal(b, h, q_idx, kv_idx):
        return (document[b, q_idx] == document[b, kv_idx]) & (q_idx >= kv_idx)

    kv_num, kv_indices = ordered(partial)
    full_num, full_indices = ordered(whole)
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=block,
                                    mask_mod=same_document_causal, seq_lengths=(length, length))


class _DocumentMaskCache:
    """The FlexAttention block mask of the current micro-batch, built by its first layer, reused by the rest.

    Every layer of one forward receives the same ``cu_seq_lens`` tensor object, so identity tells a
    new micro-batch from the same one without reading anything back.
    """

    boundaries: Optional[torch.Tensor] = None
    block_mask = None

    def get(self, cu: torch.Tensor, rows: int, length: int):
        if self.boundaries is not cu:
            self.block_mask = document_block_mask(cu, rows, length)
            self.boundaries = cu
        return self.block_mask


_document_masks = _DocumentMaskCache()


@functools.lru_cache(maxsize=2)
def _flex_kernel(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    # Compiled, flex generates a fused kernel; eager it materialises the whole score matrix (tests, CPU).
    return torch.compile(flex_attention, dynamic=True) if device_type == "cuda" else flex_attention


def _flex_attention(query, key, value, cu, longest, scaling):
    mask = _document_masks.get(cu, query.shape[0], query.shape[2])
    out = _flex_kernel(query.device.type)(query, key, value, block_mask=mask, scale=scaling,
                                          enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()


# The name earlier code and tests import; the sdpa kernel's function.
packed_sdpa_attention_forward = functools.partial(packed_attention_forward, kernel="sdpa")
