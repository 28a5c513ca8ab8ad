"""Inference engines behind one interface.

``InferenceEngine``: ``generate`` continues a token sequence and returns the new tokens
with their logprobs and the policy version that produced them; ``load`` swaps in a
new version. Invariant: one ``generate`` call runs under one version (a weight swap
waits for it), so the version tag of every token is exact.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.shared.model import MoEForCausalLM, load_checkpoint
from kiln.shared.model.checkpoint import from_hf_state_dict
from kiln.shared.model.moe import token_logprobs


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: str
    """``stop`` (a stop token was generated, included) or ``length``."""


class InferenceEngine(ABC):
    version: int = -1

    @abstractmethod
    async def generate(
        self, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int], temperature: float, seed: int
    ) -> Generation: ...

    @abstractmethod
    async def load(self, version: int, folder: Path) -> None: ...


class TorchEngine(InferenceEngine):
    """The shared policy model in this process, with a KV cache per call."""

    def __init__(self, threads: int = 1):
        torch.set_num_threads(threads)
        self.model: MoEForCausalLM | None = None
        self.version = -1
        self._lock = threading.Lock()

    async def load(self, version: int, folder: Path) -> None:
        def _load():
            model = load_checkpoint(folder).eval()
            with self._lock:
                self.model, self.version = model, version

        await asyncio.to_thread(_load)

    async def load_state(self, version: int, state: dict) -> None:
        """A version that arrived as tensors (HF names), e.g. by broadcast."""

        def _load():
            if self.model is None:
                raise RuntimeError("load a checkpoint folder first: it carries the model's config")
            model = MoEForCausalLM(self.model.config)
            with torch.no_grad():
                from_hf_state_dict(model, state)
            with self._lock:
                self.model, self.version = model.eval(), version

        await asyncio.to_thread(_load)

    async def generate(self, prompt_ids, max_new_tokens, stop_ids, temperature, seed) -> Generation:
        if self.model is None:
            raise RuntimeError("engine has no weights loaded yet")
        return await asyncio.to_thread(self._generate, list(prompt_ids), max_new_tokens, stop_ids, temperature, seed)

    @torch.no_grad()
    def _generate(self, prompt_ids, max_new_tokens, stop_ids, temperature, seed) -> Generation:
        with self._lock:
            model, version = self.model, self.version
            g = torch.Generator().manual_seed(seed)
            cache = [[] for _ in model.layers]
            logits, _ = model(torch.tensor([prompt_ids]), cache=cache)
            last = logits[0, -1]
            pos = len(prompt_ids)
            out, lps, reason = [], [], "length"
            for _ in range(max_new_tokens):
                probs = torch.softmax(last.float() / temperature, dim=-1)
                tok = int(torch.multinomial(probs, 1, generator=g))
                out.append(tok)
                lps.append(float(token_logprobs(last[None], torch.tensor([tok]), temperature)[0]))
                if tok in stop_ids:
                    reason = "stop"
                    break
                logits, _ = model(torch.tensor([[tok]]), cache=cache, start_pos=pos)
                pos += 1
                last = logits[0, -1]
            return Generation(out, lps, version, reason)
