"""`ftctl export`: a trained result in the formats people deploy, a transformers dir or one GGUF file.

``model=`` is anything ftctl loads (ftctl.evaluation.evaluate.load_model): a run dir or its
``final/``, a checkpoint ``checkpoints/step-N/``, a merged dir, a model alias or dir. Adapters are
merged into their base on the way (ftctl.merging), so both formats hold a standalone model.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from ftctl.errors import FtctlError

log = logging.getLogger("ftctl")

FORMATS = ("hf", "gguf")

#: `ftctl export` options (key=value) and what they mean.
EXPORT_OPTIONS = {
    "model": "what to export: a run dir or its final/, a checkpoints/step-N/ dir, a merged or model dir, an alias (required)",
    "format": "hf (a safetensors model dir) or gguf (one llama.cpp file) (required)",
    "output": "hf: the dir to write; gguf: the file to write, ending in .gguf (required)",
    "base": "adapters: the base model to merge into (default: the one named in adapter_config.json)",
    "dtype": "hf: float32 (default), bfloat16 or float16",
    "shard_size": "hf: largest safetensors file, e.g. 2GB or 500MB (default: one file up to 50GB)",
    "gguf.quant": "gguf: f32, f16 (default), bf16, q8_0 (norms stay f32), or llama.cpp's k-quants q4_k_m, q5_k_m, q6_k (need llama-cpp-python)",
    "quant": "same as gguf.quant",
    "name": "gguf: the model name stored in the file (default: the output file's name)",
    "overwrite": "true to replace an existing output",
}


@dataclass
class ExportRequest:
    model: str
    format: str
    output: str
    base: Optional[str] = None
    dtype: str = "float32"
    shard_size: Optional[int] = None
    quant: str = "f16"
    name: Optional[str] = None
    overwrite: bool = False


def request_from_options(options: Dict[str, str]) -> ExportRequest:
    """An ExportRequest from parsed key=value options, every value checked before anything loads."""
    from ftctl.export.gguf_writer import quant_refusal
    from ftctl.export.hf import HF_DTYPES, parse_size
    from ftctl.options import bool_option

    missing = [key for key in ("model", "format", "output") if key not in options]
    if missing:
        raise FtctlError(f"export needs {', '.join(k + '=...' for k in missing)}: ftctl export model=RUN_DIR format=hf|gguf output=PATH")
    fmt = options["format"].lower()
    if fmt not in FORMATS:
        raise FtctlError(f"format={options['format']} is not one of {', '.join(FORMATS)}")
    if fmt == "gguf" and importlib.util.find_spec("gguf") is None:
        raise FtctlError("GGUF export needs the gguf package: pip install gguf (or pip install 'ftctl[gguf]')")
    if "quant" in options and "gguf.quant" in options and options["quant"] != options["gguf.quant"]:
        raise FtctlError("quant= and gguf.quant= say different things; give one")
    quant = options.get("gguf.quant", options.get("quant", "f16")).lower()
    if fmt == "gguf" and quant_refusal(quant):
        raise FtctlError(quant_refusal(quant))
    dtype = options.get("dtype", "float32")
    if dtype not in HF_DTYPES:
        raise FtctlError(f"dtype={dtype} is not one of {', '.join(HF_DTYPES)}")
    only = {"gguf": ("dtype", "shard_size"), "hf": ("gguf.quant", "quant", "name")}[fmt]
    misplaced = [key for key in only if key in options]
    if misplaced:
        raise FtctlError(f"{', '.join(misplaced)} do{'es' if len(misplaced) == 1 else ''} not apply to format={fmt}")
    overwrite = bool_option("overwrite", options.get("overwrite", "false"))
    return ExportRequest(
        model=options["model"], format=fmt, output=options["output"], base=options.get("base"), dtype=dtype,
        shard_size=parse_size(options["shard_size"]) if "shard_size" in options else None,
        quant=quant, name=options.get("name"), overwrite=overwrite,
    )


def _recorded_base(model: str) -> Optional[str]:
    """The base an adapter result (a run dir, its final/, a checkpoint) names, which an export merges it into."""
    from ftctl.evaluation.evaluate import resolve_targets
    from ftctl.merging import read_adapter_config

    _, adapter_dir = resolve_targets(model, None)
    return read_adapter_config(adapter_dir).get("base_model_name_or_path") if adapter_dir else None


def _check_output(req: ExportRequest) -> Path:
    output = Path(req.output).expanduser().absolute()
    if req.format == "gguf":
        from ftctl.export.gguf_writer import check_gguf_output

        check_gguf_output(output, req.overwrite)
    else:
        from ftctl.merging import check_output_dir

        if output.suffix.lower() == ".gguf":
            raise FtctlError(f"output={output}: format=hf writes a model dir; for one GGUF file use format=gguf")
        check_output_dir(output, req.overwrite)
    from ftctl.merging import refuse_output_over_inputs

    refuse_output_over_inputs(output, model=req.model, base=req.base or _recorded_base(req.model))
    return output


def _source_config(model_name: Optional[str], adapter_dir: Optional[Path]) -> Optional[dict]:
    """The config.json of what will be exported (an adapter's base for adapters), when it can be read without loading weights."""
    from ftctl.models.loading import resolve_model_path

    if adapter_dir is not None and model_name is None:
        model_name = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not model_name or model_name.lower().endswith(".gguf"):
        return None
    try:
        path = Path(resolve_model_path(model_name)) / "config.json"
        return json.loads(path.read_text()) if path.is_file() else None
    except (FtctlError, OSError, ValueError):
        return None  # the loader reports it properly


def _config_object(config: dict):
    """``config`` with its family's defaults filled in (as loading would), or as it is for a family transformers does not know."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    settings = dict(config)
    try:
        return AutoConfig.for_model(settings.pop("model_type", ""), **settings)
    except (ValueError, TypeError, KeyError):
        return SimpleNamespace(**config)


def export_model(req: ExportRequest) -> Path:
    """Load (merging an adapter), then write the requested format; returns the written dir or file."""
    from ftctl.evaluation.evaluate import load_model, resolve_targets

    output = _check_output(req)
    model_name, adapter_dir = resolve_targets(req.model, None)
    if req.base:
        if adapter_dir is None:
            raise FtctlError(f"base= applies to adapters; {req.model} is a full model")
        model_name = req.base
    if req.format == "gguf":
        from ftctl.export.gguf_writer import gguf_refusal

        config = _source_config(model_name, adapter_dir)
        refusal = gguf_refusal(_config_object(config)) if config else None
        if refusal:  # before minutes of loading and merging
            raise FtctlError(refusal)
    model, tokenizer = load_model(model_name, adapter_dir)
    log.info("exporting %s%s as %s", req.model, " (adapter merged into its base)" if adapter_dir else "", req.format)
    if req.format == "hf":
        from ftctl.export.hf import export_hf

        return export_hf(model, tokenizer, output, dtype=req.dtype, shard_size=req.shard_size, overwrite=req.overwrite)
    from ftctl.export.gguf_writer import write_gguf

    return write_gguf(model, tokenizer, output, req.quant, name=req.name, overwrite=req.overwrite)
