"""The flash MLA prefill on the GPU ([gpu-kernels] item 2; not a CI test): kimi-linear's 32 heads and
K3's 96 (q/k 128 + 64 wide, values 128, latents 512) at 8K new tokens, as one prompt, as four of 2K in
one launch, and as a 2K chunk on 6K of context; checked against the fp32 reference (on a 1K slice of
queries), then timed: the served call (key expansion + attention), the same with the keys and values
loaded by TMA (``TMA_LOADS``) and the expansion alone, causal attention TFLOP/s and % of the bf16
matmul ceiling measured in the same run; beside it, as drop-ins for the whole call (checked the same
way): torch's varlen flash attention (``torch.nn.attention.varlen``, values padded to 192) and torch's
SDPA a prompt a call under each of its backends (``bench.mla_prefill_sdpa``). ``--against FILE``: the
same rows for another copy of ``mla_prefill_triton.py`` (an older commit's), alternating rounds.

    python3 -m bench.kernels_mla_prefill [--against FILE] [--rounds 3] [--heads 32,96] [--layouts "1 x 8192,..."]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import tempfile

import torch
import torch.nn.functional as F

from bench.ceilings import matmul_tflops
from bench.mla_prefill_sdpa import mla_prefill_sdpa
from bench.overrides import constants
from bench.summary import Row
from bench.timing import gpu_ms
from k3serve.ops import mla_prefill_triton, mla_ref

DEV = os.environ.get("K3SERVE_CHECK_DEVICE", "cuda")  # cpu: a smoke run through the interpreter (--shrink 64)
DT = torch.bfloat16 if DEV == "cuda" else torch.float32  # (Triton's interpreter mis-reads bf16 dots and descriptors)
DN, DR, DV, RKV = 128, 64, 128, 512
LAYOUTS = {"1 x 8192": [(0, 8192)], "4 x 2048": [(0, 2048)] * 4, "2048 on 6144": [(6144, 2048)]}


def _ms(fn, rep: int) -> float:
    return gpu_ms(fn, rep=rep) if DEV == "cuda" else (fn(), float("nan"))[1]


def load(path: str):
    """A module from another copy of mla_prefill_triton.py (its package-relative imports made absolute)."""
    src = open(path).read().replace("from .", "from k3serve.ops.")
    tmp = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    tmp.write(src)
    tmp.close()
    spec = importlib.util.spec_from_file_location("mla_prefill_other", tmp.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def case(heads: int, layout: list[tuple[int, int]], g: torch.Generator):
    w = (torch.randn(heads * (DN + DV), RKV, generator=g, device=DEV) / RKV ** 0.5).to(DT)
    q = torch.randn(sum(t for _, t in layout), heads, DN + DR, generator=g, device=DEV).to(DT)
    lat = torch.randn(sum(c + t for c, t in layout), RKV + DR, generator=g, device=DEV).to(DT)
    rows, q0, k0 = [], 0, 0
    for c, t in layout:
        rows.append([q0, k0, c, t])
        q0, k0 = q0 + t, k0 + c + t
    seqs = torch.tensor(rows, dtype=torch.int32, device=DEV)
    flops = sum(2 * heads * (DN + DR + DV) * (t * c + t * (t + 1) / 2) for c, t in layout)
    return w, q, lat, seqs, max(t for _, t in layout), flops


def check(run, w, q, lat, seqs, layout) -> float:
    """Relative error of ``run()``'s last sequence's last 1K queries against the fp32 reference."""
    scale = (DN + DR) ** -0.5
    out = run().float()
    c, t = layout[-1]
    q0, k0 = (int(v) for v in seqs[-1, :2])
    keep = min(t, 1024)
    ref = mla_ref.mla_expanded_ref(q[q0 + t - keep:q0 + t].float(), lat[k0:k0 + c + t].float(), w.float(),
                                   c + t - keep, RKV, DN, scale)
    got = out[q0 + t - keep:q0 + t]
    return ((got - ref).norm() / ref.norm()).item()


def torch_sdpa(q, lat, w, layout, heads: int, backend):
    """``bench.mla_prefill_sdpa`` (torch's SDPA a prompt a call) under one SDPA backend (an
    ``SDPBackend`` name, or None: torch's own choice)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pick = (lambda: sdpa_kernel([getattr(SDPBackend, backend)])) if backend else contextlib.nullcontext
    bounds, q0, k0 = [], 0, 0
    for c, t in layout:
        bounds.append((q0, k0, c, t))
        q0, k0 = q0 + t, k0 + c + t

    def run():
        out = torch.empty(q.shape[0], heads, DV, device=q.device)
        with pick():
            for q0, k0, c, t in bounds:
                out[q0:q0 + t] = mla_prefill_sdpa(q[q0:q0 + t], lat[k0:k0 + c + t], w, c, RKV, DN, (DN + DR) ** -0.5)
        return out
    return run


def torch_varlen(q, lat, w, layout, heads: int):
    """The same prefill through torch's varlen flash attention (``torch.nn.attention.varlen``): the keys
    expanded as ours, the shared 64-wide part broadcast over the heads, the values padded to the keys'
    192 (flash needs equal widths), causal aligned to each sequence's last key. Returns the call, or
    None where this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    lens_q = torch.tensor([t for _, t in layout], device=DEV)
    lens_k = torch.tensor([c + t for c, t in layout], device=DEV)
    cu_q, cu_k = (F.pad(n.cumsum(0), (1, 0)).to(torch.int32) for n in (lens_q, lens_k))
    max_q, max_k = max(t for _, t in layout), max(c + t for c, t in layout)

    def run():
        qx, k_nope, k_pe, v = mla_prefill_triton._expanded(q, lat, w, RKV, DN)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1)], dim=-1)
        vp = F.pad(v, (0, DN + DR - DV))
        try:  # (newer torch: causal as a window; older: is_causal)
            o = varlen_attn(qx, k, vp, cu_q, cu_k, max_q, max_k, scale=(DN + DR) ** -0.5, window_size=(-1, 0))
        except TypeError:
            o = varlen_attn(qx, k, vp, cu_q, cu_k, max_q, max_k, is_causal=True, scale=(DN + DR) ** -0.5)
        return o[..., :DV]
    return run


def main() -> list[Row]:
    """Prints its table; returns the served call (expansion included) a case, the fastest torch
    drop-in beside it, for ``bench.kernels``' one table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", help="another mla_prefill_triton.py to time beside the served one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shrink", type=int, default=1, help="divide every length by this (a CPU smoke: 64)")
    ap.add_argument("--heads", default="32,96")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="of: " + ", ".join(LAYOUTS))
    args = ap.parse_known_args()[0]  # (bench.kernels' own arguments pass through)
    mm = matmul_tflops() if DEV == "cuda" else 1.0
    mods = {"served": mla_prefill_triton} | ({"other": load(args.against)} if args.against else {})
    g = torch.Generator(device=DEV).manual_seed(0)
    print(f"{torch.cuda.get_device_name() if DEV == 'cuda' else DEV}: bf16 matmul {mm:.0f} TFLOP/s\n")
    print("| heads | layout | kernel | rel err | round ms | expansion ms | attention TFLOP/s | % matmul |\n"
          "|---|---|---|---|---|---|---|---|")
    scale = (DN + DR) ** -0.5
    summary = []
    for heads in map(int, args.heads.split(",")):
        for name in args.layouts.split(","):
            layout = LAYOUTS[name]
            layout = [(c // args.shrink, t // args.shrink) for c, t in layout]
            w, q, lat, seqs, max_tq, flops = case(heads, layout, g)
            expand = _ms(lambda: mla_prefill_triton._expanded(q, lat, w, RKV, DN), rep=50)
            runs = {label: (lambda mod=mod: mod.mla_prefill_varlen(q, lat, w, seqs, max_tq, RKV, DN, scale))
                    for label, mod in mods.items()}
            runs["served, TMA loads (TMA_LOADS)"] = constants("k3serve.ops.mla_prefill_triton.TMA_LOADS=True")(
                lambda: mla_prefill_triton.mla_prefill_varlen(q, lat, w, seqs, max_tq, RKV, DN, scale))
            runs["torch varlen_attn (values padded to 192)"] = torch_varlen(q, lat, w, layout, heads)
            for b in (None, "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
                runs[f"torch SDPA, {b or 'its own choice'}"] = torch_sdpa(q, lat, w, layout, heads, b)
            errs, times = {}, {}
            for label, run in ((k, r) for k, r in runs.items() if r is not None):  # (None: this torch lacks it)  # each call checked, then timed whole (expansion included)
                try:
                    errs[label], times[label] = check(run, w, q, lat, seqs, layout), []
                except Exception as exc:  # (a library or backend that does not take these widths or this mask)
                    print(f"| {heads} | {name} | {label} | failed: {type(exc).__name__}: {str(exc)[:160]!r} |||||",
                          flush=True)
            for _ in range(args.rounds):  # alternating rounds
                for label in times:
                    times[label].append(_ms(runs[label], rep=50))
            for label, ts in times.items():
                attn = max(min(ts) - expand, 1e-6)
                print(f"| {heads} | {name} | {label} | {errs[label]:.1e} | {' / '.join(f'{t:.3f}' for t in ts)} "
                      f"| {expand:.3f} | {flops / attn / 1e9:.0f} | {100 * flops / attn / 1e9 / mm:.0f} % |", flush=True)
            if "served" in times:
                torch_runs = {k: min(v) for k, v in times.items() if k.startswith("torch")}
                best = min(torch_runs, key=torch_runs.get, default="")
                summary.append(Row("MLA prefill, flash-style (Triton; key expansion included)", f"{heads} heads, {name}",
                                   min(times["served"]), flops, "matmul", best, torch_runs.get(best, float("nan")),
                                   f"rel err {errs['served']:.1e} (last 1K queries)"))
            del w, q, lat
    return summary


if __name__ == "__main__":
    main()
