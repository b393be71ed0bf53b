"""The forced tool call's grammar (tool_choice required / named on K3) on xgrammar itself: what it
accepts and refuses, over a byte-level vocabulary."""

import pytest
import xgrammar as xgr

from k3serve.serve.tool_grammar import tool_call_grammar

STOP = 256  # a byte-level vocabulary, then the stop token
_INFO = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"</s>"], stop_token_ids=[STOP])
_COMPILER = xgr.GrammarCompiler(_INFO)

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": ["number", "null"]}, "op": {"enum": ["plus", "minus", 3]},
    "note": {"type": "string"}, "opts": {"type": "object"}, "tags": {"anyOf": [{"type": "array"},
                                                                               {"type": "boolean"}]}},
    "required": ["a", "op"]}}},
    {"type": "function", "function": {"name": "ping"}}]


def accepts(grammar: str, text: str) -> bool:
    matcher = xgr.GrammarMatcher(_COMPILER.compile_grammar(grammar))
    return all(matcher.accept_token(b) for b in text.encode()) and matcher.accept_token(STOP)


def call(name: str, *args: tuple[str, str, str], index: int = 1) -> str:
    body = "".join(f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>' for k, t, v in args)
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>{body}<|close|>call<|sep|>'


def output(*calls: str, reasoning: str | None = None, response: str = "") -> str:
    head = "" if reasoning is None else f"{reasoning}<|close|>think<|sep|><|open|>response<|sep|>"
    return f"{head}{response}<|close|>response<|sep|><|open|>tools<|sep|>{''.join(calls)}<|close|>tools<|sep|>"


@pytest.mark.parametrize("args", [
    [("a", "integer", "-12"), ("op", "string", "plus")],
    [("a", "integer", "0"), ("b", "number", "1.5e3"), ("op", "integer", "3"),
     ("note", "string", "a < b, and a path longer than thirty-two characters: /srv/data/2026/archive.tar.gz"),
     ("opts", "object", '{"x": [1, "y", {"z": null}], "w": -0.5}'), ("tags", "array", '["a", true]')],
    [("a", "integer", "7"), ("b", "null", "null"), ("op", "string", "minus"), ("tags", "boolean", "false")],
])
def test_arguments_follow_the_json_schema(args):
    assert accepts(tool_call_grammar(TOOLS, "required", False), output(call("add", *args)))


@pytest.mark.parametrize("args", [
    [("a", "integer", "1.5"), ("op", "string", "plus")],  # an integer with a fraction (it was "number")
    [("a", "integer", "1"), ("op", "string", "times")],  # not in the enum (the enum was ignored)
    [("op", "string", "plus")],  # a required argument missing
    [("a", "integer", "1"), ("op", "string", "plus"), ("note", "string", "x<|open|>y")],  # a marker in a string
    [("a", "integer", "1"), ("op", "string", "plus"), ("opts", "object", "free text")],  # not JSON
    [("a", "string", "1"), ("op", "string", "plus")],  # the wrong type attribute
])
def test_arguments_outside_the_schema_are_refused(args):
    assert not accepts(tool_call_grammar(TOOLS, "required", False), output(call("add", *args)))


def test_required_named_reasoning_and_limits():
    required = tool_call_grammar(TOOLS, "required", True)
    long_thought = "Let me think about which tool fits, at some length. " * 20
    two = output(call("ping"), call("add", ("a", "integer", "2"), ("op", "string", "plus"), index=12),
                 reasoning=long_thought, response="Calling.")
    assert accepts(required, two)  # reasoning and response unbounded (they were cut at 64 / 16)
    assert not accepts(required, output(reasoning="x"))  # at least one call
    named = tool_call_grammar(TOOLS, {"type": "function", "function": {"name": "ping"}}, False)
    assert accepts(named, output(call("ping"))) and not accepts(named, output(call("ping"), call("ping")))
    assert not accepts(named, output(call("add", ("a", "integer", "2"), ("op", "string", "plus"))))
    capped = tool_call_grammar(TOOLS, "required", True, text_limit=16)
    assert accepts(capped, output(call("ping"), reasoning="short")) and \
        not accepts(capped, output(call("ping"), reasoning=long_thought))


@pytest.mark.parametrize("tools, choice, needle", [
    ([], "required", "requires 'tools'"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not among"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"properties": {"x": {"type": "date"}}}}}],
     "required", "unsupported argument type"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"properties": {"x": {"enum": []}}}}}],
     "required", "enum"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"properties": ["x"]}}}], "required",
     "parameters must be"),
])
def test_bad_tool_declarations_are_errors(tools, choice, needle):
    with pytest.raises(ValueError, match=needle):
        tool_call_grammar(tools, choice, False)
