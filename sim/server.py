"""The simulator's HTTP face: vLLM's OpenAI routes, /metrics, /health, and test-only admin routes.

Thin by design: validate the body (kvflow.openai_api), turn it into a ``SimRequest``, hand it to
the engine, and stream what the engine produces. Every error leaves as OpenAI's error JSON.

Admin routes (simulator only, under ``/_sim``): ``GET|POST /_sim/faults``, ``GET /_sim/state``,
``POST /_sim/kv/pull`` (the modelled P/D transfer's handshake). ``POST /reset_prefix_cache`` is
vLLM's own development route.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvflow.errors import InvalidRequestError, KvflowError, from_exception
from kvflow.openai_api import ChatCompletionRequest, CompletionRequest
from kvflow.sim import shapes, validation
from kvflow.sim.engine import Engine
from kvflow.sim.faults import Faults
from kvflow.sim.metrics import CONTENT_TYPE, SimMetrics
from kvflow.sim.request import BlockHasher, HashConfig, LoraAdapter, SimRequest
from kvflow.tokenizer import Tokenizer, prompt_token_ids

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SimState:
    engine: Engine
    tokenizer: Tokenizer
    metrics: SimMetrics
    faults: Faults
    served_names: tuple[str, ...]
    model_root: str
    max_model_len: int
    hash_config: HashConfig
    seed: int
    loras: dict[str, LoraAdapter] = field(default_factory=dict)
    role: str = "both"
    fingerprint: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    requests_seen: int = 0
    rng: random.Random = field(default_factory=random.Random)
    """Draws for the fail-rate fault; seeded from --seed so a faulty run is reproducible."""
    _seq: int = 0

    def __post_init__(self) -> None:
        self.rng.seed(self.seed)

    def next_seed(self) -> int:
        self._seq += 1
        return self.seed * 1_000_003 + self._seq


STATE = web.AppKey("sim_state", SimState)
FORCED_OUTPUT_XARG = "kvflow_sim_output_token_ids"
"""A ``vllm_xargs`` key (ignored by real vLLM) that makes the sim emit these output tokens."""
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """Compact JSON, as FastAPI (and so vLLM) writes it."""
    return web.Response(body=shapes.dumps(body), status=status, headers=headers, content_type="application/json")


def error_response(exc: KvflowError) -> web.Response:
    return json_response(exc.body(), status=exc.status, headers=exc.headers())


@web.middleware
async def errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:  # unknown route or method: FastAPI's shape, as vLLM returns
        if exc.status >= 400:
            return json_response({"detail": exc.reason}, status=exc.status)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        err = from_exception(exc)
        if not isinstance(exc, KvflowError):
            log.exception("unhandled error in %s", request.path)
        return error_response(err)


# -- OpenAI routes -------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    body = validation.parse_body(await request.read())
    parsed = validation.validate(chat, body)
    _admit(state)
    req, head = _build_request(state, request, body, parsed, chat=chat)
    wake = asyncio.Event()
    req.notify = wake.set
    state.engine.submit(req)
    try:
        if parsed.stream:
            include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            return await _stream(request, state, req, head, wake, chat=chat, include_usage=include_usage)
        return await _respond(state, req, head, wake, chat=chat)
    except (asyncio.CancelledError, ConnectionResetError):
        state.engine.abort(req.request_id)
        raise


def _admit(state: SimState) -> None:
    state.requests_seen += 1
    faults = state.faults
    if faults.crash_after_requests is not None and state.requests_seen > faults.crash_after_requests:
        log.error("fault injection: crashing on request %d", state.requests_seen)
        os._exit(1)
    if faults.should_fail(state.rng):
        raise KvflowError("simulated engine failure (fault injection)")


def _build_request(
    state: SimState, request: web.Request, body: dict[str, Any],
    parsed: CompletionRequest | ChatCompletionRequest, *, chat: bool,
) -> tuple[SimRequest, shapes.Head]:
    lora = state.loras.get(parsed.model)
    if lora is None and parsed.model not in state.served_names:
        raise validation.unknown_model(parsed.model, [*state.served_names, *state.loras])
    prompt = prompt_token_ids(state.tokenizer, body)
    from_text = chat or isinstance(body.get("prompt"), str) or _is_text_list(body.get("prompt"))
    validation.check_prompt_length(len(prompt), state.max_model_len, from_text=from_text)
    wanted = parsed.output_limit() if isinstance(parsed, ChatCompletionRequest) else parsed.max_tokens
    room = state.max_model_len - len(prompt)
    max_tokens = min(wanted, room) if wanted else room
    stop = (parsed.stop,) if isinstance(parsed.stop, str) else tuple(parsed.stop or ())
    base_id = request.headers.get("X-Request-Id") or shapes.random_id()
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{base_id}"
    req_id = f"{response_id}-0-{shapes.random_id()[:8]}"  # vLLM's internal id: response id, index, salt
    seed = parsed.seed if parsed.seed is not None else state.next_seed()
    xargs = body.get("vllm_xargs") if isinstance(body.get("vllm_xargs"), dict) else {}
    forced = xargs.get(FORCED_OUTPUT_XARG)
    req = SimRequest(
        request_id=req_id,
        prompt_ids=prompt,
        max_tokens=max_tokens,
        hasher=BlockHasher(state.hash_config, lora, parsed.cache_salt),
        rng=random.Random(seed),
        arrival=time.monotonic(),
        stop=tuple(s for s in stop if s),
        lora=lora,
        kv_transfer_params=parsed.kv_transfer_params,
        forced_output=[int(t) for t in forced] if isinstance(forced, list) else None,
        report_full_cache=xargs.get("kv_cache_report_mode") == "full",
    )
    return req, shapes.Head(response_id, int(time.time()), parsed.model, state.fingerprint)


def _is_text_list(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str)


async def _stall_forever() -> None:
    await asyncio.Event().wait()


def _result(req: SimRequest) -> shapes.Result:
    return shapes.Result(req.text, req.finish_reason, req.stop_reason, req.num_prompt_tokens, len(req.output_ids),
                         req.kv_transfer_out)


async def _respond(
    state: SimState, req: SimRequest, head: shapes.Head, wake: asyncio.Event, *, chat: bool
) -> web.Response:
    stall = state.faults.stall_after_tokens
    while not req.finished:
        await wake.wait()
        wake.clear()
        if stall is not None and len(req.output_ids) >= stall and not req.finished:
            await _stall_forever()
    build = shapes.chat_completion if chat else shapes.completion
    return web.Response(body=shapes.dumps(build(head, _result(req))), content_type="application/json")


async def _stream(request: web.Request, state: SimState, req: SimRequest, head: shapes.Head, wake: asyncio.Event,
                  *, chat: bool, include_usage: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    fmt = shapes.StreamFormat(head, chat=chat, include_usage=include_usage)
    first = fmt.first()
    if first:
        await response.write(first)
    stall = state.faults.stall_after_tokens
    # like vLLM's detokenizer, hold back text that may turn out to be the start of a stop string
    holdback = max((len(s) for s in req.stop), default=1) - 1
    sent_text, sent_tokens = 0, 0
    while True:
        await wake.wait()
        wake.clear()
        n = len(req.output_ids)
        if n == sent_tokens and not req.finished:
            continue
        end = len(req.text) if req.finished else max(sent_text, len(req.text) - holdback)
        text = req.text[sent_text:end]
        sent_text, sent_tokens = end, n
        if req.finished:
            out = fmt.last(text, req.finish_reason or "abort", req.stop_reason)
            if include_usage:
                out += fmt.usage_chunk(req.num_prompt_tokens, n)
            await response.write_eof(out + shapes.DONE)  # one write with the closing chunk
            return response
        await response.write(fmt.chunk(text))
        if stall is not None and sent_tokens >= stall:
            await _stall_forever()


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cards = [shapes.model_card(name, state.model_root, state.created, state.max_model_len)
             for name in state.served_names]
    cards += [shapes.model_card(a.name, a.path, state.created, state.max_model_len, parent=state.served_names[0])
              for a in state.loras.values()]
    return json_response({"object": "list", "data": cards})


async def health(request: web.Request) -> web.Response:
    """200 with an empty body; 503 once the engine loop has died (vLLM's EngineDeadError)."""
    return web.Response(status=200 if request.app[STATE].engine.alive else 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": shapes.VLLM_VERSION})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    ok = request.app[STATE].engine.reset_prefix_cache()
    return json_response({"success": ok})


# -- simulator-only admin routes -------------------------------------------------------------
async def get_faults(request: web.Request) -> web.Response:
    return json_response(request.app[STATE].faults.as_dict())


async def set_faults(request: web.Request) -> web.Response:
    state = request.app[STATE]
    patch = validation.parse_body(await request.read())
    state.faults.update(patch)
    if patch.get("crash"):
        log.error("fault injection: crash requested")
        asyncio.get_running_loop().call_later(0.05, os._exit, 1)
    return json_response(state.faults.as_dict())


async def sim_state(request: web.Request) -> web.Response:
    sched = request.app[STATE].engine.scheduler
    return json_response({
        "role": request.app[STATE].role,
        "running": len(sched.running),
        "waiting": sched.num_waiting,
        "num_free_blocks": sched.pool.num_free,
        "kv_cache_usage": sched.pool.usage,
        "pinned": sorted(sched.pinned),
        "num_preemptions": sched.num_preemptions,
    })


async def kv_pull(request: web.Request) -> web.Response:
    body = validation.parse_body(await request.read())
    rid = body.get("remote_request_id")
    if not isinstance(rid, str):
        raise InvalidRequestError("remote_request_id must be a string", param="remote_request_id")
    ok = request.app[STATE].engine.claim_export(rid)
    return json_response({"ok": ok, "reason": "" if ok else f"no pinned blocks for {rid}"})


def build_app(state: SimState) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=64 * 1024 * 1024)
    app[STATE] = state
    state.metrics.http.instrument(app)  # vLLM's http_request* families
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/_sim/faults", get_faults)
    app.router.add_post("/_sim/faults", set_faults)
    app.router.add_get("/_sim/state", sim_state)
    app.router.add_post("/_sim/kv/pull", kv_pull)
    return app
