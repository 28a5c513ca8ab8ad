"""One episode of an external harness: the calls it makes, recorded as trainable tokens.

A harness talks OpenAI chat messages; the policy is trained on token ids. ``Episode``
turns each ``/v1/chat/completions`` call into tokens and back without ever tokenizing
text the model generated:

- ``render`` writes a request's messages in the served model's chat format (ChatML turns,
  the tool-call syntax of ``tool_format``). An assistant message that is one this episode
  returned (same prose, same calls) is written as the exact tokens the engine generated
  for it, never re-encoded from its text;
- a call whose rendered prompt starts with the episode's tokens so far (the previous
  prompt and the completion the harness kept) *extends* the trajectory: only the new
  tail is appended, the kept completion's tokens as generated (with their logprobs and
  versions), the rest as context;
- a call that does not (the harness rewrote, truncated or summarised its history) starts
  a new *segment* at the end of the tokens so far, with the reason; segments train
  separately, and a token generated once is trained once (an old completion repeated in
  a new segment's prompt is context there);
- a generation the worker aborts (a new policy version) continues inside the same call
  once the engine serves again: the harness sees latency, the tokens carry the version
  that produced each;
- the budget (tokens generated, calls, deadline) holds whatever the harness does: the
  call that reaches it ends with ``finish_reason = "length"``, later calls get an error.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from tokenizers import Tokenizer

from kiln.shared import chat
from kiln.shared import contracts as c
from kiln.shared.model.tokenizer import special_id
from kiln.shared.toolformats import ToolFormat

from kiln.rollout.engine import InferenceEngine
from kiln.rollout.tokens import Sequence


class EpisodeError(Exception):
    """A call the episode refuses (OpenAI-style: ``code``, HTTP ``status``)."""

    def __init__(self, message: str, code: str, status: int = 400):
        super().__init__(message)
        self.code, self.status = code, status


@dataclass
class Budget:
    max_generated_tokens: int
    max_calls: int
    deadline: float
    """Unix time after which no call is served."""
    max_tokens_per_call: int


@dataclass
class Completion:
    """One choice the engine generated, waiting to be kept by the harness's next call."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stopped: bool
    """Ended by the stop token (which ``ids`` include)."""
    appended: bool = False


@dataclass
class CallRecord:
    """What one call rendered and generated (kept for tests and debugging)."""

    prompt_ids: list[int]
    choices: list[Completion]
    extended: bool
    """Its prompt extended the trajectory; False: it opened a new segment (or was first)."""


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in ("text", None))
    raise EpisodeError(f"message content must be a string or a list of text parts, not {type(content).__name__}", "invalid_content")


def message_calls(m: dict) -> list[tuple[str, dict]]:
    out = []
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or {}
        args = fn.get("arguments") or "{}"
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise EpisodeError(f"tool call {tc.get('id')!r}: arguments are not JSON", "invalid_tool_call") from None
        out.append((fn.get("name", ""), args))
    return out


def assistant_key(content: str | None, calls: list[tuple[str, dict]]) -> str:
    """What identifies an assistant message the episode returned: its prose and its calls."""
    return json.dumps([(content or "").strip(), [[n, a] for n, a in calls]], sort_keys=True, ensure_ascii=False)


class Episode:
    def __init__(
        self,
        episode_id: str,
        engine: InferenceEngine,
        tokenizer: Tokenizer,
        tool_format: ToolFormat,
        budget: Budget,
        *,
        seed: int,
        temperature: float,
        wait_resume: Callable[[], Awaitable[None]],
    ):
        self.id = episode_id
        self.engine = engine
        self.tokenizer = tokenizer
        self.format = tool_format
        self.budget = budget
        self.seed = seed
        self.temperature = temperature
        self.wait_resume = wait_resume
        self.eos = special_id(tokenizer, chat.EOS)
        self.seq = Sequence()
        self.segments: list[c.Segment] = []
        self.completions: dict[str, Completion] = {}
        self.calls: list[CallRecord] = []
        self.generated_tokens = 0
        self.malformed = 0
        self.exhausted = False
        self.lock = asyncio.Lock()
        self._turns: dict[str, list[int]] = {}
        self.last_messages: list[dict] = []
        """The messages of the last call (for the trajectory's transcript)."""

    def enc(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def enc_turn(self, text: str) -> list[int]:
        """A whole rendered turn's ids; each call re-renders the conversation, so a turn
        seen before is not tokenized again (same text, same ids: the turn is complete)."""
        ids = self._turns.get(text)
        if ids is None:
            ids = self._turns[text] = self.enc(text)
        return ids

    def closing(self, comp: Completion) -> list[int]:
        """What follows a generated turn in the chat format (as kiln's own loop writes it)."""
        return self.enc("\n") if comp.stopped else [self.eos, *self.enc("\n")]

    # --- rendering ---------------------------------------------------------------

    def render(self, messages: list[dict], tools: list[dict]) -> tuple[list[int], list[tuple[int, Completion]]]:
        """(prompt ids, [(offset, completion)] of the kept completions written as their tokens)."""
        ids: list[int] = []
        spans: list[tuple[int, Completion]] = []
        instructions = self.format.instructions(tools)
        if instructions and (not messages or messages[0].get("role") not in ("system", "developer")):
            ids += self.enc(f"<|im_start|>system\n{instructions.lstrip()}<|im_end|>\n")
        i = 0
        while i < len(messages):
            m = messages[i]
            role = m.get("role")
            if role in ("system", "developer"):
                ids += self.enc_turn(f"<|im_start|>system\n{_text(m.get('content'))}{instructions}<|im_end|>\n")
            elif role == "user":
                ids += self.enc_turn(chat.render_user(_text(m.get("content"))))
            elif role == "tool":
                results = []
                while i < len(messages) and messages[i].get("role") == "tool":
                    results.append(_text(messages[i].get("content")))
                    i += 1
                ids += self.enc_turn(chat.render_tool_results(results))
                continue
            elif role == "assistant":
                calls = message_calls(m)
                ids += self.enc(chat.assistant_prefix())
                kept = self.completions.get(assistant_key(_text(m.get("content")), calls))
                if kept is not None:
                    spans.append((len(ids), kept))
                    ids += kept.ids + self.closing(kept)
                else:  # history the harness wrote: context, in the model's own syntax
                    ids += self.enc_turn(_text(m.get("content")) + self.format.render(calls) + chat.EOS + "\n")
            else:
                raise EpisodeError(f"message {i}: unknown role {role!r}", "invalid_role")
            i += 1
        return ids + self.enc(chat.assistant_prefix()), spans

    # --- stitching ---------------------------------------------------------------

    def stitch(self, prompt: list[int], spans: list[tuple[int, Completion]]) -> bool:
        """Append the prompt's new tokens; True when it extended the trajectory."""
        n = len(self.seq.ids)
        extends = n > 0 and prompt[:n] == self.seq.ids
        if n and not extends:
            self.finish()  # what the last call generated closes the segment it belongs to
            n = len(self.seq.ids)
            at = next((k for k, (a, b) in enumerate(zip(prompt, self.seq.ids)) if a != b), min(len(prompt), n))
            self.segments.append(c.Segment(start=n, reason=(
                f"call {len(self.calls)}'s prompt does not extend the episode's tokens (it differs at token {at} of {n}): "
                "the harness rewrote, truncated or summarised its history"
            )))  # fmt: skip
        start = n if extends else 0
        pos = start
        for offset, comp in sorted(spans, key=lambda s: s[0]):
            if offset < start:
                continue
            self.seq.context(prompt[pos:offset])
            if comp.appended:
                self.seq.context(comp.ids)
            else:
                self.seq.generated(comp.ids, comp.logprobs, comp.versions)
                comp.appended = True
            pos = offset + len(comp.ids)
        self.seq.context(prompt[pos:])
        return extends

    # --- a call ------------------------------------------------------------------

    def _check_budget(self) -> int:
        b = self.budget
        if self.exhausted or self.generated_tokens >= b.max_generated_tokens:
            raise EpisodeError("the episode's token budget is spent", "budget_exhausted")
        if len(self.calls) >= b.max_calls:
            raise EpisodeError(f"the episode's {b.max_calls} calls are spent", "budget_exhausted")
        if time.time() > b.deadline:
            raise EpisodeError("the episode's deadline has passed", "deadline_exceeded", 408)
        return b.max_generated_tokens - self.generated_tokens

    async def complete(self, messages: list[dict], tools: list[dict], *, n: int, max_tokens: int | None,
                       temperature: float | None) -> list[tuple[Completion, str, list[chat.ParsedCall], str]]:
        """Generate ``n`` choices: (completion, prose, calls, finish reason) each."""
        async with self.lock:
            left = self._check_budget()
            prompt, spans = self.render(messages, tools)
            extended = self.stitch(prompt, spans)
            self.last_messages = messages
            want = min(max_tokens or self.budget.max_tokens_per_call, self.budget.max_tokens_per_call)
            choices = []
            for k in range(n):
                room = min(want, left - sum(len(ch[0].ids) for ch in choices))
                if room <= 0:
                    break
                comp, finish = await self._generate(prompt, room, temperature if temperature is not None else self.temperature,
                                                    self.seed * 7919 + len(self.calls) * 101 + k)  # fmt: skip
                text_ids = comp.ids[:-1] if comp.stopped else comp.ids
                text = self.tokenizer.decode(text_ids, skip_special_tokens=False)
                prose, calls = self.format.parse(text, tools)
                self.malformed += sum(1 for p in calls if p.error)
                good = [(p.name, p.arguments) for p in calls if not p.error]
                if any(p.error for p in calls):
                    prose = text  # a call that does not parse stays visible as text
                self.completions[assistant_key(prose, good)] = comp
                reason = "length" if finish == "length" else ("tool_calls" if good else "stop")
                choices.append((comp, prose, calls, reason))
            self.generated_tokens += sum(len(ch[0].ids) for ch in choices)
            if self.generated_tokens >= self.budget.max_generated_tokens:
                self.exhausted = True
            self.calls.append(CallRecord(prompt, [ch[0] for ch in choices], extended))
            return choices

    async def _generate(self, prompt: list[int], room: int, temperature: float, seed: int) -> tuple[Completion, str]:
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            gen = await self.engine.generate(prompt + ids, room - len(ids), {self.eos}, temperature, seed + len(ids))
            ids += gen.token_ids
            logprobs += gen.logprobs
            versions += gen.versions
            if gen.finish_reason != "abort":
                finish = gen.finish_reason
                break
            if len(ids) >= room:
                finish = "length"
                break
            await self.wait_resume()  # a new version is coming: continue under it, same call
        return Completion(ids, logprobs, versions, stopped=finish == "stop"), finish

    def transcript(self) -> list[c.ChatMessage]:
        """The conversation as the harness last sent it, then the completion it got (for people)."""
        out = []
        for m in self.last_messages:
            calls = [c.ToolCall(id=str(i), name=n, arguments=a) for i, (n, a) in enumerate(message_calls(m))]
            role = "system" if m.get("role") == "developer" else m.get("role", "user")
            out.append(c.ChatMessage(role=role, content=_text(m.get("content")), tool_calls=calls, tool_call_id=m.get("tool_call_id")))
        if self.calls and self.calls[-1].choices:
            comp = self.calls[-1].choices[0]
            text = self.tokenizer.decode(comp.ids[:-1] if comp.stopped else comp.ids, skip_special_tokens=False)
            out.append(c.ChatMessage(role="assistant", content=text, version=comp.versions[-1] if comp.versions else None))
        return out

    def finish(self) -> None:
        """The harness is done: a completion of its last call that no later call kept is
        the end of the trajectory (the first choice, when it asked for several)."""
        if self.calls and self.calls[-1].choices:
            last = self.calls[-1].choices[0]
            if not last.appended:
                self.seq.generated(last.ids, last.logprobs, last.versions)
                last.appended = True
