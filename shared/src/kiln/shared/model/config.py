"""The policy's architecture, declared once: ``MoEConfig`` (the component the model is
built from, ``MoEForCausalLM.Config``) and ``MoEArchitecture``, the part of it a fresh
policy's settings choose (``[model]``: ``kiln.shared.config.ModelSettings`` derives from it).

Invariants: torch-free (the settings import it in every service, env-pool has no torch);
``MoEConfig`` only accepts what its family's HF model (and so vLLM) can load, and
``from_hf`` refuses what our maths does not do; a field's default is the one default of
that dimension everywhere (the settings, ``kiln config show``, a model built in code).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}

# transformers' defaults for keys a config.json may omit (configuration_<family>.py).
_HF_DEFAULTS = {
    "qwen3_moe": dict(
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        norm_topk_prob=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        max_position_embeddings=32768,
    ),
    "mixtral": dict(
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        norm_topk_prob=True,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096 * 32,
    ),
    "qwen2_moe": dict(
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        norm_topk_prob=False,
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        qkv_bias=True,
        max_position_embeddings=32768,
    ),
}


class MoEArchitecture(BaseModel):
    """Architecture of a freshly initialised policy (Qwen3-MoE layout, HF parameter names)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    hidden_size: int = 64
    """Model width."""
    num_hidden_layers: int = 2
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 16
    """Per-head dimension."""
    num_experts: int = 4
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = 2
    """Router top-k."""
    moe_intermediate_size: int = 128
    """Hidden size of each expert's SwiGLU FFN."""
    max_position_embeddings: int = 4096
    """Longest sequence the model (and its RoPE cache) supports."""
    rope_theta: float = 10000.0
    """RoPE base."""
    router_aux_loss_coef: float = 0.01
    """Weight of the MoE load-balancing loss."""


class MoEConfig(MoEArchitecture):
    """Everything ``MoEForCausalLM`` is built from: the architecture plus what a checkpoint
    or tokenizer fixes (vocabulary, special tokens, the HF family's details)."""

    vocab_size: int
    """Rows of the embedding and the output head."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    norm_topk_prob: bool = True
    """Renormalise the router's top-k weights."""
    tie_word_embeddings: bool = False
    """The output head shares the embedding's weights."""
    bos_token_id: int | None = None
    """Written into config.json."""
    eos_token_id: int | list[int] | None = None
    """Written into config.json (HF configs may list several)."""
    family: str = "qwen3_moe"
    """One of ``FAMILIES`` (see ``kiln.shared.model.moe``)."""
    shared_expert_intermediate_size: int = 0
    """Width of the Qwen2-MoE shared expert; 0 = none. Needs ``family="qwen2_moe"``."""
    qkv_bias: bool = False
    """Bias on q/k/v projections (Qwen2-MoE's ``qkv_bias``). Needs ``family="qwen2_moe"``."""
    extra: dict = Field(default_factory=dict)
    """Written verbatim into config.json by ``to_hf`` (over the computed keys)."""

    @model_validator(mode="after")
    def _loadable(self) -> MoEConfig:
        # Refuse, at construction, models that no HF architecture (hence vLLM) could load.
        if self.family not in FAMILIES:
            raise ValueError(f"unsupported model family {self.family!r} (expected one of {FAMILIES})")
        if self.family == "mixtral" and not self.norm_topk_prob:
            raise ValueError("mixtral always renormalises the top-k router weights: norm_topk_prob must be True")
        if self.family != "qwen2_moe" and (self.shared_expert_intermediate_size or self.qkv_bias):
            raise ValueError(
                "a shared expert / qkv_bias exists only in the qwen2_moe layout (Qwen2MoeForCausalLM), "
                f"not in {self.family}"
            )
        if self.family == "qwen2_moe":
            if self.shared_expert_intermediate_size <= 0:
                raise ValueError("qwen2_moe needs shared_expert_intermediate_size > 0 (its HF model always has one)")
            if self.head_dim * self.num_attention_heads != self.hidden_size:
                raise ValueError("qwen2_moe derives head_dim as hidden_size // num_attention_heads (vLLM does too)")
        return self

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3_moe"

    def to_hf(self) -> dict:
        """config.json of this family's HF model with these dimensions."""
        d = dict(
            architectures=[ARCHITECTURES[self.family]],
            model_type=self.family,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_experts_per_tok=self.num_experts_per_tok,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            # transformers 5 reads rope_parameters, older readers rope_theta.
            rope_theta=self.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            router_aux_loss_coef=self.router_aux_loss_coef,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            hidden_act="silu",
            attention_dropout=0.0,
            output_router_logits=False,
            initializer_range=0.02,
            torch_dtype="float32",
            sliding_window=None,
        )
        if self.family == "mixtral":
            # Mixtral's intermediate_size *is* the expert width.
            d.update(
                num_local_experts=self.num_experts,
                intermediate_size=self.moe_intermediate_size,
                router_jitter_noise=0.0,
            )
        else:
            d.update(
                num_experts=self.num_experts,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                use_sliding_window=False,
                # intermediate_size is the dense-MLP width of mlp_only_layers (none here).
                intermediate_size=self.moe_intermediate_size * self.num_experts_per_tok,
            )
        if self.family == "qwen3_moe":
            d.update(attention_bias=False)
        if self.family == "qwen2_moe":
            d.update(shared_expert_intermediate_size=self.shared_expert_intermediate_size, qkv_bias=self.qkv_bias)
        d.update(self.extra)
        return d

    @classmethod
    def from_hf(cls, d: dict) -> MoEConfig:
        """From an HF config.json of any of ``FAMILIES`` (transformers 4 or 5 layout);
        raises ``ValueError`` for a model type or feature our maths does not reproduce."""
        kind = d.get("model_type") or "qwen3_moe"
        if kind not in FAMILIES:
            raise ValueError(f"unsupported model_type {kind!r} (expected one of {FAMILIES})")
        d = {**_HF_DEFAULTS[kind], **{k: v for k, v in d.items() if v is not None or k not in _HF_DEFAULTS[kind]}}
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"unsupported RoPE {rope} (only the default rotary embedding is implemented)")
        d["rope_theta"] = rope.get("rope_theta", d["rope_theta"])
        # Mixtral has no use_sliding_window switch: a set sliding_window is live there.
        sliding = bool(d.get("use_sliding_window")) or (kind == "mixtral" and d.get("sliding_window") is not None)
        unsupported = {
            "hidden_act": d.get("hidden_act", "silu") != "silu",
            "sliding window": sliding,
            "dense layers (decoder_sparse_step/mlp_only_layers)": d.get("decoder_sparse_step", 1) != 1
            or bool(d.get("mlp_only_layers")),
            "attention_bias": bool(d.get("attention_bias")),
            "router_jitter_noise": bool(d.get("router_jitter_noise")),
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"{kind} config uses features this model does not implement: {bad}")
        if kind == "mixtral":
            d["num_experts"] = d["num_local_experts"]
            d["moe_intermediate_size"] = d["intermediate_size"]
        elif "num_local_experts" in d:  # transformers 5 writes Qwen's num_experts under this alias
            d["num_experts"] = d["num_local_experts"]
        if kind != "qwen2_moe":
            d.pop("shared_expert_intermediate_size", None)
            d.pop("qkv_bias", None)
        d["head_dim"] = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        names = set(cls.model_fields) - {"extra", "family"}
        return cls(family=kind, **{k: v for k, v in d.items() if k in names})
