"""A decoder-only Mixture-of-Experts transformer in three HF families.

``family`` picks the exact maths and on-disk layout of one HF architecture:

- ``qwen3_moe`` (``Qwen3MoeForCausalLM``, the default): per-head q/k RMSNorm, top-k
  renormalised only if ``norm_topk_prob``, routing weights cast to the activation dtype;
- ``mixtral`` (``MixtralForCausalLM``, also what sparse upcycling of a Llama produces):
  no q/k norm, top-k always renormalised, routing weights kept fp32 for the product;
- ``qwen2_moe`` (``Qwen2MoeForCausalLM``): no q/k norm, optional q/k/v bias, and an
  always-on shared SwiGLU expert scaled by ``sigmoid(shared_expert_gate(x))``.

Common to all: RMSNorm with fp32 statistics, GQA attention with rotate-half RoPE, a
softmax (fp32) router over SwiGLU experts, the Switch-style load-balancing loss.
Routed experts live stacked in ``GroupedExperts`` (``experts.py``; grouped GEMMs);
``SparseMoE`` does the routing and token permutation around it. ``checkpoint.py`` maps
parameters to each family's HF names; nothing else knows them.

Invariants: in-memory parameter names do not depend on the family (``layers.N.mlp.gate``,
``layers.N.mlp.experts.w_*``, ``layers.N.mlp.shared_expert.*``), so the learner's
parallel/precision code sees one layout; ``MoEConfig`` (``config.py``, torch-free: the
settings derive ``[model]`` from it) only accepts what its family's HF model (and so
vLLM) can load, and ``from_hf`` refuses what our maths does not do.

Attention always runs the kernel's causal path (``is_causal``, no T x T mask) except
where padding precedes a real token (see ``MoEForCausalLM.forward``) or a cache is
extended by several tokens at once.

Rollout and learner share this module, and ``token_logprobs`` is the single definition
of a token's logprob under the policy: rollout records it while sampling, the learner
recomputes it for the importance ratio.

The learner's logprobs (``sequence_logprobs``: ``forward(..., logprobs_of=targets)``)
never hold a (B, T, V) logits tensor: ``lm_head``, ``log_softmax`` and the gather run
``logprob_chunk`` tokens at a time, each chunk under activation checkpointing, so the
forward keeps only the final hidden states and the backward rebuilds one chunk's logits
at a time (memory linear in tokens, a vocabulary's worth per chunk, not per token); the
values are ``token_logprobs`` of the same logits rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

# Declared torch-free beside the model (the settings import them); re-exported here.
from kiln.shared.model.config import ARCHITECTURES, FAMILIES, MoEArchitecture, MoEConfig  # noqa: F401
from kiln.shared.model.experts import GroupedExperts

LOGPROB_CHUNK = 1024
"""Tokens per chunk of the chunked logprobs: a multiple of 32 (MXFP8's block along the
token dimension, should ``lm_head`` be quantized); 1024 x a 151k vocabulary is 0.6 GB
of fp32 logits per copy."""


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
        self.q_proj = nn.Linear(d, self.h * self.hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, self.kv * self.hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.kv * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.hd, d, bias=False)
        # Qwen3 normalises each head's q and k; Mixtral (and Llama) do not.
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()

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


class SharedExpert(nn.Module):
    """Qwen2-MoE's dense SwiGLU expert that every token passes through."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Top-k routed SwiGLU experts (plus the optional shared expert). ``forward`` returns
    the output and the router logits.

    Routing and permutation live here, the expert GEMMs in ``self.experts``, which is
    called as ``experts(x_sorted, counts)``: an expert-parallel wrapper may replace it.
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.num_experts = e
        # HF Qwen casts the routing weights to the activation dtype before the product,
        # Mixtral multiplies by the fp32 weights: the same in fp32, not in bf16.
        self.fp32_weights = cfg.family == "mixtral"
        self.gate = nn.Linear(d, e, bias=False)
        self.experts = GroupedExperts(e, d, i)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(d, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(d, 1, bias=False)
        else:
            self.shared_expert = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        if not self.fp32_weights:
            weights = weights.to(x.dtype)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # (token, k) slots grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        token_of = order // self.top_k
        y = self.experts(x[token_of], counts)
        y = (y * weights.flatten()[order, None]).to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, token_of, y)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
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
    Config = MoEConfig
    """What it is built from (torchtitan's layout: the config nested in its component)."""

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
        self.activation_checkpointing = False
        """Recompute each decoder layer's activations in the backward pass instead of
        keeping them (training only): memory of one layer instead of all, for ~1/3 more compute."""
        self.logprob_chunk = LOGPROB_CHUNK
        """Tokens whose logits ``forward(..., logprobs_of=...)`` builds at once."""

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
        logprobs_of: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits (B, T, V) and each layer's router logits. ``cache`` (one list per layer)
        is filled/extended in place for incremental decoding from ``start_pos``.

        ``logprobs_of`` (B, T) token ids: instead of the logits, the (B, T) logprob of
        ``logprobs_of[b, t]`` under ``softmax(logits[b, t] / temperature)``, computed
        ``logprob_chunk`` tokens at a time (the module docstring).

        ``attention_mask`` (B, T): 1 = real token. Right padding (every row's real tokens
        first, as the learner and SFT build their batches) takes the attention kernel's
        causal path with no materialised mask: under a causal mask a real token never
        attends to a later position, so its output is the same as with the padding masked
        (memory and time linear in T). The outputs at padded positions are then
        unspecified (they attend to earlier pads): keep them out of every loss and
        statistic, as ``token_mask``/``loss_mask`` do. Any other mask (padding before a
        real token) builds the dense (B, 1, T, T) mask."""
        b, t = input_ids.shape
        x = self.embed_tokens(input_ids)
        pos = torch.arange(start_pos, start_pos + t, device=input_ids.device)
        cos, sin = self.rotary(pos, x.dtype)
        mask = None
        if attention_mask is not None and not right_padded(attention_mask):
            # Padding before a real token: that token must not see it (a dense mask, T^2 per row).
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        routers = []
        recompute = self.activation_checkpointing and self.training and cache is None and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            if recompute:
                x, r = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, None, mask, use_reentrant=False)
            else:
                x, r = layer(x, cos, sin, cache[i] if cache is not None else None, mask)
            routers.append(r)
        if logprobs_of is None:
            return self.lm_head(self.norm(x)), routers
        return self._chunked_logprobs(self.norm(x), logprobs_of, temperature), routers

    def _chunk_logprobs(self, h: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        return token_logprobs(self.lm_head(h), targets, temperature)

    def _chunked_logprobs(self, h: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        b, t, d = h.shape
        flat, goal = h.reshape(b * t, d), targets.reshape(b * t)
        step = max(1, self.logprob_chunk)
        grad = torch.is_grad_enabled()
        parts = []
        for lo in range(0, b * t, step):
            hc, tc = flat[lo : lo + step], goal[lo : lo + step]
            if grad:  # keep only ``hc``: the backward rebuilds this chunk's logits
                parts.append(
                    torch.utils.checkpoint.checkpoint(
                        self._chunk_logprobs, hc, tc, temperature, use_reentrant=False, preserve_rng_state=False
                    )
                )
            else:
                parts.append(self._chunk_logprobs(hc, tc, temperature))
        return torch.cat(parts).reshape(b, t)

    def routing_sums(self, router_logits: list[torch.Tensor], token_mask: torch.Tensor | None = None):
        """The statistics of the load-balancing loss as sums over the (unmasked) tokens:
        (top-k selections per expert (k, E), router probability per expert (E,), tokens).
        Sums, so that ranks holding parts of a batch can add theirs up."""
        e, k = self.config.num_experts, self.config.num_experts_per_tok
        probs = F.softmax(torch.cat(router_logits, dim=0), dim=-1, dtype=torch.float32)
        sel = probs.topk(k, dim=-1).indices
        if token_mask is None:
            m = torch.ones(probs.shape[0], device=probs.device)
        else:
            m = token_mask.reshape(-1).float().repeat(len(router_logits))
        return (F.one_hot(sel, e).float() * m[:, None, None]).sum(0), (probs * m[:, None]).sum(0), m.sum()

    def load_balancing_loss(self, router_logits: list[torch.Tensor], token_mask: torch.Tensor | None = None):
        """Switch/HF auxiliary loss: E * sum_e(fraction of tokens routed to e * mean router prob of e)."""
        return balancing_loss(self.config.num_experts, *self.routing_sums(router_logits, token_mask))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row of a 0/1 mask is real tokens followed only by padding (one
    host sync on an accelerator)."""
    m = attention_mask.bool()
    return bool((m[:, 1:] <= m[:, :-1]).all())


def balancing_loss(num_experts: int, frac_sum: torch.Tensor, prob_sum: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The load-balancing loss from ``MoEForCausalLM.routing_sums``."""
    n = n.clamp(min=1)
    return num_experts * ((frac_sum / n) * (prob_sum / n)[None, :]).sum()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature), computed in fp32."""
    lp = F.log_softmax(logits.float() / temperature, dim=-1)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def sequence_logprobs(
    model: MoEForCausalLM, ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logprob of every token given its prefix: (B, T) with position 0 set to 0. The
    logits are built a chunk of tokens at a time (``MoEForCausalLM.forward``'s
    ``logprobs_of``), every position's, so that chunks of all rows' ``B x T`` positions
    stay multiples of 32 when ``T`` is; the last position's (it predicts nothing) is
    dropped."""
    targets = torch.cat((ids[:, 1:], ids[:, :1]), dim=1)  # the last column: a placeholder
    lp, routers = model(ids, attention_mask=attention_mask, logprobs_of=targets, temperature=temperature)
    return torch.cat((torch.zeros_like(lp[:, :1]), lp[:, :-1]), dim=1), routers
