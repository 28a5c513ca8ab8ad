"""Inference engines behind one interface.

``InferenceEngine``: ``generate`` continues a token sequence and returns the new tokens
with their logprobs and, token by token, the policy version that produced them;
``load`` swaps in a new version (``load_state`` from tensors, where the engine can;
engines that receive in place, ``VllmEngine``, also implement
``kiln.shared.weights.transport.base.InPlaceTransferEngine``); ``abort`` makes every ``generate`` in flight return at
once with what it has (``finish_reason = "abort"``); ``tokens_generated`` counts the
tokens sampled so far as they come (a generation in flight moves it).

Invariants:
- the version tag of every token is exact: an engine that swaps weights in the middle
  of a generation (vLLM with ``pause_generation(mode="keep")``, ``sim``) tags the tokens
  after the swap with the new version;
- logprobs are the behaviour policy's, at the sampling temperature, as the engine
  computed them (never recomputed: engines are not bit-stable across reloads);
- an aborted generation keeps its tokens: nothing sampled is lost, the caller decides
  whether to resume from it or discard it;
- an engine that cannot go on raises ``EngineDead`` (never a per-request error that
  would have every message this worker takes fail and be dead-lettered).

Implementations: ``TorchEngine`` (the shared model in-process), ``VllmEngine``
(``kiln.rollout.vllm_engine``), ``SimEngine`` (``kiln.rollout.sim``: no model, timing
and lengths from config, for benchmarks and scheduling tests only).
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
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
    """Version at the end of the generation (of its last token)."""
    finish_reason: str
    """``stop`` (a stop token was generated, included), ``length`` or ``abort``."""
    versions: list[int] = field(default_factory=list)
    """Per-token versions; empty = every token is ``version``."""

    def __post_init__(self) -> None:
        if not self.versions:
            self.versions = [self.version] * len(self.token_ids)
        if not (len(self.versions) == len(self.logprobs) == len(self.token_ids)):
            raise ValueError("token_ids, logprobs and versions must have equal length")


class EngineDead(RuntimeError):
    """The engine can serve nothing more in this process (it failed to start, or its core
    died): the worker stops (``ServiceContext.fail``) and its work goes to other replicas."""


class InferenceEngine(ABC):
    version: int = -1
    tokens_generated: int = 0
    """Tokens sampled so far, every request together, counted as they are produced (not
    when a generation returns): throughput, and progress while a generation is in flight."""

    @abstractmethod
    async def generate(
        self, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int], temperature: float, seed: int
    ) -> Generation: ...

    @abstractmethod
    async def load(self, version: int, folder: Path) -> None:
        """Serve the verified checkpoint ``folder`` as ``version`` (every weight transport)."""

    async def load_state(self, version: int, state: dict) -> None:
        """Serve ``version`` from host tensors with HF names (the ``torch-broadcast``
        transport; ``kiln.shared.weights.transport.base.TensorEngine``). Engines that take
        only folders refuse it; ``weights.transport`` is checked against ``rollout.engine``
        before either starts, so a run never gets here."""
        raise NotImplementedError(f"{type(self).__name__} loads versions from files only")

    @abstractmethod
    async def abort(self) -> None:
        """Every ``generate`` in flight returns now with its tokens (``abort``)."""

    async def close(self) -> None:
        """Release the engine's resources (processes, memory)."""


class TorchEngine(InferenceEngine):
    """The shared policy model in this process, with a KV cache per call."""

    def __init__(self, threads: int = 1):
        torch.set_num_threads(threads)
        self.model: MoEForCausalLM | None = None
        self.version = -1
        self.tokens_generated = 0
        self._lock = threading.Lock()
        self._abort = 0  # generation counter: a generate started before an abort stops

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
        epoch = self._abort
        return await asyncio.to_thread(
            self._generate, list(prompt_ids), max_new_tokens, stop_ids, temperature, seed, epoch
        )

    async def abort(self) -> None:
        self._abort += 1

    @torch.no_grad()
    def _generate(self, prompt_ids, max_new_tokens, stop_ids, temperature, seed, epoch: int = 0) -> Generation:
        with self._lock:
            if self._abort != epoch:
                return Generation([], [], self.version, "abort")
            model, version = self.model, self.version
            g = torch.Generator().manual_seed(seed)
            cache = [[] for _ in model.layers]
            logits, _ = model(torch.tensor([prompt_ids]), cache=cache)
            last = logits[0, -1]
            pos = len(prompt_ids)
            out, lps, reason = [], [], "length"
            for _ in range(max_new_tokens):
                if self._abort != epoch:
                    reason = "abort"
                    break
                if temperature <= 0:  # greedy (evaluation); its logprob is the untempered one
                    tok = int(torch.argmax(last))
                    lps.append(float(token_logprobs(last[None], torch.tensor([tok]), 1.0)[0]))
                else:
                    probs = torch.softmax(last.float() / temperature, dim=-1)
                    tok = int(torch.multinomial(probs, 1, generator=g))
                    lps.append(float(token_logprobs(last[None], torch.tensor([tok]), temperature)[0]))
                out.append(tok)
                self.tokens_generated += 1
                if tok in stop_ids:
                    reason = "stop"
                    break
                logits, _ = model(torch.tensor([[tok]]), cache=cache, start_pos=pos)
                pos += 1
                last = logits[0, -1]
            return Generation(out, lps, version, reason)
