"""One episode as calls of OpenAI chat messages, recorded as trainable tokens.

Every rollout goes through an ``Episode``: kiln's own agent loop (``agent.py``) calls it
directly, an external harness through the worker's OpenAI-compatible endpoint
(``harness/server.py``). A harness talks chat messages; the policy is trained on token
ids. The episode turns each call into tokens and back without ever tokenizing text the
model generated:

- ``render`` writes a request's messages in the served model's chat format (ChatML turns,
  the tool-call syntax of ``tool_format``). An assistant message that is one this episode
  returned (same prose, same calls; the k-th repeat of the same message is the k-th such
  completion) is written as the exact tokens the engine generated for it, never
  re-encoded from its text;
- a call whose rendered prompt starts with the episode's tokens so far (the previous
  prompt and the completion the harness kept) *extends* the trajectory: only the new
  tail is appended, the kept completion's tokens as generated (with their logprobs and
  versions), the rest as context;
- a call that does not (the harness rewrote, truncated or summarised its history) starts
  a new *segment* at the end of the tokens so far, with the reason; segments train
  separately, and a token generated once is trained once (an old completion repeated in
  a new segment's prompt is context there);
- a generation the worker aborts (a new policy version) either continues inside the same
  call once the engine serves again (``wait_resume``: an external harness sees latency
  only), or suspends the episode (no ``wait_resume``: kiln's own loop, APRIL): the call
  stays open, ``snapshot`` holds everything (tokens, segments, kept completions, the
  open call and the tokens it generated so far) and ``Episode.restore`` continues it on
  any worker, the new tokens carrying the versions that produced them;
- the budget (tokens generated, calls, deadline, context length) holds whatever the
  harness does: the call that reaches it ends with ``finish_reason = "length"``, later
  calls get an error; a call whose prompt alone fills the context is refused
  (``context_length_exceeded``) and changes nothing: the harness may shorten its
  history and call again (a new segment).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from kiln.rollout.engine import InferenceEngine
from kiln.rollout.tokens import Sequence
from kiln.shared import chat
from kiln.shared import contracts as c
from kiln.shared.model.tokenizer import special_id
from kiln.shared.toolformats import ToolFormat


class EpisodeError(Exception):
    """A call the episode refuses (OpenAI-style: ``code``, HTTP ``status``)."""

    def __init__(self, message: str, code: str, status: int = 400):
        super().__init__(message)
        self.code, self.status = code, status


class Suspended(Exception):
    """The worker aborted the generation in flight and this episode suspends (it has no
    ``wait_resume``): its call stays open, ``Episode.snapshot`` holds it."""


@dataclass
class Budget:
    max_generated_tokens: int
    max_calls: int
    deadline: float
    """Unix time after which no call is served."""
    max_tokens_per_call: int
    max_context_tokens: int | None = None
    """Prompt plus completion of one call at most this long (None: the engine's limit)."""


@dataclass
class Completion:
    """One choice the engine generated, waiting to be kept by the harness's next call."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stopped: bool
    """Ended by the stop token (which ``ids`` include)."""
    appended: bool = False
    at: int | None = None
    """Offset of its generated tokens in the trajectory, once appended as generated."""


@dataclass
class Choice:
    completion: Completion
    text: str
    """The whole generated text (calls included, stop token not)."""
    prose: str
    """The text without its calls (the whole text when a call did not parse)."""
    calls: list[chat.ParsedCall]
    finish: str
    """OpenAI's ``finish_reason``: ``stop``, ``tool_calls`` or ``length``."""


@dataclass
class CallRecord:
    """What one call rendered and generated (kept for the response, tests and debugging)."""

    prompt_ids: list[int]
    choices: list[Choice]
    extended: bool
    """Its prompt extended the trajectory; False: it opened a new segment (or was first)."""


@dataclass
class OpenCall:
    """A call whose prompt is in the trajectory and whose generation is not done."""

    prompt_start: int
    extended: bool
    max_tokens: int | None
    temperature: float | None
    pending: Completion | None = None
    """What it generated before a suspension."""


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in ("text", None))
    raise EpisodeError(
        f"message content must be a string or a list of text parts, not {type(content).__name__}", "invalid_content"
    )


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


def read_turn(fmt: ToolFormat, text: str, tools: list[dict]) -> tuple[str, list[chat.ParsedCall]]:
    """(prose, calls) of a generated turn as the episode answers it: a call that does not
    parse leaves the whole text as prose, so the harness sees what the model wrote."""
    prose, calls = fmt.parse(text, tools)
    return (text if any(p.error for p in calls) else prose), calls


def as_openai(message: c.ChatMessage, fmt: ToolFormat, tools: list[dict]) -> dict:
    """A message of kiln's own loop (an assistant message holds the whole generated text)
    as the OpenAI message a harness would send back for it."""
    if message.role != "assistant":
        out: dict = {"role": message.role, "content": message.content}
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        return out
    prose, calls = read_turn(fmt, message.content, tools)
    good = [p for p in calls if not p.error]
    return {
        "role": "assistant",
        "content": prose,
        "tool_calls": [
            {"id": p.id, "type": "function", "function": {"name": p.name, "arguments": p.arguments}} for p in good
        ],
    }


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
        wait_resume: Callable[[], Awaitable[None]] | None,
    ):
        self.id = episode_id
        self.engine = engine
        self.tokenizer = tokenizer
        self.format = tool_format
        self.budget = budget
        self.seed = seed
        self.temperature = temperature
        self.wait_resume = wait_resume
        """None: an aborted generation suspends the episode (``Suspended``)."""
        self.eos = special_id(tokenizer, chat.EOS)
        self.seq = Sequence()
        self.segments: list[c.Segment] = []
        self.completions: dict[str, list[Completion]] = {}
        self.calls: list[CallRecord] = []
        """This worker's calls (a restored episode's earlier ones are only counted)."""
        self.ncalls = 0
        self.open: OpenCall | None = None
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
        """What follows a generated turn in the chat format."""
        return self.enc("\n") if comp.stopped else [self.eos, *self.enc("\n")]

    # --- rendering ---------------------------------------------------------------

    def render(self, messages: list[dict], tools: list[dict]) -> tuple[list[int], list[tuple[int, Completion]]]:
        """(prompt ids, [(offset, completion)] of the kept completions written as their tokens)."""
        ids: list[int] = []
        spans: list[tuple[int, Completion]] = []
        seen: dict[str, int] = {}
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
                key = assistant_key(_text(m.get("content")), calls)
                same = self.completions.get(key)
                if same:
                    k = seen[key] = seen.get(key, -1) + 1
                    kept = same[min(k, len(same) - 1)]
                    spans.append((len(ids), kept))
                    ids += kept.ids + self.closing(kept)
                else:  # history the harness wrote: context, in the model's own syntax
                    ids += self.enc_turn(_text(m.get("content")) + self.format.render(calls) + chat.EOS + "\n")
            else:
                raise EpisodeError(f"message {i}: unknown role {role!r}", "invalid_role")
            i += 1
        return ids + self.enc(chat.assistant_prefix()), spans

    # --- stitching ---------------------------------------------------------------

    def _append_generated(self, comp: Completion) -> None:
        comp.at = len(self.seq.ids)
        self.seq.generated(comp.ids, comp.logprobs, comp.versions)
        comp.appended = True

    def stitch(self, prompt: list[int], spans: list[tuple[int, Completion]]) -> bool:
        """Append the prompt's new tokens; True when it extended the trajectory."""
        # A prompt extends the current segment (the tokens since the last restart), not
        # the whole trajectory: after one rewrite, later calls extend the new segment.
        base = self.segments[-1].start if self.segments else 0
        current = self.seq.ids[base:]
        n = len(current)
        extends = n > 0 and prompt[:n] == current
        if n and not extends:
            self.finish()  # what the last call generated closes the segment it belongs to
            current = self.seq.ids[base:]
            n = len(current)
            at = next((k for k, (a, b) in enumerate(zip(prompt, current)) if a != b), min(len(prompt), n))
            self.segments.append(
                c.Segment(
                    start=len(self.seq.ids),
                    reason=(
                        f"call {self.ncalls}'s prompt does not extend the episode's tokens (it differs at token {at} of {n}): "
                        "the harness rewrote, truncated or summarised its history"
                    ),
                )
            )
        start = n if extends else 0
        pos = start
        for offset, comp in sorted(spans, key=lambda s: s[0]):
            if offset < start:
                continue
            self.seq.context(prompt[pos:offset])
            if comp.appended:
                self.seq.context(comp.ids)
            else:
                self._append_generated(comp)
            pos = offset + len(comp.ids)
        self.seq.context(prompt[pos:])
        return extends

    # --- a call ------------------------------------------------------------------

    def _check_budget(self) -> None:
        b = self.budget
        if self.exhausted or self.generated_tokens >= b.max_generated_tokens:
            raise EpisodeError("the episode's token budget is spent", "budget_exhausted")
        if self.ncalls >= b.max_calls:
            raise EpisodeError(f"the episode's {b.max_calls} calls are spent", "budget_exhausted")
        if time.time() > b.deadline:
            raise EpisodeError("the episode's deadline has passed", "deadline_exceeded", 408)

    async def complete(
        self,
        messages: list[dict],
        tools: list[dict],
        *,
        n: int = 1,
        max_tokens: int | None = None,
        temperature: float | None = None,
    ) -> CallRecord:
        """A whole call: its prompt into the trajectory, then ``n`` choices generated."""
        async with self.lock:
            self._check_budget()
            self.open_call(messages, tools, max_tokens=max_tokens, temperature=temperature, refuse_full=True)
            return await self.generate(tools, n=n)

    def open_call(
        self,
        messages: list[dict],
        tools: list[dict],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        refuse_full: bool = False,
    ) -> None:
        """Render the call's messages and stitch its prompt into the trajectory. With
        ``refuse_full`` a prompt that leaves no room in the context (``room``) is refused
        before any of it is, as a server refuses it (kiln's own loop ends instead)."""
        if self.open is not None:
            raise RuntimeError("a call is already open")
        prompt, spans = self.render(messages, tools)
        limit = self.budget.max_context_tokens
        if refuse_full and limit is not None and limit - len(prompt) - 1 <= 0:
            raise EpisodeError(
                f"the prompt is {len(prompt)} tokens: no room for a completion in the episode's context of {limit}",
                "context_length_exceeded",
            )
        extended = self.stitch(prompt, spans)
        self.last_messages = messages
        self.open = OpenCall(
            prompt_start=self.segments[-1].start if self.segments else 0,
            extended=extended,
            max_tokens=max_tokens,
            temperature=temperature,
        )

    def room(self) -> int:
        """Tokens the open call's completion may have in all (its pending ones included)."""
        assert self.open is not None
        b = self.budget
        room = min(
            self.open.max_tokens or b.max_tokens_per_call,
            b.max_tokens_per_call,
            b.max_generated_tokens - self.generated_tokens,
        )
        if b.max_context_tokens is not None:
            room = min(room, b.max_context_tokens - (len(self.seq.ids) - self.open.prompt_start) - 1)
        return room

    def pending_tokens(self) -> int:
        return len(self.open.pending.ids) if self.open is not None and self.open.pending is not None else 0

    def oldest(self) -> int | None:
        """The oldest policy version among the generated tokens, those of an open call included."""
        versions = [v for v, m in zip(self.seq.versions, self.seq.mask) if m]
        if self.open is not None and self.open.pending is not None:
            versions += self.open.pending.versions
        return min(versions) if versions else None

    async def generate(self, tools: list[dict], *, n: int = 1) -> CallRecord:
        """Finish the open call: ``n`` choices (fewer when the budget runs out first)."""
        call = self.open
        if call is None:
            raise RuntimeError("no call is open")
        if n > 1 and self.wait_resume is None:
            raise ValueError("an episode that suspends generates one choice per call")
        prompt = self.seq.ids[call.prompt_start :]
        temperature = call.temperature if call.temperature is not None else self.temperature
        choices: list[Choice] = []
        for k in range(n):
            spent = sum(len(ch.completion.ids) for ch in choices)
            room = self.room() - spent
            if room <= 0 and not (k == 0 and call.pending is not None):
                break
            comp, finish = await self._generate(
                prompt, room, temperature, self.seed * 7919 + self.ncalls * 101 + k, call.pending if k == 0 else None
            )
            text = self.tokenizer.decode(comp.ids[:-1] if comp.stopped else comp.ids, skip_special_tokens=False)
            prose, calls = read_turn(self.format, text, tools)
            self.malformed += sum(1 for p in calls if p.error)
            good = [(p.name, p.arguments) for p in calls if not p.error]
            self.completions.setdefault(assistant_key(prose, good), []).append(comp)
            reason = "length" if finish == "length" else ("tool_calls" if good else "stop")
            choices.append(Choice(comp, text, prose, calls, reason))
        self.open = None
        self.generated_tokens += sum(len(ch.completion.ids) for ch in choices)
        if self.generated_tokens >= self.budget.max_generated_tokens:
            self.exhausted = True
        record = CallRecord(prompt, choices, call.extended)
        self.calls.append(record)
        self.ncalls += 1
        return record

    async def _generate(
        self, prompt: list[int], room: int, temperature: float, seed: int, pending: Completion | None
    ) -> tuple[Completion, str]:
        ids = list(pending.ids) if pending else []
        logprobs = list(pending.logprobs) if pending else []
        versions = list(pending.versions) if pending else []
        finish = "length"
        while len(ids) < room:
            gen = await self.engine.generate(prompt + ids, room - len(ids), {self.eos}, temperature, seed + len(ids))
            ids += gen.token_ids
            logprobs += gen.logprobs
            versions += gen.versions
            if gen.finish_reason != "abort":
                finish = gen.finish_reason
                break
            if len(ids) >= room:
                break
            if self.wait_resume is None:
                assert self.open is not None
                self.open.pending = Completion(ids, logprobs, versions, stopped=False)
                raise Suspended(f"aborted after {len(ids)} tokens")
            await self.wait_resume()  # a new version is coming: continue under it, same call
        return Completion(ids, logprobs, versions, stopped=finish == "stop"), finish

    # --- the end, and moving to another worker -------------------------------------

    def transcript(self) -> list[c.ChatMessage]:
        """The conversation as the harness last sent it, then the completion it got (for people)."""
        out = []
        for m in self.last_messages:
            calls = [c.ToolCall(id=str(i), name=n, arguments=a) for i, (n, a) in enumerate(message_calls(m))]
            role = "system" if m.get("role") == "developer" else m.get("role", "user")
            out.append(
                c.ChatMessage(
                    role=role, content=_text(m.get("content")), tool_calls=calls, tool_call_id=m.get("tool_call_id")
                )
            )
        if self.calls and self.calls[-1].choices:
            ch = self.calls[-1].choices[0]
            out.append(
                c.ChatMessage(
                    role="assistant",
                    content=ch.text,
                    version=ch.completion.versions[-1] if ch.completion.versions else None,
                )
            )
        return out

    def finish(self, *, close: bool = False) -> None:
        """The harness is done: a completion of its last call that no later call kept is
        the end of the trajectory (the first choice, when it asked for several), followed
        by its closing tokens with ``close``; a call left open keeps what it generated."""
        if self.open is not None:
            if self.open.pending is not None:
                self._append_generated(self.open.pending)
            self.open = None
            return
        if self.calls and self.calls[-1].choices:
            last = self.calls[-1].choices[0].completion
            if not last.appended:
                self._append_generated(last)
                if close:
                    self.seq.context(self.closing(last))

    def snapshot(self) -> tuple[Sequence, int, c.EpisodeState]:
        """(tokens, how many of the last are the open call's generation so far, state):
        everything ``restore`` needs to continue this episode elsewhere."""
        seq = Sequence(list(self.seq.ids), list(self.seq.logprobs), list(self.seq.versions), list(self.seq.mask))
        pending = self.open.pending if self.open is not None else None
        if pending is not None:
            seq.generated(pending.ids, pending.logprobs, pending.versions)
        kept = []
        for key, comps in self.completions.items():
            for comp in comps:
                if comp.at is not None:
                    kept.append(c.KeptCompletion(key=key, stopped=comp.stopped, at=comp.at, length=len(comp.ids)))
                else:
                    kept.append(
                        c.KeptCompletion(
                            key=key,
                            stopped=comp.stopped,
                            length=len(comp.ids),
                            ids=comp.ids,
                            logprobs=comp.logprobs,
                            versions=comp.versions,
                        )
                    )
        o = self.open
        state = c.EpisodeState(
            segments=self.segments,
            calls=self.ncalls,
            generated_tokens=self.generated_tokens,
            malformed=self.malformed,
            completions=kept,
            open_call=None
            if o is None
            else c.OpenCall(
                prompt_start=o.prompt_start, extended=o.extended, max_tokens=o.max_tokens, temperature=o.temperature
            ),
        )
        return seq, len(pending.ids) if pending else 0, state

    def restore(self, partial: c.PartialSample) -> None:
        """Continue from a snapshot taken on any worker (this episode must be fresh)."""
        cut = len(partial.token_ids) - partial.turn_tokens
        self.seq = Sequence(
            partial.token_ids[:cut], partial.logprobs[:cut], partial.token_versions[:cut], partial.loss_mask[:cut]
        )
        pending = None
        if partial.turn_tokens:
            pending = Completion(
                partial.token_ids[cut:], partial.logprobs[cut:], partial.token_versions[cut:], stopped=False
            )
        st = partial.episode
        if st is None:  # suspended by an older worker: its call was open, its completions unknown
            self.ncalls = partial.num_turns
            self.open = OpenCall(prompt_start=0, extended=True, max_tokens=None, temperature=None, pending=pending)
            return
        self.segments = list(st.segments)
        self.ncalls, self.generated_tokens, self.malformed = st.calls, st.generated_tokens, st.malformed
        for k in st.completions:
            if k.at is not None:
                s = slice(k.at, k.at + k.length)
                comp = Completion(
                    self.seq.ids[s], self.seq.logprobs[s], self.seq.versions[s], k.stopped, appended=True, at=k.at
                )
            else:
                comp = Completion(list(k.ids), list(k.logprobs), list(k.versions), k.stopped)
            self.completions.setdefault(k.key, []).append(comp)
        if st.open_call is not None:
            o = st.open_call
            self.open = OpenCall(o.prompt_start, o.extended, o.max_tokens, o.temperature, pending)
