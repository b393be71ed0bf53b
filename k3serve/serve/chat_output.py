"""Chat output -> OpenAI message fields, through the family's parsers (serve/parsers.py).

K3 output is XTML (think / response / tools channels); Kimi-Linear uses the K2 tool-call section.
The text handed in was detokenized with special tokens kept, so markers are visible.
"""

from __future__ import annotations

from .parsers import K3OutputParser, KimiToolCallParser


def _is_k3(model_type: str) -> bool:
    return model_type == "kimi_k3"


class ChatStreamParser:
    """Streaming: text deltas in, OpenAI ``delta`` dicts out."""

    def __init__(self, model_type: str, reasoning: bool, tools: bool, prompt_ends_in_think: bool = False,
                 tool_call_start_index: int = 0):
        self.reasoning, self.tools = reasoning, tools
        self.k3 = _is_k3(model_type)
        self.parser = (K3OutputParser(prompt_ends_in_think, tool_call_start_index) if self.k3
                       else KimiToolCallParser(tool_call_start_index))
        self._n_calls = 0

    @property
    def saw_tool_calls(self) -> bool:
        return self.tools and self.parser.saw_tool_calls

    def _deltas(self, parsed) -> list[dict]:
        if self.k3:
            reasoning, content, calls = parsed
        else:
            (content, calls), reasoning = parsed, ""
        out = []
        if reasoning:
            out.append({"reasoning_content": reasoning} if self.reasoning else {"content": reasoning})
        if content:
            out.append({"content": content})
        if calls and self.tools:
            for c in calls:
                out.append({"tool_calls": [{"index": self._n_calls, "id": c["id"], "type": "function",
                                            "function": {"name": c["function"]["name"],
                                                         "arguments": c["function"]["arguments"]}}]})
                self._n_calls += 1
        return out

    def feed(self, delta: str) -> list[dict]:
        return self._deltas(self.parser.feed(delta)) if delta else []

    def finish(self) -> list[dict]:
        return self._deltas(self.parser.finish())


def parse_chat_output(text: str, model_type: str, reasoning: bool, tools: bool, prompt_ends_in_think: bool = False,
                      tool_call_start_index: int = 0) -> dict:
    """Non-streaming: the assistant message with content, reasoning_content and tool_calls."""
    p = ChatStreamParser(model_type, reasoning, tools, prompt_ends_in_think, tool_call_start_index)
    msg: dict = {"role": "assistant", "content": None}
    content, rsn, calls = [], [], []
    for d in p.feed(text) + p.finish():
        content.append(d.get("content") or "")
        rsn.append(d.get("reasoning_content") or "")
        for c in d.get("tool_calls", []):
            calls.append({k: v for k, v in c.items() if k != "index"})
    msg["content"] = "".join(content) or (None if calls else "")
    if reasoning:
        msg["reasoning_content"] = "".join(rsn) or None
    if calls:
        msg["tool_calls"] = calls
    return msg
