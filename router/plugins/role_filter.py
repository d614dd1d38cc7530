"""Keep endpoints that can play a role in disaggregated serving (``both`` plays either)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from kvflow.router.framework import Cycle
from kvflow.router.model import EndpointView
from kvflow.router.plugins.registry import NoParams, PluginContext, register


class RoleParams(NoParams):
    role: Literal["prefill", "decode"]


@register("role-filter", "filter")
class RoleFilter:
    Params = RoleParams

    def __init__(self, name: str, params: RoleParams, ctx: PluginContext) -> None:
        self.name = name
        self.role = params.role

    def filter(self, cycle: Cycle, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        if self.role == "prefill":
            return [ep for ep in endpoints if ep.endpoint.role.serves_prefill()]
        return [ep for ep in endpoints if ep.endpoint.role.serves_decode()]
