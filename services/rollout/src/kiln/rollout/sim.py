"""``sim``: an inference engine without a model, for benchmarks and scheduling tests.

It behaves like a batched decoder: every ``step_s`` each of the first ``max_batch``
sequences in flight gets one token (continuous batching, first come first served), so
throughput grows with concurrency up to ``max_batch`` and a long sequence holds its slot
for as long as it decodes. Lengths are lognormal (``length_median``, ``length_sigma``;
p99/p50 = exp(2.326 * sigma)), drawn from the call's seed, so the same seeds give the
same lengths in every mode being compared.

Invariants (the same as every engine's): each token is tagged with the version that
was loaded when it was produced (``load`` pauses decoding for ``load_s``, then later
tokens carry the new version, like vLLM's ``pause_generation(mode="keep")``), and an
``abort`` returns every generation in flight with the tokens it has.

Never the default engine: its tokens are random ids and its logprobs are made up.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from kiln.rollout.config import SimSettings
from kiln.rollout.engine import Generation, InferenceEngine


@dataclass
class _Seq:
    target: int
    budget: int
    stop_id: int | None
    rng: random.Random
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: asyncio.Future | None = None


class SimEngine(InferenceEngine):
    def __init__(self, settings: SimSettings):
        self.s = settings
        self.version = -1
        self._active: list[_Seq] = []
        self._ticker: asyncio.Task | None = None
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self.tokens_generated = 0
        self.busy_steps = 0
        """Decode steps that produced at least one token (the engine's busy time / step_s)."""

    def length_for(self, seed: int) -> int:
        rng = random.Random(seed)
        return max(1, int(math.ceil(rng.lognormvariate(math.log(self.s.length_median), self.s.length_sigma))))

    async def generate(self, prompt_ids, max_new_tokens, stop_ids, temperature, seed) -> Generation:
        if self.version < 0:
            raise RuntimeError("engine has no weights loaded yet")
        loop = asyncio.get_running_loop()
        rng = random.Random(seed)
        target = self.length_for(seed)
        seq = _Seq(target, max_new_tokens, min(stop_ids) if stop_ids else None, rng, done=loop.create_future())
        if max_new_tokens <= 0:
            return Generation([], [], self.version, "length")
        self._active.append(seq)
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick())
        reason = await seq.done
        return Generation(
            seq.tokens, seq.logprobs, seq.versions[-1] if seq.versions else self.version, reason, list(seq.versions)
        )

    async def _tick(self) -> None:
        while self._active:
            await self._unpaused.wait()
            await asyncio.sleep(self.s.step_s)
            if not self._unpaused.is_set():
                continue  # a load began during the step: its tokens belong to the next version
            produced = False
            for seq in list(self._active[: self.s.max_batch]):
                if seq.done.done():
                    continue
                last = len(seq.tokens) + 1 >= seq.target
                tok = (
                    seq.stop_id
                    if last and seq.stop_id is not None
                    else seq.rng.randrange(self.s.token_low, self.s.token_high)
                )
                seq.tokens.append(tok)
                seq.logprobs.append(-seq.rng.expovariate(1.0))
                seq.versions.append(self.version)
                self.tokens_generated += 1
                produced = True
                if last or len(seq.tokens) >= seq.budget:
                    self._finish(seq, "stop" if last and seq.stop_id is not None else "length")
            self.busy_steps += produced

    def _finish(self, seq: _Seq, reason: str) -> None:
        if seq in self._active:
            self._active.remove(seq)
        if not seq.done.done():
            seq.done.set_result(reason)

    async def load(self, version: int, folder: Path) -> None:
        self._unpaused.clear()
        try:
            await asyncio.sleep(self.s.load_s)
            self.version = version
        finally:
            self._unpaused.set()

    async def abort(self) -> None:
        for seq in list(self._active):
            self._finish(seq, "abort")
