"""Which llama.cpp architecture each transformers family is written as, and the conventions each one has.

Everything here follows llama.cpp's convert_hf_to_gguf.py and what llama.cpp's graphs hard-code:

* llama (Llama, Mistral -- the converter writes Mistral as llama): q/k rows are permuted, because
  this graph rotates interleaved pairs while transformers rotates halves. Every other family here
  rotates halves in llama.cpp too (rope type NEOX), so their q/k are written as they are.
* qwen2: q/k/v biases (always there; no config flag). qwen3: per-head q_norm/k_norm, head_dim given.
* gemma2, gemma3: RMSNorm computes ``x * (1 + w)``, llama.cpp multiplies by the stored weight, so
  every norm weight is written as ``1 + w``. The embedding scale sqrt(hidden) and the sliding-window
  layer pattern (gemma2 every 2nd layer full, gemma3 every 6th) are built into llama.cpp, as is
  the query scale 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 27B models): configs that differ
  are refused. gemma2 writes both soft-capping values, gemma3 the final one when set.
* phi3: fused ``qkv_proj`` and ``gate_up_proj`` (llama.cpp splits them itself), partial rotary
  dimensions, the original context length and the sliding window.
* mixtral (written as llama, as the converter does) and qwen3_moe (qwen3moe): transformers' fused
  expert parameters are written as llama.cpp's ``ffn_{gate,up,down}_exps`` (gate_up split in two),
  the router as ``ffn_gate_inp``, with the expert counts. llama.cpp renormalises the chosen experts'
  weights and makes every layer an MoE layer; configs that do otherwise are refused.

The tensor names come from gguf-py's own table (``gguf.get_tensor_name_map``), the one llama.cpp's
converter and transformers' GGUF loader use.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

log = logging.getLogger("ftctl")


@dataclass(frozen=True)
class GGUFFamily:
    arch: str  # llama.cpp's architecture name, general.architecture
    interleave_rotary: bool = False  # permute q/k rows from rotate-half to llama.cpp's interleaved pairs
    norm_offset: float = 0.0  # added to every norm weight (Gemma's 1 + w)
    activation: str = "silu"  # the MLP activation llama.cpp's graph applies
    layer_pattern: int = 0  # gemma: every Nth layer is full attention, the others sliding; 0: no sliding layers


#: transformers model_type -> how it is written. The one list of what GGUF export supports.
FAMILIES = {
    "llama": GGUFFamily("llama", interleave_rotary=True),
    "mistral": GGUFFamily("llama", interleave_rotary=True),
    "qwen2": GGUFFamily("qwen2"),
    "qwen3": GGUFFamily("qwen3"),
    "gemma2": GGUFFamily("gemma2", norm_offset=1.0, activation="gelu_pytorch_tanh", layer_pattern=2),
    "gemma3_text": GGUFFamily("gemma3", norm_offset=1.0, activation="gelu_pytorch_tanh", layer_pattern=6),
    "phi3": GGUFFamily("phi3"),
    "mixtral": GGUFFamily("llama", interleave_rotary=True),
    "qwen3_moe": GGUFFamily("qwen3moe"),
}

#: rope_type values llama.cpp expresses: in metadata (linear), or as tensors: rope_freqs (llama3, llama graph
#: only), rope_factors_long/short (longrope, Phi-3 128k and Phi-3.5).
ROPE_TYPES = {"llama": ("default", "linear", "llama3"), "phi3": ("default", "linear", "longrope")}
DEFAULT_ROPE_TYPES = ("default", "linear")
#: Layer counts of the Gemma 27B models, for which llama.cpp scales queries by 1/sqrt(hidden/heads).
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
#: The rope base llama.cpp assumes for Gemma 3's sliding layers when a file does not say.
GEMMA3_SLIDING_ROPE_THETA = 10000.0


def family_of(config) -> Optional[GGUFFamily]:
    return FAMILIES.get(getattr(config, "model_type", None))


def rope_settings(config, layer_type: str = "full_attention") -> dict:
    """The rotary settings whichever way the config spells them (transformers 5 rope_parameters, per layer
    type for Gemma 3, or rope_scaling + rope_theta)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if layer_type in params and isinstance(params[layer_type], dict):
        params = dict(params[layer_type])
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    return params


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dim(config) -> int:
    factor = rope_settings(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
    return int(head_dim(config) * factor)


def _unsupported_by(model_type: str, architectures: str) -> str:
    """Why a model_type has no GGUF writer here, naming llama.cpp's architecture when it has one."""
    try:
        from gguf import MODEL_ARCH_NAMES

        llama_cpp = {name.replace("-", "").replace("_", "") for name in MODEL_ARCH_NAMES.values()}
    except ImportError:
        llama_cpp = set()
    supported = ", ".join(sorted(FAMILIES))
    if model_type.replace("_", "").replace("-", "") in llama_cpp:
        why = f"llama.cpp has a {model_type} architecture, but ftctl does not write it yet (it writes {supported})"
    else:
        why = f"ftctl knows no llama.cpp architecture for it (it writes {supported})"
    return (
        f"GGUF export of model_type {model_type} ({architectures}): {why}. "
        "Export format=hf instead, or convert that with llama.cpp's convert_hf_to_gguf.py"
    )


def conventions_missing(config, family: GGUFFamily) -> List[str]:
    """What this config does that ``family``'s llama.cpp graph cannot express; empty when it can be written."""
    found = []
    arch = family.arch
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        found.append("attention/MLP bias terms")
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or family.activation
    if activation != family.activation:
        found.append(f"hidden_act={activation} (llama.cpp's {arch} applies {family.activation})")
    rope_type = rope_settings(config).get("rope_type", "default")
    if rope_type not in ROPE_TYPES.get(arch, DEFAULT_ROPE_TYPES):
        found.append(f"rope_type={rope_type}")
    if getattr(config, "use_sliding_window", False):
        found.append(f"use_sliding_window=true (llama.cpp's {arch} attends to the whole context)")
    if not getattr(config, "tie_word_embeddings", False) and not _has_output_tensor(arch):
        found.append(f"an lm_head of its own (llama.cpp's {arch} reuses token_embd as the output head)")
    if family.layer_pattern:
        found += _gemma_conventions_missing(config, family)
    if expert_count(config):
        if getattr(config, "mlp_only_layers", None) or (getattr(config, "decoder_sparse_step", 1) or 1) != 1:
            found.append(f"dense MLP layers among the expert layers (llama.cpp's {arch} makes every layer MoE)")
        if getattr(config, "norm_topk_prob", True) is False:
            found.append(f"norm_topk_prob=false (llama.cpp's {arch} renormalises the chosen experts' weights)")
    return found


def expert_count(config) -> int:
    """Experts per MoE layer (Mixtral's num_local_experts, Qwen-MoE's num_experts); 0 for a dense model."""
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)


def _has_output_tensor(arch: str) -> bool:
    import gguf

    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    return gguf.MODEL_TENSOR.OUTPUT in gguf.MODEL_TENSORS[arch_id]


def _gemma_conventions_missing(config, family: GGUFFamily) -> List[str]:
    found = []
    pattern = family.layer_pattern
    expected = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(config.num_hidden_layers)]
    layer_types = list(getattr(config, "layer_types", None) or expected)
    if layer_types != expected:
        found.append(f"layer_types (llama.cpp's {family.arch} fixes them: one full-attention layer in every {pattern}, the last)")
    scalar = getattr(config, "query_pre_attn_scalar", None)
    big = config.num_hidden_layers == GEMMA_27B_LAYERS[family.arch]
    llama_cpp_scalar = config.hidden_size // config.num_attention_heads if big else head_dim(config)
    if scalar is not None and scalar != llama_cpp_scalar:
        found.append(f"query_pre_attn_scalar={scalar} (llama.cpp's {family.arch} scales queries by 1/sqrt({llama_cpp_scalar}))")
    if family.arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, key, None) is None:
                found.append(f"{key}=null (llama.cpp's gemma2 always soft-caps)")
    if family.arch == "gemma3":
        if getattr(config, "attn_logit_softcapping", None):
            found.append("attn_logit_softcapping (llama.cpp's gemma3 has none)")
        sliding = rope_settings(config, "sliding_attention")
        if sliding.get("rope_type", "default") != "default":
            found.append(f"rope_type={sliding['rope_type']} on sliding layers")
    return found


def gguf_refusal(config) -> Optional[str]:
    """Why ``config`` cannot be written as a GGUF file by ftctl, or None when it can."""
    model_type = getattr(config, "model_type", None) or "unknown"
    family = family_of(config)
    if family is None and getattr(config, "vision_config", None) is not None:
        return (
            f"GGUF export of model_type {model_type}: a model with a vision tower; ftctl writes text-only models, and llama.cpp "
            "keeps the vision part in a separate mmproj file. Export format=hf instead and convert that with llama.cpp's convert_hf_to_gguf.py"
        )
    if family is None:
        architectures = ", ".join(getattr(config, "architectures", None) or []) or "unknown"
        return _unsupported_by(model_type, architectures)
    missing = conventions_missing(config, family)
    if missing:
        return f"GGUF export: llama.cpp's {family.arch} architecture cannot express this {model_type} model's {'; '.join(missing)}. Export format=hf instead"
    return None


def add_hyperparameters(writer, config, family: GGUFFamily) -> None:
    """The ``{arch}.*`` keys llama.cpp reads for this family, as its converter writes them."""
    import gguf

    dim = head_dim(config)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    writer.add_key_length(dim)
    writer.add_value_length(dim)
    writer.add_rope_dimension_count(rotary_dim(config))
    rope = rope_settings(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)

    if expert_count(config):
        writer.add_expert_count(expert_count(config))
        writer.add_expert_used_count(int(config.num_experts_per_tok))
        if getattr(config, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(int(config.moe_intermediate_size))

    sliding_window = getattr(config, "sliding_window", None)
    if family.arch == "gemma2":
        writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
        writer.add_sliding_window(int(sliding_window))
    elif family.arch == "gemma3":
        if getattr(config, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
        writer.add_sliding_window(int(sliding_window))
        writer.add_rope_freq_base_swa(float(rope_settings(config, "sliding_attention").get("rope_theta", GEMMA3_SLIDING_ROPE_THETA)))
    elif family.arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(phi3_original_context(config))
        writer.add_sliding_window(int(sliding_window or 0))  # 0: none, as the converter writes it
        if rope.get("rope_type") == "longrope":
            writer.add_rope_scaling_attn_factors(longrope_attention_factor(config))
    elif sliding_window and sliding_window < config.max_position_embeddings:
        log.info(
            "%s: llama.cpp's %s graph has no sliding window; the model behaves the same up to %d tokens of context",
            config.model_type, family.arch, sliding_window,
        )


def phi3_original_context(config) -> int:
    original = rope_settings(config).get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    return int(original or config.max_position_embeddings)


def longrope_attention_factor(config) -> float:
    """The attention scale longrope applies beyond the original context, as transformers and llama.cpp compute it."""
    rope = rope_settings(config)
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    scale = config.max_position_embeddings / phi3_original_context(config)
    return math.sqrt(1 + math.log(scale) / math.log(phi3_original_context(config))) if scale > 1.0 else 1.0


def llama3_rope_factors(config) -> np.ndarray:
    """Per-frequency divisors llama.cpp applies for Llama 3.1-style rope scaling (its rope_freqs tensor)."""
    rope = rope_settings(config)
    dim = head_dim(config)
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def computed_tensors(config) -> dict:
    """GGUF tensors made from the config rather than the weights: rope frequency factors."""
    rope = rope_settings(config)
    if rope.get("rope_type") == "llama3":
        return {"rope_freqs.weight": llama3_rope_factors(config)}
    if rope.get("rope_type") == "longrope":
        return {
            "rope_factors_long.weight": np.asarray(rope["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.asarray(rope["short_factor"], dtype=np.float32),
        }
    return {}
