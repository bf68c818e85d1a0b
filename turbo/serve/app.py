"""The HTTP API (FastAPI): OpenAI's routes over one `worker.Engine`. `make_app(engine)` is the
app a local server (main.py, uvicorn) and each Ray Serve replica (ray_app.py) serve.

A request is checked (protocol.parse), prepared (Engine.prepare) and submitted to the scheduler
before any byte of the answer is sent, so every refusal is a status code with OpenAI's error
object; the scheduler's deltas then cross from its thread through an asyncio queue. A client that
goes away mid-answer (a closed stream, a dropped connection) cancels its ticket: the scheduler
frees the sequence at its next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..chat.turn import Turn
from ..errors import TurboError
from ..sequence.driver import choice_options
from . import protocol as P
from . import responses as R
from .guard import Guard, error
from .limits import MIB, read_body
from .metrics import CONTENT_TYPE, Timing
from .scheduler import Delta
from .worker import Engine, param_of

DISCONNECT_POLL_S = 1.0  # a non-streaming answer looks this often whether its client is still there


@dataclass
class Call:
    """One request on its way: its queue of deltas and what its answer needs."""

    body: P.Body
    prompt_tokens: int
    turn: Turn | None  # a chat's: its answer read as turbo/chat/turn.py reads every turn's
    queue: asyncio.Queue
    timing: Timing
    rid: str = ""
    index: int = 0  # which choice (n > 1)
    created: int = field(default_factory=R.now)
    ticket: object = None
    done: bool = False
    generated: int = 0  # completion tokens, once its last delta has come
    cached: int = 0
    cached_from: str | None = None  # the kind of mark the state that served `cached` was kept at


def make_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="turbo", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, key=engine.config.api_key, limit=body_limit(engine))

    @app.exception_handler(P.ApiError)
    async def api_error(request: HttpRequest, e: P.ApiError):
        return error(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: HttpRequest, e: HTTPException):
        return error(P.ApiError(str(e.detail), None, e.status_code, "invalid_request_error"))

    @app.exception_handler(Exception)
    async def internal(request: HttpRequest, e: Exception):  # a bug of ours: a 500, the server goes on
        return error(P.ApiError(f"internal error: {type(e).__name__}: {e}", None, 500, "server_error"))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.text(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": engine.model, "object": "model", "created": 0, "owned_by": "turbo",
                "max_model_len": engine.max_positions}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        engine.check_model(name)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await answer(engine, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await answer(engine, request, chat=True)

    return app


DEFAULT_MAX_BODY_MB = 32.0  # ServeConfig's (an engine whose config has none: a test's stand-in)


def body_limit(engine: Engine) -> int:
    return int(getattr(engine.config, "max_body_mb", DEFAULT_MAX_BODY_MB) * MIB)


async def answer(engine: Engine, request: HttpRequest, chat: bool) -> Response:
    # (a Content-Length over the limit never gets here: Guard; a chunked body is cut at the limit)
    raw = await read_body(request.stream(), body_limit(engine), request.headers.get("content-length"))
    body = P.parse(P.parse_json(raw), chat)
    engine.check_chars(body)  # a prompt past the context: a 400 here, before any thread or tokenizer
    # off the event loop: decoding an image (or fetching one, serve.remote_images) must not stall other
    # streams; a request with images in a pool of its own, so that slow ones (a slow disk, a remote
    # server trickling its 10 s) queue behind each other, never ahead of a text request's template
    prepared = await (asyncio.get_running_loop().run_in_executor(image_pool(), engine.prepare, body)
                      if has_images(body) else asyncio.to_thread(engine.prepare, body))
    loop = asyncio.get_running_loop()
    rid, calls = R.new_id(chat), []
    try:
        # each choice after the first shares its prefill
        for i, options in enumerate(choice_options(prepared.request.options, body.n)):
            choice = dataclasses.replace(prepared.request, options=options)
            call = Call(body, len(prepared.request.ids), prepared.turn, asyncio.Queue(),
                        engine.metrics.request(), rid, index=i)
            call.ticket = engine.submit(dataclasses.replace(prepared, request=choice), sink_of(loop, call),
                                        body.max_tokens_param, calls[0].ticket if calls else None)
            calls.append(call)
    except P.ApiError:  # (the queue filled part way: none of the choices runs)
        for c in calls:
            c.ticket.cancel()
        raise
    if body.stream:
        return StreamingResponse(stream(engine, calls), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return JSONResponse(await whole(engine, calls, request))


IMAGE_WORKERS = 4  # requests with images prepared at once (the rest queue for these)
_image_pool: ThreadPoolExecutor | None = None


def image_pool() -> ThreadPoolExecutor:
    global _image_pool
    if _image_pool is None:
        _image_pool = ThreadPoolExecutor(IMAGE_WORKERS, thread_name_prefix="turbo-images")
    return _image_pool


def has_images(body: P.Body) -> bool:
    return bool(body.chat and any(isinstance(m.get("content"), list) and
                                  any(p.get("type") == "image_url" for p in m["content"]) for m in body.messages or ()))


def sink_of(loop: asyncio.AbstractEventLoop, call: Call) -> Callable[[Delta | TurboError], None]:
    def sink(item: Delta | TurboError) -> None:  # on the scheduler's thread
        try:
            loop.call_soon_threadsafe(call.queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed (the server is stopping)
            pass
    return sink


async def deltas(engine: Engine, call: Call, request: HttpRequest | None = None) -> AsyncIterator[Delta]:
    """The request's deltas to the last; a failure after admission as ApiError. However it ends
    early (the client gone, the task cancelled) the ticket is cancelled."""
    try:
        while True:
            if request is None:
                item = await call.queue.get()
            else:  # nothing else notices a client gone from a non-streaming request
                try:
                    item = await asyncio.wait_for(call.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
            if isinstance(item, Exception):
                call.done = True
                if isinstance(item, TurboError) and item.field is not None:  # the request's (a grammar's parser
                    raise P.ApiError(str(item), param_of(item))               # gave up): a 400 naming the field
                raise P.ApiError(str(item), None, 500, "server_error")
            call.timing.tokens_out(len(item.tokens))
            if item.finish is not None:
                call.done = True
                engine.metrics.finished(item.stats, item.finish, item.cached_tokens, call.timing)
            yield item
            if call.done:
                return
    finally:
        if not call.done:
            call.done = True
            call.ticket.cancel()
            engine.metrics.finished(None, None, 0, call.timing)


async def whole(engine: Engine, calls: list[Call], request: HttpRequest) -> dict:
    choices = await asyncio.gather(*(choice_of(engine, c, request) for c in calls))
    if any(c is None for c in choices):
        return {}  # the client has gone: nobody reads this
    first = calls[0]
    return {**R.envelope(first.rid, first.body.chat, first.body.model, first.created, choices, chunk=False),
            "usage": R.usage(first.prompt_tokens, sum(c.generated for c in calls), first.cached, first.cached_from)}


async def choice_of(engine: Engine, call: Call, request: HttpRequest) -> dict | None:
    """One choice of a non-streamed answer (None: the client went away)."""
    text, lps, last = [], [], None
    async for d in deltas(engine, call, request):
        text.append(d.text)
        lps += d.logprobs or []
        last = d
    if last is None or last.finish is None:
        return None
    body, out = call.body, "".join(text)
    choice: dict = {"index": call.index, "finish_reason": last.finish.reason, "stop_reason": last.finish.matched}
    logprobs = None
    if body.logprobs is not None:
        logprobs = R.chat_logprobs(lps, engine.piece) if body.chat else R.completion_logprobs(lps, engine.piece, 0)
    if call.turn is not None:
        choice["message"], made = call.turn.answer(out)
        choice["finish_reason"] = call.turn.finish_reason(last.finish.reason, made)
    else:
        choice["text"] = out
    choice["logprobs"] = logprobs
    call.generated = last.stats.generated_tokens if last.stats is not None else call.timing.tokens
    call.cached, call.cached_from = last.cached_tokens, last.cached_from
    return choice


async def stream(engine: Engine, calls: list[Call]) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, every choice's as they come, ending `data: [DONE]`."""
    first = calls[0]
    body = first.body
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(call: Call) -> None:
        try:
            async for line in choice_chunks(engine, call):
                await queue.put(line)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(c)) for c in calls]
    try:
        ended = 0
        while ended < len(calls):
            line = await queue.get()
            if line is None:
                ended += 1
            else:
                yield line
    finally:
        for t in tasks:
            t.cancel()
    if body.include_usage and all(c.done for c in calls):
        yield R.sse({**R.envelope(first.rid, body.chat, body.model, first.created, [], chunk=True),
                     "usage": R.usage(first.prompt_tokens, sum(c.generated for c in calls), first.cached,
                                      first.cached_from)})
    yield R.sse("[DONE]")


async def choice_chunks(engine: Engine, call: Call) -> AsyncIterator[str]:
    """One choice's chunks (its `index`); an error after admission as an error event."""
    body = call.body
    usage_field = {"usage": None} if body.include_usage else {}
    i = call.index

    def chunk(choice: dict) -> str:
        return R.sse({**R.envelope(call.rid, body.chat, body.model, call.created, [choice], chunk=True),
                      **usage_field})

    answer = call.turn.stream() if call.turn is not None else None
    offset = 0
    if body.chat:
        yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None})
    try:
        async for d in deltas(engine, call):
            final = d.finish is not None
            finish = d.finish.reason if final else None
            logprobs = None
            if body.logprobs is not None and d.logprobs:
                logprobs = (R.chat_logprobs(d.logprobs, engine.piece) if body.chat
                            else R.completion_logprobs(d.logprobs, engine.piece, offset))
            if answer is not None:
                think, content, made = answer.feed(d.text, final)
                delta = {**({"reasoning_content": think} if think else {}), **({"content": content} if content else {})}
                if made:  # the calls whole, each at its index, in the last chunk (as vLLM's parsers end)
                    if delta or logprobs:
                        yield chunk({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": None})
                    delta = {"tool_calls": [{"index": k, **c.openai()} for k, c in enumerate(made)]}
                    logprobs, finish = None, call.turn.finish_reason(finish, made)
                if delta or logprobs or final:
                    yield chunk({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            else:  # a chunk per step that commits tokens, its text empty while a character is incomplete
                yield chunk({"index": i, "text": d.text, "logprobs": logprobs, "finish_reason": finish,
                             **({"stop_reason": d.finish.matched} if final else {})})
            offset += len(d.text)
            if final:
                call.generated = d.stats.generated_tokens if d.stats is not None else call.timing.tokens
                call.cached, call.cached_from = d.cached_tokens, d.cached_from
    except P.ApiError as e:
        yield R.sse(e.body())
