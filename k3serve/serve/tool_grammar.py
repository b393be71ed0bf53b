"""Constrained decoding for tool_choice = required / named on K3 (model-spec §4.5).

The grammar: (reasoning closed, when the prompt left the think channel open), an optional response
channel of plain text, then a tools channel with one or more calls (exactly one named call for a
named tool_choice) whose arguments follow each tool's JSON schema, then the message close. After
that only EOS (<|end_of_msg|>) is allowed.

Argument values as the spec's parser reads them: a string is raw text (any text that opens no
``<|`` marker), every other type JSON (integers without a fraction, numbers, booleans, null, and
objects / arrays as JSON values); ``enum`` lists its values, a list of types or ``anyOf`` /
``oneOf`` offers each (the argument's ``type`` attribute says which). Free text (the reasoning,
the response, string values) is unbounded unless ``text_limit`` caps it (``serve
--tool-call-text-limit``: a weak model otherwise may never reach the call; a real one closes its
channels itself).
"""

from __future__ import annotations

import json

K3_MARKERS = ("<|open|>", "<|close|>", "<|sep|>")
_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
_INT = '"-"? ("0" | [1-9] [0-9]*)'
_SCALARS = {
    "integer": _INT,
    "number": f'{_INT} ("." [0-9]+)? ([eE] [+\\-]? [0-9]+)?',
    "boolean": '"true" | "false"',
    "null": '"null"',
    "object": "json_object",
    "array": "json_array",
}
# JSON values for object / array arguments ('<' only escaped inside strings: no marker can open)
_JSON_RULES = [
    'json_value ::= json_object | json_array | json_string | json_number | "true" | "false" | "null"',
    'json_object ::= "{" json_ws (json_string json_ws ":" json_ws json_value json_ws '
    '("," json_ws json_string json_ws ":" json_ws json_value json_ws)*)? "}"',
    'json_array ::= "[" json_ws (json_value json_ws ("," json_ws json_value json_ws)*)? "]"',
    'json_string ::= "\\"" ([^"\\\\<\\x00-\\x1f] | "\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F]{4}))* "\\""',
    f'json_number ::= {_SCALARS["number"]}',
    'json_ws ::= [ \\t\\n]{0,4}',
]


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _text(limit: int | None) -> str:
    """Text that opens no marker ('<' never followed by '|'), at most ``limit`` pieces."""
    piece = '([^<] | "<"+ [^<|])'
    return f'({piece}* "<"*)' if limit is None else f'({piece}{{0,{limit}}} "<"?)'


def _open(tag: str, **attrs: str) -> str:
    body = "<|open|>" + tag + "".join(f' {k}="{v}"' for k, v in attrs.items()) + "<|sep|>"
    return _lit(body)


def _close(tag: str) -> str:
    return _lit(f"<|close|>{tag}<|sep|>")


def _tool_name(tool: dict) -> str:
    fn = tool.get("function", tool)
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError("every tool needs a function name")
    return name


def _alternatives(schema) -> list[tuple[str, str]]:
    """(type attribute, value grammar) for each form an argument's schema allows."""
    schema = schema if isinstance(schema, dict) else {}
    if "enum" in schema:
        values = schema["enum"] if isinstance(schema["enum"], list) else []
        if not values:
            raise ValueError("an argument's enum must list at least one value")
        return [("string", _lit(v)) if isinstance(v, str) else (_json_type(v), _lit(json.dumps(v)))
                for v in values]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return [alt for sub in schema[key] for alt in _alternatives(sub)]
    types = schema.get("type", "string")
    types = types if isinstance(types, list) else [types]
    if not types or any(t not in _TYPES for t in types):
        raise ValueError(f"unsupported argument type {schema.get('type')!r} (JSON Schema types: {', '.join(_TYPES)})")
    return [(t, None if t == "string" else _SCALARS[t]) for t in dict.fromkeys(types)]


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int):
        return "integer"
    return "number" if isinstance(value, float) else "object" if isinstance(value, dict) else "array"


def tool_call_grammar(tools: list[dict], tool_choice, prompt_ends_in_think: bool,
                      text_limit: int | None = None) -> str:
    """EBNF (xgrammar dialect) forcing at least one call of the declared tools (or the named one)."""
    if not tools:
        raise ValueError("tool_choice requires 'tools'")
    by_name = {_tool_name(t): t.get("function", t) for t in tools}
    named = None
    if isinstance(tool_choice, dict):
        named = (tool_choice.get("function") or {}).get("name")
        if named not in by_name:
            raise ValueError(f"tool_choice names {named!r}, which is not among the declared tools")
    text = _text(text_limit)
    rules = []
    calls = []
    for i, (name, fn) in enumerate(by_name.items()):
        if named is not None and name != named:
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") or {} if isinstance(params, dict) else None
        required = params.get("required") or [] if isinstance(params, dict) else None
        if not isinstance(props, dict) or not isinstance(required, list):
            raise ValueError(f"tool {name!r}: parameters must be a JSON Schema object (properties an object, "
                             "required a list)")
        required = set(map(str, required))
        args = []
        for j, (key, sch) in enumerate(props.items()):
            rule = f"arg_{i}_{j}"
            forms = [f'{_open("argument", key=key, type=typ)} ({value or text}) {_close("argument")}'
                     for typ, value in _alternatives(sch)]
            rules.append(f"{rule} ::= " + " | ".join(forms))
            args.append(rule if key in required else f"{rule}?")
        body = " ".join(args) if args else '""'
        call_open = _lit('<|open|>call tool="' + name + '" index="')
        sep = _lit('"<|sep|>')
        rules.append(f'call_{i} ::= {call_open} [1-9] [0-9]* {sep} {body} {_close("call")}')
        calls.append(f"call_{i}")
    call_alt = " | ".join(calls)
    repeat = "" if named is not None else "+"
    head = f'{text} {_close("think")} ' if prompt_ends_in_think else ""
    # The response channel is always present (possibly empty); in non-thinking mode the prompt opened it.
    response = (f'{_open("response")} {text} {_close("response")}' if prompt_ends_in_think
                else f'{text} {_close("response")}')
    return "\n".join([
        f'root ::= {head}{response} {_open("tools")} ({call_alt}){repeat} {_close("tools")} ({_close("message")})?',
        *rules, *_JSON_RULES,
    ])
