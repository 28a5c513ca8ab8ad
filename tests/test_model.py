"""The policy model: HF-named checkpoints, incremental decoding, and the one
definition of a token's logprob shared by rollout (while sampling) and the learner."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kiln.shared.model import MoEConfig, MoEForCausalLM, load_checkpoint, save_checkpoint, sequence_logprobs
from kiln.shared.model.checkpoint import to_hf_state_dict

from kiln.rollout.engine import TorchEngine

CFG = MoEConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)


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
    torch.testing.assert_close(lp[0, len(prompt):], torch.tensor(gen.logprobs), rtol=0, atol=2e-5)


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
