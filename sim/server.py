"""The simulator's HTTP face: vLLM's OpenAI routes, /metrics, /health, and test-only admin routes.

Thin by design: check the body as vLLM does (``kvflow.openai_api``, then ``sim.validation``),
turn each choice of each prompt into a ``SimRequest`` for the engine, and answer with what
``sim.choices`` makes of their outputs. Every error leaves as vLLM's error JSON.

vLLM's routes: ``POST /v1/completions``, ``/v1/chat/completions``, ``/tokenize``,
``/detokenize``, ``GET|POST /ping``, ``GET /load`` (in-flight requests with
``--enable-server-load-tracking``), ``/health``, ``/metrics``, ``/version``, ``/v1/models`` and
the development route ``POST /reset_prefix_cache``. Admin routes (simulator only, under
``/_sim``): ``GET|POST /_sim/faults`` and ``GET /_sim/state`` only with ``admin_routes``
(``kvflow sim --enable-admin-routes``: tests inject faults; nobody else may), and
``POST /_sim/kv/pull`` (the modelled P/D transfer's handshake between pods). With
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set, as in vLLM, ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` too (``sim.lora``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvflow import openai_api
from kvflow.errors import InvalidRequestError, KvflowError, from_exception
from kvflow.openai_api import ChatCompletionRequest, CompletionRequest
from kvflow.sim import shapes, validation
from kvflow.sim.choices import Choice, Generation, Options
from kvflow.sim.engine import Engine
from kvflow.sim.faults import Faults
from kvflow.sim.lora import Adapters
from kvflow.sim.metrics import CONTENT_TYPE, SimMetrics
from kvflow.sim.request import BlockHasher, HashConfig, LoraAdapter, SimRequest
from kvflow.sim.sampler import Sampler
from kvflow.sim.validation import Limits, Prompt, Sampling
from kvflow.tokenizer import Tokenizer, conversation, prompt_token_ids

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
    sampler: Sampler | None = None
    loras: dict[str, LoraAdapter] = field(default_factory=dict)
    """Adapters loaded now, by served name: ``--lora-modules``, then those loaded at run time."""
    lora_enabled: bool = False
    """``--enable-lora`` (or ``--lora-modules``): adapters can be loaded at run time."""
    runtime_lora: bool = False
    """``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: the load/unload routes exist."""
    adapters: Adapters = field(init=False)
    role: str = "both"
    fingerprint: str = ""
    load_tracking: bool = False
    """vLLM's ``--enable-server-load-tracking``: ``/load`` counts in-flight generation requests."""
    tools: validation.ToolConfig = field(default_factory=validation.ToolConfig)
    created: int = field(default_factory=lambda: int(time.time()))
    requests_seen: int = 0
    server_load: int = 0
    rng: random.Random = field(default_factory=random.Random)
    """Draws for the fail-rate fault; seeded from --seed so a faulty run is reproducible."""
    _seq: int = 0

    def __post_init__(self) -> None:
        self.rng.seed(self.seed)
        self.adapters = Adapters(self.loras, enabled=self.lora_enabled or bool(self.loras))
        if self.sampler is None:
            self.sampler = Sampler(self.tokenizer)

    @property
    def limits(self) -> Limits:
        return Limits(self.max_model_len, self.tokenizer.vocab_size, self.tokenizer.max_chars_per_token)

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
    state = request.app[STATE]
    req: CompletionRequest = openai_api.validate("completions", openai_api.decode_json(await request.read()))
    return await _load_aware(state, lambda: _complete(request, state, req))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = openai_api.decode_json(await request.read())
    req: ChatCompletionRequest = openai_api.validate("chat", body)
    return await _load_aware(state, lambda: _chat(request, state, req, body))


async def _load_aware(state: SimState, handle: Callable[[], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """vLLM's ``load_aware_call``: a request counts from its handler's start to its response's end."""
    if state.load_tracking:
        state.server_load += 1
    try:
        return await handle()
    finally:
        if state.load_tracking:
            state.server_load -= 1


async def _complete(request: web.Request, state: SimState, req: CompletionRequest) -> web.StreamResponse:
    validation.check_beam_stream(req)
    model = validation.resolve_model(req.model, state.served_names, list(state.loras))
    limits = state.limits
    prompts = validation.completion_prompts(req, state.tokenizer, limits)
    params = [validation.sampling(req, validation.max_tokens_for(req.max_tokens, len(p.token_ids), limits,
                                                                  req.truncate_prompt_tokens)) for p in prompts]
    include_usage, continuous = _usage_options(req)
    options = Options(chat=False, stream=bool(req.stream), echo=bool(req.echo),
                      return_token_ids=bool(req.return_token_ids), include_usage=include_usage,
                      continuous_usage=continuous)
    return await _run(request, state, req, model, "cmpl", prompts, params, options)


async def _chat(request: web.Request, state: SimState, req: ChatCompletionRequest,
                body: dict[str, Any]) -> web.StreamResponse:
    model = validation.resolve_model(req.model, state.served_names, list(state.loras))
    limits = state.limits
    prompt = validation.chat_prompt(req, body, state.tokenizer, limits, state.tools)
    params = validation.sampling(req, validation.max_tokens_for(req.output_limit(), len(prompt.token_ids), limits,
                                                                 req.truncate_prompt_tokens))
    role = "assistant" if req.add_generation_prompt else body["messages"][-1]["role"]
    conv = conversation(body["messages"], state.tokenizer.chat_template)
    echo_text = conv[-1]["content"] if req.echo and conv and conv[-1]["role"] == role else ""
    include_usage, continuous = _usage_options(req)
    options = Options(chat=True, stream=bool(req.stream), echo=req.echo, return_token_ids=bool(req.return_token_ids),
                      include_usage=include_usage, continuous_usage=continuous, role=role, echo_text=echo_text)
    return await _run(request, state, req, model, "chatcmpl", [prompt], [params], options)


def _usage_options(req: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """vLLM's ``should_include_usage``: (final usage chunk, usage on every chunk)."""
    opts = req.stream_options
    include = bool(opts and opts.include_usage)
    return include, include and bool(opts and opts.continuous_usage_stats)


async def _run(request: web.Request, state: SimState, req: CompletionRequest | ChatCompletionRequest, model: str,
               prefix: str, prompts: list[Prompt], params: list[Sampling], options: Options) -> web.StreamResponse:
    error = validation.engine_error(prompts, params, state.tokenizer, state.limits)
    base_id = request.headers.get("X-Request-Id") or req.request_id or shapes.random_id()
    head = shapes.Head(f"{prefix}-{base_id}", int(time.time()), model, state.fingerprint)
    if error is not None:
        if not options.stream:
            raise error
        return await _stream_error(request, error)
    _admit(state)
    gen = _generation(state, req, model, head.id, prompts, params, options)
    wake = asyncio.Event()
    for r in gen.requests:
        r.notify = wake.set
        state.engine.submit(r)
    try:
        if options.stream:
            return await _stream(request, state, gen, head, wake)
        return await _respond(state, gen, head, wake)
    except (asyncio.CancelledError, ConnectionResetError):
        for r in gen.requests:
            state.engine.abort(r.request_id)
        raise


def _admit(state: SimState) -> None:
    state.requests_seen += 1
    faults = state.faults
    if faults.crash_after_requests is not None and state.requests_seen > faults.crash_after_requests:
        log.error("fault injection: crashing on request %d", state.requests_seen)
        os._exit(1)
    if faults.should_fail(state.rng):
        raise KvflowError("simulated engine failure (fault injection)")


def _generation(state: SimState, req: CompletionRequest | ChatCompletionRequest, model: str, response_id: str,
                prompts: list[Prompt], params: list[Sampling], options: Options) -> Generation:
    """One engine request per choice per prompt, numbered as vLLM numbers them (prompt * n + choice)."""
    lora = state.loras.get(model)
    xargs = req.vllm_xargs or {}
    forced = xargs.get(FORCED_OUTPUT_XARG)
    choices = []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        parent = f"{response_id}-{i}-{shapes.random_id()[:8]}"  # vLLM's internal id: response id, prompt, salt
        for j in range(p.n):
            seed = _seed(state, p, prompt, j)
            sim_req = SimRequest(
                request_id=parent if p.n == 1 else f"{j}_{parent}",
                prompt_ids=prompt.token_ids,
                max_tokens=p.max_tokens,
                hasher=BlockHasher(state.hash_config, lora, req.cache_salt),
                rng=random.Random(seed),
                arrival=time.monotonic(),
                stop=p.stop,
                lora=lora,
                kv_transfer_params=req.kv_transfer_params,
                forced_output=[int(t) for t in forced] if isinstance(forced, list) else None,
                report_full_cache=xargs.get("kv_cache_report_mode") == "full",
            )
            choices.append(Choice(i * p.n + j, i, prompt, p, sim_req))
    assert state.sampler is not None
    return Generation(options, choices, state.tokenizer, state.sampler, prompts)


def _seed(state: SimState, p: Sampling, prompt: Prompt, child: int) -> int:
    """vLLM gives child ``j`` of a seeded request ``seed + j``; greedy output depends on the prompt only."""
    if p.seed is not None:
        return p.seed + child
    if p.temperature < validation.GREEDY_EPS:
        return zlib.crc32(repr(prompt.token_ids).encode())
    return state.next_seed()


async def _stall_forever() -> None:
    await asyncio.Event().wait()


async def _respond(state: SimState, gen: Generation, head: shapes.Head, wake: asyncio.Event) -> web.Response:
    stall = state.faults.stall_after_tokens
    while not gen.finished:
        await wake.wait()
        wake.clear()
        if stall is not None and gen.max_output() >= stall and not gen.finished:
            await _stall_forever()
    return web.Response(body=shapes.dumps(gen.body(head)), content_type="application/json")


async def _stream_error(request: web.Request, error: KvflowError) -> web.StreamResponse:
    """An engine refusal after the 200: one error event, then ``[DONE]``."""
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    await response.write_eof(shapes.error_event(error.body()))
    return response


async def _stream(request: web.Request, state: SimState, gen: Generation, head: shapes.Head,
                  wake: asyncio.Event) -> web.StreamResponse:
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    fmt = shapes.StreamFormat(head, chat=gen.options.chat)
    opening = b"".join(gen.opening(fmt))
    if opening:
        await response.write(opening)
    stall = state.faults.stall_after_tokens
    # like vLLM's detokenizer, hold back text that may turn out to be the start of a stop string
    holdback = max((len(s) for c in gen.choices if not c.sampling.include_stop_str_in_output
                    for s in c.sampling.stop), default=1) - 1
    while True:
        await wake.wait()
        wake.clear()
        out, finished = gen.chunks(fmt, holdback)
        if finished:
            await response.write_eof(out + gen.closing(fmt) + shapes.DONE)  # one write with the closing chunks
            return response
        if out:
            await response.write(out)
        if stall is not None and gen.max_output() >= stall:
            await _stall_forever()


# -- tokenizer routes -----------------------------------------------------------------------
async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = openai_api.decode_json(await request.read())
    req = openai_api.tokenize_request(
        body, lambda model: validation.resolve_model(model, state.served_names, list(state.loras)))
    ids = prompt_token_ids(state.tokenizer, body)  # a prompt, or chat messages rendered: as the gateway and router
    return json_response(openai_api.tokenize_answer(state.tokenizer, ids, state.max_model_len, req))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = openai_api.validate("detokenize", openai_api.decode_json(await request.read()))
    validation.resolve_model(req.model, state.served_names, list(state.loras))
    return json_response({"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)})


# -- the rest of vLLM's routes ----------------------------------------------------------------
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


async def load(request: web.Request) -> web.Response:
    return json_response({"server_load": request.app[STATE].server_load})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": shapes.VLLM_VERSION})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    ok = request.app[STATE].engine.reset_prefix_cache()
    return json_response({"success": ok})


async def load_lora_adapter(request: web.Request) -> web.Response:
    body = openai_api.decode_json(await request.read())
    return web.Response(text=request.app[STATE].adapters.load(body))


async def unload_lora_adapter(request: web.Request) -> web.Response:
    body = openai_api.decode_json(await request.read())
    return web.Response(text=request.app[STATE].adapters.unload(body))


# -- simulator-only admin routes -------------------------------------------------------------
async def get_faults(request: web.Request) -> web.Response:
    return json_response(request.app[STATE].faults.as_dict())


async def set_faults(request: web.Request) -> web.Response:
    state = request.app[STATE]
    patch = openai_api.decode_json(await request.read())
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
    body = openai_api.decode_json(await request.read())
    rid = body.get("remote_request_id")
    if not isinstance(rid, str):
        raise InvalidRequestError("remote_request_id must be a string", param="remote_request_id")
    ok = request.app[STATE].engine.claim_export(rid)
    return json_response({"ok": ok, "reason": "" if ok else f"no pinned blocks for {rid}"})


def build_app(state: SimState, *, admin_routes: bool = False) -> web.Application:
    app = web.Application(middlewares=[errors_middleware], client_max_size=64 * 1024 * 1024)
    app[STATE] = state
    state.metrics.http.instrument(app)  # vLLM's http_request* families
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    if state.runtime_lora:
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    if admin_routes:
        app.router.add_get("/_sim/faults", get_faults)
        app.router.add_post("/_sim/faults", set_faults)
        app.router.add_get("/_sim/state", sim_state)
    app.router.add_post("/_sim/kv/pull", kv_pull)
    return app
