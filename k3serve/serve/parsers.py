"""Reasoning and tool-call parsers for generated text (model-spec §4.3, §4.5).

Input is the detokenized completion WITH special tokens kept and no spaces inserted between them
(``tokenizer.decode(ids, skip_special_tokens=False)``). Markers are matched tolerantly: whitespace
is allowed between the pieces of a multi-token marker (``<|open|> tools <|sep|>``).

Every parser is an incremental state machine: streaming feeds it text deltas (``feed``) and ends
with ``finish()``; the non-streaming ``extract`` runs the same machine over the whole text, so
both paths agree for every way of splitting the text. A delta never carries a partial marker: a
tail that could still become a marker is held back until it is decided (and released as text by
``finish()`` if the stream ends first).

- :class:`K3ReasoningParser` splits the K3 think channel from the rest.
- :class:`K3ToolCallParser` turns K3's response / tools channels into content + OpenAI tool calls.
- :class:`K3OutputParser` chains the two (what a K3 chat endpoint needs).
- :class:`KimiToolCallParser` handles the K2 / Kimi-Linear ``<|tool_calls_section_begin|>`` format.

Tool calls come out in OpenAI shape: non-streaming ``{"id", "type": "function", "function":
{"name", "arguments"}}``; streaming deltas add ``"index"`` (0-based within the response) and carry
each call whole (id, name and the complete arguments) once its block is complete.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import json
import re
from typing import Any

__all__ = ["K3ReasoningParser", "K3ToolCallParser", "K3OutputParser", "KimiToolCallParser",
           "k3_reasoning_open", "parse_k3_call"]

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"

_FULL, _PARTIAL, _NO = 2, 1, 0
_ATTRS = object()  # marker part: optional ' key="value"...' text up to the next <|sep|>

THINK_OPEN = (OPEN, "think", SEP)
THINK_CLOSE = (CLOSE, "think", SEP)
RESPONSE_OPEN = (OPEN, "response", SEP)
RESPONSE_CLOSE = (CLOSE, "response", SEP)
TOOLS_OPEN = (OPEN, "tools", SEP)
TOOLS_CLOSE = (CLOSE, "tools", SEP)
MESSAGE_CLOSE = (CLOSE, "message", SEP)
EOM = (END_OF_MSG,)
CALL_OPEN = (OPEN, "call", _ATTRS, SEP)
CALL_CLOSE = (CLOSE, "call", SEP)


# ---- marker matching ----------------------------------------------------------------------------

def _match(s: str, i: int, parts: tuple) -> tuple[int, int, str]:
    """Match a marker at ``s[i:]``: (_FULL, end, attrs) / (_PARTIAL, -1, "") when ``s`` ends inside
    a possible marker / (_NO, -1, ""). Whitespace is allowed between the parts."""
    j, n, attrs = i, len(s), ""
    for k, part in enumerate(parts):
        if part is _ATTRS:
            if j >= n:
                return _PARTIAL, -1, ""
            if s.startswith("<|", j) or (s[j] == "<" and j == n - 1):
                continue  # no attributes; the next part (<|sep|>) checks what follows
            if not s[j].isspace():
                return _NO, -1, ""
            stop = s.find("<|", j)
            if stop == -1:
                return _PARTIAL, -1, ""
            attrs = s[j:stop]
            j = stop
            continue
        if k and parts[k - 1] is not _ATTRS:
            while j < n and s[j].isspace():
                j += 1
        for ch in part:
            if j >= n:
                return _PARTIAL, -1, ""
            if s[j] != ch:
                return _NO, -1, ""
            j += 1
    return _FULL, j, attrs


def _scan(s: str, start: int, markers: dict[str, tuple], final: bool) -> tuple[str, int, int, str | None, str]:
    """First marker at or after ``start``: ("found", pos, end, name, attrs); ("hold", pos, ...) when
    ``s[pos:]`` could still become a marker (never when ``final``); ("none", len(s), ...)."""
    i = s.find("<", start)
    while i != -1:
        partial = False
        for name, parts in markers.items():
            st, end, attrs = _match(s, i, parts)
            if st == _FULL:
                return "found", i, end, name, attrs
            if st == _PARTIAL:
                partial = True
        if partial and not final:
            return "hold", i, -1, None, ""
        i = s.find("<", i + 1)
    return "none", len(s), -1, None, ""


_ATTR_RE = re.compile(r'([\w.\-]+)\s*=\s*"([^"]*)"')


def _attrs(text: str) -> dict[str, str]:
    return {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTR_RE.findall(text)}


def k3_reasoning_open(text: str) -> bool:
    """True when ``text`` (e.g. a decoded K3 prompt) leaves a think channel open: its most recent
    think-open comes after its most recent think-close (§4.5; old turns keep closed channels)."""
    def last(parts):
        pos, i = -1, 0
        while True:
            kind, p, end, _, _ = _scan(text, i, {"m": parts}, True)
            if kind != "found":
                return pos
            pos, i = p, end
    return last(THINK_OPEN) > last(THINK_CLOSE)


# =================================================================================================
# K3 reasoning
# =================================================================================================

class K3ReasoningParser:
    """Split K3 output into reasoning (the think channel) and the rest.

    ``prompt_ended_in_think``: the prompt's generation prefix opened the think channel (thinking
    mode), so reasoning starts at the first character. Otherwise reasoning exists only if the
    output itself starts with ``<|open|>think<|sep|>``. Reasoning runs to the first
    ``<|close|>think<|sep|>``; everything after it is returned as content text (still carrying the
    response / tools channel markers: feed it to :class:`K3ToolCallParser`).

    Streaming: ``feed(delta) -> (reasoning_delta, content_delta)``, then ``finish()``.
    """

    _START, _REASONING, _CONTENT = 0, 1, 2

    def __init__(self, prompt_ended_in_think: bool = True) -> None:
        self._buf = ""
        self._pos = 0  # scan / emit position in _buf
        self._state = self._REASONING if prompt_ended_in_think else self._START
        self.saw_reasoning = bool(prompt_ended_in_think)
        self.reasoning_ended = False

    @staticmethod
    def extract(text: str, prompt_ended_in_think: bool = True) -> tuple[str | None, str]:
        """(reasoning or None when there is no think channel, content text)."""
        p = K3ReasoningParser(prompt_ended_in_think)
        r1, c1 = p.feed(text)
        r2, c2 = p.finish()
        return (r1 + r2 if p.saw_reasoning else None), c1 + c2

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        return self._step(final=True)

    def _step(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        buf = self._buf
        if self._state == self._START:
            st, end, _ = _match(buf, 0, THINK_OPEN)
            if st == _PARTIAL and not final:
                return "", ""
            if st == _FULL:
                self._state, self._pos, self.saw_reasoning = self._REASONING, end, True
            else:
                self._state = self._CONTENT
        if self._state == self._REASONING:
            kind, pos, end, _, _ = _scan(buf, self._pos, {"close": THINK_CLOSE}, final)
            if kind == "found":
                reasoning = buf[self._pos:pos]
                self._state, self._pos, self.reasoning_ended = self._CONTENT, end, True
            else:
                reasoning = buf[self._pos:pos]
                self._pos = pos
        if self._state == self._CONTENT:
            content = buf[self._pos:]
            self._pos = len(buf)
        # keep the buffer short: everything before _pos is consumed
        if self._pos > 4096:
            self._buf, self._pos = self._buf[self._pos:], 0
        return reasoning, content


# =================================================================================================
# K3 tool calls
# =================================================================================================

_ARG_RE = re.compile(
    r"<\|open\|>\s*argument(?P<attrs>(?:(?!<\|sep\|>).)*?)<\|sep\|>(?P<val>.*?)<\|close\|>\s*argument\s*<\|sep\|>",
    re.DOTALL)
_JSON_RE = re.compile(
    r"<\|open\|>\s*json(?P<attrs>(?:(?!<\|sep\|>).)*?)<\|sep\|>(?P<val>.*?)<\|close\|>\s*json\s*<\|sep\|>",
    re.DOTALL)


def parse_k3_call(attrs: str, body: str) -> tuple[str, str] | None:
    """(name, arguments JSON string) of one complete ``call`` block, or None without a tool name.

    Arguments of type "string" are the raw text (no unescaping); other types are JSON-decoded,
    keeping the raw text when that fails. A ``json`` block (arguments the renderer could not
    parse) is passed through: re-serialized when it is a JSON object, else raw.
    """
    name = _attrs(attrs).get("tool", "")
    if not name:
        return None
    args: dict[str, Any] = {}
    for m in _ARG_RE.finditer(body):
        a = _attrs(m["attrs"])
        key, typ, raw = a.get("key", ""), a.get("type", "string"), m["val"]
        if typ == "string":
            args[key] = raw
        else:
            try:
                args[key] = json.loads(raw)
            except ValueError:
                args[key] = raw
    if not args:
        jm = _JSON_RE.search(body)
        if jm is not None:
            raw = jm["val"]
            try:
                parsed = json.loads(raw)
            except ValueError:
                return name, raw
            return name, (json.dumps(parsed, ensure_ascii=False) if isinstance(parsed, dict) else raw)
    return name, json.dumps(args, ensure_ascii=False)


class _ToolCallStream(ABC):
    """Shared driver of the tool-call parsers: text deltas in, (content, tool-call deltas) out;
    the non-streaming ``extract`` runs the same state machine over the whole text."""

    _INITIAL: int

    def __init__(self, start_index: int = 0) -> None:
        self.start_index = start_index
        self._buf, self._pos, self._state = "", 0, self._INITIAL
        self._call_body = 0  # where the open call's body starts in the buffer
        self._n_calls = 0

    @property
    def saw_tool_calls(self) -> bool:
        return self._n_calls > 0

    def extract(self, text: str) -> tuple[str, list[dict]]:
        """Non-streaming: (content, [{"id", "type", "function": {"name", "arguments"}}])."""
        p = type(self)(self.start_index)
        c1, t1 = p.feed(text)
        c2, t2 = p.finish()
        return c1 + c2, [{k: v for k, v in d.items() if k != "index"} for d in t1 + t2]

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self._buf += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        return self._step(final=True)

    # The format's state machine: states _BODY (text up to a mark is content), _CALL (text up to
    # the mark is one call's body; the buffer is not trimmed inside it) and _DONE (the rest is
    # ignored), plus any of its own; ``_MARKS[state]`` the marks scanned for in that state.
    _BODY: int
    _CALL: int
    _DONE: int
    _MARKS: dict[int, dict[str, tuple[str, ...]]]

    @abstractmethod
    def _on_mark(self, state: int, name: str, attrs: str, pos: int, end: int, calls: list[dict]) -> int:
        """Mark ``name`` found at buf[pos:end] in ``state``: emit what it completes, return the next state."""

    def _step(self, final: bool) -> tuple[str, list[dict]]:
        content, calls = "", []
        while self._state != self._DONE:
            st = self._state
            kind, pos, end, name, attrs = _scan(self._buf, self._pos, self._MARKS[st], final)
            if st == self._BODY:
                content += self._buf[self._pos:pos]
            self._pos = pos  # elsewhere the text before a mark is dropped (or is a call body)
            if kind != "found":
                break  # a call still open when the stream ends is dropped
            self._state = self._on_mark(st, name, attrs, pos, end, calls)
            self._pos = end
        if self._state == self._DONE:
            self._pos = len(self._buf)
        if self._state != self._CALL and self._pos > 4096:
            self._buf, self._pos = self._buf[self._pos:], 0
        return content, calls


class K3ToolCallParser(_ToolCallStream):
    """K3 response / tools channels -> (content, tool calls) (§4.5).

    Input is the text after the think channel (or the whole completion in non-thinking mode):
    ``[<|open|>response<|sep|>] content [<|close|>response<|sep|>] [<|open|>tools<|sep|> call*
    <|close|>tools<|sep|>] [<|close|>message<|sep|>] [<|end_of_msg|>]``. Content is the response
    body, ending at the first close-response / tools-open / close-message / end-of-message marker;
    calls are the complete ``call`` blocks of the tools channel. Tool-call ids are
    ``functions.{name}:{idx}`` with ``idx`` counting from ``start_index`` (the number of tool calls
    earlier in the conversation).

    Streaming: ``feed(delta) -> (content_delta, tool_call_deltas)``, then ``finish()``.
    """

    _START, _BODY, _AFTER, _TOOLS, _CALL, _DONE = range(6)
    _BODY_END = {"response_close": RESPONSE_CLOSE, "tools_open": TOOLS_OPEN,
                 "message_close": MESSAGE_CLOSE, "eom": EOM}
    _AFTER_MARKS = {"tools_open": TOOLS_OPEN, "message_close": MESSAGE_CLOSE, "eom": EOM}
    _TOOLS_MARKS = {"call": CALL_OPEN, "tools_close": TOOLS_CLOSE, "message_close": MESSAGE_CLOSE, "eom": EOM}
    _MARKS = {_BODY: _BODY_END, _AFTER: _AFTER_MARKS, _TOOLS: _TOOLS_MARKS, _CALL: {"close": CALL_CLOSE}}

    _INITIAL = _START
    _call_attrs = ""

    def _emit_call(self, attrs: str, body: str, out: list[dict]) -> None:
        parsed = parse_k3_call(attrs, body)
        if parsed is None:
            return
        name, arguments = parsed
        out.append({"index": self._n_calls, "id": f"functions.{name}:{self.start_index + self._n_calls}",
                    "type": "function", "function": {"name": name, "arguments": arguments}})
        self._n_calls += 1

    def _step(self, final: bool) -> tuple[str, list[dict]]:
        if self._state == self._START:  # an optional response-open marker at the very start
            m, end, _ = _match(self._buf, 0, RESPONSE_OPEN)
            if m == _PARTIAL and not final:
                return "", []
            self._state, self._pos = self._BODY, (end if m == _FULL else 0)
        return super()._step(final)

    def _on_mark(self, state: int, name: str, attrs: str, pos: int, end: int, calls: list[dict]) -> int:
        if state == self._BODY:
            return {"response_close": self._AFTER, "tools_open": self._TOOLS}.get(name, self._DONE)
        if state == self._AFTER:  # text between the channels is dropped
            return self._TOOLS if name == "tools_open" else self._DONE
        if state == self._TOOLS:
            if name != "call":
                return self._DONE
            self._call_attrs, self._call_body = attrs, end
            return self._CALL
        self._emit_call(self._call_attrs, self._buf[self._call_body:pos], calls)  # _CALL
        return self._TOOLS


class K3OutputParser:
    """Reasoning + content + tool calls of one K3 completion (reasoning parser, then tool parser).

    ``feed(delta) -> (reasoning_delta, content_delta, tool_call_deltas)``; ``finish()`` likewise;
    ``extract(text) -> (reasoning | None, content, tool_calls)``.
    """

    def __init__(self, prompt_ended_in_think: bool = True, start_index: int = 0) -> None:
        self.prompt_ended_in_think = prompt_ended_in_think
        self.start_index = start_index
        self.reasoning = K3ReasoningParser(prompt_ended_in_think)
        self.tools = K3ToolCallParser(start_index)

    @property
    def saw_tool_calls(self) -> bool:
        return self.tools.saw_tool_calls

    def feed(self, delta: str) -> tuple[str, str, list[dict]]:
        r, c = self.reasoning.feed(delta)
        content, calls = self.tools.feed(c) if c else ("", [])
        return r, content, calls

    def finish(self) -> tuple[str, str, list[dict]]:
        r, c = self.reasoning.finish()
        c1, t1 = self.tools.feed(c) if c else ("", [])
        c2, t2 = self.tools.finish()
        return r, c1 + c2, t1 + t2

    def extract(self, text: str) -> tuple[str | None, str, list[dict]]:
        reasoning, rest = K3ReasoningParser.extract(text, self.prompt_ended_in_think)
        content, calls = K3ToolCallParser(self.start_index).extract(rest)
        return reasoning, content, calls


# =================================================================================================
# K2 / Kimi-Linear tool calls
# =================================================================================================

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
IM_END = "<|im_end|>"


def _k2_name(call_id: str) -> str:
    """The function name in ``functions.{name}:{idx}``: between ``functions.`` and the last ``:``."""
    head = call_id.rsplit(":", 1)[0] if ":" in call_id else call_id
    return head[len("functions."):] if head.startswith("functions.") else head


class KimiToolCallParser(_ToolCallStream):
    """K2-family tool calls (§4.3): ``content <|tool_calls_section_begin|> (<|tool_call_begin|> id
    <|tool_call_argument_begin|> {json} <|tool_call_end|>)* <|tool_calls_section_end|>``.

    Content is the text before the section (or before ``<|im_end|>``). The call id is kept as the
    model wrote it (``functions.{name}:{idx}``) and is the OpenAI id; the name is parsed out of it;
    arguments are the raw JSON text (whitespace-trimmed). The singular spelling
    ``<|tool_call_section_begin|>`` seen from some K2 checkpoints is accepted too.

    Streaming: ``feed(delta) -> (content_delta, tool_call_deltas)``, then ``finish()``.
    """

    _BODY, _TOOLS, _CALL, _DONE = range(4)
    _BODY_END = {"section": (SECTION_BEGIN,), "section1": ("<|tool_call_section_begin|>",), "end": (IM_END,)}
    _TOOLS_MARKS = {"call": (CALL_BEGIN,), "section_end": (SECTION_END,),
                    "section_end1": ("<|tool_call_section_end|>",), "end": (IM_END,)}
    _MARKS = {_BODY: _BODY_END, _TOOLS: _TOOLS_MARKS, _CALL: {"end": (CALL_END,)}}

    _INITIAL = _BODY  # start_index is unused for ids here (the model writes them)

    def _on_mark(self, state: int, name: str, attrs: str, pos: int, end: int, calls: list[dict]) -> int:
        if state == self._BODY:
            return self._DONE if name == "end" else self._TOOLS
        if state == self._TOOLS:
            if name != "call":
                return self._DONE
            self._call_body = end
            return self._CALL
        body = self._buf[self._call_body:pos]  # _CALL: "id <|tool_call_argument_begin|> {json}"
        if ARGUMENT_BEGIN in body:
            cid, args = body.split(ARGUMENT_BEGIN, 1)
            cid = cid.strip()
            if cid:
                calls.append({"index": self._n_calls, "id": cid, "type": "function",
                              "function": {"name": _k2_name(cid), "arguments": args.strip()}})
                self._n_calls += 1
        return self._TOOLS
