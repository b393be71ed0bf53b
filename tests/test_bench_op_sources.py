"""bench/op_sources.py: a profiled call's aten ops attributed to the k3serve line that ran them."""

import torch
from torch.profiler import ProfilerActivity, profile

from bench.op_sources import ops_by_source
from k3serve.ops.kda_ref import l2norm


def test_ops_are_attributed_to_the_k3serve_frame_that_ran_them():
    x = torch.randn(64, 4, 32)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        l2norm(x)
        torch.mm(x[:, 0], x[:, 0].t())  # not ours
    rows = ops_by_source(prof.events(), "self_cpu_time_total")
    ours = [r for r in rows if r["source"].startswith("ops/kda_ref.py")]
    assert ours and all("l2norm" in r["source"] for r in ours)
    assert any(r["op"] == "aten::mm" and r["source"] == "(no k3serve frame)" for r in rows)
    assert rows == sorted(rows, key=lambda r: -r["ms"])
