"""HF-format checkpoint folders: ``model.safetensors`` + ``config.json`` + tokenizer files.

Parameter names on disk are HF ``Qwen3MoeForCausalLM`` names (``model.layers.N...``,
per-expert ``mlp.experts.E.{gate,up,down}_proj.weight``), so vLLM and transformers
load exactly what the learner trained. ``to_hf_state_dict``/``from_hf_state_dict`` are
the only places that know the mapping.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kiln.shared.model.moe import MoEConfig, MoEForCausalLM

WEIGHTS_FILE = "model.safetensors"


def plain(t: torch.Tensor) -> torch.Tensor:
    """The high-precision tensor under a training wrapper (torchao's MXFP8/FP8 weight
    subclasses keep it as ``_data``); plain tensors unchanged."""
    inner = getattr(t, "_data", None)
    return inner if isinstance(inner, torch.Tensor) and type(t) not in (torch.Tensor, torch.nn.Parameter) else t


def to_hf_state_dict(model: MoEForCausalLM) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = plain(t).detach().contiguous()
        if name.startswith("rotary."):
            continue
        if name == "lm_head.weight":
            if not model.config.tie_word_embeddings:
                out[name] = t
            continue
        parts = name.split(".")
        if parts[0] == "layers" and parts[2] == "mlp" and parts[3] == "experts":
            proj = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}[parts[4]]
            for e in range(t.shape[0]):
                out[f"model.layers.{parts[1]}.mlp.experts.{e}.{proj}.weight"] = t[e].clone()
            continue
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
        if len(parts) > 4 and parts[0] == "layers" and parts[3] == "experts":
            experts.setdefault((parts[1], parts[5]), {})[int(parts[4])] = t
            continue
        own[".".join(parts)] = t
    for (layer, proj), per in experts.items():
        if sorted(per) != list(range(cfg.num_experts)):
            raise KeyError(f"layer {layer} {proj}: experts {sorted(per)} != 0..{cfg.num_experts - 1}")
        key = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}[proj]
        own[f"layers.{layer}.mlp.experts.{key}"] = torch.stack([per[e] for e in range(cfg.num_experts)])
    if cfg.tie_word_embeddings:
        own["lm_head.weight"] = own["embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(own, strict=False)
    missing = [m for m in missing if not m.startswith("rotary.")]
    if missing or unexpected:
        raise KeyError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")


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
        from_hf_state_dict(model, load_file(str(folder / WEIGHTS_FILE)))
    return model
