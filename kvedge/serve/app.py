"""The OpenAI-compatible HTTP API of `kvedge serve` (Starlette; uvicorn runs it): requests in, Jobs to the
scheduler, events back out as JSON or server-sent events.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics.
What kvedge cannot do (n > 1, tools, logprobs, logit_bias, frequency / presence penalties, ...) is refused
with an OpenAI-style error object, as is any parameter this module does not know: nothing is ignored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvedge.errors import KvedgeError
from kvedge.runtime.sampling import SamplingParams
from kvedge.runtime.tokenizer import eos_ids
from kvedge.serve.scheduler import Event, Job, QueueFull, Scheduler

MAX_BODY_BYTES = 1 << 20
log = logging.getLogger("kvedge.serve")
# parameters that change nothing kvedge does (who asks, storage, routing hints)
HARMLESS = {"model", "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
SAMPLING = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
            "repetition_penalty", "ignore_eos", "n", "logprobs", "frequency_penalty", "presence_penalty",
            "logit_bias"}
COMPLETION_FIELDS = HARMLESS | SAMPLING | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = HARMLESS | SAMPLING | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                     "functions", "function_call", "parallel_tool_calls", "response_format"}
ROLES = {"system", "developer", "user", "assistant"}


class ApiError(Exception):
    """An OpenAI-style error answer: status, message, the parameter at fault, a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# -- reading a request ------------------------------------------------------------------------------------------
def _get(body: dict, name: str, types: tuple[type, ...], default=None, what: str = ""):
    """body[name] if it has one of `types` (bool is not a number here), default when absent or null."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        raise ApiError(400, f"'{name}' must be {what or ' or '.join(t.__name__ for t in types)}, got "
                            f"{type(v).__name__} {json.dumps(v)[:60]}", name)
    return v


def _refuse(body: dict, name: str, allowed, why: str) -> None:
    """A parameter kvedge cannot honour: fine absent or at `allowed` (a value, or a predicate), refused else."""
    v = body.get(name)
    if v is None or (allowed(v) if callable(allowed) else v == allowed):
        return
    raise ApiError(400, f"'{name}' = {json.dumps(v)[:60]} is not supported: {why}", name, "unsupported_parameter")


def _check_fields(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(400, f"unsupported parameter(s) {', '.join(map(repr, unknown))}: kvedge serve does not "
                            f"implement them", unknown[0], "unsupported_parameter")
    _refuse(body, "n", 1, "kvedge returns one choice per request; send n requests")
    _refuse(body, "logprobs", lambda v: v is False or v == 0, "kvedge does not return log probabilities")
    _refuse(body, "top_logprobs", 0, "kvedge does not return log probabilities")
    _refuse(body, "logit_bias", lambda v: v == {}, "kvedge has no logit bias")
    for name in ("frequency_penalty", "presence_penalty"):
        _refuse(body, name, lambda v: v == 0, "kvedge has no additive penalties; it has repetition_penalty "
                                              "(multiplicative, > 1 penalizes tokens already present)")
    _refuse(body, "echo", False, "the prompt is not echoed")
    _refuse(body, "best_of", 1, "kvedge returns one choice per request")
    _refuse(body, "suffix", lambda v: v == "", "kvedge does not insert text")
    for name in ("tools", "functions"):
        _refuse(body, name, lambda v: v == [], "kvedge serve has no tool calling")
    for name in ("tool_choice", "function_call"):
        _refuse(body, name, "none", "kvedge serve has no tool calling")
    _refuse(body, "response_format", lambda v: v == {"type": "text"}, "kvedge serve has no structured output")


def _sampling(body: dict) -> SamplingParams:
    try:
        return SamplingParams(temperature=float(_get(body, "temperature", (int, float), 1.0)),
                              top_k=_get(body, "top_k", (int,), 0),
                              top_p=float(_get(body, "top_p", (int, float), 1.0)),
                              repetition_penalty=float(_get(body, "repetition_penalty", (int, float), 1.0)),
                              seed=_get(body, "seed", (int,)))
    except KvedgeError as e:
        raise ApiError(400, str(e)) from None


def _stop(body: dict) -> tuple[str, ...]:
    stop = _get(body, "stop", (str, list), (), "a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be at most 4 non-empty strings", "stop")
    return tuple(stop)


def _text_content(content, where: str) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"{where}: only text parts are supported", "messages")
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where}: content must be a string or a list of text parts", "messages")


class Completion:
    """The shape of /v1/completions answers: a choice holds `text`."""

    prefix, chunk_object, opens = "cmpl-", "text_completion", False  # opens: a first chunk with the role

    def choice(self, text: str, finish: str | None, role: bool = False) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def answer(self, head: dict, text: str, finish: str) -> dict:
        return head | {"choices": [self.choice(text, finish)]}


class ChatCompletion(Completion):
    """The shape of /v1/chat/completions answers: a chunk's choice holds a `delta` (the first one the role), the
    answer's a `message`."""

    prefix, chunk_object, opens = "chatcmpl-", "chat.completion.chunk", True

    def choice(self, text: str, finish: str | None, role: bool = False) -> dict:
        delta = {"role": "assistant", "content": text} if role else {"content": text} if finish is None else {}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def answer(self, head: dict, text: str, finish: str) -> dict:
        return head | {"object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}]}


class Api:
    """The routes over one scheduler. Requests are parsed and checked on the event loop (prompts tokenized in a
    worker thread); generation runs on the scheduler's thread, whose events come back through
    call_soon_threadsafe."""

    def __init__(self, scheduler: Scheduler, model_name: str, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.scheduler, self.tokenizer, self.metrics = scheduler, scheduler.tokenizer, scheduler.metrics
        self.model_name, self.api_key, self.max_body_bytes = model_name, api_key, max_body_bytes
        self.created = int(time.time())
        self.eos = eos_ids(scheduler.backend.cfg, self.tokenizer)

    # -- plumbing --------------------------------------------------------------------------------------------
    def route(self, handler, auth: bool = True):
        async def endpoint(request):
            try:
                if auth and self.api_key is not None and not secrets.compare_digest(
                        request.headers.get("authorization", "").encode(), f"Bearer {self.api_key}".encode()):
                    raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                   code="invalid_api_key")
                return await handler(request)
            except ApiError as e:
                if self.metrics is not None:
                    self.metrics.refused("rejected" if e.status == 429 else "invalid")
                headers = {"Retry-After": "1"} if e.status == 429 else None
                return JSONResponse(e.body(), status_code=e.status, headers=headers)
            except Exception as e:  # noqa: BLE001 - a bug answers this request with a 500; the server goes on
                log.exception("kvedge serve: %s %s failed", request.method, request.url.path)
                return JSONResponse(ApiError(500, f"{type(e).__name__}: {e}", kind="server_error").body(),
                                    status_code=500)

        return endpoint

    async def _body(self, request, known: set[str]) -> dict:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise ApiError(413, f"the request body ({length} bytes) is over the limit of {self.max_body_bytes} bytes")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.max_body_bytes:
                raise ApiError(413, f"the request body is over the limit of {self.max_body_bytes} bytes")
        try:
            body = json.loads(data, parse_constant=_not_json)
        except ValueError as e:
            raise ApiError(400, f"malformed JSON in the request body: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")
        _check_fields(body, known)
        return body

    def _job(self, body: dict, prompt: list[int], max_tokens: int | None) -> Job:
        room = self.scheduler.max_seq_len - len(prompt)
        if max_tokens is None:
            max_tokens = max(room, 1)
        job = Job(prompt, max_tokens, _sampling(body), _stop(body),
                  frozenset() if _get(body, "ignore_eos", (bool,), False) else self.eos)
        try:
            self.scheduler.check(job)
        except KvedgeError as e:
            code = "context_length_exceeded" if room < max_tokens else None
            raise ApiError(400, str(e), "messages" if "messages" in body else "prompt", code) from None
        return job

    async def _run(self, request, job: Job, stream: bool, usage_in_stream: bool, shape: "Completion"):
        """Submit the job; stream its events as SSE chunks, or wait for the whole answer. A client that goes
        away cancels the job (the scheduler frees its row)."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        job.emit = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise ApiError(429, str(e), code="rate_limit_exceeded", kind="requests") from None
        except KvedgeError as e:
            raise ApiError(503, str(e), kind="server_error") from None
        head = {"id": shape.prefix + uuid.uuid4().hex[:24], "object": shape.chunk_object, "created": int(time.time()),
                "model": self.model_name}

        def usage(event: Event) -> dict:
            return {"prompt_tokens": len(job.prompt), "completion_tokens": event.completion_tokens,
                    "total_tokens": len(job.prompt) + event.completion_tokens}

        def error(event: Event) -> dict:
            return ApiError(500, f"generation failed: {event.error}", kind="server_error").body()

        if not stream:
            async def collect():
                parts = []
                while True:
                    event = await events.get()
                    parts.append(event.text)
                    if event.finish is not None:
                        return "".join(parts), event

            answer, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnected(request))
            try:
                await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not answer.done():
                    answer.cancel()
                    self.scheduler.cancel(job)
            if not answer.done() or answer.cancelled():
                return JSONResponse({}, status_code=499)  # nobody reads it
            text, event = answer.result()
            if event.finish == "error":
                return JSONResponse(error(event), status_code=500)
            return JSONResponse(shape.answer(head, text, event.finish) | {"usage": usage(event)})

        async def sse():
            if shape.opens:
                yield _sse(head | {"choices": [shape.choice("", None, role=True)]})
            while True:
                event = await events.get()
                if event.finish is None:  # one chunk a token, as it comes
                    yield _sse(head | {"choices": [shape.choice(event.text, None)]})
                    continue
                if event.finish == "error":
                    yield _sse(error(event))
                else:
                    yield _sse(head | {"choices": [shape.choice("", event.finish)]})
                    if usage_in_stream:
                        yield _sse(head | {"choices": [], "usage": usage(event)})
                yield "data: [DONE]\n\n"
                return

        return EventStream(sse(), on_end=lambda: self.scheduler.cancel(job))

    def _stream_flags(self, body: dict) -> tuple[bool, bool]:
        stream = _get(body, "stream", (bool,), False)
        opts = _get(body, "stream_options", (dict,), {}, "an object")
        if opts and not stream:
            raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
        if set(opts) - {"include_usage"}:
            raise ApiError(400, f"unsupported stream_options {sorted(set(opts) - {'include_usage'})}",
                           "stream_options")
        return stream, bool(opts.get("include_usage", False))

    # -- the routes ---------------------------------------------------------------------------------------------
    async def completions(self, request):
        body = await self._body(request, COMPLETION_FIELDS)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = await asyncio.to_thread(self.tokenizer.encode, prompt)  # a long prompt: not on the loop
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        elif isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
            raise ApiError(400, f"one prompt per request, got {len(prompt)} (kvedge returns one choice)", "prompt")
        else:
            raise ApiError(400, "'prompt' must be a string or a list of token ids", "prompt")
        job = self._job(body, ids, _get(body, "max_tokens", (int,), 16))
        return await self._run(request, job, *self._stream_flags(body), Completion())

    async def chat(self, request):
        body = await self._body(request, CHAT_FIELDS)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
        rendered = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise ApiError(400, f"messages[{i}]: an object with a role of {', '.join(sorted(ROLES))} expected "
                                    f"(tool messages are not supported)", "messages")
            role = "system" if m["role"] == "developer" else m["role"]
            rendered.append({"role": role, "content": _text_content(m.get("content"), f"messages[{i}]")})
        max_tokens = _get(body, "max_completion_tokens", (int,), _get(body, "max_tokens", (int,)))
        try:  # rendering and tokenizing a long conversation: off the event loop
            ids = await asyncio.to_thread(self._chat_ids, rendered)
        except KvedgeError as e:
            raise ApiError(400, str(e), "messages") from None
        job = self._job(body, ids, max_tokens)
        return await self._run(request, job, *self._stream_flags(body), ChatCompletion())

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), add_special_tokens=False)

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvedge",
             "max_model_len": self.scheduler.max_seq_len}]})

    async def health(self, request):
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request):
        if self.metrics is None:
            raise ApiError(404, "this server keeps no metrics")
        data, content_type = self.metrics.render()
        return Response(data, media_type=content_type)


class EventStream(StreamingResponse):
    """Server-sent events; `on_end` runs however the response ends: sent in full, its client gone mid-stream,
    or never started (the scheduler's cancel is a no-op for a job that has finished)."""

    def __init__(self, events, on_end):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_end = on_end

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _disconnected(request) -> None:
    """Return when the client goes away (the body is read: all that can come is http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(scheduler: Scheduler, model_name: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES):
    """The Starlette app; its lifespan starts the scheduler's thread and, at shutdown, ends what is in flight."""
    api = Api(scheduler, model_name, api_key, max_body_bytes)

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.close)

    app = Starlette(routes=[
        Route("/v1/chat/completions", api.route(api.chat), methods=["POST"]),
        Route("/v1/completions", api.route(api.completions), methods=["POST"]),
        Route("/v1/models", api.route(api.models), methods=["GET"]),
        Route("/metrics", api.route(api.metrics_text), methods=["GET"]),
        Route("/health", api.route(api.health, auth=False), methods=["GET"]),
    ], lifespan=lifespan)
    app.state.scheduler = scheduler
    return app
