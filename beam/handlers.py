"""``RunInference`` model handlers that send each element to a kvflow gateway.

Like Beam's ``VLLMCompletionsModelHandler`` and ``VLLMChatModelHandler``: a batch of elements
is sent as concurrent requests (so the engines' continuous batching fills up), and each result
is ``PredictionResult(example, inference)`` with the OpenAI response object as ``inference``.
With ``base_url`` the handler is a client of a running gateway (kvflow up, a cluster); without,
``load_model`` starts a ``LocalStack`` on the worker, and a batch that fails on a dead or stuck
stack restarts it and is sent once more before the error goes back to Beam (which retries).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import openai
from apache_beam.ml.inference.base import ModelHandler, PredictionResult

from kvflow.beam.stack import LocalStack, StackOptions

ExampleT = TypeVar("ExampleT")

RECOVERABLE = (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError)
"""Failures that a restarted local stack may cure (a refused connection, no answer, a 5xx)."""


@dataclass(frozen=True, slots=True, weakref_slot=True)  # Beam's model cache holds models by weak reference
class Gateway:
    """A gateway that is already running: nothing to restart."""

    base_url: str
    model: str

    def endpoint(self) -> tuple[str, str]:
        return self.base_url, self.model

    def recover(self) -> bool:
        return False


Target = Gateway | LocalStack
"""What ``load_model`` gives Beam. The handler only calls its methods (``endpoint``, ``recover``):
with ``share_across_processes`` Beam hands back a proxy, which forwards method calls only."""


class _KvflowModelHandler(ModelHandler[ExampleT, PredictionResult, Target], Generic[ExampleT]):
    def __init__(self, base_url: str | None = None, model: str | None = None, *, api_key: str | None = None,
                 stack: StackOptions | None = None, max_concurrency: int = 256, timeout: float = 600.0,
                 priority: int | None = None, share_across_processes: bool = False, **batching: Any) -> None:
        """``base_url``: a gateway, as its root (``http://host:8080``) or as OpenAI clients name it
        (``http://host:8080/v1``); None starts a local stack (``stack``).
        ``model``: the served model (default: the gateway's first). ``max_concurrency``: requests
        in flight per batch. ``priority``: sent as ``x-kvflow-priority`` (when the gateway lets
        clients set it). ``share_across_processes``: one stack per machine instead of per worker
        process (Beam's multi-process sharing; set it on GPU workers). ``batching``: Beam's
        ``min_batch_size``, ``max_batch_size``, ... for ``BatchElements``."""
        super().__init__(**batching)
        self._base_url = gateway_root(base_url) if base_url else None
        self._model = model
        self._api_key = api_key or "unused"
        self._stack = stack or StackOptions()
        self._max_concurrency = max_concurrency
        self._timeout = timeout
        self._headers = {"x-kvflow-priority": str(priority)} if priority is not None else {}
        self._share = share_across_processes

    # --- ModelHandler --------------------------------------------------------------------

    def load_model(self) -> Target:
        if self._base_url is None:
            return LocalStack(self._stack)
        return Gateway(self._base_url, self._model or _first_model(self._base_url, self._api_key))

    def run_inference(self, batch: Sequence[ExampleT], model: Target,
                      inference_args: dict[str, Any] | None = None) -> Iterable[PredictionResult]:
        return asyncio.run(self._run(batch, model, dict(inference_args or {})))

    def validate_inference_args(self, inference_args: dict[str, Any] | None) -> None:
        """Any OpenAI request field (``max_tokens``, ``temperature``, ...) may be passed."""

    def share_model_across_processes(self) -> bool:
        return self._share

    def get_metrics_namespace(self) -> str:
        return "KvflowModelHandler"

    # --- requests ------------------------------------------------------------------------

    async def _run(self, batch: Sequence[ExampleT], target: Target, args: dict[str, Any]) -> list[PredictionResult]:
        try:
            return await self._send(batch, target, args)
        except RECOVERABLE:
            if not await asyncio.to_thread(target.recover):
                raise
            return await self._send(batch, target, args)

    async def _send(self, batch: Sequence[ExampleT], target: Target, args: dict[str, Any]) -> list[PredictionResult]:
        base_url, served = target.endpoint()
        model = self._model or served
        limit = asyncio.Semaphore(self._max_concurrency)
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=self._api_key, timeout=self._timeout,
                                      max_retries=2, default_headers=self._headers) as client:
            async def one(example: ExampleT) -> Any:
                async with limit:
                    return await self._request(client, model, example, args)

            answers = await asyncio.gather(*(one(x) for x in batch))
        return [PredictionResult(x, y, model_id=model) for x, y in zip(batch, answers)]

    async def _request(self, client: openai.AsyncOpenAI, model: str, example: ExampleT, args: dict[str, Any]) -> Any:
        raise NotImplementedError


class KvflowCompletionsModelHandler(_KvflowModelHandler[str]):
    """Elements are prompts (``str``); each inference is an ``openai.types.Completion``."""

    async def _request(self, client: openai.AsyncOpenAI, model: str, example: str, args: dict[str, Any]) -> Any:
        return await client.completions.create(model=model, prompt=example, **args)


class KvflowChatModelHandler(_KvflowModelHandler[Sequence[Any]]):
    """Elements are conversations: sequences of messages, each a ``{"role", "content"}`` mapping
    or an object with ``role`` and ``content`` (Beam's ``OpenAIChatMessage``); each inference is
    an ``openai.types.chat.ChatCompletion``."""

    async def _request(self, client: openai.AsyncOpenAI, model: str, example: Sequence[Any],
                       args: dict[str, Any]) -> Any:
        messages: list[Any] = [dict(m) if isinstance(m, Mapping) else {"role": m.role, "content": m.content} for m in example]
        return await client.chat.completions.create(model=model, messages=messages, **args)


def gateway_root(base_url: str) -> str:
    """The gateway's root from either spelling: ``…:8080``, ``…:8080/`` or OpenAI's ``…:8080/v1``."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1") if root.endswith("/v1") else root


def _first_model(base_url: str, api_key: str) -> str:
    request = urllib.request.Request(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        models = json.loads(response.read())["data"]
    if not models:
        raise RuntimeError(f"the gateway at {base_url} serves no model")
    return str(models[0]["id"])
