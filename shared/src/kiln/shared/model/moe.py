"""A decoder-only Mixture-of-Experts transformer with the Qwen3-MoE layout.

Same maths as HF ``Qwen3MoeForCausalLM``: RMSNorm (fp32 statistics), GQA attention with
per-head q/k RMSNorm and rotate-half RoPE, a softmax router with top-k (optionally
renormalised) over SwiGLU experts, and the Switch-style load-balancing loss. Experts
are stored stacked (``w_gate``/``w_up``: (E, I, D), ``w_down``: (E, D, I)) so that a
grouped GEMM can run them; ``checkpoint.py`` maps them to HF's per-expert names.

Rollout and learner share this module, and ``token_logprobs`` is the single definition
of a token's logprob under the policy: rollout records it while sampling, the learner
recomputes it for the importance ratio.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kiln.shared.model.experts import GroupedExperts


@dataclass
class MoEConfig:
    vocab_size: int
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra: dict = field(default_factory=dict)

    def to_hf(self) -> dict:
        """config.json of an HF ``Qwen3MoeForCausalLM`` with these dimensions."""
        d = asdict(self)
        d.pop("extra")
        d.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            intermediate_size=self.moe_intermediate_size * self.num_experts_per_tok,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            hidden_act="silu",
            attention_bias=False,
            attention_dropout=0.0,
            output_router_logits=False,
            use_sliding_window=False,
            initializer_range=0.02,
            torch_dtype="float32",
            **self.extra,
        )
        return d

    @classmethod
    def from_hf(cls, d: dict) -> MoEConfig:
        names = set(cls.__dataclass_fields__) - {"extra"}
        if d.get("model_type") not in (None, "qwen3_moe"):
            raise ValueError(f"unsupported model_type {d.get('model_type')!r} (expected qwen3_moe)")
        return cls(**{k: v for k, v in d.items() if k in names})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.h, self.kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(d, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, d, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache: list | None, mask: torch.Tensor | None):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.h, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            if cache:
                k = torch.cat((cache[0], k), dim=2)
                v = torch.cat((cache[1], v), dim=2)
            cache[:] = [k, v]
        rep = self.h // self.kv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        if mask is None and t > 1 and k.shape[2] > t:  # extending a cache by several tokens
            length = k.shape[2]
            mask = torch.ones(t, length, dtype=torch.bool, device=x.device).tril(diagonal=length - t)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.h * self.hd))


class SparseMoE(nn.Module):
    """Top-k routed SwiGLU experts. ``forward`` returns the output and the router logits."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.num_experts = e
        self.gate = nn.Linear(d, e, bias=False)
        self.experts = GroupedExperts(e, d, i)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # (token, k) slots grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        token_of = order // self.top_k
        y = self.experts(x[token_of], counts)
        out = torch.zeros_like(x).index_add_(0, token_of, y * weights.flatten()[order, None])
        return out.reshape(shape), logits


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg)

    def forward(self, x, cos, sin, cache, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, mask)
        y, router_logits = self.mlp(self.post_attention_layernorm(x))
        return x + y, router_logits


class MoEForCausalLM(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)

    def init_weights(self, seed: int, std: float = 0.02) -> MoEForCausalLM:
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                nn.init.ones_(p)
            else:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        cache: list[list] | None = None,
        start_pos: int = 0,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits (B, T, V) and each layer's router logits. ``cache`` (one list per layer)
        is filled/extended in place for incremental decoding from ``start_pos``."""
        b, t = input_ids.shape
        x = self.embed_tokens(input_ids)
        pos = torch.arange(start_pos, start_pos + t, device=input_ids.device)
        cos, sin = self.rotary(pos, x.dtype)
        mask = None
        if attention_mask is not None:  # (B, T) 1 = real token; padding is on the right
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        routers = []
        for i, layer in enumerate(self.layers):
            x, r = layer(x, cos, sin, cache[i] if cache is not None else None, mask)
            routers.append(r)
        return self.lm_head(self.norm(x)), routers

    def load_balancing_loss(self, router_logits: list[torch.Tensor], token_mask: torch.Tensor | None = None):
        """Switch/HF auxiliary loss: E * sum_e(fraction of tokens routed to e * mean router prob of e)."""
        e, k = self.config.num_experts, self.config.num_experts_per_tok
        logits = torch.cat(router_logits, dim=0)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        _, sel = probs.topk(k, dim=-1)
        onehot = F.one_hot(sel, e).float()  # (N, k, E)
        if token_mask is None:
            frac = onehot.mean(0)
            prob = probs.mean(0)
        else:
            m = token_mask.reshape(-1).float().repeat(len(router_logits))
            denom = m.sum().clamp(min=1)
            frac = (onehot * m[:, None, None]).sum(0) / denom
            prob = (probs * m[:, None]).sum(0) / denom
        return e * (frac * prob[None, :]).sum()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature), computed in fp32."""
    lp = F.log_softmax(logits.float() / temperature, dim=-1)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def sequence_logprobs(
    model: MoEForCausalLM, ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logprob of every token given its prefix: (B, T) with position 0 set to 0."""
    logits, routers = model(ids, attention_mask=attention_mask)
    lp = token_logprobs(logits[:, :-1], ids[:, 1:], temperature)
    return torch.cat((torch.zeros_like(lp[:, :1]), lp), dim=1), routers
