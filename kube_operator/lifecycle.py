"""Pure lifecycle decisions: is an engine stuck, how many replicas a pool needs.

The scraping of ``/metrics`` happens at the edge (``kvflow.operator.scrape``, with the router's
fetch and parser: ``kvflow.protocol.vllm_metrics``); these functions only look at samples
already taken, so they are tested with plain numbers.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence

from kvflow.protocol.vllm_metrics import EngineMetrics


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One scrape of one engine pod."""

    at: float  # monotonic seconds
    running: float
    waiting: float
    generated: float


def sample_from_metrics(metrics: EngineMetrics, at: float) -> Sample:
    return Sample(at=at, running=metrics.running, waiting=metrics.waiting, generated=metrics.generated_tokens)


def is_stuck(history: Sequence[Sample], now: float, threshold: float) -> bool:
    """True when requests have been running for ``threshold`` seconds without a new token.

    The window is the trailing run of samples that all show running requests; the engine is
    stuck if that run spans at least ``threshold`` seconds and its generated-token counter did
    not grow across it. A counter reset (restarted engine) counts as progress.
    """
    if not history or history[-1].running <= 0:
        return False
    start = len(history) - 1
    while start > 0 and history[start - 1].running > 0:
        start -= 1
    window = history[start:]
    if now - window[0].at < threshold:
        return False
    tokens = [sample.generated for sample in window]
    return all(later == earlier for earlier, later in itertools.pairwise(tokens)) and len(tokens) > 1


def trim(history: Sequence[Sample], now: float, keep_seconds: float) -> list[Sample]:
    """Drop samples older than ``keep_seconds``, except the newest of those.

    Keeping one sample from before the cut means a window can always reach back past the
    threshold, however far apart the scrapes happen to be.
    """
    recent = [sample for sample in history if now - sample.at <= keep_seconds]
    older = [sample for sample in history if now - sample.at > keep_seconds]
    return older[-1:] + recent


def desired_replicas(current: int, queue_depths: Iterable[float], target_per_replica: float,
                     low: int, high: int) -> int:
    """Replicas so that waiting requests per replica stay near the target, within [low, high].

    Scales up by at most doubling and down by at most one replica per decision, so a burst
    does not thrash the pool and a quiet spell drains it slowly.
    """
    depths = list(queue_depths)
    if not depths:
        return max(low, min(current, high))
    wanted = math.ceil(sum(depths) / target_per_replica) if target_per_replica > 0 else current
    if wanted > current:
        wanted = min(wanted, max(1, current) * 2)
    elif wanted < current:
        wanted = current - 1
    return max(low, min(wanted, high))


def stabilized(current: int, recommendations: Sequence[tuple[float, int]], now: float, window: float) -> int:
    """Scale up at once; scale down only to the highest recommendation of the last ``window``
    seconds (the HorizontalPodAutoscaler's scale-down stabilisation), so a brief lull does not
    shed replicas that the next burst needs."""
    recent = [r for t, r in recommendations if now - t <= window]
    if not recent:
        return current
    newest = recent[-1]
    if newest >= current:
        return newest
    return min(current, max(recent))
