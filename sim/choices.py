"""The choices of one OpenAI request, and what vLLM's serving layer makes of their engine outputs.

vLLM runs a request with ``n`` choices and several prompts as several engine requests (each
prompt ``n`` times, sharing the prompt's tokens); the serving layer numbers them ``index = prompt
* n + choice`` and turns their outputs into choices, stream chunks, logprobs, echoes and usage.
``Generation`` does the same for the simulator's ``SimRequest``s: it only reads them (the engine
writes them), and produces dicts for ``shapes`` to encode. No I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvflow.sim import shapes
from kvflow.sim.request import SimRequest, Status
from kvflow.sim.sampler import Sampler
from kvflow.sim.shapes import Delta, TokenLogprobs
from kvflow.sim.validation import Prompt, Sampling
from kvflow.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Options:
    """What the request asks of the answer (beyond sampling)."""

    chat: bool
    stream: bool = False
    echo: bool = False
    return_token_ids: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    role: str = "assistant"
    echo_text: str = ""
    """Chat: the last message's content, echoed when its role is the answer's role."""


@dataclass(slots=True)
class Choice:
    index: int
    prompt_index: int
    prompt: Prompt
    sampling: Sampling
    req: SimRequest
    sent_text: int = 0
    sent_tokens: int = 0
    text_offset: int = 0
    started: bool = False
    finished_sent: bool = False

    @property
    def text(self) -> str:
        """The output text; with ``include_stop_str_in_output`` the stop string stays in."""
        r = self.req
        if self.sampling.include_stop_str_in_output and r.finish_reason == "stop" and isinstance(r.stop_reason, str):
            return r.text + r.stop_reason
        return r.text


@dataclass(slots=True)
class Generation:
    options: Options
    choices: list[Choice]
    tokenizer: Tokenizer
    sampler: Sampler
    prompts: list[Prompt] = field(default_factory=list)
    plain: bool = field(init=False)
    """Chunks carry only new text (no echo, token ids, logprobs or usage): the byte templates."""

    def __post_init__(self) -> None:
        o = self.options
        self.plain = not (o.echo or o.return_token_ids or o.continuous_usage
                          or any(c.sampling.logprobs is not None or c.sampling.include_stop_str_in_output
                                 for c in self.choices))

    @property
    def finished(self) -> bool:
        for c in self.choices:
            if c.req.status is not Status.FINISHED:
                return False
        return True

    @property
    def requests(self) -> list[SimRequest]:
        return [c.req for c in self.choices]

    def max_output(self) -> int:
        return max(len(c.req.output_ids) for c in self.choices)

    # -- logprobs ----------------------------------------------------------------------------
    def _token(self, token_id: int, *, special: bool = False) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=not special)

    def _entry(self, token_id: int, position: int, k: int, *, special: bool = False) -> TokenLogprobs:
        chosen, *alts = self.sampler.logprobs(token_id, position, max(k, 0))
        top = ((self._token(chosen.token_id, special=special), chosen.logprob),
               *((self._token(a.token_id), a.logprob) for a in alts))
        return TokenLogprobs(top[0][0], chosen.logprob, top)

    def _output_entries(self, c: Choice, start: int, end: int) -> list[TokenLogprobs]:
        k = c.sampling.logprobs or 0
        base = len(c.prompt.token_ids)
        return [self._entry(t, base + start + j, k) for j, t in enumerate(c.req.output_ids[start:end])]

    def _prompt_entries(self, c: Choice, k: int) -> list[TokenLogprobs]:
        ids = c.prompt.token_ids
        first = TokenLogprobs(self._token(ids[0], special=True), None, None)
        return [first, *(self._entry(t, p, k, special=True) for p, t in enumerate(ids[1:], 1))]

    def prompt_logprobs(self, c: Choice) -> list[Any] | None:
        """vLLM's ``prompt_logprobs``: per prompt position, the token and the k best, by token id."""
        k = c.sampling.prompt_logprobs
        if k is None:
            return None
        out: list[Any] = [None]
        for p, t in enumerate(c.prompt.token_ids[1:], 1):
            ranked = self.sampler.logprobs(t, p, k)
            out.append({str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                           "decoded_token": self._token(lp.token_id, special=True)}
                        for lp in ranked})
        return out

    def _logprobs(self, c: Choice, start: int, end: int, *, echo_prompt: bool) -> dict[str, Any] | None:
        k = c.sampling.logprobs
        if k is None:
            return None
        entries = self._output_entries(c, start, end)
        if self.options.chat:
            return shapes.chat_logprobs(entries, k)
        if echo_prompt:
            entries = self._prompt_entries(c, k) + entries
        body = shapes.completion_logprobs(entries, c.text_offset)
        if entries:
            c.text_offset = body["text_offset"][-1] + len(entries[-1].token)
        return body

    # -- whole answers ----------------------------------------------------------------------------
    def usage(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens): every prompt once, every choice's output."""
        prompt = sum(len(p.token_ids) for p in self.prompts)
        return prompt, sum(len(c.req.output_ids) for c in self.choices)

    def body(self, head: shapes.Head) -> dict[str, Any]:
        o = self.options
        use = shapes.usage(*self.usage())
        kv = self.choices[0].req.kv_transfer_out
        if o.chat:
            choices = [shapes.chat_choice(c.index, o.role, (o.echo_text if o.echo else "") + c.text,
                                          c.req.finish_reason, c.req.stop_reason,
                                          logprobs=self._logprobs(c, 0, len(c.req.output_ids), echo_prompt=False),
                                          token_ids=list(c.req.output_ids) if o.return_token_ids else None)
                       for c in self.choices]
            first = self.choices[0]
            return shapes.chat_completion(
                head, choices, use, prompt_logprobs=self.prompt_logprobs(first),
                prompt_token_ids=list(first.prompt.token_ids) if o.return_token_ids else None, kv_transfer_params=kv)
        out = []
        for c in self.choices:
            echo_only = self._echo_only(c)
            text = "" if echo_only else c.text
            if o.echo:
                text = ("" if o.return_token_ids else c.prompt.text) + text
            out.append(shapes.completion_choice(
                c.index, text, c.req.finish_reason, c.req.stop_reason,
                logprobs=self._logprobs(c, 0, 0 if echo_only else len(c.req.output_ids), echo_prompt=o.echo),
                token_ids=list(c.req.output_ids) if o.return_token_ids else None,
                prompt_logprobs=self.prompt_logprobs(c),
                prompt_token_ids=list(c.prompt.token_ids) if o.return_token_ids else None))
        return shapes.completion(head, out, use, kv)

    def _echo_only(self, c: Choice) -> bool:
        """``echo`` with ``max_tokens: 0``: vLLM runs one step but answers with the prompt alone."""
        return self.options.echo and c.sampling.echo_only

    # -- streams ---------------------------------------------------------------------------------
    def opening(self, fmt: shapes.StreamFormat) -> Iterator[bytes]:
        """Chat: each choice's role chunk (and echo chunk) before any token."""
        o = self.options
        if not o.chat:
            return
        first = self.choices[0]
        prompt_tokens = len(first.prompt.token_ids)
        use = shapes.chat_chunk_usage(prompt_tokens, 0) if o.continuous_usage else None
        ids = list(first.prompt.token_ids) if o.return_token_ids else None
        for c in self.choices:
            yield fmt.role(c.index, o.role, prompt_token_ids=ids, usage=use)
        if o.echo and o.echo_text:
            for c in self.choices:
                yield fmt.echo(c.index, o.echo_text, usage=use)

    def chunks(self, fmt: shapes.StreamFormat, holdback: int) -> tuple[bytes, bool]:
        """A chunk for every choice with new output since the last call, in index order; and
        whether every choice has finished."""
        out = b""
        plain = self.plain
        done = True
        for c in self.choices:
            r = c.req
            n = len(r.output_ids)
            finished = r.status is Status.FINISHED
            done = done and finished
            if c.finished_sent or (n == c.sent_tokens and not finished):
                continue
            text = r.text if plain else c.text
            end = len(text) if finished else max(c.sent_text, len(text) - holdback)
            delta, start = text[c.sent_text:end], c.sent_tokens
            c.sent_text, c.sent_tokens = end, n
            if plain and not finished:  # the hot path: only new text
                out += fmt.plain(c.index, delta)
            else:
                out += fmt.chunk(self._delta(c, delta, start, n))
        return out, done

    def _delta(self, c: Choice, text: str, start: int, n: int) -> Delta:
        o, r = self.options, c.req
        d = Delta(c.index, text)
        if not c.started:
            c.started = True
            if o.echo and not o.chat:
                prompt_text = "" if o.return_token_ids else c.prompt.text
                d.text = prompt_text if self._echo_only(c) else prompt_text + text
                d.prompt_token_ids = list(c.prompt.token_ids)
            elif o.return_token_ids and not o.chat:
                d.prompt_token_ids = list(c.prompt.token_ids)
        if o.return_token_ids:
            d.token_ids = list(r.output_ids[start:n])
        d.logprobs = self._logprobs(c, start, start if self._echo_only(c) else n, echo_prompt=o.echo and start == 0)
        if o.continuous_usage:
            d.usage = (shapes.chat_chunk_usage if o.chat else shapes.short_usage)(len(c.prompt.token_ids), n)
        if r.finished:
            c.finished_sent = True
            d.finish_reason, d.stop_reason = r.finish_reason or "abort", r.stop_reason
            d.fingerprint = not o.include_usage
        return d

    def closing(self, fmt: shapes.StreamFormat) -> bytes:
        if not self.options.include_usage:
            return b""
        prompt, completion = self.usage()
        if self.options.chat:
            prompt = len(self.choices[0].prompt.token_ids)
        return fmt.usage_chunk(prompt, completion)
