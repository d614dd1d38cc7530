"""One request's load on the pods that serve it, from dispatch to its end.

The router's decision comes as a ``Flight`` (``Router.route``, or ``Router.decide`` for a
request already tokenized): ``flight.request`` is what was decided on, ``flight.result`` the
decision. Accounting follows the pod that actually serves: the gateway (or the ext_proc server)
tells the ``Flight`` each attempt it makes, and only a pod that was really sent the request
carries its load and learns its prefix. A failed attempt is undone on that pod before the next
one::

    flight = await router.route(incoming)
    try:
        flight.send_prefill(pod)       # P/D: the prompt's prefill leg on a prefill pod ...
        flight.prefill_done(ok=True)   # ... which ends (KV exported, or failed: decode computes it)
        flight.send(pod)               # an attempt on a decode/aggregated pod
        flight.failed(pod)             # that attempt failed before answering: undone there
        flight.first_token()           # prefill done: its work leaves the pod's queue
    finally:
        flight.finish()                # whatever happened, nothing stays counted

What a pod carries (``LoadCounter``): the request in flight, the KV blocks it adds there (its
prompt tokens not already cached: a cached prefix is shared, not copied), and until its first
token the prompt tokens the pod must compute (not cached there), which is the
queue a later request waits behind. The time from dispatch to first token, over the work that
was ahead of it, is the pod's observed prefill speed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from kvflow.endpoints import Endpoint, EndpointId
from kvflow.router.model import LoadCounter

if TYPE_CHECKING:
    from kvflow.router.model import SchedulingRequest, SchedulingResult

SPEED_WEIGHT = 0.2
"""Weight of the newest observation in a pod's prefill-speed average."""
SPEED_STEP = 3.0
"""An observation counts as at most this many times slower (or faster) than the pod's average.
A first token far later than estimated is much more often a wrong estimate of the work (a prefix
the request was to reuse computed again, requests preempted when the pod's KV cache overflowed,
a queue longer than the router knew) than a pod that got ten times slower. Taken at face value,
one such outlier marks the pod slow, the pod then gets no requests, and no first token comes to
correct it while the others take its share (bench/RESULTS.md, "The pool's speed"). A pod that
really is slower still shows it, over a few requests."""


class Beliefs(Protocol):
    """What else one request's flight teaches, beyond the load it puts on pods: the router's
    beliefs about where prompts are cached and which pods answer (``Router`` gives each flight
    its own). Each call names the pod and whether it is the prefill leg."""

    def sent(self, endpoint: Endpoint, prefill: bool, work: int, tokens: int) -> None:
        """The pod was sent the request: ``work`` prompt tokens to compute, ``tokens`` of KV it adds."""

    def prefilled(self, endpoint: Endpoint, prefill: bool) -> None:
        """Its prefill there ended: first token, answer, failure or end (maybe more than once)."""

    def undone(self, endpoint: Endpoint, prefill: bool) -> None:
        """The attempt there failed before it answered: nothing of it stays there."""

    def answered(self, endpoint: Endpoint, prefill: bool) -> None:
        """The pod answered the attempt."""

    def released(self, endpoint: Endpoint, prefill: bool, undone: bool) -> None:
        """The pod no longer holds the leg (``undone``: it computed nothing of it)."""


class Leg:
    """One pod's share of a request: its queue position, for as long as the pod holds it (a
    router's own request's, or a peer replica's, ``router/peers.py``)."""

    __slots__ = ("endpoint", "counter", "work", "tokens", "position", "ahead", "sent_at", "prefilling")

    def __init__(self, endpoint: Endpoint, counter: LoadCounter | None, work: int, tokens: int, now: float) -> None:
        """``work``: tokens the pod computes; ``tokens``: the KV it adds (the same, unless pulled)."""
        self.endpoint, self.counter, self.work, self.tokens = endpoint, counter, work, tokens
        self.sent_at, self.prefilling = now, True
        self.ahead, self.position = 0.0, 0
        if counter is not None:
            counter.in_flight += 1
            counter.dispatched += 1
            counter.prefilling += 1
            counter.tokens += tokens
            self.ahead, self.position = counter.enqueue(work, now)

    def prefilled(self) -> bool:
        """Its prefill is done; False if it was already."""
        if not self.prefilling:
            return False
        self.prefilling = False
        if self.counter is not None:
            self.counter.prefilling = max(0, self.counter.prefilling - 1)
            self.counter.prefilled(self.position)
        return True

    def release(self, now: float, *, undo: bool) -> None:
        """The pod no longer holds the request; ``undo``: it computed nothing of it."""
        counter = self.counter
        if counter is None:
            return
        if self.prefilling:
            self.prefilling = False
            counter.prefilling = max(0, counter.prefilling - 1)
            if undo:
                counter.dequeue(self.work, now)
            else:  # it ended, so its prefill did too
                counter.prefilled(self.position)
        counter.in_flight = max(0, counter.in_flight - 1)
        counter.dispatched = max(0, counter.dispatched - 1)
        counter.tokens = max(0, counter.tokens - self.tokens)


class Flight:
    """See the module docstring. Every method is idempotent where a caller could repeat it."""

    __slots__ = (
        "request", "result", "cached_blocks", "beliefs", "_counter", "_block_size", "_clock", "_step_tokens",
        "_leg", "_prefill", "_remote", "served", "_done",
    )

    def __init__(
        self,
        request: SchedulingRequest,
        result: SchedulingResult,
        *,
        counter: Callable[[EndpointId], LoadCounter | None],
        cached_blocks: Mapping[EndpointId, int],
        block_size: int,
        clock: Callable[[], float],
        beliefs: Beliefs,
        step_tokens: int = 0,
    ) -> None:
        self.request = request
        """What was decided on."""
        self.result = result
        """The decision: ``targets[0]`` the pick, then the fallbacks; ``prefill`` P/D's prefill pod."""
        self.cached_blocks = cached_blocks
        """Leading blocks of the prompt each pod was believed to hold when the decision was made."""
        self.beliefs = beliefs
        """Told each step, for what it teaches beyond load (the router's indexes, passive health)."""
        self._counter = counter
        self._block_size = block_size
        self._clock = clock
        self._step_tokens = step_tokens
        self._leg: Leg | None = None
        self._prefill: Leg | None = None
        self._remote = False
        self.served: Endpoint | None = None
        """The pod that answered (set by ``first_token`` or ``finish``), or None."""
        self._done = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.token_ids)

    def uncached(self, endpoint: Endpoint) -> int:
        """Prompt tokens ``endpoint`` must compute, as the router believes (vLLM always computes one)."""
        cached = self.cached_blocks.get(endpoint.id, 0) * self._block_size
        return max(1, self.prompt_tokens - cached)

    # -- P/D: the prefill leg --------------------------------------------------------------

    def send_prefill(self, endpoint: Endpoint) -> None:
        if self._done or self._prefill is not None:
            return
        work = self.uncached(endpoint)
        self._prefill = Leg(endpoint, self._counter(endpoint.id), work, work, self._clock())
        self.beliefs.sent(endpoint, True, work, work)

    def prefill_done(self, *, ok: bool) -> None:
        """The prefill pod answered (its KV is ready to pull) or failed (decode computes the prompt)."""
        leg, self._prefill = self._prefill, None
        if leg is None:
            return
        if ok:
            leg.prefilled()
            self._observe(leg)
            self.beliefs.answered(leg.endpoint, True)
        leg.release(self._clock(), undo=not ok)
        self.beliefs.released(leg.endpoint, True, not ok)
        self._remote = ok
        self.beliefs.prefilled(leg.endpoint, True)
        if not ok:
            self.beliefs.undone(leg.endpoint, True)

    # -- attempts on decode / aggregated pods ----------------------------------------------

    def dispatch(self) -> None:
        """Sent to the pick, after the prefill pod's leg where P/D split it, with no other
        attempt to follow: what an entry that cannot retry does (the ext_proc server: Envoy
        sends it), and what a replay does."""
        prefill = self.result.prefill
        if prefill is not None:
            self.send_prefill(prefill)
        self.send(self.result.targets[0], remote=prefill is not None)

    def send(self, endpoint: Endpoint, *, remote: bool = False) -> None:
        """An attempt on ``endpoint`` starts (a previous one must have ended with ``failed``);
        ``remote``: its KV comes from the prefill leg (the default once that leg succeeded)."""
        if self._done or self._leg is not None:
            return
        self._remote = self._remote or remote
        blocks = self.uncached(endpoint)  # pulled or computed, the pod holds them
        work = 0 if self._remote else blocks
        self._leg = Leg(endpoint, self._counter(endpoint.id), work, blocks, self._clock())
        self.beliefs.sent(endpoint, False, work, blocks)

    def failed(self, endpoint: Endpoint) -> None:
        """The attempt on ``endpoint`` failed before it answered: nothing of it stays there."""
        leg = self._leg
        if leg is None or leg.endpoint.id != endpoint.id:
            return
        self._leg = None
        leg.release(self._clock(), undo=True)
        self.beliefs.released(endpoint, False, True)
        self.beliefs.undone(endpoint, False)

    def first_token(self, *, observe: bool = True) -> None:
        """The serving pod produced its first token (``observe``: the time is a real TTFT)."""
        leg = self._leg
        if leg is None or not leg.prefilled():
            return
        self.beliefs.prefilled(leg.endpoint, False)
        self.served = leg.endpoint
        if observe and not self._remote:
            self._observe(leg)

    def finish(self) -> None:
        """The request ended, however: whatever it still holds is released."""
        if self._done:
            return
        self._done = True
        if self._prefill is not None:
            self.prefill_done(ok=False)
        leg, self._leg = self._leg, None
        if leg is not None:
            self.served = leg.endpoint
            if not leg.prefilling:  # it answered, and did not fail before the end (a stream may stall)
                self.beliefs.answered(leg.endpoint, False)
            leg.release(self._clock(), undo=False)
            self.beliefs.released(leg.endpoint, False, False)
            self.beliefs.prefilled(leg.endpoint, False)

    def _observe(self, leg: Leg) -> None:
        """The pod's prefill speed: time to first token over the work that was ahead, its own, a step."""
        counter = leg.counter
        units = leg.ahead + leg.work + self._step_tokens
        if counter is None or units <= 0:
            return
        speed = (self._clock() - leg.sent_at) / units
        old = counter.seconds_per_token
        if old <= 0:
            counter.seconds_per_token = speed
            return
        speed = min(max(speed, old / SPEED_STEP), old * SPEED_STEP)
        counter.seconds_per_token = old + SPEED_WEIGHT * (speed - old)

    def __enter__(self) -> Flight:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()
