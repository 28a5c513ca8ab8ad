"""HF-format checkpoint folders: ``model.safetensors`` (or sharded with an index) +
``config.json`` + tokenizer files.

Parameter names on disk are the HF names of the model's family, so vLLM and
transformers load exactly what the learner trained:

- ``qwen3_moe`` / ``qwen2_moe``: ``model.layers.N.mlp.gate.weight``,
  ``mlp.experts.E.{gate,up,down}_proj.weight``; qwen2_moe adds
  ``mlp.shared_expert.{gate,up,down}_proj.weight`` and ``mlp.shared_expert_gate.weight``;
- ``mixtral``: ``model.layers.N.block_sparse_moe.gate.weight``,
  ``block_sparse_moe.experts.E.{w1,w3,w2}.weight`` (w1 = gate, w3 = up, w2 = down).

Invariants: ``to_hf_state_dict`` writes per-expert names only (what transformers 5's
``save_pretrained`` writes too, and what vLLM reads); ``from_hf_state_dict`` also
accepts either block prefix and transformers 5's in-memory fused experts
(``experts.gate_up_proj`` (E, 2I, D) with gate rows first, ``experts.down_proj``
(E, D, I)), and raises on any tensor left over or missing. These two functions are the
only places that know the mapping.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kiln.shared.model.moe import MoEConfig, MoEForCausalLM

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def plain(t: torch.Tensor) -> torch.Tensor:
    """The high-precision tensor under a training wrapper (torchao's MXFP8/FP8 weight
    subclasses keep it as ``_data``); plain tensors unchanged."""
    inner = getattr(t, "_data", None)
    return inner if isinstance(inner, torch.Tensor) and type(t) not in (torch.Tensor, torch.nn.Parameter) else t


# Per-family on-disk names of the MoE block and of each expert's three projections.
_BLOCK = {"qwen3_moe": "mlp", "qwen2_moe": "mlp", "mixtral": "block_sparse_moe"}
_QWEN_PROJ = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
_PROJ = {"qwen3_moe": _QWEN_PROJ, "qwen2_moe": _QWEN_PROJ, "mixtral": {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}}
# Reading accepts every family's projection names (the config, not the names, decides).
_READ_PROJ = {
    "gate_proj": "w_gate",
    "up_proj": "w_up",
    "down_proj": "w_down",
    "w1": "w_gate",
    "w3": "w_up",
    "w2": "w_down",
}


def to_hf_state_dict(model: MoEForCausalLM) -> dict[str, torch.Tensor]:
    family = model.config.family
    block, proj = _BLOCK[family], _PROJ[family]
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = plain(t).detach().cpu().contiguous()
        if name.startswith("rotary."):
            continue
        if name == "lm_head.weight":
            if not model.config.tie_word_embeddings:
                out[name] = t
            continue
        parts = name.split(".")
        if parts[0] == "layers" and parts[2] == "mlp" and parts[3] == "experts":
            for e in range(t.shape[0]):
                out[f"model.layers.{parts[1]}.{block}.experts.{e}.{proj[parts[4]]}.weight"] = t[e].clone()
            continue
        if parts[0] == "layers" and parts[2] == "mlp":
            name = ".".join(parts[:2] + [block] + parts[3:])
        out[f"model.{name}"] = t
    return out


def from_hf_state_dict(model: MoEForCausalLM, sd: dict[str, torch.Tensor]) -> None:
    cfg = model.config
    own: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in sd.items():
        if name == "lm_head.weight":
            own[name] = t
            continue
        if not name.startswith("model."):
            raise KeyError(f"unexpected tensor {name!r} in checkpoint")
        parts = name[len("model.") :].split(".")
        if len(parts) > 2 and parts[0] == "layers" and parts[2] in ("mlp", "block_sparse_moe"):
            parts[2] = "mlp"
            if parts[3:5] == ["experts", "gate_up_proj"]:  # transformers 5 in-memory fusion
                gate, up = t.chunk(2, dim=1)  # gate rows first, as HF's forward splits them
                own[f"layers.{parts[1]}.mlp.experts.w_gate"], own[f"layers.{parts[1]}.mlp.experts.w_up"] = gate, up
                continue
            if parts[3:5] == ["experts", "down_proj"]:
                own[f"layers.{parts[1]}.mlp.experts.w_down"] = t
                continue
            if len(parts) == 7 and parts[3] == "experts" and parts[5] in _READ_PROJ:
                experts.setdefault((parts[1], _READ_PROJ[parts[5]]), {})[int(parts[4])] = t
                continue
        own[".".join(parts)] = t
    for (layer, key), per in experts.items():
        if sorted(per) != list(range(cfg.num_experts)):
            raise KeyError(f"layer {layer} {key}: experts {sorted(per)} != 0..{cfg.num_experts - 1}")
        own[f"layers.{layer}.mlp.experts.{key}"] = torch.stack([per[e] for e in range(cfg.num_experts)])
    if cfg.tie_word_embeddings:
        own["lm_head.weight"] = own["embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(own, strict=False)
    missing = [m for m in missing if not m.startswith("rotary.")]
    if missing or unexpected:
        raise KeyError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder: ``model.safetensors`` or the shards its index names."""
    folder = Path(folder)
    if (folder / WEIGHTS_FILE).exists():
        return load_file(str(folder / WEIGHTS_FILE))
    index = json.loads((folder / INDEX_FILE).read_text())
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(folder / shard)))
    return out


def save_checkpoint(model: MoEForCausalLM, folder: str | Path, tokenizer=None) -> Path:
    from kiln.shared.model.tokenizer import save_tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(to_hf_state_dict(model), str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(model.config.to_hf(), indent=2, sort_keys=True))
    if tokenizer is not None:
        save_tokenizer(tokenizer, folder)
    return folder


def load_config_json(folder: str | Path) -> MoEConfig:
    return MoEConfig.from_hf(json.loads((Path(folder) / "config.json").read_text()))


def load_checkpoint(folder: str | Path, model: MoEForCausalLM | None = None) -> MoEForCausalLM:
    """Load weights into ``model`` (in place, keeps optimizer references) or a new model."""
    folder = Path(folder)
    if model is None:
        model = MoEForCausalLM(load_config_json(folder))
    with torch.no_grad():
        from_hf_state_dict(model, read_weights(folder))
    return model
