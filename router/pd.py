"""The profile handler: one profile (aggregated), or decode then prefill (disaggregated).

Like llm-d's pd-profile-handler: the decode pod is chosen first, among pods that can decode;
if the prompt tokens it does not have cached exceed the threshold and prefill pods exist, a
second profile picks the prefill pod. A prefill pool that cannot take the request leaves the
request aggregated rather than failing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.errors import NoCapacityError, RateLimitError
from kvflow.router.framework import Cycle, Profile, ProfileRun
from kvflow.router.model import EndpointView, SchedulingResult
from kvflow.router.plugins.prefix_cache import prefix_matches
from kvflow.router.prefix_index import ApproxPrefixIndex, PrefixIndex
from kvflow.endpoints import Role


@dataclass(frozen=True, slots=True)
class PdPolicy:
    enabled: bool = True
    threshold: int = 256


@dataclass(frozen=True, slots=True)
class Decision:
    result: SchedulingResult
    runs: tuple[ProfileRun, ...]


def cached_blocks(cycle: Cycle, endpoint: EndpointView, approx: ApproxPrefixIndex, precise: PrefixIndex) -> int:
    """Blocks of the prompt the router believes ``endpoint`` holds: what the profile's prefix
    scorer found, else the precise index for a pod it knows, else the approximate one."""
    for kind in ("precise", "approx"):
        found = cycle.data.get(f"prefix:{kind}")
        if found is not None:
            return int(found.get(endpoint.id, 0))
    if precise.blocks_of(endpoint.id):
        return prefix_matches(cycle, "precise", precise).get(endpoint.id, 0)
    return prefix_matches(cycle, "approx", approx).get(endpoint.id, 0)


def decide(
    cycle: Cycle,
    snapshot: Sequence[EndpointView],
    profile: Profile,
    prefill_profile: Profile,
    policy: PdPolicy,
    approx: ApproxPrefixIndex,
    precise: PrefixIndex,
) -> Decision:
    decoders = [ep for ep in snapshot if ep.endpoint.role is not Role.PREFILL]
    if not decoders:
        raise NoCapacityError(f"no endpoint can serve model {cycle.request.model!r}")
    run = profile.run(cycle, decoders)
    if not run.targets:
        raise NoCapacityError(f"no endpoint can serve model {cycle.request.model!r}")
    pick = run.targets[0]
    cached = min(cached_blocks(cycle, pick, approx, precise) * cycle.block_size, cycle.prompt_tokens)
    result = SchedulingResult(profile.name, tuple(v.endpoint for v in run.targets), None, cached)
    prefillers = [ep for ep in snapshot if ep.endpoint.role is Role.PREFILL]
    if not (policy.enabled and prefillers and cycle.prompt_tokens - cached > policy.threshold):
        return Decision(result, (run,))
    try:
        prefill_run = prefill_profile.run(cycle, prefillers)
    except (NoCapacityError, RateLimitError):
        return Decision(result, (run,))
    prefill = prefill_run.targets[0].endpoint
    return Decision(SchedulingResult(profile.name, result.targets, prefill, cached), (run, prefill_run))
