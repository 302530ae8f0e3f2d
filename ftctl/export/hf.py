"""Write a model as a standalone transformers dir: safetensors (sharded on request), config, generation config, tokenizer."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from ftctl.errors import FtctlError

HF_DTYPES = ("float32", "bfloat16", "float16")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, key: str = "shard_size") -> int:
    """Bytes in '2GB', '500MB', '1.5GiB' or a plain number of bytes."""
    match = _SIZE.match(text)
    if not match or match.group(2) and match.group(2).upper() not in _UNITS:
        raise FtctlError(f"{key}={text}: write a size such as 2GB, 500MB or 1GiB")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if size < 1:
        raise FtctlError(f"{key}={text}: must be more than 0 bytes")
    return size


def export_hf(model, tokenizer, output, *, dtype: str = "float32", shard_size: Optional[int] = None, overwrite: bool = False) -> Path:
    """Cast ``model`` to ``dtype`` and write it with its tokenizer (and chat template) into ``output``, all or nothing."""
    import torch

    from ftctl.merging import write_merged

    if dtype not in HF_DTYPES:
        raise FtctlError(f"dtype={dtype} is not one of {', '.join(HF_DTYPES)}")
    model = model.to(getattr(torch, dtype))
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    if tokenizer.pad_token_id is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return write_merged(model, tokenizer, Path(output), overwrite=overwrite, max_shard_size=shard_size)
