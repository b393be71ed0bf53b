"""OpenAI's Responses API (/v1/responses: the OpenAI Agents SDK's and Codex's), on the chat path.

A request becomes a chat request: ``instructions`` a system message, ``input`` items messages
(``function_call`` items the assistant's tool calls, ``function_call_output`` items tool results,
``reasoning`` items the next assistant message's reasoning), ``previous_response_id`` the stored
conversation before them. The chat output's reasoning, text and tool calls (the server's
--reasoning-parser / --tool-call-parser split them) become ``reasoning``, ``message`` and
``function_call`` output items; a stream is the Responses event sequence over the same items.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from .api import (APIError, ServerState, _chat_logprobs, _first, _parser_args, chat_generation, check_model_name,
                  collect, validated)
from .protocol import ChatCompletionRequest
from .response_store import StoredResponse

# Responses fields with no chat counterpart of the same name (mapped below, or ignored)
_OWN = {"input", "instructions", "previous_response_id", "max_output_tokens", "text", "reasoning", "store",
        "metadata", "include", "truncation", "tools", "tool_choice", "top_logprobs", "service_tier", "user",
        "prompt_cache_key", "safety_identifier", "stream_options", "background", "max_tool_calls"}
_UNSUPPORTED = {"background": "background responses", "conversation": "conversations (use previous_response_id)",
                "prompt": "reusable prompt templates"}
# chat names in errors -> the Responses request's own
_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
          "reasoning_effort": "reasoning.effort", "thinking_effort": "reasoning.effort", "messages": "input"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def stored(state: ServerState, response_id: str, param: str = "response_id") -> StoredResponse:
    item = state.responses.get(response_id)
    if item is None:
        raise APIError(404, f"no stored response with id {response_id!r} (never stored, deleted, or evicted: this "
                            f"server keeps the newest {state.responses.capacity})", param=param,
                       code="response_not_found")
    return item


def _text_of(content, where: str) -> str:
    """A message's text: a string, or its input_text / output_text / text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.content[{j}]: only text parts (input_text / output_text) are supported, "
                                f"got {kind!r}", param="input")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items) -> list[dict]:
    """``input`` (a string, or a list of items) as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise APIError(400, "input must be a string or a list of items", param="input")
    messages: list[dict] = []
    reasoning: list[str] = []  # (a reasoning item belongs to the assistant turn after it)

    def assistant() -> dict:
        """The assistant message the next output item joins (a new one after any other role)."""
        if not messages or messages[-1]["role"] != "assistant" or reasoning:
            messages.append({"role": "assistant", "content": ""})
            if reasoning:
                messages[-1]["reasoning_content"] = "".join(reasoning)
                reasoning.clear()
        return messages[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer, got {role!r}",
                               param="input")
            text = _text_of(item.get("content"), where)
            if role == "assistant":
                msg = assistant()
                msg["content"] += text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning.append("".join(p.get("text", "") for p in parts if isinstance(p, dict)))
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(400, f"{where}: a function_call needs call_id, name and arguments (strings)",
                               param="input")
            assistant().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a function_call_output needs its call_id", param="input")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _text_of(output, where)})
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (message, reasoning, "
                                "function_call, function_call_output are)", param="input")
    return messages


def _chat_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools if isinstance(tools, list) else [None]):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise APIError(400, f"tools[{i}]: only function tools (type function, with a name) are supported, got "
                                f"{kind!r}", param="tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice: auto, none, required or {type: function, name} are supported",
                           param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text) -> dict | None:
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if fmt is None or not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt


def chat_request(state: ServerState, data: dict) -> tuple[ChatCompletionRequest, list[dict]]:
    """(the chat request, the conversation without instructions: what a stored response keeps)."""
    for key, what in _UNSUPPORTED.items():
        if data.get(key):
            raise APIError(400, f"{key}: {what} are not supported", param=key)
    if data.get("n", 1) != 1:
        raise APIError(400, "n: a response has one output", param="n")
    prev = data.get("previous_response_id")
    messages = (list(stored(state, prev, "previous_response_id").messages) if prev else [])
    messages += input_messages(data.get("input"))
    instructions = data.get("instructions")
    chat = {k: v for k, v in data.items() if k not in _OWN}
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + messages
    if data.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = data["max_output_tokens"]
    if data.get("tools"):
        chat["tools"] = _chat_tools(data["tools"])
        chat["tool_choice"] = _chat_tool_choice(data.get("tool_choice", "auto"))
    chat["response_format"] = _response_format(data.get("text"))
    effort = (data.get("reasoning") or {}).get("effort") if isinstance(data.get("reasoning"), dict) else None
    if effort is not None:
        chat["reasoning_effort"] = effort
    if LOGPROBS_INCLUDE in (data.get("include") or []) or data.get("top_logprobs") is not None:
        chat["logprobs"], chat["top_logprobs"] = True, data.get("top_logprobs") or 0
    return validated(ChatCompletionRequest, chat), messages


def _renamed(exc: APIError) -> APIError:
    """A chat-path error, with the Responses request's names for its parameters."""
    msg = exc.message
    for chat_name, own in _NAMES.items():
        msg = msg.replace(chat_name, own)
    exc.message, exc.param = msg, _NAMES.get(exc.param, exc.param)
    return exc


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class OutputItems:
    """Chat deltas ({reasoning_content} / {content} / {tool_calls}) in; the Responses output items,
    and the stream events that build them, out (one mechanism for both forms of a response)."""

    def __init__(self):
        self.items: list[dict] = []
        self._open: dict | None = None  # the reasoning or message item text is going to

    def add(self, delta: dict) -> list[tuple[str, dict]]:
        events = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls", []):
            events += self.close()
            item = {"id": _item_id("fc"), "type": "function_call", "status": "completed", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": call["function"]["arguments"]}
            self.items.append(item)
            where = {"item_id": item["id"], "output_index": len(self.items) - 1}
            events += [("response.output_item.added", {"output_index": where["output_index"],
                                                       "item": {**item, "arguments": "", "status": "in_progress"}}),
                       ("response.function_call_arguments.delta", {**where, "delta": item["arguments"]}),
                       ("response.function_call_arguments.done", {**where, "arguments": item["arguments"]}),
                       ("response.output_item.done", {"output_index": where["output_index"], "item": item})]
        return [(kind, copy.deepcopy(body)) for kind, body in events]

    def _text(self, kind: str, text: str) -> list[tuple[str, dict]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self.close()
            part = ({"type": "reasoning_text", "text": ""} if kind == "reasoning"
                    else {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            item = ({"id": _item_id("rs"), "type": "reasoning", "summary": [], "content": [part],
                     "status": "in_progress"} if kind == "reasoning" else
                    {"id": _item_id("msg"), "type": "message", "role": "assistant", "content": [part],
                     "status": "in_progress"})
            self.items.append(item)
            self._open = item
            events += [("response.output_item.added", {"output_index": len(self.items) - 1,
                                                       "item": {**item, "content": []}}),
                       ("response.content_part.added", {**self._where(item), "part": part})]
        self._open["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        events.append((name, {**self._where(self._open), "delta": text,
                              **({} if kind == "reasoning" else {"logprobs": []})}))
        return [(k, copy.deepcopy(b)) for k, b in events]

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}

    def close(self, status: str = "completed") -> list[tuple[str, dict]]:
        """Ends the open text item (``status``: incomplete when the output ran out of tokens)."""
        item, self._open = self._open, None
        if item is None:
            return []
        where, part = self._where(item), item["content"][0]
        item["status"] = status
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": part["logprobs"]}
        events = [(done, {**where, "text": part["text"], **extra}),
                  ("response.content_part.done", {**where, "part": part}),
                  ("response.output_item.done", {"output_index": where["output_index"], "item": item})]
        return [(k, copy.deepcopy(b)) for k, b in events]

    def finish(self, status: str) -> list[tuple[str, dict]]:
        """The last events; an output with no item at all gets an empty message (as OpenAI's)."""
        events = [] if self.items else self._text("message", "")
        return events + self.close(status)


class _Response:
    """One response being made: its id, settings echoed back, and the final object."""

    def __init__(self, state: ServerState, data: dict, chat: ChatCompletionRequest, prompt):
        self.state, self.data, self.chat, self.prompt = state, data, chat, prompt
        self.id, self.created = _item_id("resp"), int(time.time())
        self.items = OutputItems()

    def obj(self, status: str, usage: dict | None = None, incomplete: bool = False) -> dict:
        d, chat = self.data, self.chat
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": d.get("instructions"), "max_output_tokens": d.get("max_output_tokens"),
                "metadata": d.get("metadata") or {}, "model": self.state.model_name,
                "output": copy.deepcopy(self.items.items), "parallel_tool_calls": d.get("parallel_tool_calls", True),
                "previous_response_id": d.get("previous_response_id"),
                "reasoning": {"effort": chat.reasoning_effort, "summary": None}, "store": d.get("store", True),
                "temperature": chat.temperature if chat.temperature is not None else 1.0,
                "text": {"format": (d.get("text") or {}).get("format") or {"type": "text"}},
                "tool_choice": d.get("tool_choice", "auto"), "tools": d.get("tools") or [],
                "top_p": chat.top_p if chat.top_p is not None else 1.0, "truncation": "disabled", "usage": usage,
                "user": d.get("user")}

    def deltas(self, text: str, finished: bool, parser) -> list[dict]:
        if parser is None:
            return [{"content": text}] if text else []
        return parser.feed(text) + (parser.finish() if finished else [])

    def parser(self):
        from .chat_output import ChatStreamParser

        st, chat = self.state, self.chat
        if st.reasoning_parser or (st.tool_call_parser and chat.tools):
            return ChatStreamParser(**_parser_args(st, chat, self.prompt))
        return None

    def reasoning_tokens(self, o) -> int:
        """The output tokens of the think channel: up to its close marker (ASCII and special tokens,
        so token by token its text is exact), all of them if it never closed."""
        if not (self.state.reasoning_parser and self.state.info.model_type == "kimi_k3"):
            return 0
        from .parsers import THINK_CLOSE, K3ReasoningParser

        if K3ReasoningParser.extract(o.text, bool(getattr(self.prompt, "prompt_ends_in_think", False)))[0] is None:
            return 0
        text, marker = "", "".join(THINK_CLOSE)
        for n, t in enumerate(o.token_ids):
            text += self.state.tokenizer.decode([t])
            if marker in text[-len(marker) - 64:]:
                return n + 1
        return len(o.token_ids)

    def final(self, out, messages: list[dict]) -> dict:
        """The finished response (stored when asked): usage, status, logprobs."""
        o = out.outputs[0]
        incomplete = o.finish_reason == "length"
        usage = {"input_tokens": len(self.prompt.token_ids),
                 "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                 "output_tokens": len(o.token_ids), "total_tokens": len(self.prompt.token_ids) + len(o.token_ids),
                 "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens(o)}}
        if self.chat.logprobs and o.logprobs is not None:
            lps = _chat_logprobs(self.state, self.chat, o.logprobs)["content"]
            for it in self.items.items:
                if it["type"] == "message":
                    it["content"][0]["logprobs"] = lps
        resp = self.obj("incomplete" if incomplete else "completed", usage, incomplete)
        if resp["store"]:
            self.state.responses.put(resp, messages + input_messages(self.items.items))  # (items read as input)
        return resp


async def create(state: ServerState, request: Request, data: dict):
    check_model_name(state, data.get("model"))
    try:
        chat, messages = chat_request(state, data)
        prompt, gen = chat_generation(state, request, chat)
    except APIError as exc:
        raise _renamed(exc) from None
    made = _Response(state, data, chat, prompt)
    if chat.stream:
        try:
            first = await _first(gen)
        except APIError as exc:
            raise _renamed(exc) from None
        return StreamingResponse(_events(made, gen, first, messages), media_type="text/event-stream")
    final, = await collect(request, [gen])
    o = final.outputs[0]
    for d in made.deltas(o.text, True, made.parser()):
        made.items.add(d)
    made.items.finish("incomplete" if o.finish_reason == "length" else "completed")
    return made.final(final, messages)


async def _events(made: _Response, gen, first, messages: list[dict]) -> AsyncIterator[str]:
    seq = itertools.count()

    def event(kind: str, body: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **body})}\n\n"

    try:
        yield event("response.created", {"response": made.obj("in_progress")})
        yield event("response.in_progress", {"response": made.obj("in_progress")})
        parser, out = made.parser(), first
        while True:
            o = out.outputs[0]
            for d in made.deltas(o.delta_text, out.finished, parser):
                for kind, body in made.items.add(d):
                    yield event(kind, body)
            if out.finished:
                break
            out = await gen.__anext__()
        incomplete = out.outputs[0].finish_reason == "length"
        for kind, body in made.items.finish("incomplete" if incomplete else "completed"):
            yield event(kind, body)
        resp = made.final(out, messages)
        yield event("response.incomplete" if incomplete else "response.completed", {"response": resp})
    except Exception as exc:  # (after the 200: the failure is an event, as OpenAI's)
        yield event("response.failed", {"response": {**made.obj("failed"), "error": {
            "code": "server_error", "message": f"the request failed mid-stream: {exc}"}}})
    finally:
        await gen.aclose()
