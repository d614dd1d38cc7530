"""Apache Beam model handlers that run RunInference through kvflow (``pip install kvflow[beam]``).

    from apache_beam.ml.inference.base import RunInference
    from kvflow.beam import KvflowCompletionsModelHandler

    prompts | RunInference(KvflowCompletionsModelHandler(base_url="http://gateway:8080", model="m"))
    prompts | RunInference(KvflowCompletionsModelHandler())   # a local kvflow stack per worker

Each element becomes ``PredictionResult(example, inference)`` with the OpenAI response object
as ``inference``, as Beam's own vLLM handlers give. Modules: ``handlers`` (the model handlers),
``stack`` (the local stack a handler without ``base_url`` starts, checks and restarts).
docs/batch.md shows the same pipeline on Dataflow, Flink and Spark.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvflowChatModelHandler", "KvflowCompletionsModelHandler", "StackOptions", "stop_local_stacks"]


def __getattr__(name: str) -> Any:  # apache-beam is imported only when a handler is used
    if name in ("KvflowChatModelHandler", "KvflowCompletionsModelHandler"):
        try:
            from kvflow.beam import handlers
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(f"kvflow.beam needs apache-beam and openai: pip install 'kvflow[beam]' ({exc})") from exc
        return getattr(handlers, name)
    if name in ("StackOptions", "stop_local_stacks"):
        from kvflow.beam import stack

        return getattr(stack, name)
    raise AttributeError(name)
