"""Session affinity: requests carrying the same session header go back to the same pod.

The scorer remembers (bounded, oldest forgotten first) which pod each session was last sent
to, and scores that pod 1, every other 0.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from pydantic import Field

from kvflow.router.framework import Cycle
from kvflow.router.model import EndpointView, SchedulingRequest, SchedulingResult
from kvflow.router.plugins.registry import NoParams, PluginContext, register
from kvflow.endpoints import EndpointId


class SessionParams(NoParams):
    header: str = "x-session-id"
    max_sessions: int = Field(default=100_000, alias="maxSessions", gt=0)


@register("session-affinity-scorer", "scorer")
class SessionAffinityScorer:
    Params = SessionParams

    def __init__(self, name: str, params: SessionParams, ctx: PluginContext) -> None:
        self.name = name
        self.header = params.header.lower()
        self.max_sessions = params.max_sessions
        self.sessions: OrderedDict[str, EndpointId] = OrderedDict()

    def score(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Mapping[EndpointId, float]:
        session = cycle.request.headers.get(self.header)
        home = self.sessions.get(session) if session else None
        if home is None:
            return {}  # no session, or a new one: every pod alike, the scorer abstains
        return {ep.id: 1.0 if ep.id == home else 0.0 for ep in endpoints}

    def request_started(self, request: SchedulingRequest, result: SchedulingResult) -> None:
        session = request.headers.get(self.header)
        if not session or not result.targets:
            return
        self.sessions[session] = result.targets[0].id
        self.sessions.move_to_end(session)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
