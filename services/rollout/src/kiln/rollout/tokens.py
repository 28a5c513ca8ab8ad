"""A trajectory's token arrays as they grow (shared by kiln's own loop and the harness endpoint).

Invariant: the four arrays stay parallel; context tokens (prompt, observations) carry
mask 0, logprob 0 and version -1; generated tokens mask 1 with the logprob and version
the engine reported for each."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sequence:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)

    def context(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.mask += [0] * len(ids)

    def generated(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.mask += [1] * len(ids)

    def oldest(self) -> int | None:
        """The oldest policy version among the generated tokens (None: none yet)."""
        gen = [v for v, m in zip(self.versions, self.mask) if m]
        return min(gen) if gen else None
