"""The learner's logprobs are computed a chunk of tokens at a time
(``MoEForCausalLM.forward(..., logprobs_of=...)``): the same logprobs and the same
gradients as ``token_logprobs`` of the full (B, T, V) logits, whatever the chunk size
(chunks crossing rows, a last short chunk; the head in MXFP8 too), to float summation
order (measured: logprobs bit-identical at chunk 32, 5e-7 apart at chunk 7; gradients
3e-6 apart on values up to 15), and no tensor of vocabulary width is kept for the
backward."""

from __future__ import annotations

import pytest
import torch

from kiln.shared.model import MoEConfig, MoEForCausalLM, sequence_logprobs, token_logprobs

VOCAB = 300  # no other dimension of the model has this size


def tiny(vocab: int = VOCAB) -> MoEForCausalLM:
    cfg = MoEConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
    )
    return MoEForCausalLM(cfg).init_weights(0, std=0.1)


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, 40), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 31:] = 0  # right padding, as the learner builds its rows
    attn[2, 17:] = 0
    weight = torch.randn(3, 40, generator=g) * attn  # a loss touching every real position
    return ids * attn, attn, weight


def dense_logprobs(model, ids, attn, temperature):
    """The path before chunking: the whole logits tensor, then ``token_logprobs``."""
    logits, routers = model(ids, attention_mask=attn)
    lp = token_logprobs(logits[:, :-1], ids[:, 1:], temperature)
    return torch.cat((torch.zeros_like(lp[:, :1]), lp), dim=1), routers


def loss_and_grads(model, fn, ids, attn, weight, temperature):
    model.zero_grad(set_to_none=True)
    lp, routers = fn(model, ids, attn, temperature)
    ((lp * weight).sum() + model.load_balancing_loss(routers, attn)).backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunk", [7, 32, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_gradients_equal_the_dense_ones(chunk, temperature):
    model = tiny().train()
    ids, attn, weight = batch()
    want_lp, want_grads = loss_and_grads(model, dense_logprobs, ids, attn, weight, temperature)
    model.logprob_chunk = chunk  # 7: chunks cross rows, the last one short
    lp, grads = loss_and_grads(model, sequence_logprobs, ids, attn, weight, temperature)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-6)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5, msg=name)
    with torch.no_grad():  # the proximal/reference passes: no checkpointing, same values
        torch.testing.assert_close(sequence_logprobs(model, ids, attn, temperature)[0], want_lp, rtol=0, atol=1e-6)


def test_chunked_logprobs_with_activation_checkpointing():
    model = tiny().train()
    ids, attn, weight = batch()
    want_lp, want_grads = loss_and_grads(model, dense_logprobs, ids, attn, weight, 1.0)
    model.activation_checkpointing, model.logprob_chunk = True, 16
    lp, grads = loss_and_grads(model, sequence_logprobs, ids, attn, weight, 1.0)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-6)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5, msg=name)


def test_chunked_logprobs_with_the_head_in_mxfp8():
    """``lm_head`` quantized too (``keep_high_precision`` empty; a vocabulary of 320, a
    multiple of the MX block): chunks of 32 tokens give the dense path's logprobs and
    gradients (measured: logprobs bit-identical, gradients 5e-7 apart)."""
    from kiln.learner.precision import apply_precision

    g = torch.Generator().manual_seed(0)
    ids, attn = torch.randint(0, 320, (2, 64), generator=g), torch.ones(2, 64, dtype=torch.long)
    weight = torch.randn(2, 64, generator=g)
    got = []
    for fn in (dense_logprobs, sequence_logprobs):
        model = tiny(320).train()
        assert apply_precision(model, "mxfp8", keep_high_precision=())["lm_head"].startswith("mxfp8")
        model.logprob_chunk = 32
        got.append(loss_and_grads(model, fn, ids, attn, weight, 1.0))
    (want_lp, want_grads), (lp, grads) = got
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-6)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5, msg=name)


def test_no_vocabulary_wide_tensor_is_kept_for_the_backward():
    """Every tensor autograd saves during the forward, by shape: the dense path keeps
    (B, T, V) logits; the chunked one keeps no tensor of vocabulary width (each chunk's
    logits are rebuilt in the backward), only the hidden states."""
    model = tiny().train()
    ids, attn, weight = batch()
    saved: list[tuple[int, ...]] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    for fn in (dense_logprobs, sequence_logprobs):
        saved.clear()
        model.logprob_chunk = 32
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, routers = fn(model, ids, attn, 1.0)
        wide = [s for s in saved if s and s[-1] == VOCAB and len(s) > 1 and s[0] > 1]
        if fn is dense_logprobs:
            assert any(s[:-1] in ((3, 40), (3, 39)) for s in wide), wide
        else:
            assert wide == [], wide  # the lm_head weight (V, D) aside: its last dim is D
        (lp * weight).sum().backward()
