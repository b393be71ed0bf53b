"""Constrained decoding for tool_choice = required / named on K3 (model-spec §4.5).

The grammar: (reasoning closed, when the prompt left the think channel open), an optional response
channel of plain text, then a tools channel with one or more calls (exactly one named call for a
named tool_choice) whose argument keys and types follow each tool's JSON schema, then the message
close. After that only EOS (<|end_of_msg|>) is allowed. Free-text parts are bounded so that even a
weak model reaches the tool call.
"""

from __future__ import annotations

import json

K3_MARKERS = ("<|open|>", "<|close|>", "<|sep|>")
_TYPES = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "null": "null",
          "object": "object", "array": "array"}
_VALUES = {
    "string": '[^<]{0,32}',
    "number": '"-"? [0-9]{1,12} ("." [0-9]{1,6})?',
    "boolean": '"true" | "false"',
    "null": '"null"',
    "object": '"{" [^<]{0,128} "}"',
    "array": '"[" [^<]{0,128} "]"',
}


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _open(tag: str, **attrs: str) -> str:
    body = "<|open|>" + tag + "".join(f' {k}="{v}"' for k, v in attrs.items()) + "<|sep|>"
    return _lit(body)


def _close(tag: str) -> str:
    return _lit(f"<|close|>{tag}<|sep|>")


def _tool_name(tool: dict) -> str:
    fn = tool.get("function", tool)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("every tool needs a function name")
    return name


def tool_call_grammar(tools: list[dict], tool_choice, prompt_ends_in_think: bool) -> str:
    """EBNF (xgrammar dialect) forcing at least one call of the declared tools (or the named one)."""
    if not tools:
        raise ValueError("tool_choice requires 'tools'")
    by_name = {_tool_name(t): t.get("function", t) for t in tools}
    named = None
    if isinstance(tool_choice, dict):
        named = (tool_choice.get("function") or {}).get("name")
        if named not in by_name:
            raise ValueError(f"tool_choice names {named!r}, which is not among the declared tools")
    rules = []
    calls = []
    for i, (name, fn) in enumerate(by_name.items()):
        if named is not None and name != named:
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        args = []
        for j, (key, sch) in enumerate(props.items()):
            typ = _TYPES.get((sch or {}).get("type", "string"), "string")
            rule = f"arg_{i}_{j}"
            rules.append(f'{rule} ::= {_open("argument", key=key, type=typ)} ({_VALUES[typ]}) {_close("argument")}')
            args.append(rule if key in required else f"{rule}?")
        body = " ".join(args) if args else '""'
        call_open = _lit('<|open|>call tool="' + name + '" index="')
        sep = _lit('"<|sep|>')
        rules.append(f'call_{i} ::= {call_open} [1-9] {sep} {body} {_close("call")}')
        calls.append(f"call_{i}")
    call_alt = " | ".join(calls)
    repeat = "" if named is not None else "+"
    head = f'[^<]{{0,64}} {_close("think")} ' if prompt_ends_in_think else ""
    # The response channel is always present (possibly empty); in non-thinking mode the prompt opened it.
    response = (f'{_open("response")} [^<]{{0,16}} {_close("response")}' if prompt_ends_in_think
                else f'[^<]{{0,16}} {_close("response")}')
    return "\n".join([
        f'root ::= {head}{response} {_open("tools")} ({call_alt}){repeat} {_close("tools")} ({_close("message")})?',
        *rules,
    ])
