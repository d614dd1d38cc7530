"""Scheduler plugins, one small file each; importing this package registers them all."""

from kvflow.router.plugins import (  # noqa: F401 - imported to register
    active_requests,
    health_filter,
    kv_cache,
    lora_affinity,
    max_score,
    model_filter,
    prefix_cache,
    queue_depth,
    role_filter,
    round_robin,
    running,
    saturation_filter,
    session_affinity,
    ttft,
    weighted_random,
)
from kvflow.router.plugins.registry import REGISTRY, PluginContext, build, register, validate

__all__ = ["REGISTRY", "PluginContext", "build", "register", "validate"]
