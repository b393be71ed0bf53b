"""The engine process's command loop (engine/engine_process.EngineLoop) on the tiny model, its
commands arriving at set times on a fake clock: how an idle engine takes a burst of requests."""

import pytest

from k3serve.engine.engine import EngineConfig, LLMEngine
from k3serve.engine.engine_process import AddRequest, EngineLoop, Stop, StepOutputs
from k3serve.engine.sampling_params import SamplingParams


class ScriptedPipe:
    """Commands that arrive at given times (s) of a fake clock: ``poll(timeout)`` moves the clock to
    the next arrival if it comes within ``timeout``, else by ``timeout``."""

    def __init__(self, arrivals):
        self.arrivals, self.now = list(arrivals), 0.0

    def poll(self, timeout: float) -> bool:
        if self.arrivals and self.arrivals[0][0] <= self.now + timeout:
            self.now = max(self.now, self.arrivals[0][0])
            return True
        self.now += timeout
        return False

    def recv(self):
        return self.arrivals.pop(0)[1]


class Outputs:
    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_pretrained(None, preset="tiny", device="cpu", config=EngineConfig(
        cache_memory="64MiB", enable_prefix_caching=False))


def run_loop(engine, gap_s: float, arrival_times: list[float]) -> tuple[dict, list]:
    """Four-token answers to prompts arriving at ``arrival_times``; the engine's scheduled-token
    counts over the run, and what the loop sent."""
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    script = [(t, AddRequest(f"r{i}-{gap_s}", [(7 * i + j) % 1000 for j in range(24)], params))
              for i, t in enumerate(arrival_times)]
    # (the clock moves only while the loop waits: the Stop comes once the engine has gone idle)
    pipe, out = ScriptedPipe(script + [(arrival_times[-1] + 1.0, Stop())]), Outputs()
    before = engine.scheduled_tokens()
    EngineLoop(engine, None, pipe, out, burst_gap_s=gap_s, clock=lambda: pipe.now).run()
    after = engine.scheduled_tokens()
    return {k: after[k] - before[k] for k in after}, out.sent


def finished(sent) -> set[str]:
    return {rid for m in sent if isinstance(m, StepOutputs) for rid, done, _ in m.outputs if done}


def test_an_idle_engine_waits_for_the_rest_of_a_burst(engine):
    """Four requests 1 ms apart: with no wait the first is prefilled alone; with a 2 ms gap the
    four share one prompt step. Every request finishes either way."""
    burst = [0.0, 0.001, 0.002, 0.003]
    at_once, sent = run_loop(engine, 0.0, burst)
    assert at_once["prefill"] == 4 * 24 and at_once["prefill_steps"] >= 2 and len(finished(sent)) == 4
    waited, sent = run_loop(engine, 0.002, burst)
    assert waited == {"prefill": 4 * 24, "decode": 4 * 3, "prefill_steps": 1} and len(finished(sent)) == 4


def test_the_wait_ends_at_a_quiet_gap_and_at_its_bound(engine):
    """A request 5 ms after the first, with a 2 ms gap: not waited for (two prompt steps). Arrivals
    every 1.5 ms for 30 ms: the wait stops at BURST_MAX_S (20 ms), so not all share the first step."""
    apart, _ = run_loop(engine, 0.002, [0.0, 0.005])
    assert apart["prefill_steps"] == 2
    stream = [0.0015 * i for i in range(21)]
    bounded, sent = run_loop(engine, 0.002, stream)
    assert bounded["prefill_steps"] >= 2 and len(finished(sent)) == 21
    assert EngineLoop.BURST_MAX_S == 0.02
