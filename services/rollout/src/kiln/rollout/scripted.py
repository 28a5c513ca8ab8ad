"""``scripted``: an inference engine that replays given assistant turns, a test double
for the policy (tests of the whole platform against a policy whose actions are known:
the reward attacks run through ``kiln run``, tests/test_attack_run.py).

Invariants: an episode's turn is read from its prompt (the assistant turns it already
holds), so any number of episodes may run at once and a resumed one goes on where it
was; the script is chosen by the call's seed, so the samples of a group play different
scripts; tokens are the version's own tokenizer's encoding of the text plus the
end-of-turn token, with made-up logprobs (never train on them).
"""

from __future__ import annotations

from pathlib import Path

from kiln.rollout.config import ScriptedSettings
from kiln.rollout.engine import Generation, InferenceEngine
from kiln.shared import chat
from kiln.shared.model.tokenizer import load_tokenizer, special_id

LOGPROB = -0.25


class ScriptedEngine(InferenceEngine):
    def __init__(self, settings: ScriptedSettings):
        if not settings.episodes or not all(settings.episodes):
            raise ValueError(
                "rollout.engine = 'scripted' needs [rollout.scripted] episodes, each with at least one turn"
            )
        self.s = settings
        self.version = -1
        self.tokenizer = None
        self._prefix: list[int] = []
        self._eos = -1

    async def load(self, version: int, folder: Path) -> None:
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(folder)
            self._prefix = self.tokenizer.encode(chat.assistant_prefix(), add_special_tokens=False).ids
            self._eos = special_id(self.tokenizer, chat.EOS)
        self.version = version

    def turn_of(self, prompt_ids: list[int]) -> int:
        """The assistant turns before this one: the prompt ends with the current one's prefix."""
        p, n = self._prefix, len(self._prefix)
        return sum(1 for i in range(len(prompt_ids) - n + 1) if prompt_ids[i : i + n] == p) - 1

    async def generate(self, prompt_ids, max_new_tokens, stop_ids, temperature, seed) -> Generation:
        if self.tokenizer is None:
            raise RuntimeError("engine has no weights loaded yet")
        script = self.s.episodes[seed % len(self.s.episodes)]
        text = script[min(max(self.turn_of(list(prompt_ids)), 0), len(script) - 1)]
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids + [self._eos]
        finish = "stop"
        if len(ids) > max_new_tokens:
            ids, finish = ids[:max_new_tokens], "length"
        self.tokens_generated += len(ids)
        return Generation(ids, [LOGPROB] * len(ids), self.version, finish)

    async def abort(self) -> None:
        pass  # a generation returns at once: nothing is ever in flight
