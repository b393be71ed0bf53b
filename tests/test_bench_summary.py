"""bench.summary: the one table of ``python -m bench.kernels`` (rates and ceiling fractions from each
row's work and time, the reference op's time and the speed-up beside it)."""

import math

from bench.summary import Row, table


def test_rates_and_fractions_follow_work_time_and_the_run_ceilings():
    rows = [Row("KDA fused decode mixer", "N 64", 0.25, 0.8e9, "copy", "fla", 0.5, "rel err 1e-7"),
            Row("routed experts", "8192 tokens", 20.0, 7.0e12, "matmul", check="rel err 4e-3"),
            Row("route", "1 token", 0.004, ref="torch", ref_ms=0.012)]
    lines = table(rows, copy_tbs=4.0, matmul_tflops=700.0).splitlines()
    assert lines[0] == "ceilings this run: copy 4.00 TB/s, bf16 matmul 700 TFLOP/s"
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[4:]]
    # 0.8 GB in 0.25 ms = 3.2 TB/s = 80 % of 4.0; fla's 0.5 ms beside it: 2.00x
    assert cells[0] == ["KDA fused decode mixer", "N 64", "0.2500", "3.20 TB/s", "80 % of copy", "fla", "0.5000",
                        "2.00x", "rel err 1e-7"]
    # 7e12 FLOPs in 20 ms = 350 TFLOP/s = 50 % of 700; no reference: dashes
    assert cells[1][3:8] == ["350 TFLOP/s", "50 % of matmul", "-", "-", "-"]
    # a latency-bound row: no rate, the speed-up still shown
    assert cells[2][3:8] == ["-", "-", "torch", "0.0120", "3.00x"]


def test_a_reference_without_a_time_shows_no_speed_up():
    row = Row("MLA prefill", "32 heads", 1.0, 1e9, "matmul", "torch SDPA", math.nan)
    assert math.isclose(row.rate(), 1.0)
    last = table([row], 4.0, 700.0).splitlines()[-1]
    assert "| torch SDPA | - | - |" in last
