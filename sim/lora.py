"""vLLM's dynamic LoRA API: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

vLLM mounts the two routes only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is ``1`` or ``true``
(any case); without it they are absent (404 ``{"detail": "Not Found"}``). ``kvflow sim`` reads
the same variable. Checks and answers are vLLM's (``OpenAIServingModels``):

========================================  ======  ==============================================
request                                   status  body
========================================  ======  ==============================================
load ``{"lora_name", "lora_path"}``       200     ``Success: LoRA adapter 'NAME' added successfully.``
load, a name or path empty                400     ``InvalidUserInput``: both must be provided
load, the name already loaded             400     ``InvalidUserInput``: already loaded (unless
                                                  ``load_inplace``: the path is replaced, same id)
load without ``--enable-lora``            500     ``InternalServerError``: LoRA is not enabled
unload ``{"lora_name"}``                  200     ``Success: LoRA adapter 'NAME' removed successfully.``
unload, the name empty                    400     ``InvalidUserInput``
unload, a name not loaded                 404     ``NotFoundError``: cannot be found
========================================  ======  ==============================================

Success bodies are plain text, errors vLLM's error JSON. A loaded adapter is one like those of
``--lora-modules``: listed in ``/v1/models`` (``parent``: the base model), servable by name, its
blocks keyed on ``(name, path)`` and its KV events tagged with its id. Ids count up from the static
adapters' and are never reused (vLLM's ``lora_id_counter``). Adapters are not capped at
``--max-loras``: that caps those in one batch, and vLLM keeps every loaded one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from kvflow.errors import InvalidRequestError, KvflowError, NotFoundError
from kvflow.openai_api import RequestValidationError
from kvflow.sim.request import LoraAdapter

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
M = TypeVar("M", bound=BaseModel)


def runtime_updating(env: Mapping[str, str] = os.environ) -> bool:
    """vLLM's ``envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING``."""
    return env.get(RUNTIME_ENV, "0").strip().lower() in ("1", "true")


class InvalidUserInput(InvalidRequestError):
    type = "InvalidUserInput"


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def _parse(model: type[M], body: object) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError.from_errors(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]) from None


@dataclass(slots=True)
class Adapters:
    """The adapters a server has loaded, by served name (static ones first)."""

    loaded: dict[str, LoraAdapter] = field(default_factory=dict)
    enabled: bool = False
    """``--enable-lora`` (or static ``--lora-modules``): the engine has LoRA slots to load into."""
    _last_id: int = 0

    def __post_init__(self) -> None:
        self._last_id = max((a.adapter_id for a in self.loaded.values()), default=0)

    def load(self, body: object) -> str:
        req = _parse(LoadLoRAAdapterRequest, body)
        if not req.lora_name or not req.lora_path:
            raise InvalidUserInput("Both 'lora_name' and 'lora_path' must be provided.")
        old = self.loaded.get(req.lora_name)
        if old is not None and not req.load_inplace:
            raise InvalidUserInput(f"The lora adapter '{req.lora_name}' has already been loaded. If you want to "
                                   "load the adapter in place, set 'load_inplace' to True.")
        if not self.enabled:
            # the engine core's add_lora fails; the API server answers with its message, a 500
            raise KvflowError("Call to add_lora method failed: LoRA is not enabled.")
        if old is not None:
            adapter_id = old.adapter_id
        else:
            self._last_id += 1
            adapter_id = self._last_id
        self.loaded[req.lora_name] = LoraAdapter(req.lora_name, req.lora_path, adapter_id)
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    def unload(self, body: object) -> str:
        req = _parse(UnloadLoRAAdapterRequest, body)
        if not req.lora_name:
            raise InvalidUserInput("'lora_name' needs to be provided to unload a LoRA adapter.")
        if req.lora_name not in self.loaded:
            raise NotFoundError(f"The lora adapter '{req.lora_name}' cannot be found.")
        del self.loaded[req.lora_name]
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
