"""A live `k3serve serve` on the tiny model, driven by the official openai client and raw HTTP."""

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from k3serve.make_model import make_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model_dir, *extra):
    port = _free_port()
    cmd = [sys.executable, "-m", "k3serve.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--dtype", "float32", "--device", "cpu", "--cache-memory", "64MiB", "--page-size", "16",
           "--max-model-len", "512", "--served-model-name", "tiny", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("served")
    make_model("tiny", path, seed=6, progress=False)
    return path


@contextlib.contextmanager
def serving(model_dir, *extra):
    """A server's URL while the block runs; SIGTERM and a wait after."""
    proc, url = _start(model_dir, *extra)
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(model_dir):
    with serving(model_dir, "--max-queue", "64") as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def _pool_used(url) -> float:
    """Pool bytes held by live requests (cached prefix checkpoints excluded)."""
    text = httpx.get(url + "/metrics").text
    return float(re.search(r"^k3serve_request_cache_bytes (\S+)", text, re.M).group(1))


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(server + "/health").status_code == 200
    assert httpx.get(server + "/ping").status_code == 200 and httpx.post(server + "/ping").status_code == 200
    assert httpx.get(server + "/version").json() == {"version": __import__("k3serve").__version__}


def test_completion_usage_matches_tokens(client, server):
    out = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    prompt_ids = httpx.post(server + "/tokenize", json={"prompt": "def f(x):"}).json()["tokens"]
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 7 and out.usage.total_tokens == len(prompt_ids) + 7


def test_completion_streaming_equals_non_streaming(client):
    kw = dict(model="tiny", prompt="import os\n", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    usage = [c.usage for c in chunks if c.usage]
    assert usage and usage[-1].completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_chat_streaming_and_not(client):
    msgs = [{"role": "user", "content": "Write a haiku about state."}]
    kw = dict(model="tiny", messages=msgs, max_tokens=10, temperature=0, seed=1, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (full.choices[0].message.content or "")
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_sampling_extras_and_n(client):
    out = client.completions.create(model="tiny", prompt="x = ", max_tokens=5, n=3, temperature=0.9, seed=5,
                                    extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.2,
                                                "ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 15
    again = client.completions.create(model="tiny", prompt="x = ", max_tokens=5, n=3, temperature=0.9, seed=5,
                                      extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.2,
                                                  "ignore_eos": True})
    assert [c.text for c in out.choices] == [c.text for c in again.choices]  # seeded: reproducible


@pytest.mark.parametrize("body,status,needle", [
    ("{not json", 400, "not valid JSON"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_p": 7}, 400, "top_p"),
    ({"model": "tiny", "prompt": "hi", "n": 0}, 400, "n must be"),
    ({"model": "other", "prompt": "hi"}, 404, "does not exist"),
    ({"model": "tiny", "prompt": "word " * 600}, 400, "max_model_len"),
    ({"model": "tiny", "prompt": [999999]}, 400, "token ids"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": "hi", "n": 100000}, 400, "max_num_seqs"),  # (it locked the engine up)
    ({"model": "tiny", "prompt": [98] * 500, "max_tokens": 13}, 400, "maximum context length is 512"),
    ({"model": "tiny", "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": "tiny", "prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ({"model": "tiny", "prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be"),  # (0 only with echo)
    ({"model": "tiny", "prompt": "hi", "logit_bias": {"5": 500}}, 400, "biases in [-100, 100]"),
    ({"model": "tiny", "prompt": "hi", "cache_salt": ""}, 400, "cache_salt must be"),
    ({"model": "tiny", "prompt": "hi", "allowed_token_ids": [64], "guided_choice": ["yes", "no"]}, 400,
     "cannot be combined with structured output"),
    ({"model": "tiny", "prompt": "hi", "priority": 1}, 400, "needs the priority scheduling policy"),
    ({"model": "tiny", "prompt": [1.5]}, 400, "prompt has none of its accepted forms"),
    ({"model": "tiny", "prompt": "hi", "logit_bias": {"9999999": 1}}, 400, "logit_bias: token ids must be"),
    ({"model": "tiny", "prompt": "hi", "allowed_token_ids": [9999999]}, 400, "allowed_token_ids: token ids"),
    ({"model": "tiny", "prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs must be in 0..20"),
    ({"model": "tiny", "prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400, "not available when streaming"),
])
def test_bad_completion_requests(server, body, status, needle):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server + "/v1/completions", content=data, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    assert httpx.get(server + "/health").status_code == 200  # and the server keeps serving


@pytest.mark.parametrize("body,param,needle", [
    ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be"),
    ({"max_completion_tokens": 600}, "max_completion_tokens", "maximum context length"),
    ({"max_tokens": 600}, "max_tokens", "maximum context length"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [{"type": "function"}]}, "tools", "function.name"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be in 0..20"),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, "messages", "max_model_len"),
    ({"logit_bias": {"9999999": 1}}, "logit_bias", "token ids must be"),
    ({"allowed_token_ids": [9999999]}, "allowed_token_ids", "token ids must be"),
    ({"structured_outputs": {}}, "structured_outputs", "give one of"),
    ({"guided_grammar": ""}, "guided_grammar", "non-empty EBNF"),
])
def test_bad_chat_fields_name_their_parameter(server, body, param, needle):
    r = httpx.post(server + "/v1/chat/completions",
                   json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == param, err


def test_unknown_routes_get_openai_style_errors(server):
    for r, status in ((httpx.get(server + "/v1/nothing"), 404), (httpx.get(server + "/v1/completions"), 405)):
        assert r.status_code == status and r.json()["error"]["message"], r.text


def test_bad_chat_requests(client):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")  # a good request right after works


def test_tokenize_detokenize(server):
    ids = httpx.post(server + "/tokenize", json={"prompt": "héllo wörld"}).json()["tokens"]
    assert httpx.post(server + "/detokenize", json={"tokens": ids}).json()["prompt"] == "héllo wörld"
    r = httpx.post(server + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["count"] > 3


def test_disconnect_mid_stream_returns_memory(server):
    assert _pool_used(server) == 0
    body = {"model": "tiny", "prompt": "a" * 100, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=30) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 3:
                assert _pool_used(server) > 0
                break
    for _ in range(100):
        if _pool_used(server) == 0:
            break
        time.sleep(0.05)
    assert _pool_used(server) == 0
    metrics = httpx.get(server + "/metrics").text
    assert "k3serve_num_requests_waiting" in metrics and 'k3serve_cache_pool_used_bytes{kind="kda"}' in metrics
    count = float(re.search(r"^k3serve_time_to_first_token_seconds_count (\S+)", metrics, re.M).group(1))
    gen = float(re.search(r"^k3serve_generation_tokens_total (\S+)", metrics, re.M).group(1))
    assert count >= 1 and gen >= 3  # earlier requests in this module were observed
    assert re.search(r'^k3serve_requests_total\{finish_reason="length"\} \S+', metrics, re.M)
    eager = float(re.search(r'^k3serve_engine_steps\{kind="eager"\} (\S+)', metrics, re.M).group(1))
    assert eager >= 3 and re.search(r'^k3serve_engine_steps\{kind="prefill_graph"\} 0\.0', metrics, re.M)
    scheduled = {k: float(re.search(rf'^k3serve_engine_scheduled_tokens\{{kind="{k}"\}} (\S+)', metrics, re.M).group(1))
                 for k in ("prefill", "decode")}
    prefill_steps = float(re.search(r"^k3serve_engine_prefill_steps (\S+)", metrics, re.M).group(1))
    assert scheduled["prefill"] >= 100 and scheduled["decode"] >= 3 and 1 <= prefill_steps <= eager
    # vLLM's names for what its dashboards read: the same values, a model_name label
    vllm = lambda name, labels="": float(re.search(  # noqa: E731
        rf'^vllm:{name}\{{{labels}model_name="tiny"\}} (\S+)', metrics, re.M).group(1))
    assert vllm("generation_tokens_total") == gen and vllm("time_to_first_token_seconds_count") == count
    assert vllm("request_success_total", 'finished_reason="length",') >= 1
    assert vllm("num_requests_running") == 0 and 0 <= vllm("kv_cache_usage_perc") <= 1
    assert vllm("e2e_request_latency_seconds_bucket", r'le="\+Inf",') >= 1


def test_api_key_and_queue_limit_and_sigterm(model_dir):
    proc, url = _start(model_dir, "--api-key", "sekret", "--max-queue", "0")
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url + "/health").status_code == 200  # outside /v1: no key needed
        ok = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        with pytest.raises(openai.APIStatusError) as exc:
            ok.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert exc.value.status_code == 503
        assert ok.models.list().data[0].id == "tiny"
    finally:
        proc.send_signal(signal.SIGTERM)
        # graceful: uvicorn drains, our shutdown hook aborts in-flight work, then it re-raises SIGTERM
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)


def test_generation_config_sets_omitted_settings(model_dir):
    """--override-generation-config (over the model's generation_config.json): a request that omits
    temperature and max_tokens samples greedily, 3 tokens; one that sets them gets its own."""
    proc, url = _start(model_dir, "--override-generation-config", '{"temperature": 0, "max_new_tokens": 3}',
                       "--scheduling-policy", "priority")
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        outs = [c.completions.create(model="tiny", prompt="x =", seed=s, extra_body={"ignore_eos": True})
                for s in (1, 2)]
        assert all(o.usage.completion_tokens == 3 for o in outs) and outs[0].choices[0].text == outs[1].choices[0].text
        own = c.completions.create(model="tiny", prompt="x =", max_tokens=5, temperature=1.0,
                                   extra_body={"ignore_eos": True})
        assert own.usage.completion_tokens == 5
        chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                         extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 3
        urgent = c.completions.create(model="tiny", prompt="x =", extra_body={"priority": -5, "ignore_eos": True})
        assert urgent.choices[0].text == outs[0].choices[0].text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    with pytest.raises(RuntimeError, match="temprature not among"):
        _start(model_dir, "--override-generation-config", '{"temprature": 0}')


def test_usage_reports_cached_prompt_tokens(model_dir):
    """usage.prompt_tokens_details.cached_tokens: a chat's next turn reads its history from the prefix
    cache (small blocks here), and says how much; the first turn none."""
    proc, url = _start(model_dir, "--prefix-block-size", "16", "--kda-checkpoint-interval", "16")
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "Tell me about recurrent state in linear attention."}]
        first = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Go on."}]
        second = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
        assert 0 < second.usage.prompt_tokens_details.cached_tokens <= first.usage.prompt_tokens
        r = c.responses.create(model="tiny", input=msgs, max_output_tokens=4, temperature=0)
        assert r.usage.input_tokens_details.cached_tokens >= second.usage.prompt_tokens_details.cached_tokens
        # vLLM's /reset_prefix_cache: the same turn again starts cold
        assert httpx.post(url + "/reset_prefix_cache").json() == {"checkpoints_held": 0}
        again = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == 0
        assert again.choices[0].message.content == second.choices[0].message.content
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_sigterm_with_a_request_in_flight(model_dir):
    import threading

    proc, url = _start(model_dir)
    result = {}

    def consume():
        body = {"model": "tiny", "prompt": "z" * 50, "max_tokens": 450, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                result["lines"] = sum(1 for _ in r.iter_lines())
        except httpx.HTTPError as exc:  # the server may close the connection while stopping
            result["error"] = repr(exc)

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    t.join(timeout=30)
    assert not t.is_alive() and result  # the client was not left hanging
    # what the processes froze for serving (gc.freeze) is collectable again at exit: Triton's bindings
    # print "nanobind: leaked ..." for every object left
    assert "leaked" not in proc.stdout.read()


def _children(pid: int) -> list[int]:
    kids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            kids += [int(k) for k in f.read().split()]
    return kids


def test_engine_runs_in_its_own_process_and_its_death_is_an_error_not_a_hang(model_dir):
    """The engine steps in a child process (no GIL shared with the HTTP event loop). If it dies,
    /health turns 500, a request in flight and a new one get an error at once, and the HTTP
    process keeps answering."""
    proc, url = _start(model_dir)
    try:
        engines = [k for k in _children(proc.pid) if "spawn_main" in open(f"/proc/{k}/cmdline").read()]
        assert len(engines) == 1, engines
        body = {"model": "tiny", "prompt": "a b c", "max_tokens": 300, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(engines[0], signal.SIGKILL)
            rest = [line for line in lines if line]  # the stream ends (no hang) with an error event
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert rest[-1] == "data: [DONE]" and "engine" in error["message"] and error["type"] == "internal_error"
        for _ in range(100):
            if httpx.get(url + "/health", timeout=5).status_code == 500:
                break
            time.sleep(0.05)
        assert httpx.get(url + "/health", timeout=5).status_code == 500
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 500 and "engine" in r.json()["error"]["message"]
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)


def test_bench_serve_against_the_live_server(server, capsys):
    from k3serve.cli import main

    assert main(["bench", "serve", "--url", server, "--dataset", "random", "--num-prompts", "6",
                 "--concurrency", "3", "--input-len", "40", "--output-len", "6", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["completed"] == 6 and rep["failed"] == 0 and rep["output_token_throughput"] > 0
    assert 0 < rep["ttft_ms"]["median"] <= rep["e2e_ms"]["median"] and rep["itl_ms"]["p99"] >= rep["itl_ms"]["median"]
    assert 6 * 20 <= rep["input_tokens"] <= 6 * 40 and 6 * 3 <= rep["output_tokens"] <= 6 * 6
    assert main(["bench", "serve", "--url", server, "--num-prompts", "4", "--concurrency", "2", "--input-len", "33",
                 "--output-len", "5", "--range-ratio", "0", "--seed", "11", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)  # fixed lengths: every prompt and answer exactly as long as asked
    assert (rep["completed"], rep["input_tokens"], rep["output_tokens"]) == (4, 4 * 33, 4 * 5)
    # the server's engine computed each prompt once (a seed of its own: no prefix hits) and each
    # answer's tokens after its first one a decode step each, in at most one prompt step a request
    eng = rep["server_engine"]
    assert (eng["prefill_tokens"], eng["decode_tokens"]) == (4 * 33, 4 * 4) and 1 <= eng["prefill_steps"] <= 4
    assert 0 < rep["client_cpu_s"]
    assert main(["bench", "serve", "--url", server, "--num-prompts", "5", "--concurrency", "3", "--input-len", "21",
                 "--output-len", "4", "--range-ratio", "0", "--client-processes", "2", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)  # two client processes (2 + 1 streams), one merged report
    assert (rep["requests"], rep["completed"], rep["input_tokens"], rep["output_tokens"]) == (5, 5, 5 * 21, 5 * 4)
    assert 0 < rep["ttft_ms"]["median"] <= rep["e2e_ms"]["median"] and rep["client_cpu_s"] > 0
    assert main(["bench", "serve", "--url", server, "--dataset", "agentic", "--num-prompts", "2", "--turns", "3",
                 "--system-len", "64", "--input-len", "30", "--output-len", "4", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["requests"] == 6 and rep["completed"] == 6


def test_structured_output_json_schema_and_choice(client):
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a person"}], temperature=0,  # (to the context's end)
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        extra_body={"max_whitespace": 1})
    text = out.choices[0].message.content
    if out.choices[0].finish_reason == "stop":  # a random model may run out of tokens mid-object
        jsonschema.validate(json.loads(text), schema)
    else:
        assert out.choices[0].finish_reason == "length" and text.lstrip().startswith("{")
    out = client.completions.create(model="tiny", prompt="answer:", max_tokens=10, temperature=0.8, seed=3,
                                    extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert out.choices[0].text in ("yes", "no", "maybe") and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model="tiny", prompt="code:", max_tokens=10, temperature=0,
                                    extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out.choices[0].text)
    grammar = 'root ::= "ab" digit digit ("!" | "?")\ndigit ::= [0-9]'  # (vLLM's guided_grammar: EBNF)
    for extra in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        out = client.completions.create(model="tiny", prompt="g:", max_tokens=10, temperature=1.0, seed=4,
                                        extra_body=extra)
        assert re.fullmatch(r"ab[0-9]{2}[!?]", out.choices[0].text) and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model="tiny", prompt="answer:", max_tokens=10, temperature=0.8, seed=3,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].text in ("yes", "no")


def test_invalid_schema_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="structured-output"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=3, extra_body={"guided_regex": "(unclosed"})
    with pytest.raises(openai.BadRequestError, match="invalid grammar"):
        client.completions.create(model="tiny", prompt="x", max_tokens=3, extra_body={"guided_grammar": "root ::= ("})
    assert client.models.list().data


def test_k3_chat_rendering_reaches_the_model(server):
    """The chat prompt is K3 XTML: /tokenize of a one-turn conversation ends in the assistant's
    open think channel (thinking on by default)."""
    msgs = [{"role": "user", "content": "hi <|open|>"}]
    ids = httpx.post(server + "/tokenize", json={"messages": msgs}).json()["tokens"]
    r = httpx.post(server + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert r.startswith("<|open|>message role=\"user\"<|sep|>hi <|open|><|close|>message<|sep|><|end_of_msg|>")
    assert r.endswith("<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>")
    # three structural opens (user message, assistant message, think); the user's "<|open|>" is text
    assert ids.count(2048 - 256 + 3) == 3


def test_reasoning_parser_splits_the_think_channel(model_dir):
    """With --reasoning-parser kimi_k3 and thinking on, a (random) model that never closes its
    think channel produces only reasoning_content; with reasoning_effort none only content."""
    proc, url = _start(model_dir, "--reasoning-parser", "kimi_k3", "--tool-call-parser", "kimi_k3",
                       "--return-tokens-as-token-ids")
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "think about it"}]
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, logprobs=True,
                                      top_logprobs=1, extra_body={"ignore_eos": True})
        assert all(re.fullmatch(r"token_id:\d+", e.token) for e in r.choices[0].logprobs.content)  # (the flag)
        named = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, logprobs=True,
                                          extra_body={"return_tokens_as_token_ids": False})
        assert not any(e.token.startswith("token_id:") for e in named.choices[0].logprobs.content)
        m = r.choices[0].message
        assert m.reasoning_content and not m.content  # everything generated sits in the open think channel
        chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        streamed = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or ""
                           for ch in chunks if ch.choices)
        assert streamed == m.reasoning_content
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                      reasoning_effort="none", extra_body={"ignore_eos": True})
        assert r.choices[0].message.content is not None and not r.choices[0].message.reasoning_content
        tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
        r = c.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
        with pytest.raises(openai.BadRequestError, match="thinking_effort|effort"):
            c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, reasoning_effort="medium")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_fifty_concurrent_streams_are_independent(server):
    """50 streaming requests at once: all complete, and each equals the same request made alone."""
    import asyncio

    prompts = [[(7 * i + j) % 1500 + 3 for j in range(5 + i % 17)] for i in range(50)]

    async def one(client, p):
        body = {"model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True}
        text = []
        async with client.stream("POST", server + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += [c["text"] for c in json.loads(line[6:])["choices"]]
        return "".join(text)

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    streamed = asyncio.run(main())
    assert len(streamed) == 50
    for i in (0, 13, 27, 49):  # spot-check against requests made alone
        alone = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": prompts[i], "max_tokens": 6,
                                                             "temperature": 0, "ignore_eos": True}, timeout=60)
        assert alone.json()["choices"][0]["text"] == streamed[i]
    assert _pool_used(server) == 0


def test_serve_refuses_an_illegal_layout_before_loading(model_dir, capsys, monkeypatch):
    import k3serve.model.loader as loader
    from k3serve.cli import main

    monkeypatch.setattr(loader, "load_checkpoint", lambda *a, **k: pytest.fail("weights were loaded"))
    assert main(["serve", "--model", str(model_dir), "-tp", "3", "--port", "1"]) == 2
    assert "TP=3 does not divide" in capsys.readouterr().err


def test_serve_names_a_truncated_shard_and_exits(tmp_path):
    """A bad checkpoint stops the engine process's start-up; the server says which shard and why,
    with exit code 2, instead of a traceback or a server without an engine."""
    make_model("tiny", tmp_path, seed=2, progress=False)
    shard = next(tmp_path.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    port = _free_port()
    proc = subprocess.run([sys.executable, "-m", "k3serve.cli", "serve", "--model", str(tmp_path), "--device", "cpu",
                           "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"error: shard {shard.name} is unreadable or truncated" in proc.stderr


def test_tool_call_round_trip(model_dir):
    """Named tool_choice constrains the (random) model's output to a K3 tool call: the call is
    parsed into OpenAI tool_calls, the tool result goes back, and the final answer is plain text."""
    proc, url = _start(model_dir, "--tool-call-parser", "kimi_k3", "--reasoning-parser", "kimi_k3",
                       "--max-model-len", "4096",  # the byte-level tiny tokenizer needs room for the call
                       "--tool-call-text-limit", "16")  # (a random model would never close its channels)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "weather by city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                           "required": ["city"]}}}]
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        r = c.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=800, temperature=0,
                                      reasoning_effort="none",
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id == "functions.get_weather:0"
        args = json.loads(call.function.arguments)
        assert isinstance(args["city"], str) and set(args) <= {"city", "days"}
        if "days" in args:
            assert isinstance(args["days"], int)  # (an integer, never a fraction: it was a number)
        # streaming gives the same call
        chunks = list(c.chat.completions.create(
            model="tiny", messages=msgs, tools=tools, max_tokens=800, temperature=0, reasoning_effort="none",
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True))
        deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
        assert [d.function.name for d in deltas] == ["get_weather"]
        assert json.loads(deltas[0].function.arguments) == args
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # send the tool result back and get a final answer
        msgs += [{"role": "assistant", "content": choice.message.content or "", "tool_calls": [
                     {"id": call.id, "type": "function",
                      "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
        final = c.chat.completions.create(model="tiny", messages=msgs, tools=tools, tool_choice="none",
                                          max_tokens=8, temperature=0, reasoning_effort="none")
        assert final.choices[0].message.tool_calls is None and isinstance(final.choices[0].message.content, str)
        # required: some declared tool is called
        r = c.chat.completions.create(model="tiny", messages=msgs[:1], tools=tools, tool_choice="required",
                                      max_tokens=800, temperature=0)
        assert r.choices[0].message.tool_calls and r.choices[0].message.tool_calls[0].function.name == "get_weather"
        with pytest.raises(openai.BadRequestError, match="not among the declared tools"):
            c.chat.completions.create(model="tiny", messages=msgs[:1], tools=tools, max_tokens=5,
                                      tool_choice={"type": "function", "function": {"name": "nope"}})
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_logprobs(client):
    out = client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    # greedy: the sampled token is the top alternative (several byte tokens may decode to the same
    # text key, so the dict can hold fewer entries, never a higher one)
    assert all(alts and max(alts.values()) <= v + 1e-5 for alts, v in zip(lp.top_logprobs, lp.token_logprobs))
    # sampled: the chosen token is in its entry beside the k likeliest (OpenAI's and vLLM's k + 1), by id
    hot = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=20, temperature=1.5, seed=7,
                                    logprobs=1, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    hl = hot.choices[0].logprobs
    assert all(t in alts and alts[t] == v and 1 <= len(alts) <= 2
               for t, v, alts in zip(hl.tokens, hl.token_logprobs, hl.top_logprobs))
    assert any(len(alts) == 2 for alts in hl.top_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_echo_scores_the_prompt(client, server):
    """echo + logprobs (lm-eval's loglikelihood request, max_tokens 0 or 1): the prompt's tokens come
    back with their logprobs (the first without). A generated token's logprob equals the same token's
    when it is scored as part of the next prompt; streamed, the same entries."""
    prompt = [5, 77, 301, 9, 1200, 44, 16]
    gen = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                    extra_body={"ignore_eos": True})
    lp = gen.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert gen.choices[0].text == "".join(lp.tokens)
    as_ids = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                       echo=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    named = as_ids.choices[0].logprobs
    assert named.tokens[:7] == [f"token_id:{t}" for t in prompt] and named.token_logprobs == lp.token_logprobs
    assert named.text_offset == lp.text_offset and as_ids.choices[0].text == gen.choices[0].text
    ids = [int(t.split(":")[1]) for t in named.tokens[7:]]
    scored = client.completions.create(model="tiny", prompt=prompt + ids, max_tokens=0, logprobs=2, echo=True)
    choice = scored.choices[0]
    assert choice.text == gen.choices[0].text and scored.usage.completion_tokens == 0
    assert choice.logprobs.tokens == lp.tokens
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    for a, b in zip(choice.logprobs.top_logprobs[1:], lp.top_logprobs[1:]):
        assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
    chunks = list(client.completions.create(model="tiny", prompt=prompt + ids, max_tokens=0, logprobs=2, echo=True,
                                            stream=True, stream_options={"include_usage": True}))
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in parts) == choice.text and chunks[-1].usage.completion_tokens == 0
    assert [t for p in parts if p.logprobs for t in p.logprobs.token_logprobs] == choice.logprobs.token_logprobs
    assert [o for p in parts if p.logprobs for o in p.logprobs.text_offset] == choice.logprobs.text_offset


def test_logit_bias_and_allowed_token_ids(client):
    """OpenAI's logit_bias (+100: that token every step, greedy or not) and vLLM's allowed_token_ids
    (sampled tokens never leave the set), the tokens read back as ids."""
    ids = lambda out: [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]  # noqa: E731
    kw = dict(model="tiny", prompt="x", max_tokens=6, logprobs=0)
    forced = client.completions.create(**kw, temperature=0.8, seed=2, logit_bias={"42": 100},
                                       extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert ids(forced) == [42] * 6
    allowed = client.completions.create(**kw, temperature=1.0, seed=3, n=4, extra_body={
        "allowed_token_ids": [7, 300, 1100], "ignore_eos": True, "return_tokens_as_token_ids": True})
    assert {t for c in allowed.choices for t in [int(x.split(":")[1]) for x in c.logprobs.tokens]} <= {7, 300, 1100}


def test_truncate_prompt_tokens(client):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens run (the same output as sending them
    alone); -1 fits a prompt past the context into it; on chat, the rendered conversation's end."""
    prompt = [5, 77, 301, 9, 1200, 44, 16, 900]
    kw = dict(model="tiny", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    cut = client.completions.create(prompt=prompt, **{**kw, "extra_body": {"ignore_eos": True,
                                                                           "truncate_prompt_tokens": 3}})
    alone = client.completions.create(prompt=prompt[-3:], **kw)
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text == alone.choices[0].text
    long = client.completions.create(model="tiny", prompt=[98] * 700, max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": -1})
    assert long.usage.prompt_tokens == 511
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello " * 50}],
                                          max_tokens=1, extra_body={"truncate_prompt_tokens": 10})
    assert chat.usage.prompt_tokens == 10
    for bad in (0, -2, 512):
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens must be"):
            client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"truncate_prompt_tokens": bad})


def test_request_ids_from_the_client(client, server):
    """vLLM's request_id field and X-Request-Id header name the request (a trace id carries through);
    an id already running is a 400 and the running request is untouched."""
    out = client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_headers={"X-Request-Id": "trace-7"})
    assert out.id == "cmpl-trace-7"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                          extra_body={"request_id": "mine"})
    assert chat.id == "chatcmpl-mine"
    two = client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=2, extra_body={"request_id": "pair"})
    assert two.id == "cmpl-pair-0" and len(two.choices) == 2
    body = {"model": "tiny", "prompt": "x", "max_tokens": 200, "stream": True, "ignore_eos": True, "request_id": "dup"}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as first:
        lines = first.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        again = httpx.post(server + "/v1/completions", json=body)
        assert again.status_code == 400 and "already in use" in again.json()["error"]["message"]
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in "".join(rest)


def test_prompt_logprobs_field(client):
    """vLLM's prompt_logprobs extra: the first token None, then the prompt token and its k likeliest
    alternatives with ranks; on chat, over the rendered conversation."""
    prompt = [5, 77, 301, 9, 1200]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2})
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for tok, entry in zip(prompt[1:], plp[1:]):
        assert str(tok) in entry and 2 <= len(entry) <= 3
        ranks = sorted(e["rank"] for t, e in entry.items() if t != str(tok) or e["rank"] <= 2)
        assert ranks[:2] == [1, 2] and all(e["logprob"] <= 0 for e in entry.values())
        best = max(entry.values(), key=lambda e: e["logprob"])
        assert best["rank"] == 1
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == chat.usage.prompt_tokens
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in plp[1:])


def _counter(server, name: str) -> float:
    found = re.search(rf"^{name} (\S+)", httpx.get(server + "/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def test_disconnect_during_non_streaming_request_returns_memory(server):
    """The request is aborted at once, not run to its end (tokens arrive faster than the old
    0.5 s disconnect poll, so it never looked), and nothing fails on the way (it logged a 500)."""
    tokens0, errors0 = _counter(server, "k3serve_generation_tokens_total"), \
        _counter(server, 'k3serve_request_errors_total{status="500"}')
    body = {"model": "tiny", "prompt": [98] * 40, "max_tokens": 450, "n": 4,  # (within the 512 context)
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, timeout=1.0)  # the client gives up mid-generation
    for _ in range(100):
        if _pool_used(server) == 0:
            break
        time.sleep(0.05)
    assert _pool_used(server) == 0
    time.sleep(0.3)
    assert _counter(server, "k3serve_generation_tokens_total") - tokens0 < 4 * 450 / 2
    assert _counter(server, 'k3serve_request_errors_total{status="500"}') == errors0
    assert httpx.get(server + "/health").status_code == 200


def test_logprobs_under_a_grammar_are_the_models(client):
    """A grammar's mask made the reported logprobs -inf (a 500: not JSON); they are the model's."""
    out = client.completions.create(model="tiny", prompt="Pick:", max_tokens=8, logprobs=3, temperature=0,
                                    extra_body={"guided_regex": "[a-z]{3}"})
    lp = out.choices[0].logprobs
    assert re.fullmatch("[a-z]{3}", out.choices[0].text) and len(lp.token_logprobs) >= 1
    assert all(-1e4 < v <= 0 for v in lp.token_logprobs) and all(
        -1e4 < v <= 0 for alts in lp.top_logprobs for v in alts.values())
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=6,
                                          response_format={"type": "json_object"}, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert content and all(-1e4 < c.logprob <= 0 and len(c.top_logprobs) == 2 for c in content)
    # logprobs without top_logprobs: each token's own, no alternatives (it returned none at all)
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                           temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    assert len(plain.choices[0].logprobs.content) == 3 and all(
        c.top_logprobs == [] and isinstance(c.bytes, list) for c in plain.choices[0].logprobs.content)


def test_min_tokens_does_not_break_a_grammar(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "?"}], max_tokens=16,
                                         extra_body={"guided_choice": ["yes", "no"], "min_tokens": 8})
    assert out.choices[0].message.content in ("yes", "no") and out.choices[0].finish_reason == "stop"


def _events(server, path, body) -> list[dict]:
    with httpx.stream("POST", server + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_streamed_completions_carry_logprobs_echo_and_stop_reason(client, server):
    body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 6, "temperature": 0, "logprobs": 2,
            "ignore_eos": True}
    full = client.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                     extra_body={"ignore_eos": True}).choices[0]
    chunks = [c["choices"][0] for c in _events(server, "/v1/completions", {**body, "stream": True}) if c["choices"]]
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert tokens == full.logprobs.tokens and offsets == full.logprobs.text_offset
    assert [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]] == pytest.approx(
        full.logprobs.token_logprobs)
    assert chunks[-1]["finish_reason"] == "length" and "stop_reason" in chunks[-1]
    echoed = _events(server, "/v1/completions", {"model": "tiny", "prompt": "Once upon", "max_tokens": 4,
                                                 "temperature": 0, "echo": True, "stream": True})
    text = "".join(c["choices"][0]["text"] for c in echoed if c["choices"])
    assert text.startswith("Once upon") and text == "Once upon" + client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=4, temperature=0).choices[0].text
    chat = _events(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                    "max_tokens": 3, "temperature": 0, "logprobs": True,
                                                    "top_logprobs": 1, "ignore_eos": True, "stream": True})
    lps = [e for c in chat for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    assert len(lps) == 3 and all(len(e["top_logprobs"]) == 1 for e in lps)
    assert chat[-1]["choices"][0]["finish_reason"] == "length" and "stop_reason" in chat[-1]["choices"][0]


def test_a_list_of_prompts_runs_together_and_streams(client, server):
    prompts = ["def f():", "class A:", "x = 1"]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, n=2, temperature=0,
                                    extra_body={"ignore_eos": True})
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [t for t in alone for _ in range(2)]
    events = _events(server, "/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": 5, "n": 2,
                                                 "temperature": 0, "ignore_eos": True, "stream": True,
                                                 "stream_options": {"include_usage": True,
                                                                    "continuous_usage_stats": True}})
    running = [e["usage"]["completion_tokens"] for e in events]  # (usage on every chunk: so far, never less)
    assert running == sorted(running) and running[0] > 0
    assert len({e["usage"]["prompt_tokens"] for e in events}) == 1
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(6)] == [t for t in alone for _ in range(2)]
    assert events[-1]["usage"]["completion_tokens"] == 30 == out.usage.completion_tokens


def test_tokenize_honours_add_generation_prompt(server):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon a"}]
    with_prompt = httpx.post(server + "/tokenize", json={"messages": msgs}).json()["count"]
    closed = httpx.post(server + "/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()["tokens"]
    assert len(closed) < with_prompt
    # continue_final_message: the assistant's text left open, so the model continues it (it was ignored)
    body = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True}
    open_ = httpx.post(server + "/tokenize", json=body).json()["tokens"]
    text = httpx.post(server + "/detokenize", json={"tokens": open_}).json()["prompt"]
    assert text.endswith("Once upon a") and closed[:len(open_)] == open_ and len(open_) < len(closed)
    out = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, **body})
    assert out.status_code == 200 and out.json()["usage"]["prompt_tokens"] == len(open_)
    for bad in ({**body, "add_generation_prompt": True}, {**body, "messages": msgs[:1]}):
        r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, **bad})
        assert r.status_code == 400 and "continue_final_message" in r.json()["error"]["message"], r.text


def test_metrics_do_not_wait_on_a_long_engine_step():
    """/metrics answers from the engine's last gauges when a fresh read takes over a second (a long
    prefill step held every scrape, past Prometheus's 10 s timeout, then a 500); 503 before any read.
    The engine's slowness is played by a stand-in; the gauges are a real engine's."""
    import asyncio

    from k3serve.engine.engine import EngineConfig, LLMEngine
    from k3serve.engine.engine_process import engine_stats
    from k3serve.model.loader import load_model
    from k3serve.serve.api import ServerState, build_app

    gauges = engine_stats(LLMEngine(load_model(preset="tiny", dtype="float32", device="cpu"), None,
                                     EngineConfig(cache_memory="16MiB", page_size=16)))

    class SlowEngine:
        slow, errored, info = False, None, None

        async def stats(self, timeout=30.0, reset_prefix_cache=False):
            if self.slow:
                await asyncio.wait_for(asyncio.sleep(60), timeout)
            return gauges

    async def scrape(engine):
        app = build_app(ServerState(engine, "tiny"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            engine.slow = True
            cold = await c.get("/metrics")
            engine.slow = False
            warm = await c.get("/metrics")
            engine.slow = True
            t0 = time.monotonic()
            busy = await c.get("/metrics")
            return cold, warm, busy, time.monotonic() - t0

    cold, warm, busy, seconds = asyncio.run(scrape(SlowEngine()))
    assert cold.status_code == 503 and cold.json()["error"]["type"] == "server_busy"
    assert warm.status_code == busy.status_code == 200 and busy.text == warm.text and seconds < 30
