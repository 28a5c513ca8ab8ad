"""The policy model (needs the ``model`` extra: torch, safetensors, tokenizers)."""

from kiln.shared.model.checkpoint import load_checkpoint, save_checkpoint
from kiln.shared.model.moe import MoEConfig, MoEForCausalLM, sequence_logprobs, token_logprobs

__all__ = ["MoEConfig", "MoEForCausalLM", "load_checkpoint", "save_checkpoint", "sequence_logprobs", "token_logprobs"]
