"""Which line of ours launched each torch op in a profile: the torch profiler names copy / index /
fill kernels, not who asked for them (bench/gpu_check_graphs.py --parts op_sources)."""

from __future__ import annotations


def innermost_source(event) -> str:
    """The innermost k3serve frame of an op event: from its recorded stack where this torch fills
    ``stack`` (innermost first), else from its ancestors, which ``with_stack`` records as Python
    call events of their own ("path/file.py(line): function"; torch 2.13 on CPU does only this)."""
    for frame in getattr(event, "stack", None) or ():
        if "k3serve/" in frame:
            return frame.split("k3serve/")[-1]
    up = event.cpu_parent
    while up is not None and "k3serve/" not in up.name:
        up = up.cpu_parent
    return up.name.split("k3serve/")[-1] if up is not None else "(no k3serve frame)"


def ops_by_source(events, time_attr: str) -> list[dict]:
    """aten ops with time (``time_attr``, us) grouped by (name, innermost k3serve frame): count and
    ms, most time first."""
    groups: dict[tuple, list] = {}
    for e in events:
        t = getattr(e, time_attr)
        if not e.name.startswith("aten::") or t <= 0:
            continue
        g = groups.setdefault((e.name, innermost_source(e)), [0, 0.0])
        g[0] += 1
        g[1] += t / 1e3
    rows = [{"op": op, "source": src, "count": n, "ms": round(ms, 3)} for (op, src), (n, ms) in groups.items()]
    return sorted(rows, key=lambda r: -r["ms"])
