"""The policy model: HF-named checkpoints, incremental decoding, and the one
definition of a token's logprob shared by rollout (while sampling) and the learner."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kiln.rollout.engine import TorchEngine
from kiln.shared.model import MoEConfig, MoEForCausalLM, load_checkpoint, save_checkpoint, sequence_logprobs
from kiln.shared.model import experts as experts_mod
from kiln.shared.model.checkpoint import to_hf_state_dict
from kiln.shared.model.experts import GroupedExperts, default_gemm, gemm_backend, loop_gemm
from kiln.shared.model.moe import SparseMoE

CFG = MoEConfig(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
)


def model(seed=0) -> MoEForCausalLM:
    return MoEForCausalLM(CFG).init_weights(seed, std=0.2)


def test_checkpoint_round_trip_uses_hf_names(tmp_path):
    m = model()
    save_checkpoint(m, tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.0.mlp.gate.weight" in names and "lm_head.weight" in names
    assert "model.layers.0.self_attn.q_norm.weight" in names
    assert not any("w_gate" in n or "rotary" in n for n in names)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == "qwen3_moe" and hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["num_experts"] == 4
    m2 = load_checkpoint(tmp_path)
    for (k, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), k
    assert len(to_hf_state_dict(m)) == len(names)


def test_incremental_decoding_matches_full_forward():
    m = model().eval()
    ids = torch.randint(0, CFG.vocab_size, (1, 40))
    with torch.no_grad():
        full, _ = m(ids)
        cache = [[] for _ in m.layers]
        a, _ = m(ids[:, :30], cache=cache)
        b, _ = m(ids[:, 30:37], cache=cache, start_pos=30)  # several tokens onto a cache
        c, _ = m(ids[:, 37:38], cache=cache, start_pos=37)
    torch.testing.assert_close(torch.cat([a, b, c], 1), full[:, :38], rtol=1e-5, atol=1e-5)


def test_padding_does_not_change_logprobs():
    m = model().eval()
    ids = torch.randint(0, CFG.vocab_size, (1, 20))
    padded = torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], 1)
    with torch.no_grad():
        lp, _ = sequence_logprobs(m, ids, torch.ones_like(ids))
        lp2, _ = sequence_logprobs(m, padded, torch.cat([torch.ones(1, 20), torch.zeros(1, 5)], 1).long())
    torch.testing.assert_close(lp, lp2[:, :20], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_engine_logprobs_equal_learner_recompute(tmp_path, temperature):
    m = model(3)
    save_checkpoint(m, tmp_path)
    engine = TorchEngine()
    await engine.load(5, tmp_path)
    prompt = list(range(1, 30))
    gen = await engine.generate(prompt, 25, stop_ids=set(), temperature=temperature, seed=11)
    assert gen.version == 5 and len(gen.token_ids) == 25 and gen.finish_reason == "length"
    again = await engine.generate(prompt, 25, stop_ids=set(), temperature=temperature, seed=11)
    assert again.token_ids == gen.token_ids  # seeded sampling is reproducible
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        lp, _ = sequence_logprobs(m.eval(), ids, torch.ones_like(ids), temperature)
    torch.testing.assert_close(lp[0, len(prompt) :], torch.tensor(gen.logprobs), rtol=0, atol=2e-5)


async def test_engine_stops_at_stop_token(tmp_path):
    save_checkpoint(model(1), tmp_path)
    engine = TorchEngine()
    await engine.load(0, tmp_path)
    free = await engine.generate([1, 2, 3], 10, stop_ids=set(), temperature=1.0, seed=0)
    stop_at = free.token_ids[3]
    gen = await engine.generate([1, 2, 3], 10, stop_ids={stop_at}, temperature=1.0, seed=0)
    first = free.token_ids.index(stop_at)
    assert gen.token_ids == free.token_ids[: first + 1] and gen.finish_reason == "stop"


def test_load_balancing_loss_is_one_when_uniform():
    m = model()
    e = CFG.num_experts
    # Uniform router probabilities and perfectly balanced top-k choices give exactly 1 * k.
    logits = torch.zeros(e * 10, e)
    logits[torch.arange(e * 10), torch.arange(e * 10) % e] = 1e-4
    value = m.load_balancing_loss([logits])
    assert abs(float(value) - CFG.num_experts_per_tok) < 1e-2


# --- experts as a grouped GEMM -------------------------------------------------------


def _gemm_case(k, n, counts, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), k, generator=g).to(dtype).requires_grad_()
    w = torch.randn(len(counts), n, k, generator=g).to(dtype).requires_grad_()  # stored (E, N, K) like w_gate
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    return x, w, offs


def _fwd_bwd(gemm, x, w, offs):
    x.grad = w.grad = None
    y = gemm(x, w.transpose(-2, -1), offs)
    y.sum().backward()  # an expanded gradient: the case torch._grouped_mm's backward rejects
    return y.detach(), x.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_gemm_equals_the_loop_forward_and_backward(dtype):
    x, w, offs = _gemm_case(32, 24, [5, 0, 9, 6], dtype)  # an empty group too
    for a, b in zip(_fwd_bwd(default_gemm, x, w, offs), _fwd_bwd(loop_gemm, x, w, offs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    if hasattr(torch, "_grouped_mm"):  # torch 2.13 CPU: the single-kernel path is the one that ran
        assert gemm_backend("cpu", dtype, 32, 24) == "grouped_mm"


def test_unaligned_shapes_fall_back_to_the_loop():
    x, w, offs = _gemm_case(6, 10, [3, 4])  # 24- and 40-byte fp32 rows: not multiples of 16 bytes
    assert gemm_backend("cpu", torch.float32, 6, 10) == "loop"
    for a, b in zip(_fwd_bwd(default_gemm, x, w, offs), _fwd_bwd(loop_gemm, x, w, offs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_grouped_mm_probe_works_under_inference_mode(monkeypatch):
    monkeypatch.setattr(experts_mod, "_SUPPORTED", {})
    with torch.inference_mode():
        backend = gemm_backend("cpu", torch.float32)
    assert backend == ("grouped_mm" if hasattr(torch, "_grouped_mm") else "loop")


def test_grouped_experts_use_the_pluggable_gemm():
    ge = GroupedExperts(3, 16, 8)
    with torch.no_grad():
        for p in ge.parameters():
            p.normal_()
    calls = []

    def spy(x, w_t, offs):
        calls.append((tuple(x.shape), tuple(w_t.shape), offs.dtype, offs.tolist()))
        return loop_gemm(x, w_t, offs)

    x = torch.randn(7, 16)
    want = ge(x, [2, 0, 5])
    ge.gemm = spy
    torch.testing.assert_close(ge(x, torch.tensor([2, 0, 5])), want)
    assert calls == [((7, 16), (3, 16, 8), torch.int32, [2, 2, 7])] * 2 + [((7, 8), (3, 8, 16), torch.int32, [2, 2, 7])]


def _reference_moe(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, straight from the definition (Qwen2-MoE with a shared expert)."""
    ex = moe.experts
    out = []
    for t in x:
        p = torch.softmax(moe.gate.weight @ t, -1)
        w, idx = p.topk(moe.top_k)
        if moe.norm_topk:
            w = w / w.sum()
        y = sum(wi * (ex.w_down[e] @ (F.silu(ex.w_gate[e] @ t) * (ex.w_up[e] @ t))) for wi, e in zip(w, idx.tolist()))
        se = moe.shared_expert
        shared = se.down_proj.weight @ (F.silu(se.gate_proj.weight @ t) * (se.up_proj.weight @ t))
        out.append(y + torch.sigmoid(moe.shared_expert_gate.weight @ t) * shared)
    return torch.stack(out)


@pytest.mark.parametrize("norm_topk", [False, True])
def test_shared_expert_moe_matches_a_hand_written_reference(norm_topk):
    cfg = MoEConfig(
        vocab_size=10,
        hidden_size=16,
        num_attention_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        family="qwen2_moe",
        shared_expert_intermediate_size=12,
        norm_topk_prob=norm_topk,
    )
    m = MoEForCausalLM(cfg).init_weights(0, std=0.3)
    moe = m.layers[0].mlp
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        y, logits = moe(x)
        want = _reference_moe(moe, x.reshape(-1, 16)).reshape(2, 5, 16)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    assert logits.shape == (10, 4)


def test_training_step_reaches_every_parameter():
    cfg = MoEConfig(
        vocab_size=32,
        hidden_size=16,
        num_attention_heads=2,
        head_dim=8,
        num_experts=4,
        moe_intermediate_size=8,
        family="qwen2_moe",
        shared_expert_intermediate_size=8,
        qkv_bias=True,
    )
    m = MoEForCausalLM(cfg).init_weights(0, std=0.2)
    ids = torch.randint(0, 32, (2, 12))
    lp, routers = sequence_logprobs(m, ids, torch.ones_like(ids))
    (-lp.sum() + m.load_balancing_loss(routers)).backward()
    no_grad = [n for n, p in m.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, no_grad


def test_mixtral_family_has_no_qk_norm_and_renormalises():
    cfg = MoEConfig(vocab_size=16, hidden_size=16, num_attention_heads=2, head_dim=8, family="mixtral")
    m = MoEForCausalLM(cfg)
    assert not any("q_norm" in n or "k_norm" in n for n, _ in m.named_parameters())
    assert m.layers[0].mlp.norm_topk and cfg.to_hf()["model_type"] == "mixtral"


def test_activation_checkpointing_keeps_gradients_and_frees_activations():
    """Recomputing layers in the backward pass gives the same gradients (and load-balancing
    statistics) while the forward keeps a fraction of the activations alive."""
    cfg = MoEConfig(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
    )
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    attn[1, 30:] = 0
    grads, saved = {}, {}
    for ac in (False, True):
        m = MoEForCausalLM(cfg).init_weights(0, std=0.2).train()
        m.activation_checkpointing = ac
        nbytes = []

        def pack(t):
            nbytes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, routers = sequence_logprobs(m, ids, attn)
            loss = -(lp * attn).sum() + m.load_balancing_loss(routers)
        saved[ac] = sum(nbytes)
        loss.backward()
        grads[ac] = {n: p.grad.clone() for n, p in m.named_parameters()}
    for n, g in grads[False].items():
        torch.testing.assert_close(grads[True][n], g, rtol=1e-5, atol=1e-6, msg=n)
    assert saved[True] < 0.5 * saved[False], saved
