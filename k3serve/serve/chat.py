"""Chat rendering for the Kimi family (model-spec §4.3-4.7): OpenAI messages -> prompt token ids.

Two formats:

- **Kimi K3 "XTML"** (``model_type == "kimi_k3"``, §4.4): :func:`render_k3` is a port of the
  shipped ``encoding_k3.py`` ``build_chat_segments``. It returns an ordered list of segments
  ``(text, allow_special)``; structural markers (``<|open|>``, ``<|close|>``, ``<|sep|>``,
  ``<|end_of_msg|>``, the image placeholder) are ``allow_special=True`` segments, everything else
  (tag names, attribute pieces, user/tool/assistant text) is ordinary text. Token ids are the
  concatenation of the per-segment encodings (:func:`encode_segments`) — segments are never
  re-joined before BPE, and user text that spells ``<|open|>`` stays ordinary text.
- **Kimi-Linear / K2 family** (``model_type == "kimi_linear"``, §4.3): the Jinja ``chat_template``
  shipped with the tokenizer is used when present (rendered like HF ``apply_chat_template``, then
  split on special-token text); otherwise :func:`render_kimi_linear` renders the K2-Instruct
  layout built in.

The fixed English bodies of K3's internal system messages are module constants below (one
place), copied verbatim from ``encoding_k3.py`` — see the provenance note there.

Every validation failure is a :class:`ValueError` whose message is fit for an HTTP 400.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "Segment", "render_k3", "render_k3_assistant_body", "render_kimi_linear", "render_jinja_template",
    "encode_segments", "apply_chat_template", "build_chat_prompt", "ChatPrompt", "resolve_k3_thinking",
    "load_chat_template", "count_tool_calls", "segments_text",
    "OPEN", "CLOSE", "SEP", "END_OF_MSG", "IMAGE_PLACEHOLDER", "THINKING_EFFORTS",
]

Segment = tuple[str, bool]  # (text, allow_special)

# ---- K3 markers (§4.2 / §4.4) -------------------------------------------------------------------
OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
THINKING_EFFORTS = ("low", "high", "max")

# ---- K3 internal system-message bodies ----------------------------------------------------------
# VERBATIM from the shipped ``encoding_k3.py`` (moonshotai/Kimi-K3). Transcribed from the copy
# vendored in vLLM (``vllm/tokenizers/encoding_k3.py``, header "Source:
# https://huggingface.co/moonshotai/Kimi-K3/blob/main/encoding_k3.py"), and cross-checked
# character for character against independent transcriptions: vLLM's earlier port ("Derived from
# moonshotai/Kimi-K3 encoding_k3.py at commit c5d1dd4"), llama.cpp ``models/templates/Kimi-K3.jinja``
# and several third-party ports that test against the release file. All agree on every body.
# Note the effort body advertises `medium` although only low/high/max are accepted: that is
# upstream's text, reproduced as is.
K3_TOOL_DECLARE_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
K3_TOOL_DECLARE_DYNAMIC_HEADER = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n"
)
K3_THINKING_EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
K3_TOOL_CHOICE_REQUIRED_BODY = (
    "The system is invoked with `tool_choice=required`.\n"
    "You MUST call tools in the next message."
)
K3_TOOL_CHOICE_NONE_BODY = (
    "The system is invoked with `tool_choice=none`.\n"
    "You MUST NOT call any tools in the next message."
)
K3_RESPONSE_FORMAT_JSON_OBJECT_BODY = (
    "The system is invoked with `response_format=json_object`.\n"
    "Your response must be raw JSON data without markdown code blocks (```json) or any additional "
    "formatting."
)
K3_RESPONSE_FORMAT_JSON_SCHEMA_BODY = (
    "The system is invoked with `response_format=json_schema`.\n"
    "Your response must be raw JSON data without markdown code blocks (```json) or any additional "
    "formatting.\n"
    "The JSON data must match the following schema:\n"
    "```json\n{schema}\n```"
)

# ---- Kimi-Linear / K2 built-in layout (used only when the tokenizer ships no chat_template) -----
# The default system prompt is the K2-Instruct template's text; NOT verified against the
# Kimi-Linear-48B-A3B-Instruct release (spec §6 item 6). The shipped template, when present,
# always wins over this built-in layout.
KIMI_LINEAR_DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
IM_USER, IM_ASSISTANT, IM_SYSTEM = "<|im_user|>", "<|im_assistant|>", "<|im_system|>"
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
TOOL_CALLS_SECTION_BEGIN, TOOL_CALLS_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN, TOOL_CALL_ARGUMENT_BEGIN, TOOL_CALL_END = (
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")

_ROLES = ("system", "user", "assistant", "tool")


# =================================================================================================
# small helpers
# =================================================================================================

def _text(text: Any) -> list[Segment]:
    text = str(text)
    return [(text, False)] if text else []


def _control(text: str) -> list[Segment]:
    return [(text, True)]


def _escape_attr(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open_tag(tag: str, attrs: Iterable[tuple[str, Any]] = ()) -> list[Segment]:
    segs = _control(OPEN) + _text(tag)
    for key, value in attrs:
        segs += _text(f" {key}") + _text('="') + _text(_escape_attr(value)) + _text('"')
    return segs + _control(SEP)


def _close_tag(tag: str) -> list[Segment]:
    return _control(CLOSE) + _text(tag) + _control(SEP)


def _json_compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _deep_sort(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _deep_sort(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [_deep_sort(v) for v in obj]
    return obj


def _xtml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    return "array"


def _xtml_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _internal_system_message(kind: str, body: str) -> list[Segment]:
    return (_open_tag("message", [("role", "system"), ("type", kind)]) + _text(body.strip())
            + _close_tag("message") + _control(END_OF_MSG))


def _render_tool_declare(tools: Any, *, dynamic: bool = False) -> list[Segment]:
    header = K3_TOOL_DECLARE_DYNAMIC_HEADER if dynamic else K3_TOOL_DECLARE_HEADER
    body = header + "```json\n" + _json_compact(tools) + "\n```"
    return (_open_tag("message", [("role", "system"), ("type", "tool-declare")]) + _text(body)
            + _close_tag("message") + _control(END_OF_MSG))


def segments_text(segments: Sequence[Segment]) -> str:
    """The prompt as one string (debugging / goldens only: never encode this string)."""
    return "".join(t for t, _ in segments)


def count_tool_calls(messages: Sequence[Mapping[str, Any]]) -> int:
    """Number of tool calls made by assistant turns in ``messages``: the starting ``idx`` for the
    ``functions.{name}:{idx}`` ids of the next response (§4.5)."""
    n = 0
    for m in messages or ():
        if isinstance(m, Mapping) and m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            n += len(m["tool_calls"])
    return n


# =================================================================================================
# validation / normalization of OpenAI-shaped input (errors are HTTP-400 ValueErrors)
# =================================================================================================

def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise ValueError("'messages' must be a list of message objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be an object")
        m = dict(m)
        role = m.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            m["role"] = role = "system"
        if role not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(_ROLES)} (got {role!r})")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list, tuple)):
            raise ValueError(f"messages[{i}].content must be a string, a list of content parts or null")
        if isinstance(content, (list, tuple)):
            for j, part in enumerate(content):
                if not isinstance(part, Mapping):
                    raise ValueError(f"messages[{i}].content[{j}] must be an object")
                ptype = part.get("type")
                if ptype in ("image", "image_url"):
                    continue
                if ptype != "text":
                    raise ValueError(f"messages[{i}].content[{j}]: unsupported content part type {ptype!r} "
                                     "(supported: 'text', 'image_url')")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}].text must be a string")
        if m.get("name") is not None and not isinstance(m.get("name"), str):
            raise ValueError(f"messages[{i}].name must be a string")
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise ValueError(f"messages[{i}]: only assistant messages may carry tool_calls")
            if not isinstance(calls, (list, tuple)):
                raise ValueError(f"messages[{i}].tool_calls must be a list")
            for j, call in enumerate(calls):
                if not isinstance(call, Mapping):
                    raise ValueError(f"messages[{i}].tool_calls[{j}] must be an object")
                fn = call.get("function", call)
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn.get("name"):
                    raise ValueError(f"messages[{i}].tool_calls[{j}].function.name must be a non-empty string")
                args = fn.get("arguments")
                if args is not None and not isinstance(args, (str, dict)):
                    raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON "
                                     "object string (or an object)")
        for key in ("reasoning_content", "reasoning"):
            v = m.get(key)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"messages[{i}].{key} must be a string")
        if role == "system" and m.get("tools") is not None and not isinstance(m.get("tools"), list):
            raise ValueError(f"messages[{i}].tools must be a list")
        out.append(m)
    return out


def _check_tools(tools: Any) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ValueError("'tools' must be a list of tool definitions")
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping):
            raise ValueError(f"tools[{i}] must be an object")
        if t.get("type", "function") == "function":
            fn = t.get("function")
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn.get("name"):
                raise ValueError(f"tools[{i}].function.name must be a non-empty string")
            if fn.get("parameters") is not None and not isinstance(fn.get("parameters"), Mapping):
                raise ValueError(f"tools[{i}].function.parameters must be a JSON Schema object")
    return list(tools)


def check_tool_choice(tools: Any, tool_choice: Any) -> None:
    """tool_choice "required" or a named function needs declared tools (and that one among them)."""
    if tool_choice == "required" or isinstance(tool_choice, Mapping):
        if not tools:
            raise ValueError(f"tool_choice {tool_choice!r} needs 'tools'")
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice.get("function"), Mapping) \
            else None
        if not isinstance(name, str) or not name:
            raise ValueError("tool_choice: a named one is {\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in {(t.get("function") or {}).get("name") for t in tools if isinstance(t, Mapping)}:
            raise ValueError(f"tool_choice names {name!r}, which is not among the declared tools")


def _normalize_arguments(arguments: Any, where: str) -> tuple[dict, str | None]:
    """(mapping, raw JSON block) as encoding_k3.normalize_tool_arguments."""
    if arguments is None:
        return {}, None
    if isinstance(arguments, dict):
        return arguments, None
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}, None
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return {}, arguments
        if not isinstance(parsed, dict):
            raise ValueError(f"{where}: tool call arguments must be a JSON object")
        return parsed, None
    raise ValueError(f"{where}: tool call arguments must be a JSON object string")


def _normalize_message(m: dict, i: int) -> dict:
    out = dict(m)
    if out.get("tools") is not None:
        out["tools"] = _deep_sort(out["tools"])
    calls = out.get("tool_calls")
    if not calls:
        return out
    norm = []
    for j, call in enumerate(calls):
        call = dict(call)
        nested = isinstance(call.get("function"), Mapping)
        fn = dict(call["function"]) if nested else call
        args, block = _normalize_arguments(fn.get("arguments"), f"messages[{i}].tool_calls[{j}]")
        fn["arguments"] = args
        fn.pop("_xtml_json_block", None)
        if block is not None:
            fn["_xtml_json_block"] = block
        if nested:
            call["function"] = fn
        norm.append(call)
    out["tool_calls"] = norm
    return out


def _call_fn(call: Mapping) -> Mapping:
    fn = call.get("function", call)
    return fn if isinstance(fn, Mapping) else call


def _reorder_tool_results(messages: list[dict]) -> list[dict]:
    """encoding_k3.normalize_xtml_tool_result_messages: sort each run of consecutive tool messages
    by the 1-based position of its tool_call_id in the preceding assistant's tool_calls (ties keep
    input order); the matched call's name becomes the message's ``tool`` (and ``name`` if set).
    A run with any unmatched id is left untouched."""
    out: list[dict] = []
    index: dict[str, tuple[int, Any]] = {}
    i, n = 0, len(messages)
    while i < n:
        m = messages[i]
        if m.get("role") == "assistant":
            index = {}
            for pos, call in enumerate(m.get("tool_calls") or [], start=1):
                cid = call.get("id")
                if cid is not None and str(cid) not in index:
                    index[str(cid)] = (pos, _call_fn(call).get("name"))
            out.append(m)
            i += 1
            continue
        if m.get("role") != "tool":
            out.append(m)
            i += 1
            continue
        run, unresolved = [], False
        while i < n and messages[i].get("role") == "tool":
            tm = messages[i]
            cid = tm.get("tool_call_id", tm.get("id"))
            hit = index.get(str(cid)) if cid is not None else None
            if hit is None:
                unresolved = True
                run.append((0, len(run), tm, None))
            else:
                run.append((hit[0], len(run), tm, hit[1]))
            i += 1
        if unresolved:
            out.extend(r[2] for r in run)
            continue
        run.sort(key=lambda r: (r[0], r[1]))
        for _, _, tm, name in run:
            if name is None:
                out.append(tm)
                continue
            tm = dict(tm)
            tm["tool"] = name
            if "name" in tm:
                tm["name"] = name
            out.append(tm)
    return out


# =================================================================================================
# Kimi K3 (XTML) — port of encoding_k3.build_chat_segments
# =================================================================================================

def _render_content(content: Any, allow_images: bool) -> list[Segment]:
    if isinstance(content, str):
        return _text(content)
    segs: list[Segment] = []
    for part in content or ():
        if part.get("type") in ("image", "image_url"):
            if not allow_images:
                raise ValueError("images are not supported by this model")
            segs += _control(IMAGE_PLACEHOLDER)
        else:
            segs += _text(part["text"])
    return segs


def render_k3_assistant_body(message: Mapping[str, Any], thinking: bool = True,
                             allow_images: bool = True) -> list[Segment]:
    """The channels of one assistant turn (between its ``message`` open and close tags):
    ``think`` (thinking mode only), ``response``, and ``tools`` when it has tool calls. This is what
    the model generates after the generation prompt (§4.5), prefixed by ``O think S`` /
    ``O response S``. ``message`` may carry raw OpenAI tool calls (JSON-string arguments)."""
    m = _normalize_message(_check_messages([message])[0], 0)
    return _assistant_body(m, thinking, allow_images)


def _assistant_body(m: Mapping[str, Any], thinking: bool, allow_images: bool) -> list[Segment]:
    segs: list[Segment] = []
    if thinking:
        segs += _open_tag("think")
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if reasoning is not None and str(reasoning).strip():
            segs += _text(reasoning)
        segs += _close_tag("think")
    segs += _open_tag("response")
    segs += _render_content(m.get("content"), allow_images)
    segs += _close_tag("response")
    calls = m.get("tool_calls")
    if calls:
        segs += _open_tag("tools")
        for idx, call in enumerate(calls, start=1):
            fn = _call_fn(call)
            segs += _open_tag("call", [("tool", fn["name"]), ("index", idx)])
            block = fn.get("_xtml_json_block")
            args = fn.get("arguments", {})
            if block is not None:
                segs += _open_tag("json", [("type", "object")]) + _text(block) + _close_tag("json")
            elif isinstance(args, dict):
                for key, value in args.items():
                    segs += _open_tag("argument", [("key", key), ("type", _xtml_type(value))])
                    segs += _text(_xtml_value(value))
                    segs += _close_tag("argument")
            segs += _close_tag("call")
        segs += _close_tag("tools")
    return segs


def _check_effort(thinking_effort: Any) -> None:
    if thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        raise ValueError(f"unsupported thinking_effort {thinking_effort!r}: this model supports "
                         f"{', '.join(repr(e) for e in THINKING_EFFORTS)} (reasoning_effort 'none' "
                         "turns thinking off)")


def _response_format_type(response_format: Any) -> str | None:
    if response_format is None:
        return None
    if isinstance(response_format, Mapping):
        rtype = response_format.get("type")
    else:
        rtype = response_format
    if rtype not in (None, "text", "json_object", "json_schema"):
        raise ValueError(f"unsupported response_format type {rtype!r} "
                         "(supported: 'text', 'json_object', 'json_schema')")
    return rtype


def _response_schema(response_format: Any) -> Any:
    if not isinstance(response_format, Mapping):
        return None
    js = response_format.get("json_schema")
    if js is None:
        return None
    if isinstance(js, Mapping):
        return js.get("schema", js.get("json_schema", js))
    return js


def render_k3(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
              tool_choice: Any = None, response_format: Any = None, thinking: bool = True,
              thinking_effort: str | None = None, add_generation_prompt: bool = True, *,
              response_schema: Any = None, allow_images: bool = True) -> list[Segment]:
    """Render a conversation in K3's XTML (§4.4) as ``(text, allow_special)`` segments.

    Order: tool declaration, thinking-effort note, the messages, tool-choice note, response-format
    note, generation prompt (``O message role="assistant" S`` + ``O think S`` / ``O response S``).
    ``thinking_effort`` must be one of low/high/max (ValueError otherwise); it is rendered only in
    thinking mode. ``tool_choice`` "required"/"none" add the tool-choice note ("auto", a named
    choice or None add nothing). ``allow_images=False`` makes image parts a ValueError.
    """
    if not isinstance(thinking, bool):
        raise ValueError(f"'thinking' must be a boolean (got {thinking!r})")
    _check_effort(thinking_effort)
    msgs = _check_messages(messages)
    tools = _deep_sort(_check_tools(tools))
    if tool_choice is not None and not isinstance(tool_choice, Mapping) \
            and tool_choice not in ("auto", "required", "none"):
        raise ValueError(f"unsupported tool_choice {tool_choice!r} "
                         "(supported: 'auto', 'required', 'none' or a named function)")
    rtype = _response_format_type(response_format)
    schema = response_schema if response_schema is not None else _response_schema(response_format)
    if rtype == "json_schema" and schema is None:
        raise ValueError("response_format of type 'json_schema' needs a json_schema.schema")

    msgs = [_normalize_message(m, i) for i, m in enumerate(_reorder_tool_results(msgs))]
    segs: list[Segment] = []
    if tools:
        segs += _render_tool_declare(tools)
    if thinking and thinking_effort is not None:
        segs += _internal_system_message("thinking-effort", K3_THINKING_EFFORT_BODY.format(effort=thinking_effort))

    prior_calls: list | None = None
    tool_index = 0
    for i, m in enumerate(msgs):
        role = m["role"]
        if role == "system" and m.get("tools"):
            segs += _render_tool_declare(m["tools"], dynamic=True)
        elif role in ("user", "system"):
            attrs = [("role", role)]
            if m.get("name"):
                attrs.append(("name", m["name"]))
            segs += _open_tag("message", attrs) + _render_content(m.get("content"), allow_images)
            segs += _close_tag("message") + _control(END_OF_MSG)
        elif role == "tool":
            tool_index += 1
            name = m.get("tool", m.get("name"))
            if name is None and prior_calls and tool_index <= len(prior_calls):
                name = _call_fn(prior_calls[tool_index - 1]).get("name")
            if name is None:
                raise ValueError(f"messages[{i}]: cannot tell which tool this result belongs to: give it a "
                                 "tool_call_id matching the preceding assistant tool_calls (or a 'name')")
            segs += _open_tag("message", [("role", "tool"), ("tool", name), ("index", tool_index)])
            segs += _render_content(m.get("content"), allow_images)
            segs += _close_tag("message") + _control(END_OF_MSG)
        else:  # assistant
            prior_calls = m.get("tool_calls")
            tool_index = 0
            attrs = [("role", "assistant")]
            if m.get("name"):
                attrs.append(("name", m["name"]))
            segs += _open_tag("message", attrs) + _assistant_body(m, thinking, allow_images)
            segs += _close_tag("message") + _control(END_OF_MSG)

    if tool_choice == "required":
        segs += _internal_system_message("tool-choice", K3_TOOL_CHOICE_REQUIRED_BODY)
    elif tool_choice == "none":
        segs += _internal_system_message("tool-choice", K3_TOOL_CHOICE_NONE_BODY)
    if rtype == "json_object":
        segs += _internal_system_message("response-format", K3_RESPONSE_FORMAT_JSON_OBJECT_BODY)
    elif rtype == "json_schema":
        segs += _internal_system_message(
            "response-format", K3_RESPONSE_FORMAT_JSON_SCHEMA_BODY.format(schema=_json_compact(_deep_sort(schema))))
    if add_generation_prompt:
        segs += _open_tag("message", [("role", "assistant")])
        segs += _open_tag("think" if thinking else "response")
    return segs


# =================================================================================================
# Kimi-Linear / K2 family
# =================================================================================================

def _k2_content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    out = []
    for part in content or ():
        if part.get("type") in ("image", "image_url"):
            raise ValueError("images are not supported by this model")
        out.append(part["text"])
    return "".join(out)


def _merge_text(segs: list[Segment]) -> list[Segment]:
    """Join adjacent ordinary-text segments: HF tokenizes the rendered K2 string in one pass, so
    the text between two markers is one BPE chunk."""
    out: list[Segment] = []
    for text, special in segs:
        if not text:
            continue
        if out and not special and not out[-1][1]:
            out[-1] = (out[-1][0] + text, False)
        else:
            out.append((text, special))
    return out


def render_kimi_linear(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                       add_generation_prompt: bool = True) -> list[Segment]:
    """The K2-family layout (§4.3) built in, for tokenizers that ship no ``chat_template``:
    ``<|im_{role}|>{name or role}<|im_middle|>{content}<|im_end|>`` turns, a tool-declare turn
    first, a default system turn when the first message is not a system message, tool calls as a
    ``<|tool_calls_section_begin|>`` block with ids ``functions.{name}:{idx}`` (the message's own
    id when it has one), tool results as system-role turns ``## Return of {id}\\n{content}``."""
    msgs = _check_messages(messages)
    tools = _check_tools(tools)
    segs: list[Segment] = []
    if tools:
        segs += [(IM_SYSTEM, True), ("tool_declare", False), (IM_MIDDLE, True),
                 (_json_compact(tools), False), (IM_END, True)]
    counter = 0
    for i, m in enumerate(msgs):
        role = m["role"]
        if i == 0 and role != "system":
            segs += [(IM_SYSTEM, True), ("system", False), (IM_MIDDLE, True),
                     (KIMI_LINEAR_DEFAULT_SYSTEM_PROMPT, False), (IM_END, True)]
        marker = IM_USER if role == "user" else IM_ASSISTANT if role == "assistant" else IM_SYSTEM
        segs += [(marker, True), (m.get("name") or role, False), (IM_MIDDLE, True)]
        if role == "assistant" and m.get("tool_calls"):
            segs.append((_k2_content_text(m.get("content")), False))
            segs.append((TOOL_CALLS_SECTION_BEGIN, True))
            for call in m["tool_calls"]:
                fn = _call_fn(call)
                cid = call.get("id") or f"functions.{fn['name']}:{counter}"
                counter += 1
                args = fn.get("arguments")
                args = args if isinstance(args, str) else json.dumps(args if args is not None else {},
                                                                     ensure_ascii=False)
                segs += [(TOOL_CALL_BEGIN, True), (str(cid), False), (TOOL_CALL_ARGUMENT_BEGIN, True),
                         (args, False), (TOOL_CALL_END, True)]
            segs.append((TOOL_CALLS_SECTION_END, True))
        elif role == "tool":
            segs.append((f"## Return of {m.get('tool_call_id')}\n" + _k2_content_text(m.get("content")), False))
        else:
            segs.append((_k2_content_text(m.get("content")), False))
        segs.append((IM_END, True))
    if add_generation_prompt:
        segs += [(IM_ASSISTANT, True), ("assistant", False), (IM_MIDDLE, True)]
    return _merge_text(segs)


_SENTINEL = "\U000F0000"  # stands in for "<|" inside caller strings while the template renders


def _shield(obj: Any) -> Any:
    if isinstance(obj, str):
        return obj.replace("<|", _SENTINEL)
    if isinstance(obj, Mapping):
        return {k: _shield(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_shield(v) for v in obj]
    return obj


@functools.lru_cache(maxsize=8)
def _compile_template(source: str):
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' override of Jinja's HTML-escaping tojson
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        import datetime
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def render_jinja_template(source: str, specials: Iterable[str], messages: Sequence[Mapping[str, Any]],
                          tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
                          **context: Any) -> list[Segment]:
    """Render a shipped Jinja chat template as HF ``apply_chat_template`` does (trim_blocks,
    lstrip_blocks, HF's tojson, raise_exception), then split the string on special-token text.
    Special-token text inside caller strings (messages, tools) stays ordinary text."""
    import jinja2

    msgs = _check_messages(messages)
    tools = _check_tools(tools)
    try:
        rendered = _compile_template(source).render(
            messages=_shield(msgs), tools=_shield(tools) if tools else None,
            add_generation_prompt=add_generation_prompt, **context)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from None
    names = sorted({s for s in specials if s}, key=len, reverse=True)
    segs: list[Segment] = []
    if names:
        pat = re.compile("(" + "|".join(re.escape(s) for s in names) + ")")
        for k, piece in enumerate(pat.split(rendered)):
            if piece:
                segs.append((piece, True) if k % 2 else (piece.replace(_SENTINEL, "<|"), False))
    elif rendered:
        segs.append((rendered.replace(_SENTINEL, "<|"), False))
    return _merge_text(segs)


@functools.lru_cache(maxsize=16)
def load_chat_template(model_dir: str) -> str | None:
    """The Jinja chat template shipped in ``model_dir`` (``chat_template.jinja``, else
    ``tokenizer_config.json`` ``chat_template``: a string, or the entry named "default"), or None."""
    d = Path(model_dir)
    if not d.is_dir():
        return None
    f = d / "chat_template.jinja"
    if f.is_file():
        return f.read_text(encoding="utf-8")
    cfg = d / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        tpl = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, json.JSONDecodeError):
        return None
    if isinstance(tpl, list):
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    return tpl if isinstance(tpl, str) and tpl else None


# =================================================================================================
# encoding and the entry point
# =================================================================================================

def encode_segments(tokenizer, segments: Iterable[Segment]) -> list[int]:
    """Per-segment encoding: ordinary segments BPE-encoded with special-token recognition off;
    each ``allow_special`` segment must be exactly one special token of ``tokenizer``."""
    ids: list[int] = []
    specials = tokenizer.special_tokens
    for text, allow_special in segments:
        if allow_special:
            tid = specials.get(text)
            if tid is None:
                if text == IMAGE_PLACEHOLDER:
                    raise ValueError("images are not supported by this model")
                raise ValueError(f"the chat format needs the special token {text!r}, which this tokenizer "
                                 "does not have")
            ids.append(tid)
        elif text:
            ids.extend(tokenizer.encode(text, allow_special=False))
    return ids


def resolve_k3_thinking(thinking: Any = None, enable_thinking: Any = None, thinking_effort: Any = None,
                        reasoning_effort: Any = None, default_thinking_effort: str | None = None
                        ) -> tuple[bool, str | None]:
    """(thinking, thinking_effort) from the request (§4.6): ``thinking`` (alias ``enable_thinking``,
    default True); OpenAI ``reasoning_effort`` "none" turns thinking off, any other value is the
    effort unless ``thinking_effort`` is given. Efforts other than low/high/max are rejected."""
    if thinking is None:
        thinking = True if enable_thinking is None else enable_thinking
    if not isinstance(thinking, bool):
        raise ValueError(f"'thinking' must be a boolean (got {thinking!r})")
    if reasoning_effort is not None and not isinstance(reasoning_effort, str):
        raise ValueError(f"'reasoning_effort' must be a string (got {reasoning_effort!r})")
    if reasoning_effort == "none":
        thinking = False
    elif thinking_effort is None and reasoning_effort is not None:
        thinking_effort = reasoning_effort
    if thinking_effort is None and thinking:
        thinking_effort = default_thinking_effort
    _check_effort(thinking_effort)
    return thinking, thinking_effort


@dataclass
class ChatPrompt:
    token_ids: list[int]
    segments: list[Segment]
    model_type: str
    thinking: bool = False                 # K3: think channels rendered
    thinking_effort: str | None = None
    prompt_ends_in_think: bool = False     # K3: generation starts inside the think channel
    prompt_ends_in_response: bool = False  # K3: generation starts inside the response channel
    tool_call_start_index: int = 0         # idx of the next functions.{name}:{idx} id
    extra: dict = field(default_factory=dict)


_K3_TYPES = ("kimi_k3",)
_K2_TYPES = ("kimi_linear", "kimi_k2")


def build_chat_prompt(tokenizer, model_type: str, messages: Sequence[Mapping[str, Any]], *,
                      tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = None,
                      response_format: Any = None, reasoning_effort: str | None = None,
                      add_generation_prompt: bool = True, chat_template_kwargs: Mapping[str, Any] | None = None,
                      thinking: Any = None, enable_thinking: Any = None, thinking_effort: Any = None,
                      default_thinking_effort: str | None = None, chat_template: str | None = None,
                      continue_final_message: bool = False, **extra: Any) -> ChatPrompt:
    """Render + encode a chat request; see :func:`apply_chat_template`. ``continue_final_message``
    (vLLM's): the final assistant message is left open after its text, so the model continues it
    (an assistant prefill); it excludes ``add_generation_prompt``."""
    kw = dict(chat_template_kwargs or {})
    thinking = kw.pop("thinking", thinking) if thinking is None else thinking
    enable_thinking = kw.pop("enable_thinking", enable_thinking) if enable_thinking is None else enable_thinking
    thinking_effort = kw.pop("thinking_effort", thinking_effort) if thinking_effort is None else thinking_effort
    if not isinstance(add_generation_prompt, bool):
        raise ValueError("'add_generation_prompt' must be a boolean")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    check_tool_choice(_check_tools(tools), tool_choice)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    cut = _cut_after_final_message(messages) if continue_final_message else (lambda segs: segs)

    if model_type in _K3_TYPES:
        thinking, effort = resolve_k3_thinking(thinking, enable_thinking, thinking_effort, reasoning_effort,
                                               default_thinking_effort)
        segs = cut(render_k3(messages, tools, tool_choice, response_format, thinking, effort, add_generation_prompt,
                             response_schema=kw.get("response_schema"),
                             allow_images=IMAGE_PLACEHOLDER in tokenizer.special_tokens))
        return ChatPrompt(encode_segments(tokenizer, segs), segs, model_type, thinking, effort,
                          prompt_ends_in_think=add_generation_prompt and thinking,
                          prompt_ends_in_response=continue_final_message or (add_generation_prompt and not thinking),
                          tool_call_start_index=count_tool_calls(messages))
    if model_type in _K2_TYPES:
        source = chat_template
        if source is None and getattr(tokenizer, "name_or_path", ""):
            source = load_chat_template(str(tokenizer.name_or_path))
        if source is not None:
            context = {k: v for k, v in {**extra, **kw}.items()
                       if k not in ("messages", "tools", "add_generation_prompt", "response_schema")}
            segs = render_jinja_template(source, tokenizer.special_tokens, messages, tools,
                                         add_generation_prompt, **context)
        else:
            segs = render_kimi_linear(messages, tools, add_generation_prompt)
        segs = cut(segs)
        return ChatPrompt(encode_segments(tokenizer, segs), segs, model_type,
                          tool_call_start_index=count_tool_calls(messages))
    raise ValueError(f"no chat format for model_type {model_type!r} (known: {', '.join(_K3_TYPES + _K2_TYPES)})")


def _cut_after_final_message(messages: Sequence[Mapping[str, Any]]):
    """The rendered segments cut right after the final assistant message's text (what closes it
    goes), as vLLM finds it: the last occurrence of that text."""
    last = messages[-1]
    content = last.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    if last.get("role") != "assistant" or not isinstance(content, str) or not content:
        raise ValueError("continue_final_message needs a final assistant message with text content")

    def cut(segs: list[Segment]) -> list[Segment]:
        for i in range(len(segs) - 1, -1, -1):
            at = segs[i][0].rfind(content)
            if at >= 0:
                return segs[:i] + [(segs[i][0][:at + len(content)], segs[i][1])]
        raise ValueError("the final message's text is not in the rendered prompt")
    return cut


def apply_chat_template(tokenizer, model_type: str, messages: Sequence[Mapping[str, Any]], **kw: Any) -> list[int]:
    """Prompt token ids for an OpenAI chat request.

    ``model_type`` "kimi_k3" renders K3 XTML (:func:`render_k3`); "kimi_linear" (or "kimi_k2")
    renders the K2 format (shipped Jinja template if the tokenizer directory has one, else
    :func:`render_kimi_linear`). Keywords: ``tools``, ``tool_choice``, ``response_format``,
    ``reasoning_effort`` (OpenAI; "none" -> thinking off, else the thinking effort),
    ``add_generation_prompt``, ``chat_template_kwargs`` (or its keys directly: ``thinking`` /
    ``enable_thinking``, ``thinking_effort``), ``default_thinking_effort`` (K3 effort when the
    request names none; None renders no effort note, as encoding_k3 does), ``chat_template``
    (K2: override the shipped template). Unknown keywords are ignored (as chat_template_kwargs
    are elsewhere). Invalid requests raise ValueError.
    """
    return build_chat_prompt(tokenizer, model_type, messages, **kw).token_ids
