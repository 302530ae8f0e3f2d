"""A decoder model's shape read from its config.json: sizes, parameter counts, linear layers. No torch.

Enough for the memory estimator and FLOP counts of Llama-family models (Llama, Mistral, Qwen2/3,
SmolLM, ...): pre-norm decoder layers with grouped-query attention and a gated MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from ftctl.errors import FtctlError

#: Architectures whose causal-LM forward ends in ``logits = self.lm_head(hidden_states)``, with no
#: scaling or soft-capping after it, so the output head may compute the loss itself (ftctl.training.loss).
HEAD_RETURNS_PLAIN_LOGITS = frozenset({"llama", "mistral", "qwen2", "qwen3"})

#: Names of a decoder layer's linear modules (as peft's target_modules see them), in reading order.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Architecture:
    model_type: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # Mixture of experts (Mixtral, Qwen3-MoE): 0 experts for a dense model. transformers keeps each
    # MoE layer's experts as fused 3-D parameters, not linear modules; ``intermediate`` is then the
    # MLP width a token passes through (experts_per_token × expert_intermediate).
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    moe_layers: int = 0  # layers whose MLP is the experts; the others have the dense MLP of dense_intermediate
    dense_intermediate: int = 0

    @classmethod
    def from_config(cls, config: dict, source: str = "config") -> "Architecture":
        config = config.get("text_config", config) if "hidden_size" not in config else config
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            model_type = str(config.get("model_type", ""))
            attention_bias = bool(config.get("attention_bias", False))
            moe = _moe_fields(config)
            return cls(
                model_type=model_type,
                vocab=int(config["vocab_size"]),
                hidden=hidden,
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate=int(moe.pop("intermediate", None) or config["intermediate_size"]),
                tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases (its config has no flag for them); Llama's flag covers o too.
                qkv_bias=attention_bias or model_type == "qwen2",
                o_bias=attention_bias and model_type != "qwen2",
                mlp_bias=bool(config.get("mlp_bias", False)),
                **moe,
            )
        except KeyError as exc:
            raise FtctlError(
                f"{source}: no '{exc.args[0]}' key; the memory estimate understands Llama-style decoder configs "
                "(hidden_size, num_attention_heads, num_hidden_layers, intermediate_size, vocab_size)"
            ) from None

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> Dict[str, Tuple[int, int, bool]]:
        """(in_features, out_features, has_bias) of each linear module in one decoder layer (MoE: attention only)."""
        h, a, kv, i = self.hidden, self.attention_width, self.kv_width, self.intermediate
        attention = {
            "q_proj": (h, a, self.qkv_bias), "k_proj": (h, kv, self.qkv_bias), "v_proj": (h, kv, self.qkv_bias),
            "o_proj": (a, h, self.o_bias),
        }
        if self.experts:
            return attention
        return {**attention, "gate_proj": (h, i, self.mlp_bias), "up_proj": (h, i, self.mlp_bias), "down_proj": (i, h, self.mlp_bias)}

    def linear_parameters_per_layer(self) -> int:
        return sum(i * o + (o if bias else 0) for i, o, bias in self.linear_shapes().values())

    def expert_parameters_per_layer(self) -> int:
        """An MoE layer's experts (gate, up, down each) and its router; averaged over layers with dense MLPs."""
        if not self.experts:
            return 0
        moe = self.experts * 3 * self.hidden * self.expert_intermediate + self.experts * self.hidden
        dense = 3 * self.hidden * self.dense_intermediate
        return (self.moe_layers * moe + (self.layers - self.moe_layers) * dense) // self.layers

    def layer_parameters(self) -> int:
        return self.linear_parameters_per_layer() + self.expert_parameters_per_layer() + 2 * self.hidden  # two RMSNorm weights

    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden

    def head_parameters(self) -> int:
        """Parameters of the output head that are not the embedding's (0 when tied)."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def parameters(self) -> int:
        return self.embedding_parameters() + self.layers * self.layer_parameters() + self.hidden + self.head_parameters()


def _moe_fields(config: dict) -> dict:
    """The expert fields of an MoE config (Mixtral's num_local_experts, Qwen-MoE's num_experts); empty for a dense one."""
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    if experts <= 1:
        return {}
    per_token = int(config["num_experts_per_tok"])
    expert_width = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    layers = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    dense_only = set(config.get("mlp_only_layers") or [])
    moe_layers = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    return dict(
        experts=experts, experts_per_token=per_token, expert_intermediate=expert_width, moe_layers=moe_layers,
        dense_intermediate=int(config["intermediate_size"]), intermediate=per_token * expert_width,
    )
