"""Each kernel's share of a graph replay's critical path, from profiler events (pure Python: the
arithmetic is tested on CPU, tests/test_charge.py; bench/gpu_check_graphs.py feeds it).

A kernel is charged the time from the latest end before it to its own end. With PDL a kernel
starts, and waits, while its predecessor drains: its own duration holds that wait, and
start-to-start deltas would charge it its predecessor's work. A run's charges add up to its span;
gaps over ``RUN_GAP_US`` start a new run (runs are apart by a host sync)."""

from __future__ import annotations

RUN_GAP_US = 50.0


def short(name: str) -> str:
    """A kernel name for a table column: Triton's ``_x_kernel`` as ``x``, others cut."""
    return name.strip("_").removesuffix("_kernel")[:40]


def charge(events: list[tuple[float, float, str]], runs: int = 1, show: range = range(0), mark: str = "") -> dict:
    """``events`` (start us, end us, name) of ``runs`` replays -> per run: charged us by kernel name
    (``by_name``) and by kernel after its predecessor (``by_pair``, "name < previous": the same
    kernel at different places of a layer, e.g. o_proj's GEMV after the KDA kernel), the span, and
    the kernels at the positions ``show`` of the first run. ``mark`` (a name's substring): also
    ``before_last_mark``, what each run charged before its last kernel of that name and how much of
    it went to that name (a model step's layers end where its final AttnRes mixer starts: what
    follows is the LM head's)."""
    ev = sorted(events)
    per: dict[str, list] = {}
    pairs: dict[str, list] = {}
    run = []
    steps: list[list[tuple[str, float]]] = [[]]  # (name, charged) by run
    done = ev[0][0] if ev else 0.0
    prev = "start"
    span = 0.0
    for i, (s, e, name) in enumerate(ev):
        if s - done > RUN_GAP_US:
            done, prev = s, "start"
            steps.append([])
        step = max(0.0, e - done)
        steps[-1].append((name, step))
        done = max(done, e)
        span += step
        for table, key in ((per, name[:80]), (pairs, f"{short(name)} < {short(prev)}")):
            acc = table.setdefault(key, [0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += step
            acc[2] += e - s
        prev = name
        if i in show:
            run.append({"kernel": name[:60], "index": i, "start_us": round(s - ev[0][0], 2), "own_us": round(e - s, 2),
                        "charged_us": round(step, 2)})

    def rows(table: dict) -> list[dict]:
        return sorted(({"kernel": k, "count": c / runs, "charged_us": round(t / runs, 1), "own_us": round(o / runs, 1),
                        "charged_us_each": round(t / c, 2)} for k, (c, t, o) in table.items()),
                      key=lambda r: -r["charged_us"])
    out = {"kernels": len(ev) / max(runs, 1), "span_ms": round(span / max(runs, 1) / 1e3, 3),
           "by_name": rows(per), "by_pair": rows(pairs), "run": run}
    if mark:
        tot = {"span_us": 0.0, "mark_us": 0.0, "mark_calls": 0.0}
        for st in steps:
            last = max((i for i, (name, _) in enumerate(st) if mark in name), default=len(st))
            tot["span_us"] += sum(c for _, c in st[:last])
            tot["mark_us"] += sum(c for name, c in st[:last] if mark in name)
            tot["mark_calls"] += sum(mark in name for name, _ in st[:last])
        out["before_last_mark"] = {k: round(v / max(runs, 1), 2) for k, v in tot.items()}
    return out
