"""The policy model (needs the ``model`` extra: torch, safetensors, tokenizers).

Names are imported on first use, so that ``kiln.shared.model.config`` (torch-free: the
settings derive ``[model]`` from it) can be read without torch."""

from importlib import import_module

_WHERE = {
    "load_checkpoint": "checkpoint",
    "load_config_json": "checkpoint",
    "save_checkpoint": "checkpoint",
    "GroupedExperts": "experts",
    "FAMILIES": "config",
    "MoEArchitecture": "config",
    "MoEConfig": "config",
    "MoEForCausalLM": "moe",
    "sequence_logprobs": "moe",
    "token_logprobs": "moe",
    "upcycle_checkpoint": "upcycle",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
