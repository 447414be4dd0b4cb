"""``torch-npu2 serve``: an OpenAI-compatible HTTP server for one patched model (FastAPI + uvicorn).

``/v1/chat/completions``, ``/v1/completions`` (both also as server-sent events with ``"stream": true``) and
``/v1/models``. The model is loaded once; requests run one at a time, in arrival order, on one generation
thread, and at most ``max_queue`` wait behind the running one (more get 503 with a Retry-After). A client that
disconnects cancels its generation after the current token, or before it starts if it was still waiting.
Every field is type-checked: malformed bodies, mistyped or out-of-range parameters and OpenAI fields this server
does not implement get 400 with a message naming the parameter, a model other than the one served gets 404
``model_not_found``; nothing a request does stops the server.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from .patch_llama import PromptTooLongError
from .textgen import (ConversationCache, Generation, Sampling, SamplingError, TokenLogprob, chat_input_ids,
                      check_request, generate, text_input_ids)

API_KEY_VARIABLE = "TORCH_NPU2_API_KEY"
DEFAULT_MAX_TOKENS = 256
# Requests that may wait behind the running one: enough for a dozen concurrent clients with the openai package's
# defaults (2 retries of a 503) to all get answers; a waiting request holds only its prompt.
DEFAULT_MAX_QUEUE = 32
POLL_SECONDS = 0.2  # how often a waiting non-streaming request checks whether its client is still there
# Our sampling field names where OpenAI's differ, for error messages.
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "logprobs": "top_logprobs"}
MOST_COMPLETION_LOGPROBS = 5  # the legacy completions API's limit
UNLIKELY = -9999.0  # OpenAI's stand-in for a log-probability of -inf (JSON has no infinity)
# What a mistyped field should have been, for the 400's message.
EXPECTED = {"model": "a string", "max_tokens": "an int", "max_completion_tokens": "an int", "temperature": "a number",
            "top_p": "a number", "top_k": "an int", "repetition_penalty": "a number", "seed": "an int",
            "stop": "a string or a list of strings", "stream": "a boolean", "stream_options": "an object",
            "n": "an int", "presence_penalty": "a number", "frequency_penalty": "a number",
            "logit_bias": "an object mapping token ids to numbers", "user": "a string", "messages": "a list of messages",
            "prompt": "a string or a list of strings", "top_logprobs": "an int"}

log = logging.getLogger("torch_npu2.serve")


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---- request bodies -------------------------------------------------------------------------------------------

class _Strict(BaseModel):
    # no coercion ("5" is not an int, true is not a number) and no unknown field: an OpenAI field this server does
    # not implement (tools, response_format, echo, …) is refused by name rather than silently ignored
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Body(_Strict):
    model: str | None = None  # None or the served model's id
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # an extension (as in vLLM and llama.cpp's server)
    repetition_penalty: float = 1.0  # an extension
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end user's id, for the operator: it does not change the answer


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionBody(_Body):
    prompt: str | list[str]
    logprobs: int | None = None


FIELD_NAMES = {name for body in (ChatBody, CompletionBody, ChatMessage, TextPart, StreamOptions)
               for name in body.model_fields}


# ---- the generation queue --------------------------------------------------------------------------------------

@dataclass
class JobRecord:
    """What a finished job did (kept for logs and tests)."""

    finish_reason: str
    completion_tokens: int
    started: float
    ended: float


@dataclass
class Job:
    input_ids: object
    sampling: Sampling
    loop: asyncio.AbstractEventLoop
    cancel: threading.Event = field(default_factory=threading.Event)
    # ("text", (str, its tokens' logprobs)), ("done", Generation), ("error", exception)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    def _post(self, event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def run(self, model, tokenizer, conversation: ConversationCache | None = None) -> Generation | None:
        """On the generation thread. ``conversation``: the cache the previous request left (the Worker's)."""
        behind: list[TokenLogprob] = []  # generate hands a piece's logprobs over just before its text

        def on_text(text: str) -> None:
            self._post(("text", (text, behind[:])))
            behind.clear()

        try:
            result = generate(model, tokenizer, self.input_ids, self.sampling, on_text=on_text, cancel=self.cancel,
                              on_logprobs=behind.extend, conversation=conversation)
        except Exception as exc:  # reported to the request; the server goes on
            log.exception("generation failed")
            self._post(("error", exc))
            return None
        self._post(("done", result))
        return result


class Worker:
    """One generation at a time on one thread, in arrival order; at most ``max_queue`` jobs wait behind it. It keeps
    the KV cache of the last generation: a request whose prompt starts with that one's prompt and answer (the next
    turn of the same chat) prefills only its new tokens."""

    def __init__(self, model, tokenizer, max_queue: int):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {max_queue!r}")
        self.model, self.tokenizer, self.max_queue = model, tokenizer, max_queue
        self.conversation = ConversationCache()
        self.outstanding = 0  # accepted and not finished: the running job and those waiting
        self.finished: deque[JobRecord] = deque(maxlen=256)
        self._jobs: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._current: Job | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="torch-npu2-generate")

    async def start(self) -> None:
        self._jobs = asyncio.Queue()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._current is not None:
            self._current.cancel.set()
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def submit(self, input_ids, sampling: Sampling) -> Job:
        if self.outstanding > self.max_queue:
            raise ApiError(503, f"the server is busy: one request is running and {self.max_queue} are waiting "
                                "(the most it queues); retry later", kind="server_busy", headers={"Retry-After": "1"})
        job = Job(input_ids, sampling, asyncio.get_running_loop())
        self.outstanding += 1
        self._jobs.put_nowait(job)
        return job

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            job = await self._jobs.get()
            started = time.perf_counter()
            try:
                if job.cancel.is_set():  # its client left while it waited
                    self.finished.append(JobRecord("cancelled", 0, started, started))
                    continue
                self._current = job
                result = await loop.run_in_executor(self._executor, job.run, self.model, self.tokenizer,
                                                    self.conversation)
                if result is not None:
                    self.finished.append(JobRecord(result.finish_reason, result.completion_tokens, started,
                                                   time.perf_counter()))
                    log.info("%s %s", result.finish_reason, result.stats_line())
            finally:
                self._current = None
                self.outstanding -= 1


# ---- the app ---------------------------------------------------------------------------------------------------

def _logit_bias(body: _Body) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; a key that is not a token id gets a 400."""
    pairs = []
    for key, bias in (body.logit_bias or {}).items():
        if not key.isdecimal():
            raise ApiError(400, f"logit_bias: keys must be token ids (integers, as strings), got {key!r}", "logit_bias")
        pairs.append((int(key), bias))
    return tuple(pairs)


def _sampling(model, body: _Body, max_tokens: int | None, logprobs: int | None, prompt_tokens: int, context: int,
              prompt_param: str) -> Sampling:
    if body.n != 1:
        raise ApiError(400, f"n: only 1 choice per request is supported, got {body.n}", "n")
    room = context - prompt_tokens
    if max_tokens is not None and 0 < room < max_tokens:
        raise ApiError(400, f"max_tokens: the prompt ({prompt_tokens} tokens) leaves room for {room} tokens in the "
                            f"model's context of {context}, got {max_tokens}", "max_tokens")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        sampling = Sampling(max_new_tokens=min(DEFAULT_MAX_TOKENS, max(room, 1)) if max_tokens is None else max_tokens,
                            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                            repetition_penalty=body.repetition_penalty, stop=stop, seed=body.seed,
                            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                            logit_bias=_logit_bias(body), logprobs=logprobs)
        check_request(model, sampling, prompt_tokens)
    except SamplingError as exc:
        name = OPENAI_NAMES.get(exc.field, exc.field)
        raise ApiError(400, f"{name}: expected {exc.expected}, got {exc.value!r}", name) from None
    except PromptTooLongError as exc:
        raise ApiError(400, f"{prompt_param}: {exc}", prompt_param) from None
    return sampling


def _logprob(value: float) -> float:
    return value if value > UNLIKELY else UNLIKELY


def _chat_logprobs(entries: list[TokenLogprob] | None) -> dict | None:
    """OpenAI's chat ``logprobs``: per token its text, log-probability, UTF-8 bytes and the likeliest tokens."""
    if entries is None:
        return None
    return {"content": [{"token": e.text, "logprob": _logprob(e.logprob), "bytes": list(e.bytes),
                         "top_logprobs": [{"token": text, "logprob": _logprob(lp), "bytes": list(raw)}
                                          for text, raw, lp in e.top]} for e in entries], "refusal": None}


def _completion_logprobs(entries: list[TokenLogprob] | None) -> dict | None:
    """The legacy completions ``logprobs``: parallel lists, the likeliest tokens as {text: log-probability}."""
    if entries is None:
        return None
    return {"tokens": [e.text for e in entries], "token_logprobs": [_logprob(e.logprob) for e in entries],
            "top_logprobs": [{text: _logprob(lp) for text, _, lp in e.top} for e in entries],
            "text_offset": [e.text_offset for e in entries]}


def _usage(result: Generation) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}  # not prefilled again (Worker)


def _sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _validation_error(errors: list[dict], body: type[_Body]) -> ApiError:
    """A 400 naming the parameter of pydantic's first error in ``body``: its path through the fields and list
    indices (``messages[0].role``), without pydantic's union-member tags or a JSON syntax error's byte offset."""
    first = errors[0]
    kind, loc = first.get("type", ""), first.get("loc", ())[1:]
    if kind == "json_invalid":
        return ApiError(400, "the body is not valid JSON")
    path = [part for i, part in enumerate(loc) if isinstance(part, int) or part in FIELD_NAMES
            or (kind == "extra_forbidden" and i == len(loc) - 1)]
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".") or None
    expected = {**EXPECTED, "logprobs": "a boolean" if body is ChatBody else "an int"}
    if kind == "extra_forbidden":
        message = f"{param}: not supported by this server (it takes: {', '.join(sorted(body.model_fields))})"
    elif kind == "missing":
        message = f"{param}: Field required"
    elif len(path) == 1 and path[0] in expected:
        message = f"{param}: expected {expected[path[0]]}, got {first.get('input')!r}"
    else:
        message = f"{param}: {first.get('msg', 'invalid')}" if param else first.get("msg", "invalid request")
    return ApiError(400, message, param)


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _install_error_handlers(app: FastAPI) -> None:
    """Every failure leaves as OpenAI's error shape: ours, a body that does not validate, Starlette's own HTTP
    errors (unknown route, wrong method) and, as a 500, anything else."""
    async def api_error(request, exc: ApiError):
        return _error_response(exc)

    async def invalid_body(request, exc: RequestValidationError):
        body = CompletionBody if request.url.path.endswith("/v1/completions") else ChatBody
        return _error_response(_validation_error(exc.errors(), body))

    async def http_error(request, exc: HTTPException):
        return _error_response(ApiError(exc.status_code, str(exc.detail), kind="invalid_request_error"))

    async def server_error(request, exc: Exception):
        log.exception("request failed")
        return _error_response(ApiError(500, f"{type(exc).__name__}: {exc}", kind="server_error"))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)


async def _result_of(job: Job, request: Request) -> Generation:
    """Wait for a non-streamed job, cancelling it if the client goes away (checked every POLL_SECONDS, whether or
    not text keeps arriving)."""
    loop = asyncio.get_running_loop()
    check_at = loop.time() + POLL_SECONDS
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(job.events.get(), POLL_SECONDS)
            except asyncio.TimeoutError:
                kind, value = "waiting", None
            if kind == "done":
                return value
            if kind == "error":
                raise ApiError(500, f"generation failed: {type(value).__name__}: {value}", kind="server_error")
            if loop.time() >= check_at:
                if await request.is_disconnected():
                    raise ApiError(499, "client disconnected")
                check_at = loop.time() + POLL_SECONDS
    finally:
        job.cancel.set()  # a no-op once done


async def _events_of(job: Job, chunk, final, include_usage: bool):
    """Server-sent events of a job: ``chunk(text, logprobs)`` per piece of text, ``final(result)`` at the end;
    closing the stream (the client left) cancels the job."""
    try:
        yield _sse(chunk("", None))
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                yield _sse(chunk(*value))
            elif kind == "error":
                yield _sse(ApiError(500, f"generation failed: {type(value).__name__}: {value}",
                                    kind="server_error").body())
                break
            else:
                yield _sse(final(value))
                if include_usage:
                    yield _sse({**final(value), "choices": [], "usage": _usage(value)})
                break
        yield _sse("[DONE]")
    finally:
        job.cancel.set()


def _stream(job: Job, body: _Body, chunk, final) -> StreamingResponse:
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return StreamingResponse(_events_of(job, chunk, final, include_usage), media_type="text/event-stream")


class _Endpoints:
    """The routes' handlers and what they share: the worker, the served model's name and context, the API key."""

    def __init__(self, model, tokenizer, model_name: str, api_key: str | None, max_queue: int):
        self.model, self.tokenizer, self.model_name, self.api_key = model, tokenizer, model_name, api_key
        self.worker = Worker(model, tokenizer, max_queue)
        self.context = getattr(model.config, "max_position_embeddings", None) or 2 ** 31
        self.created = int(time.time())

    async def authorized(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           kind="authentication_error")

    def _start(self, body: _Body, input_ids, max_tokens: int | None, logprobs: int | None, prompt_param: str) -> Job:
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist: this server serves {self.model_name!r}",
                           "model", code="model_not_found")
        sampling = _sampling(self.model, body, max_tokens, logprobs, input_ids.shape[1], self.context, prompt_param)
        return self.worker.submit(input_ids, sampling)

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "torch_npu2"}]}

    async def chat_completions(self, body: ChatBody, request: Request):
        if not body.messages:
            raise ApiError(400, "messages: expected at least one message", "messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs set to true", "top_logprobs")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        job = self._start(body, chat_input_ids(self.tokenizer, messages), max_tokens, logprobs, "messages")
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "model": self.model_name, "created": int(time.time())}
        if body.stream:
            def chunk(text, entries):
                delta = {"role": "assistant", "content": ""} if text == "" else {"content": text}
                return {**head, "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": delta, "finish_reason": None,
                                     "logprobs": _chat_logprobs(entries) if logprobs is not None else None}]}

            def final(result):
                return {**head, "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": {}, "finish_reason": _finish(result)}]}

            return _stream(job, body, chunk, final)
        result = await _result_of(job, request)
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                             "logprobs": _chat_logprobs(result.logprobs), "finish_reason": _finish(result)}],
                "usage": _usage(result)}

    async def completions(self, body: CompletionBody, request: Request):
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1 or not prompts[0]:
            raise ApiError(400, "prompt: expected one non-empty string", "prompt")
        if body.logprobs is not None and not 0 <= body.logprobs <= MOST_COMPLETION_LOGPROBS:
            raise ApiError(400, f"logprobs: expected an int in [0, {MOST_COMPLETION_LOGPROBS}], got {body.logprobs}",
                           "logprobs")
        job = self._start(body, text_input_ids(self.tokenizer, prompts[0]), body.max_tokens, body.logprobs, "prompt")
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "model": self.model_name,
                "created": int(time.time())}
        if body.stream:
            def chunk(text, entries):
                return {**head, "choices": [{"index": 0, "text": text, "finish_reason": None,
                                             "logprobs": _completion_logprobs(entries) if body.logprobs is not None
                                             else None}]}

            def final(result):
                return {**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                             "finish_reason": _finish(result)}]}

            return _stream(job, body, chunk, final)
        result = await _result_of(job, request)
        return {**head, "choices": [{"index": 0, "text": result.text, "logprobs": _completion_logprobs(result.logprobs),
                                     "finish_reason": _finish(result)}], "usage": _usage(result)}


def create_app(model, tokenizer, model_name: str, api_key: str | None = None, max_queue: int = DEFAULT_MAX_QUEUE):
    """The ASGI app serving ``model`` (already patched) under the id ``model_name``; ``app.state.worker`` runs
    the generations."""
    endpoints = _Endpoints(model, tokenizer, model_name, api_key, max_queue)

    @asynccontextmanager
    async def lifespan(app):
        await endpoints.worker.start()
        yield
        await endpoints.worker.stop()

    app = FastAPI(title="torch_npu2", lifespan=lifespan)
    app.state.worker = endpoints.worker
    _install_error_handlers(app)
    guarded = [Depends(endpoints.authorized)]
    app.get("/v1/models", dependencies=guarded)(endpoints.models)
    app.post("/v1/chat/completions", dependencies=guarded)(endpoints.chat_completions)
    app.post("/v1/completions", dependencies=guarded)(endpoints.completions)
    return app


def _finish(result: Generation) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, ready for ``run``: binding before the model loads makes a port in use or
    an address this machine does not have an error before any slow work. OSError otherwise."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a closed server's TIME_WAIT is fine
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def run(model, tokenizer, model_name: str, sock: socket.socket, api_key: str | None = None,
        max_queue: int = DEFAULT_MAX_QUEUE) -> int:
    """Serve on ``sock`` (from ``bind``) until interrupted (Ctrl-C: uvicorn shuts down cleanly)."""
    import uvicorn

    app = create_app(model, tokenizer, model_name, api_key=api_key, max_queue=max_queue)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    print(f"serving {model_name} at http://{where}:{port}/v1 (OpenAI-compatible; "
          f"{'API key required' if api_key else 'no API key'}; Ctrl-C stops)", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled once it has shut down cleanly
        pass
    return 0
