"""The policy model (needs the ``model`` extra: torch, safetensors, tokenizers)."""

from kiln.shared.model.checkpoint import load_checkpoint, load_config_json, save_checkpoint
from kiln.shared.model.experts import GroupedExperts
from kiln.shared.model.moe import FAMILIES, MoEConfig, MoEForCausalLM, sequence_logprobs, token_logprobs
from kiln.shared.model.upcycle import upcycle_checkpoint

__all__ = [
    "FAMILIES",
    "GroupedExperts",
    "MoEConfig",
    "MoEForCausalLM",
    "load_checkpoint",
    "load_config_json",
    "save_checkpoint",
    "sequence_logprobs",
    "token_logprobs",
    "upcycle_checkpoint",
]
