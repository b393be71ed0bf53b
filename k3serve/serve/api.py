"""The OpenAI-compatible HTTP server (FastAPI): completions, chat, models, tokenize, metrics.

Every bad input is a 4xx with an OpenAI-style error body and the server keeps serving; a client
that disconnects aborts its request and its cache memory returns at once.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_engine import AsyncLLM, QueueFull
from ..engine.engine import RequestOutput
from ..engine.scheduler import RequestRejected
from .metrics import Metrics
from .protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       error_body)
from .response_store import ResponseStore


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


@dataclass
class ServerState:
    llm: AsyncLLM
    model_name: str
    tokenizer: Any = None  # this process's own copy (the engine process holds another)
    api_key: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    tool_call_text_limit: int | None = None  # (tool_grammar: free text of a forced tool call, capped)
    return_tokens_as_token_ids: bool = False  # (the requests' default)
    sampling_defaults: dict = field(default_factory=dict)  # (the model's generation config: omitted settings)
    responses: ResponseStore = field(default_factory=ResponseStore)  # (/v1/responses' stored ones)
    last_stats: dict | None = None  # (/metrics: the engine's last gauges)

    @property
    def info(self):
        return self.llm.info


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def _error_event_on_failure(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream whose engine fails after the 200 went out ends with an OpenAI-style error event
    and [DONE] (as vLLM's), not a cut connection."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        yield _sse(error_body(f"the request failed mid-stream: {exc}", "internal_error"))
        yield _sse("[DONE]")


class _APIKeyCheck:
    """Plain ASGI middleware for /v1: Starlette's ``@app.middleware("http")`` (BaseHTTPMiddleware)
    pipes every response through memory streams and a task, per SSE chunk; behind it 39 % of the
    event loop's samples at 256 streams (RESULTS.md thirty-fifth session)."""

    def __init__(self, app, key: str, metrics: Metrics):
        self.app, self.expected, self.metrics = app, f"Bearer {key}".encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if given != self.expected:
                self.metrics.errors.labels("401").inc()
                response = JSONResponse(error_body("invalid or missing API key", "authentication_error",
                                                   code="invalid_api_key"), status_code=401)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


async def _json_body(request: Request) -> dict:
    try:
        data = await request.json()
    except Exception:
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return data


async def _parse(request: Request, model_cls):
    return validated(model_cls, await _json_body(request))


def validated(model_cls, data: dict):
    """``data`` as ``model_cls`` (pydantic); a bad field is a 400 naming it."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        err = errors[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        top = str(err["loc"][0]) if err.get("loc") else None
        same = [e for e in errors if e.get("loc") and str(e["loc"][0]) == top]
        if len(same) > 1:  # (a union field: each accepted type's complaint, not just the first's)
            tried = "; ".join(f"as {'.'.join(map(str, e['loc'][1:])) or top}: {e.get('msg')}" for e in same[:4])
            raise APIError(400, f"{top} has none of its accepted forms ({tried})", param=top) from None
        raise APIError(400, f"{loc}: {err.get('msg')}", param=loc or None) from None


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="k3serve", version="0.1.0")
    metrics = Metrics(state.model_name)
    app.state.k3 = state
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        metrics.errors.labels(str(exc.status)).inc()
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):  # unknown routes, wrong methods
        metrics.errors.labels(str(exc.status_code)).inc()
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error" if exc.status_code < 500 else
                                       "internal_error", code=exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        metrics.errors.labels("500").inc()
        return JSONResponse(error_body(f"internal error: {exc!r}", "internal_error"), status_code=500)

    if state.api_key:
        app.add_middleware(_APIKeyCheck, key=state.api_key, metrics=metrics)

    def check_model(name: str | None) -> None:
        check_model_name(state, name)

    @app.get("/health")
    async def health():
        if state.llm.errored is not None:
            return JSONResponse(error_body("engine failed", "internal_error"), status_code=500)
        return Response(status_code=200)

    app.add_api_route("/ping", health, methods=["GET", "POST"])  # (vLLM's, for SageMaker-style probes)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """(vLLM's: cached checkpoints dropped, so a benchmark starts cold.)"""
        try:
            prefix = (await state.llm.stats(reset_prefix_cache=True))["prefix"]
        except TimeoutError:
            raise APIError(503, "the engine did not answer within 30 s", "server_busy") from None
        return {"checkpoints_held": prefix.get("checkpoints_held", 0)}

    @app.get("/version")
    async def version():
        from .. import __version__

        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_route():
        """Never waits on a long engine step (a big prefill: seconds; Prometheus times a scrape out at
        10 s): the engine's gauges as of its last reply when a fresh one takes over a second."""
        try:
            state.last_stats = await state.llm.stats(timeout=1.0)
        except TimeoutError:
            if state.last_stats is None:
                raise APIError(503, "the engine is busy with a long step; no gauges read yet", "server_busy") from None
        return Response(metrics.render(state.last_stats), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(time.time()), "owned_by": "k3serve",
            "max_model_len": state.info.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _parse(request, TokenizeRequest)
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'")
        ids = (encode_prompt(state, body.prompt) if body.prompt is not None
               else render_chat(state, ChatCompletionRequest(
                   messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                   continue_final_message=body.continue_final_message)).token_ids)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.info.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _parse(request, DetokenizeRequest)
        check_model(body.model)
        need_tokenizer(state)
        vocab = state.info.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in 0..{vocab - 1}", param="tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        check_model(body.model)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        if body.suffix is not None:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        check_prompt_logprobs(body)
        # echo with max_tokens 0: the prompt scored, nothing generated (the one token run is dropped)
        max_tokens = 1 if body.echo and body.max_tokens == 0 else body.max_tokens
        prompt_ids = [encode_prompt(state, p, body.truncate_prompt_tokens) for p in prompts]
        for ids in prompt_ids:
            check_budget(state, ids, max_tokens, "max_tokens")
        params = make_params(state, body, max_tokens, body.logprobs, 16)
        if body.echo and body.logprobs is not None:  # (the prompt's tokens are reported with logprobs too)
            params.prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0)
        grammar = grammar_spec(state, body)
        gens = [start(state, request, ids, params, grammar, body, i if len(prompt_ids) > 1 else None)
                for i, ids in enumerate(prompt_ids)]
        if body.stream:
            try:
                firsts = [await _first(gen) for gen in gens]
            except BaseException:
                await _close(gens)
                raise
            return StreamingResponse(_error_event_on_failure(stream_completion(state, body, prompt_ids, gens, firsts)),
                                     media_type="text/event-stream")
        return completion_response(state, body, prompt_ids, await collect(request, gens))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _parse(request, ChatCompletionRequest)
        check_model(body.model)
        prompt, gen = chat_generation(state, request, body)
        if body.stream:
            first = await _first(gen)
            return StreamingResponse(_error_event_on_failure(stream_chat(state, body, prompt, gen, first)),
                                     media_type="text/event-stream")
        final, = await collect(request, [gen])
        return chat_response(state, body, prompt, final)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        from .responses import create

        return await create(state, request, await _json_body(request))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        from .responses import stored

        return stored(state, response_id).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        from .responses import stored

        stored(state, response_id)
        state.responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return app


def check_model_name(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                       "invalid_request_error", "model", "model_not_found")


def chat_generation(state: ServerState, request: Request, body: ChatCompletionRequest):
    """(the rendered prompt, its generation) of a chat request, checked and started."""
    prompt = render_chat(state, body)
    ids = prompt.token_ids
    use_parsers = bool(state.reasoning_parser or (state.tool_call_parser and body.tools))
    given = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = getattr(body, given)
    check_budget(state, ids, max_tokens, given)
    check_prompt_logprobs(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    params = make_params(state, body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                         max(1, state.info.max_model_len - len(ids)), keep_special=use_parsers, param=given,
                         logprobs_param="top_logprobs")
    grammar = grammar_spec(state, body, prompt)
    return prompt, start(state, request, ids, params, grammar, body)


# ---- request plumbing ----------------------------------------------------------------------

def need_tokenizer(state: ServerState) -> None:
    if state.tokenizer is None:
        raise APIError(400, "this model has no tokenizer: send token ids")


def encode_prompt(state: ServerState, prompt, truncate: int | None = None) -> list[int]:
    if isinstance(prompt, str):
        need_tokenizer(state)
        ids = state.tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        vocab = state.info.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be integers in 0..{vocab - 1}", param="prompt")
    ids = truncated(state, ids, truncate)
    check_length(state, ids, "prompt")
    return ids


def truncated(state: ServerState, ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last ``keep`` tokens (-1: as many as the context
    admits, one short of it for the first generated token)."""
    if keep is None:
        return ids
    limit = state.info.max_model_len
    if keep == -1:
        keep = limit - 1
    if keep < 1 or keep >= limit:
        raise APIError(400, f"truncate_prompt_tokens must be -1 or in 1..{limit - 1} (the context is {limit} tokens), "
                            f"got {keep}", param="truncate_prompt_tokens")
    return ids[-keep:]


def check_length(state: ServerState, ids: list[int], param: str) -> None:
    try:
        state.llm.check_admissible(ids)
    except RequestRejected as exc:
        raise APIError(400, str(exc), param=param) from None


def check_prompt_logprobs(body) -> None:
    if body.stream and body.prompt_logprobs is not None:  # (vLLM's rule; a completion's echo streams them)
        raise APIError(400, "prompt_logprobs are not available when streaming", param="prompt_logprobs")


def check_budget(state: ServerState, ids: list[int], max_tokens, param: str) -> None:
    """A prompt plus the tokens asked for past the context is refused, as vLLM does (not cut short
    silently); left out, the request runs to the end of the context."""
    limit = state.info.max_model_len
    if isinstance(max_tokens, int) and max_tokens > 0 and len(ids) + max_tokens > limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens; you requested "
                            f"{len(ids) + max_tokens} ({len(ids)} in the prompt, {max_tokens} in the completion): "
                            f"reduce the prompt or {param}", param=param)


def render_chat(state: ServerState, body: ChatCompletionRequest):
    """The chat prompt (ids + where it left the model: think / response channel, tool-call index)."""
    need_tokenizer(state)
    from .chat import build_chat_prompt

    try:
        prompt = build_chat_prompt(
            state.tokenizer, state.info.model_type,
            [m.model_dump(exclude_none=True) for m in body.messages], tools=body.tools, tool_choice=body.tool_choice,
            response_format=body.response_format, reasoning_effort=body.reasoning_effort,
            add_generation_prompt=body.add_generation_prompt, chat_template_kwargs=body.chat_template_kwargs,
            continue_final_message=body.continue_final_message)
    except (ValueError, TypeError, KeyError) as exc:
        field = re.search(r"\b(tool_choice|tools|continue_final_message|add_generation_prompt|reasoning_effort|"
                          r"thinking_effort|response_format)\b", str(exc))
        raise APIError(400, f"cannot render the conversation: {exc}", param=field[1] if field else "messages") from None
    prompt.token_ids = truncated(state, prompt.token_ids, getattr(body, "truncate_prompt_tokens", None))
    check_length(state, prompt.token_ids, "messages")
    return prompt


def make_params(state: ServerState, body, max_tokens, logprobs, default_max: int, keep_special: bool = False,
                param: str = "max_tokens", logprobs_param: str = "logprobs"):
    try:
        params = body.sampling_params(max_tokens, logprobs, default_max, state.sampling_defaults)
    except ValueError as exc:  # (SamplingParams' messages start with the field they are about)
        msg = str(exc)
        field = msg.split(" ", 1)[0]
        named = {"max_tokens": param, "logprobs": logprobs_param}.get(field, field)  # (as the request named it)
        msg, field = named + msg[len(field):], named
        raise APIError(400, msg, param=field if field.isidentifier() else None) from None
    vocab = state.info.vocab_size
    for name in ("logit_bias", "allowed_token_ids"):
        if any(t >= vocab for t in getattr(params, name) or ()):
            raise APIError(400, f"{name}: token ids must be in 0..{vocab - 1}", param=name)
    if keep_special:
        params.skip_special_tokens = False  # the reasoning / tool parsers read the markers
    return params


def _forced_tool_call(state: ServerState, body) -> bool:
    """tool_choice required / named on K3 with the tool parser on: the output is constrained."""
    choice = getattr(body, "tool_choice", None)
    return bool(getattr(body, "tools", None) and state.tool_call_parser and (choice == "required" or isinstance(choice, dict))
                and state.info.model_type == "kimi_k3")


_CONSTRAINTS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs")


def grammar_spec(state: ServerState, body, prompt=None):
    """The request's output constraint (a GrammarSpec) or None. The engine process compiles it off
    its hot path; an invalid one comes back as the request's first output (``_first``: a 400)."""
    if not state.info.structured_output:
        if body.response_format not in (None, {"type": "text"}) or body.guided_json or body.guided_regex \
                or body.guided_choice or body.guided_grammar or body.structured_outputs:
            raise APIError(400, "structured output is not available on this server", param="response_format")
        return None
    from .grammar import GrammarError, GrammarSpec

    try:
        spec = GrammarSpec.from_openai(response_format=body.response_format, guided_json=body.guided_json,
                                       guided_regex=body.guided_regex, guided_choice=body.guided_choice,
                                       guided_grammar=body.guided_grammar, structured_outputs=body.structured_outputs)
        if _forced_tool_call(state, body):
            if spec is not None:
                raise ValueError("tool_choice required/named cannot be combined with another output constraint")
            from .tool_grammar import tool_call_grammar

            spec = GrammarSpec("ebnf", tool_call_grammar(body.tools, body.tool_choice,
                                                         bool(getattr(prompt, "prompt_ends_in_think", False)),
                                                         state.tool_call_text_limit))
        return spec
    except (GrammarError, ValueError) as exc:
        given = [f for f in _CONSTRAINTS if getattr(body, f, None) not in (None, {"type": "text"})]
        raise APIError(400, f"invalid structured-output request: {exc}",
                       param=given[0] if len(given) == 1 else "response_format") from None


def start(state: ServerState, request: Request, ids, params, grammar, body,
          index: int | None = None) -> AsyncIterator[RequestOutput]:
    """One prompt's generation. Its id: the body's ``request_id`` or the X-Request-Id header (vLLM's:
    a client's trace id carries through), else a random one; ``index``: the prompt's in a list."""
    base = getattr(body, "request_id", None) or request.headers.get("x-request-id") or uuid.uuid4().hex[:24]
    rid = f"{'chatcmpl' if 'chat' in request.url.path else 'cmpl'}-{base}" + ("" if index is None else f"-{index}")
    return _observed(request.app.state.metrics, len(ids),
                     state.llm.generate(ids, params, rid, grammar=grammar, priority=body.priority))


async def _observed(metrics: Metrics, prompt_len: int, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Prometheus timings and counters around one request's output stream."""
    t0 = time.perf_counter()
    last = None
    try:
        async for out in gen:
            now = time.perf_counter()
            new = sum(len(o.delta_token_ids) for o in out.outputs)
            if new:
                if last is None:
                    metrics.ttft.observe(now - t0)
                else:
                    metrics.itl.observe((now - last) / new)
                last = now
                metrics.generation_tokens.inc(new)
            if out.finished:
                metrics.prompt_tokens.inc(prompt_len)
                metrics.e2e.observe(now - t0)
                for o in out.outputs:
                    metrics.requests.labels(o.finish_reason or "unknown").inc()
            yield out
    finally:
        await gen.aclose()


async def _first(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    """First output before the 200 is sent, so queue-full and engine rejections are real 4xx/5xx."""
    try:
        return await gen.__anext__()
    except QueueFull as exc:
        raise APIError(503, str(exc), "server_overloaded") from None
    except RequestRejected as exc:
        raise APIError(400, str(exc)) from None
    except ValueError as exc:  # the engine's other refusals, GrammarError (a bad constraint) among them
        from .grammar import GrammarError

        if isinstance(exc, GrammarError):
            raise APIError(400, f"invalid structured-output request: {exc}", param="response_format") from None
        raise APIError(400, str(exc)) from None


async def _last(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    out = await _first(gen)
    while not out.finished:
        out = await gen.__anext__()
    return out


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has gone: its body is read, so the next ASGI message is the
    disconnect (what Starlette's streaming responses listen for)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _close(gens: list[AsyncIterator[RequestOutput]]) -> None:
    """Closing a generation that has not finished aborts it: its memory returns now."""
    for gen in gens:
        await gen.aclose()


async def collect(request: Request, gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """The final outputs of a non-streaming request's generations, run together; the first
    failure fails them all, and a client that disconnects aborts them at once, queued or running."""
    tasks = [asyncio.ensure_future(_last(gen)) for gen in gens]
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        waiting = set(tasks)
        while waiting:
            done, _ = await asyncio.wait(waiting | {gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                raise APIError(499, "client disconnected")
            for task in done:
                task.result()  # (raises the failure)
            waiting -= done
        return [task.result() for task in tasks]
    finally:
        for task in (*tasks, gone):
            task.cancel()
        await asyncio.gather(*tasks, gone, return_exceptions=True)  # (before closing: none still runs)
        await _close(gens)


def _with_usage(body, chunk: dict, prompt_len: int, outs: list[RequestOutput]) -> dict:
    """A stream chunk, with the usage so far where the request asked for it on every chunk."""
    if body.stream_options and body.stream_options.continuous_usage_stats:
        chunk["usage"] = _usage(prompt_len, outs, not _echo_only(body))
    return chunk


def _echo_only(body) -> bool:
    """/v1/completions' echo with max_tokens 0: the prompt (scored), nothing generated."""
    return bool(getattr(body, "echo", False) and body.max_tokens == 0)


def _usage(prompt_len: int, outs: list[RequestOutput], generated: bool = True) -> dict:
    completion = sum(len(o.token_ids) for r in outs for o in r.outputs) if generated else 0
    prompt = prompt_len
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.num_cached_tokens for r in outs)}}


def _logprob(x: float) -> float:
    """JSON has no -inf (vLLM's floor, for a token whose probability underflowed)."""
    return max(x, -9999.0) if not math.isnan(x) else -9999.0


def _completion_logprobs(state: ServerState, body, lps, offset: int = 0) -> dict | None:
    """/v1/completions' logprobs of ``lps`` [(token, logprob, alternatives)], their text starting
    at ``offset`` of the choice's text (an echoed prompt's first token: logprob and alternatives None)."""
    if lps is None:
        return None
    text, name = _token_text(state), _token_name(state, body)
    lengths = [len(text(t)) for t, _, _ in lps]
    offsets = [offset + sum(lengths[:i]) for i in range(len(lps))]
    return {"tokens": [name(t) for t, _, _ in lps],
            "token_logprobs": [None if lp is None else _logprob(lp) for _, lp, _ in lps],
            # (the chosen token and its k alternatives, up to k + 1 entries: OpenAI's and vLLM's)
            "top_logprobs": [None if alts is None else {name(a): _logprob(alp) for a, alp in [(t, lp), *alts]}
                             for t, lp, alts in lps],
            "text_offset": offsets}


def _token_text(state: ServerState):
    tok = state.tokenizer
    return (lambda t: tok.decode([t])) if tok else str


def _token_name(state: ServerState, body):
    """How logprobs name a token: its text, or vLLM's "token_id:N" under return_tokens_as_token_ids
    (exact where a token's bytes are not whole characters)."""
    as_ids = body.return_tokens_as_token_ids
    as_ids = state.return_tokens_as_token_ids if as_ids is None else as_ids
    return (lambda t: f"token_id:{t}") if as_ids else _token_text(state)


def _echoed_scores(ids: list[int], scores: list, k: int) -> list[tuple]:
    """An echoed prompt's tokens as logprob entries: the engine's prompt scores, ``k`` alternatives."""
    return [(ids[0], None, None)] + [(t, lp, alts[:k]) for t, lp, alts, _ in scores[1:]]


def _prompt_logprobs(state: ServerState, scores: list | None, k: int) -> list | None:
    """vLLM's ``prompt_logprobs`` field: None for the first token, then {token id: {logprob, rank,
    decoded_token}} of the prompt's token and its ``k`` likeliest alternatives."""
    if scores is None:
        return None
    name = _token_text(state)
    out: list = [None]
    for t, lp, alts, rank in scores[1:]:
        entry = {str(t): {"logprob": _logprob(lp), "rank": rank, "decoded_token": name(t)}}
        for r, (a, alp) in enumerate(alts[:k], 1):
            entry.setdefault(str(a), {"logprob": _logprob(alp), "rank": r, "decoded_token": name(a)})
        out.append(entry)
    return out


def _chat_logprobs(state: ServerState, body, lps) -> dict:
    tok, name = state.tokenizer, _token_name(state, body)

    def entry(t: int, lp: float) -> dict:
        return {"token": name(t), "logprob": _logprob(lp), "bytes": list(tok.token_bytes(t))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]} for t, lp, alts in lps]}


def _prompt_text(state: ServerState, ids: list[int]) -> str:
    return state.tokenizer.decode(ids) if state.tokenizer else ""


def completion_response(state: ServerState, body, prompt_ids, finals) -> dict:
    choices = []
    generated = not _echo_only(body)
    for i, (ids, out) in enumerate(zip(prompt_ids, finals)):
        for o in out.outputs:
            text = (o.text if state.tokenizer else " ".join(map(str, o.token_ids))) if generated else ""
            lps = None if o.logprobs is None else (o.logprobs if generated else [])
            if body.echo:
                text = _prompt_text(state, ids) + text
                lps = None if lps is None else _echoed_scores(ids, out.prompt_logprobs, body.logprobs) + lps
            choice = {"index": i * body.n + o.index, "text": text, "finish_reason": o.finish_reason,
                      "stop_reason": o.stop_reason, "logprobs": _completion_logprobs(state, body, lps)}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _prompt_logprobs(state, out.prompt_logprobs, body.prompt_logprobs)
            choices.append(choice)
    usage = _usage(sum(len(p) for p in prompt_ids), finals, generated)
    return {"id": finals[0].request_id, "object": "text_completion", "created": int(time.time()),
            "model": state.model_name, "choices": choices, "usage": usage}


async def _merged(gens, firsts) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) of every generation as its outputs come; one generation runs inline
    (the common stream: no task, no queue)."""
    if len(gens) == 1:
        out = firsts[0]
        yield 0, out
        while not out.finished:
            out = await gens[0].__anext__()
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen, out) -> None:
        try:
            await queue.put((i, out))
            while not out.finished:
                out = await gen.__anext__()
                await queue.put((i, out))
        except Exception as exc:
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, gen, first)) for i, (gen, first) in enumerate(zip(gens, firsts))]
    try:
        running = len(gens)
        while running:
            i, out = await queue.get()
            if isinstance(out, Exception):
                raise out
            running -= out.finished
            yield i, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def stream_completion(state: ServerState, body, prompt_ids, gens, firsts) -> AsyncIterator[str]:
    """One SSE stream for every prompt's choices (index = prompt * n + choice), with each chunk's
    logprobs, the prompt first under ``echo``, and the stop reason at the end."""
    created, rid = int(time.time()), firsts[0].request_id
    prompt_len = sum(len(p) for p in prompt_ids)
    reported: set[int] = set()
    sent_lps: dict[int, int] = {}
    text_len: dict[int, int] = {}  # (as the whole response's text_offset: the token texts' lengths)
    finals = list(firsts)
    generated = not _echo_only(body)
    try:
        async for i, out in _merged(gens, firsts):
            finals[i] = out
            for o in out.outputs:
                key = i * body.n + o.index
                if key in reported or not (o.delta_text or o.delta_token_ids or o.finish_reason):
                    continue
                text = (o.delta_text if state.tokenizer else " ".join(map(str, o.delta_token_ids))) if generated else ""
                entries = None
                if o.logprobs is not None:
                    entries = o.logprobs[sent_lps.get(key, 0):] if generated else []
                    sent_lps[key] = len(o.logprobs)
                offset, prefix = text_len.get(key, 0), ""
                if body.echo and key not in text_len:  # (the prompt, scored, heads the choice's first chunk)
                    prefix = _prompt_text(state, prompt_ids[i])
                    if entries is not None:
                        entries = _echoed_scores(prompt_ids[i], out.prompt_logprobs, body.logprobs) + entries
                    else:
                        offset += len(prefix)
                lps = _completion_logprobs(state, body, entries, offset)
                text_len[key] = offset + (sum(len(_token_text(state)(t)) for t, _, _ in entries) if entries else 0)
                text = prefix + text
                choice = {"index": key, "text": text, "logprobs": lps, "finish_reason": o.finish_reason}
                if o.finish_reason:
                    choice["stop_reason"] = o.stop_reason
                    reported.add(key)
                yield _sse(_with_usage(body, {"id": rid, "object": "text_completion", "created": created,
                                              "model": state.model_name, "choices": [choice]}, prompt_len, finals))
    finally:
        await _close(gens)
    if body.stream_options and body.stream_options.include_usage:
        yield _sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                    "choices": [], "usage": _usage(prompt_len, finals, generated)})
    yield _sse("[DONE]")


def _parser_args(state: ServerState, body, prompt) -> dict:
    return dict(model_type=state.info.model_type, reasoning=bool(state.reasoning_parser),
                tools=bool(state.tool_call_parser and body.tools and body.tool_choice != "none"),
                prompt_ends_in_think=bool(getattr(prompt, "prompt_ends_in_think", False)),
                tool_call_start_index=getattr(prompt, "tool_call_start_index", 0))


def _chat_message(state: ServerState, body, prompt, text: str) -> tuple[dict, bool]:
    from .chat_output import parse_chat_output

    msg = {"role": "assistant", "content": text}
    if state.reasoning_parser or (state.tool_call_parser and body.tools):
        msg = parse_chat_output(text, **_parser_args(state, body, prompt))
    return msg, bool(msg.get("tool_calls"))


def chat_response(state: ServerState, body, prompt, final: RequestOutput) -> dict:
    prompt_ids = prompt.token_ids
    choices = []
    for o in final.outputs:
        msg, has_tools = _chat_message(state, body, prompt, o.text)
        choice = {"index": o.index, "message": msg, "finish_reason": "tool_calls" if has_tools else o.finish_reason}
        if body.logprobs and o.logprobs is not None:
            choice["logprobs"] = _chat_logprobs(state, body, o.logprobs)
        choices.append(choice)
    response = {"id": final.request_id, "object": "chat.completion", "created": int(time.time()),
                "model": state.model_name, "choices": choices, "usage": _usage(len(prompt_ids), [final])}
    if body.prompt_logprobs is not None:
        response["prompt_logprobs"] = _prompt_logprobs(state, final.prompt_logprobs, body.prompt_logprobs)
    return response


async def stream_chat(state: ServerState, body, prompt, gen, first) -> AsyncIterator[str]:
    from .chat_output import ChatStreamParser

    prompt_ids = prompt.token_ids
    created, rid = int(time.time()), first.request_id
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name}
    use_parsers = state.reasoning_parser or (state.tool_call_parser and body.tools)
    parsers = {}
    reported: set[int] = set()
    sent_lps: dict[int, int] = {}
    for o in first.outputs:
        yield _sse({**head, "choices": [{"index": o.index, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
    out = first
    while True:
        for o in out.outputs:
            if o.index in reported:
                continue
            if use_parsers:
                p = parsers.setdefault(o.index, ChatStreamParser(**_parser_args(state, body, prompt)))
                deltas = p.feed(o.delta_text) + (p.finish() if o.finish_reason else [])
            else:
                deltas = [{"content": o.delta_text}] if o.delta_text else []
            lps = None  # (the new tokens' logprobs ride on the output's first chunk)
            if body.logprobs and o.logprobs is not None and len(o.logprobs) > sent_lps.get(o.index, 0):
                lps = _chat_logprobs(state, body, o.logprobs[sent_lps.get(o.index, 0):])
                sent_lps[o.index] = len(o.logprobs)
                deltas = deltas or [{}]
            for d in deltas:
                yield _sse(_with_usage(body, {**head, "choices": [{"index": o.index, "delta": d, "logprobs": lps,
                                                                   "finish_reason": None}]}, len(prompt_ids), [out]))
                lps = None
            if o.finish_reason and o.index not in reported:
                reason = "tool_calls" if use_parsers and parsers[o.index].saw_tool_calls else o.finish_reason
                last = {"index": o.index, "delta": {}, "finish_reason": reason, "stop_reason": o.stop_reason}
                yield _sse(_with_usage(body, {**head, "choices": [last]}, len(prompt_ids), [out]))
                reported.add(o.index)
        if out.finished:
            break
        out = await gen.__anext__()
    if body.stream_options and body.stream_options.include_usage:
        yield _sse({**head, "choices": [], "usage": _usage(len(prompt_ids), [out])})
    yield _sse("[DONE]")
