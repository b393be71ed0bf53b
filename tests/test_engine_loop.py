"""The engine process's command loop (engine/engine_process.EngineLoop) on the tiny model, its
commands arriving at set times on a fake clock: how an idle engine takes a burst of requests."""

import pytest

from k3serve.engine.engine import EngineConfig, LLMEngine
from k3serve.engine.engine_process import AddRequest, EngineLoop, StatsQuery, StatsReply, Stop, StepOutputs
from k3serve.engine.sampling_params import SamplingParams


class ScriptedPipe:
    """Commands that arrive at given times (s) of a fake clock: ``poll(timeout)`` moves the clock to
    the next arrival if it comes within ``timeout``, else by ``timeout``. A busy engine polls with no
    timeout between steps: each such poll first moves the clock by ``busy_poll_s`` (a step's time)."""

    def __init__(self, arrivals, busy_poll_s: float = 0.0):
        self.arrivals, self.now, self.busy_poll_s = list(arrivals), 0.0, busy_poll_s

    def poll(self, timeout: float) -> bool:
        if timeout == 0:
            self.now += self.busy_poll_s
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


class TimedEngine:
    """The engine, noting the fake clock at each step that computed prompt tokens."""

    def __init__(self, engine, pipe):
        self.engine, self.pipe, self.prefill_times = engine, pipe, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self, *args, **kwargs):
        before = self.engine.scheduled_tokens()["prefill"]
        outs = self.engine.step(*args, **kwargs)
        if self.engine.scheduled_tokens()["prefill"] > before:
            self.prefill_times.append(round(self.pipe.now, 6))
        return outs


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_pretrained(None, preset="tiny", device="cpu", config=EngineConfig(
        cache_memory="64MiB", enable_prefix_caching=False))


def run_loop(engine, gap_s: float, arrival_times: list[float], busy_poll_s: float = 0.0,
             queries: tuple[float, ...] = ()):
    """Four-token answers to prompts arriving at ``arrival_times`` (and stats queries at ``queries``):
    the engine's scheduled-token counts over the run, and the clock at each step with prompt tokens."""
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    script = [(t, AddRequest(f"r{i}-{gap_s}", [(7 * i + j) % 1000 for j in range(24)], params))
              for i, t in enumerate(arrival_times)]
    script = sorted(script + [(t, StatsQuery(i)) for i, t in enumerate(queries)], key=lambda a: a[0])
    # (the Stop comes once the engine has long gone idle)
    pipe, out = ScriptedPipe(script + [(arrival_times[-1] + 1.0, Stop())], busy_poll_s), Outputs()
    timed = TimedEngine(engine, pipe)
    before = engine.scheduled_tokens()
    EngineLoop(timed, None, pipe, out, burst_gap_s=gap_s, clock=lambda: pipe.now).run()
    after = engine.scheduled_tokens()
    assert len(finished(out.sent)) == len(arrival_times)
    assert sum(isinstance(m, StatsReply) for m in out.sent) == len(queries)
    return {k: after[k] - before[k] for k in after}, timed.prefill_times


def finished(sent) -> set[str]:
    return {rid for m in sent if isinstance(m, StepOutputs) for rid, done, *_ in m.outputs if done}


def test_an_idle_engine_waits_for_the_rest_of_a_burst(engine):
    """Four requests 1 ms apart: with no wait the first is prefilled alone; with a 2 ms gap the
    four share one prompt step. The server's default gap is 5 ms."""
    burst = [0.0, 0.001, 0.002, 0.003]
    at_once, _ = run_loop(engine, 0.0, burst)
    assert at_once["prefill"] == 4 * 24 and at_once["prefill_steps"] >= 2
    waited, times = run_loop(engine, 0.002, burst)
    assert waited == {"prefill": 4 * 24, "decode": 4 * 3, "prefill_steps": 1} and times == [0.005]
    assert EngineLoop(engine, None, None, None).burst_gap_s == 0.005


def test_the_wait_ends_at_a_quiet_gap_and_at_its_bound(engine):
    """A request 5 ms after the first, with a 2 ms gap: not waited for (two prompt steps). Arrivals
    every 1.5 ms for 30 ms: the wait stops at BURST_MAX_S (20 ms), so not all share the first step."""
    apart, _ = run_loop(engine, 0.002, [0.0, 0.005])
    assert apart["prefill_steps"] == 2
    # a stats query (a /metrics scrape) 1 ms into the wait neither ends it nor stretches the gap
    queried, times = run_loop(engine, 0.002, [0.0, 0.0015, 0.0045], queries=(0.001, 0.003))
    assert queried["prefill_steps"] == 2 and times[0] == 0.0035
    stream = [0.0015 * i for i in range(21)]
    bounded, times = run_loop(engine, 0.002, stream)
    assert bounded["prefill_steps"] >= 2 and times[0] == pytest.approx(0.02)
    assert EngineLoop.BURST_MAX_S == 0.02


def test_a_lone_client_pays_the_gap_once(engine):
    """One request at a time, 100 ms apart: the first waits the 2 ms gap and finds no company; the
    later ones are prefilled the moment they arrive."""
    counts, times = run_loop(engine, 0.002, [0.0, 0.1, 0.2, 0.3])
    assert counts["prefill_steps"] == 4 and times == [0.002, 0.1, 0.2, 0.3]


def test_company_for_a_lone_arrival_brings_the_wait_back(engine):
    """After a lone request (no more waits), one at 100 ms steps at once and another comes 3 ms
    later, while the engine is busy (steps of 1 ms): the traffic is bursty again, so the pair at
    200 / 201.5 ms shares one prompt step."""
    counts, times = run_loop(engine, 0.002, [0.0, 0.1, 0.103, 0.2, 0.2015], busy_poll_s=0.001)
    assert counts["prefill_steps"] == 4 and times[0] == 0.002 and times[1] < 0.1 + 0.002 <= times[-1] - 0.1
