"""The profile handler: one profile (aggregated), or decode then prefill (disaggregated).

Like llm-d's pd-profile-handler: the decode pod is chosen first, among pods that can decode;
if the prompt tokens it does not have cached exceed the threshold and prefill pods exist, a
second profile picks the prefill pod. A prefill pool that cannot take the request leaves the
request aggregated rather than failing it.

The decider needs the prompt's cached blocks on the decode pick only when it could
disaggregate (prefill pods exist) or when the profile matched prefixes anyway; otherwise
(round-robin, least-load without prefill pods) the prompt is never hashed and
``cached_tokens`` is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.errors import NoCapacityError, RateLimitError
from kvflow.router.framework import Cycle, Profile, ProfileRun
from kvflow.router.model import EndpointView, SchedulingResult
from kvflow.router.plugins.prefix_cache import prefix_matches
from kvflow.router.prefix_index import ApproxPrefixIndex, PrefixIndex


@dataclass(frozen=True, slots=True)
class PdPolicy:
    enabled: bool = True
    threshold: int = 256


@dataclass(frozen=True, slots=True)
class Decision:
    result: SchedulingResult
    runs: tuple[ProfileRun, ...]
    reads_prefixes: bool = True
    """The decision read the prompt's block hashes: the router should learn its prefix."""


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


def same_revision(prefillers: Sequence[EndpointView], decode: EndpointView) -> Sequence[EndpointView]:
    """Prefill pods whose KV cache the decode pod can use: the same model revision. During a
    rollout old and new pods coexist; pairing across revisions would hand a decode pod KV
    blocks computed by other weights."""
    revision = decode.endpoint.revision
    return [p for p in prefillers if p.endpoint.revision == revision]


def decide(
    cycle: Cycle,
    decoders: Sequence[EndpointView],
    prefillers: Sequence[EndpointView],
    profile: Profile,
    prefill_profile: Profile,
    policy: PdPolicy,
    approx: ApproxPrefixIndex,
    precise: PrefixIndex,
) -> Decision:
    """``decoders``: the pods that can decode; ``prefillers``: prefill-only pods."""
    if not decoders:
        raise NoCapacityError(f"no endpoint can serve model {cycle.request.model!r}")
    run = profile.run(cycle, decoders)
    if not run.targets:
        raise NoCapacityError(f"no endpoint can serve model {cycle.request.model!r}")
    pick = run.targets[0]
    prefillers = same_revision(prefillers, pick)
    may_split = policy.enabled and bool(prefillers)
    prefixes = profile.reads_prefixes or may_split
    cached = 0
    if prefixes:
        cached = min(cached_blocks(cycle, pick, approx, precise) * cycle.block_size, cycle.prompt_tokens)
    result = SchedulingResult(profile.name, tuple(v.endpoint for v in run.targets), None, cached)
    if not (may_split and cycle.prompt_tokens - cached > policy.threshold):
        return Decision(result, (run,), prefixes)
    try:
        prefill_run = prefill_profile.run(cycle, prefillers)
    except (NoCapacityError, RateLimitError):
        return Decision(result, (run,), prefixes)
    prefill = prefill_run.targets[0].endpoint
    return Decision(SchedulingResult(profile.name, result.targets, prefill, cached), (run, prefill_run), prefixes)
