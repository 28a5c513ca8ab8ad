"""The learner's training step on every architecture kiln builds: activation
checkpointing gives the same loss and gradients as keeping the activations (first step
of a fresh process included, MXFP8 too), and right-padded batches take the attention
kernel's causal path without a dense mask, with the real tokens' logprobs unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.learner.config import LearnerConfig
from kiln.learner.grpo import LossConfig
from kiln.learner.parallel import policy_gradient_step
from kiln.shared.config import load_config
from kiln.shared.model import MoEConfig, MoEForCausalLM, sequence_logprobs
from kiln.shared.model import experts as experts_mod
from kiln.shared.model import moe as moe_mod

ROOT = Path(__file__).resolve().parents[1]


def preset_arch(name: str) -> MoEConfig:
    """The architecture a fresh run of ``configs/<name>.toml`` builds (vocabulary at its target)."""
    arch = load_config(LearnerConfig, ROOT / "configs" / f"{name}.toml").model.model_dump(
        exclude={"init_from", "cache_dir"}
    )
    return MoEConfig(**arch)


SHAPES = {
    "tiny": lambda: preset_arch("tiny"),
    "smoke": lambda: preset_arch("smoke"),
    # What upcycling a Llama produces (Mixtral layout), at a small size.
    "mixtral": lambda: MoEConfig(
        vocab_size=300,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
        family="mixtral",
    ),
    "qwen2_moe": lambda: MoEConfig(
        vocab_size=300,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
        family="qwen2_moe",
        shared_expert_intermediate_size=64,
        qkv_bias=True,
    ),
}


def learner_batch(vocab: int, lengths: list[int], n: int) -> dict[str, torch.Tensor]:
    """Right-padded rows as ``Policy.train_step`` builds them; the first 8 tokens are prompt."""
    g = torch.Generator().manual_seed(0)
    rows = len(lengths)
    attn = (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]).long()
    mask = attn.clone().float()
    mask[:, :8] = 0
    return {
        "ids": torch.randint(1, vocab, (rows, n), generator=g) * attn,
        "attn": attn,
        "mask": mask,
        "behaviour": -torch.rand(rows, n, generator=g) * 4 * attn,
        "adv": torch.tensor([[1.0], [-0.5], [0.25]])[:rows],
    }


def one_step(cfg: MoEConfig, checkpointing: bool, precision: str = "fp32") -> tuple[float, dict[str, torch.Tensor]]:
    model = MoEForCausalLM(cfg).init_weights(0, std=0.1)
    if precision != "fp32":
        from kiln.learner.precision import apply_precision

        apply_precision(model, precision)
    model.activation_checkpointing = checkpointing
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = learner_batch(cfg.vocab_size, [64, 50, 33], 64)  # 64: a multiple of the MX block
    out = policy_gradient_step(
        model,
        opt,
        batch,
        global_tokens=float(batch["mask"].sum()),
        loss=LossConfig(),
        temperature=1.0,
        max_grad_norm=1.0,
    )
    return out["loss"], {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_activation_checkpointing_step_equals_the_plain_step(monkeypatch, shape):
    """The first checkpointed step of a process (the experts' GEMM probe not yet cached:
    it used to run inside the checkpointed layer and make torch's CheckpointError) gives
    the plain step's loss and gradients."""
    cfg = SHAPES[shape]()
    monkeypatch.setattr(experts_mod, "_SUPPORTED", {})
    loss_ac, grads_ac = one_step(cfg, True)
    loss, grads = one_step(cfg, False)
    assert loss_ac == pytest.approx(loss, rel=1e-6, abs=1e-7)
    for name, g in grads.items():
        torch.testing.assert_close(grads_ac[name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("shape", ["tiny", "mixtral"])  # mixtral: the smollm2-moe preset's layout and precision
def test_activation_checkpointing_step_in_mxfp8(monkeypatch, shape):
    pytest.importorskip("torchao.prototype.moe_training", reason="torchao is a learner dependency")
    cfg = SHAPES[shape]()
    monkeypatch.setattr(experts_mod, "_SUPPORTED", {})
    loss_ac, grads_ac = one_step(cfg, True, "mxfp8")
    loss, grads = one_step(cfg, False, "mxfp8")
    assert loss_ac == pytest.approx(loss, rel=1e-6, abs=1e-7)
    for name, g in grads.items():
        torch.testing.assert_close(grads_ac[name], g, rtol=1e-5, atol=1e-7, msg=name)


def _attention_calls(monkeypatch) -> list[dict]:
    calls = []
    sdpa = moe_mod.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append({"mask": attn_mask, "is_causal": is_causal})
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(moe_mod.F, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("shape", ["tiny", "qwen2_moe"])
def test_right_padding_needs_no_dense_mask(monkeypatch, shape):
    """A right-padded batch attends causally with no mask, and every real token's
    logprob is what the dense padding mask gave and what the row alone (unpadded) gives;
    padding before a real token still gets the dense mask."""
    cfg = SHAPES[shape]()
    model = MoEForCausalLM(cfg).init_weights(1, std=0.1).eval()
    batch = learner_batch(cfg.vocab_size, [64, 50, 33], 64)
    ids, attn = batch["ids"], batch["attn"]
    calls = _attention_calls(monkeypatch)
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, ids, attn)
        assert calls and all(c["mask"] is None and c["is_causal"] for c in calls), calls
        with monkeypatch.context() as m:
            m.setattr(moe_mod, "right_padded", lambda a: False)  # the dense path every batch used to take
            dense, _ = sequence_logprobs(model, ids, attn)
        alone = [
            sequence_logprobs(model, ids[i : i + 1, :k], attn[i : i + 1, :k])[0][0] for i, k in enumerate([64, 50, 33])
        ]
        real = attn.bool()
        torch.testing.assert_close(lp[real], dense[real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lp[real], torch.cat(alone), rtol=1e-5, atol=1e-5)
        calls.clear()
        left = attn.flip(1)  # left padding: real tokens after pads must not see them
        sequence_logprobs(model, ids.flip(1), left)
    assert calls and all(c["mask"] is not None for c in calls)
    assert not moe_mod.right_padded(left) and moe_mod.right_padded(attn) and moe_mod.right_padded(torch.zeros(2, 3))


def test_training_gradients_ignore_the_padding_mask(monkeypatch):
    """The learner's fp32 step gives the same loss and gradients with the causal path as
    with the dense padding mask (padded positions carry no loss and no routing statistic)."""
    cfg = SHAPES["tiny"]()
    loss, grads = one_step(cfg, False)
    monkeypatch.setattr(moe_mod, "right_padded", lambda a: False)
    loss_dense, grads_dense = one_step(cfg, False)
    assert loss == pytest.approx(loss_dense, rel=1e-5, abs=1e-6)
    for name, g in grads_dense.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_memory_bench_runs_both_trees():
    """``bench/learner.py --memory`` (the docs' before/after table) at its smallest: one
    shape, each tree once (this checkout standing in for the ``--before`` tree)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "learner.py"),
            "--memory",
            "--shapes",
            "2x32",
            "--repeats",
            "1",
            "--steps",
            "2",
            "--before",
            str(ROOT),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| rows x tokens | tokens | before peak MiB | before s/step | after peak MiB | after s/step |" in proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| 2 x 32 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "64" and all(float(c.split()[0].replace(",", "")) >= 0 for c in cells[2:]), row
