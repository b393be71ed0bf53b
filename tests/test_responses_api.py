"""/v1/responses on a live server (the tiny K3 model, reasoning and tool-call parsers on), through the
official openai client: each response equals the chat completion of the same conversation, streamed
or not, continued by previous_response_id, with function calls and their outputs."""

import json

import httpx
import openai
import pytest

from k3serve.make_model import make_model
from test_server import serving

GREEDY = dict(temperature=0, reasoning={"effort": "none"})
TOOL = {"type": "function", "name": "get_weather", "description": "weather by city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_TOOL = {"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("responses")
    make_model("tiny", path, seed=6, progress=False)
    with serving(path, "--tool-call-parser", "kimi_k3", "--reasoning-parser", "kimi_k3", "--max-model-len", "4096",
                 "--tool-call-text-limit", "16") as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def chat_of(client, messages, max_tokens, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0,
                                          reasoning_effort="none", extra_body={"ignore_eos": True}, **kw)


def test_a_response_is_the_chat_completion_of_its_conversation(client):
    r = client.responses.create(model="tiny", input="Write a haiku about state.", instructions="Be brief.",
                                max_output_tokens=12, extra_body={"ignore_eos": True}, **GREEDY)
    chat = chat_of(client, [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Write a haiku about state."}], 12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == chat.choices[0].message.content
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # (ignore_eos: 12 ran)
    assert item.status == "incomplete" and r.instructions == "Be brief." and r.temperature == 0
    # thinking on (the default): the think channel is a reasoning item, as the chat's reasoning_content
    t = client.responses.create(model="tiny", input="Why?", max_output_tokens=10, temperature=0)
    tc = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Why?"}], max_tokens=10,
                                        temperature=0)
    reasoning = [i for i in t.output if i.type == "reasoning"]
    assert reasoning and reasoning[0].content[0].text == tc.choices[0].message.reasoning_content
    assert t.usage.output_tokens_details.reasoning_tokens == t.usage.output_tokens == 10  # (never closed: all)
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_streamed_events_build_the_same_response(client):
    kw = dict(model="tiny", input="List three colours.", max_output_tokens=10, extra_body={"ignore_eos": True},
              **GREEDY)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens == 10
    assert [i.type for i in final.output] == [i.type for i in whole.output] == ["message"]


def test_previous_response_id_continues_a_stored_conversation(client, server):
    first = client.responses.create(model="tiny", input="Hello there.", max_output_tokens=6, **GREEDY)
    second = client.responses.create(model="tiny", input="And then?", previous_response_id=first.id,
                                     max_output_tokens=6, **GREEDY)
    chat = chat_of(client, [{"role": "user", "content": "Hello there."},
                            {"role": "assistant", "content": first.output_text},
                            {"role": "user", "content": "And then?"}], 6)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    r = httpx.post(server + "/v1/responses", json={"model": "tiny", "input": "x", "previous_response_id": "resp_no"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_function_call_round_trip(client):
    """A forced function call comes out as a function_call item (streamed: its arguments' events);
    its output sent back continues to the chat's final answer for the same turns."""
    kw = dict(model="tiny", input="Weather in Paris?", tools=[TOOL], max_output_tokens=800, **GREEDY)
    r = client.responses.create(tool_choice={"type": "function", "name": "get_weather"}, **kw)
    [call] = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    assert call.call_id == "functions.get_weather:0" and r.status == "completed"
    events = list(client.responses.create(tool_choice={"type": "function", "name": "get_weather"}, stream=True, **kw))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments] and events[-1].type == "response.completed"
    after = client.responses.create(model="tiny", previous_response_id=r.id, tools=[TOOL], tool_choice="none",
                                    input=[{"type": "function_call_output", "call_id": call.call_id,
                                            "output": '{"temp_c": 21}'}], max_output_tokens=8, **GREEDY)
    said = "".join(i.content[0].text for i in r.output if i.type == "message")
    chat = chat_of(client, [{"role": "user", "content": "Weather in Paris?"},
                            {"role": "assistant", "content": said, "tool_calls": [
                                {"id": call.call_id, "type": "function",
                                 "function": {"name": call.name, "arguments": call.arguments}}]},
                            {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp_c": 21}'}], 8,
                   tools=[CHAT_TOOL], tool_choice="none")
    assert after.output_text == chat.choices[0].message.content
    # the same turns sent whole as input items, with no stored state
    whole = client.responses.create(model="tiny", tools=[TOOL], tool_choice="none", max_output_tokens=8, store=False,
                                    input=[{"role": "user", "content": "Weather in Paris?"},
                                           *([{"type": "message", "role": "assistant",
                                               "content": [{"type": "output_text", "text": said}]}] if said else []),
                                           {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                            "arguments": call.arguments},
                                           {"type": "function_call_output", "call_id": call.call_id,
                                            "output": '{"temp_c": 21}'}], **GREEDY)
    assert whole.output_text == after.output_text


def test_structured_text_format(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client.responses.create(model="tiny", input="ok?", max_output_tokens=40, temperature=0,
                                reasoning={"effort": "none"},
                                text={"format": {"type": "json_schema", "name": "r", "schema": schema}})
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text)["ok"], bool)
    else:
        assert r.output_text.lstrip().startswith("{")


@pytest.mark.parametrize("body,param,needle", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "only text parts"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be"),
    ({"input": "x", "reasoning": {"effort": "medium"}}, "reasoning.effort", "effort"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format", "text.format"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input", "call_id, name and arguments"),
    ({"input": 5}, "input", "input must be"),
])
def test_bad_requests(server, body, param, needle):
    r = httpx.post(server + "/v1/responses", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == param, err
    assert httpx.get(server + "/health").status_code == 200
