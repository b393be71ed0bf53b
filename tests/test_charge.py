"""bench/charge.py: a graph replay's kernels charged on its critical path (the arithmetic the GPU
A/B tables rest on, on made-up profiler events)."""

import pytest

from bench.charge import charge, short


def test_kernels_are_charged_from_the_latest_end_before_them():
    # a PDL chain: b starts (and waits) while a runs, c likewise; then a gap (a host sync) and run 2
    run = [(0.0, 10.0, "_a_kernel"), (2.0, 15.0, "_b_kernel"), (14.0, 16.0, "_c_kernel"), (17.0, 18.0, "_b_kernel")]
    events = run + [(s + 1000.0, e + 1000.0, n) for s, e, n in run]
    got = charge(events, runs=2, show=range(1, 3))
    by_name = {r["kernel"]: r["charged_us"] for r in got["by_name"]}
    assert by_name == {"_a_kernel": 10.0, "_b_kernel": 5.0 + 2.0, "_c_kernel": 1.0}
    assert got["span_ms"] == pytest.approx(0.018)  # the charges add up to a run's span (idle 16-17 too)
    assert sum(by_name.values()) == pytest.approx(18.0)
    by_pair = {r["kernel"]: r["charged_us"] for r in got["by_pair"]}
    assert by_pair == {"a < start": 10.0, "b < a": 5.0, "c < b": 1.0, "b < c": 2.0}
    assert [r["index"] for r in got["run"]] == [1, 2] and got["run"][0]["own_us"] == 13.0
    assert got["kernels"] == 4


def test_a_kernel_ending_inside_its_predecessor_is_charged_nothing():
    got = charge([(0.0, 10.0, "big"), (1.0, 5.0, "side"), (9.0, 12.0, "next")])
    assert {r["kernel"]: r["charged_us"] for r in got["by_name"]} == {"big": 10.0, "side": 0.0, "next": 2.0}


def test_short_names():
    assert short("_gemv_kernel") == "gemv" and short("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT").startswith("nvjet")


def test_what_runs_charged_before_their_last_marked_kernel():
    # two runs of: mixer, layer, mixer, layer, final mixer, head; the window ends where the final mixer starts
    run = [(0.0, 2.0, "_attn_res_kernel"), (2.0, 10.0, "_gemv_kernel"), (9.0, 12.0, "_attn_res_kernel"),
           (12.0, 20.0, "_gemv_kernel"), (20.0, 23.0, "_attn_res_kernel"), (23.0, 50.0, "lm_head")]
    events = run + [(s + 1000.0, e + 1000.0, n) for s, e, n in run]
    got = charge(events, runs=2, mark="attn_res")
    assert got["before_last_mark"] == {"span_us": 20.0, "mark_us": 2.0 + 2.0, "mark_calls": 2.0}
    assert "before_last_mark" not in charge(events, runs=2)
