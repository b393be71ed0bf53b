"""Where fla-core's chunked KDA forward spends a prefill's time, kernel by kernel, on the GPU
([gpu-kernels]; not a CI test): the call the model makes (``fla_backend._chunk_kda``'s
``chunk_kda_fwd``, q and k normalised already, the decay computed from the raw gate inside the
chunk cumsum) on kimi-linear's 32 heads and K3's 96 (D = 128), as one prompt of 8K tokens and as 16
of 512. The whole call is timed (graph-replayed, cold L2) and then profiled: each kernel's ms a call,
its share, and the call's TFLOP/s by the chunk algorithm's matmul count (``chunk_flops``) as a
fraction of the bf16 matmul ceiling measured in the same run. It says which of fla's stages (gate
cumsum, intra-chunk UT transform, the sequential inter-chunk state pass, the output) a kernel of our
own would have to beat (anchors.md: FlashKDA ~2x fla at H 96, T 8K). With K3's bounded gate, also fla's
``safe_gate`` path and, where the ``flash_kda`` package is installed (``bash bench/gpu_session.sh flashkda``
builds it), FlashKDA through the adapter the model would call (``fla_backend._flash_kda_prefill``).

Usage: python -m bench.kernels_kda_prefill [--layouts "1 x 8192,16 x 512"] [--heads 32,96]
"""

from __future__ import annotations

import argparse

import torch

from bench.ceilings import matmul_tflops
from bench.compare import rel
from bench.summary import Row
from bench.timing import by_kernel, gpu_ms

D, CHUNK = 128, 64


def chunk_flops(T: int, H: int, d: int = D, c: int = CHUNK) -> float:
    """Matmul FLOPs of the chunked delta rule a token a head: intra-chunk k k^T and q k^T (2 c d
    each), the triangular solve applied to k and v (2 c d each, as matmuls), w h and k^T v_new
    against the [d, d] state (2 d^2 each), q h (2 d^2): T H (8 c d + 6 d^2)."""
    return T * H * (8 * c * d + 6 * d * d)


def inputs(prompts: int, length: int, H: int, lower_bound: float | None, g: torch.Generator) -> dict:
    T = prompts * length
    dev = "cuda"
    qk = [torch.nn.functional.normalize(torch.randn(1, T, H, D, device=dev, generator=g), dim=-1).bfloat16()
          for _ in range(2)]
    cu = torch.arange(0, T + 1, length, device=dev, dtype=torch.int32)
    return dict(q=qk[0], k=qk[1], v=torch.randn(1, T, H, D, device=dev, generator=g).bfloat16(),
                g=torch.randn(1, T, H, D, device=dev, generator=g).bfloat16(),
                beta=torch.rand(1, T, H, device=dev, generator=g), scale=D ** -0.5, initial_state=None,
                output_final_state=True, cu_seqlens=cu.long(), cu_seqlens_cpu=cu.long().cpu(), chunk_size=CHUNK,
                use_gate_in_kernel=True, A_log=torch.randn(H, device=dev, generator=g) * 0.5,
                dt_bias=torch.randn(H * D, device=dev, generator=g) * 0.5, lower_bound=lower_bound)


def main() -> list[Row]:
    """Prints its table; returns, a layout each, the chunked forward the model serves (FlashKDA where
    it applies and is installed, else fla's) with fla's plain chunk_kda beside it, for ``bench.kernels``."""
    from fla.ops.kda.chunk_fwd import chunk_kda_fwd
    from fla.ops.utils.index import prepare_chunk_indices

    from k3serve.ops.fla_backend import _flash_kda, _flash_kda_prefill, safe_gate

    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="1 x 8192,16 x 512")
    ap.add_argument("--heads", default="32,96")
    args = ap.parse_known_args()[0]  # (bench.kernels' own arguments pass through)
    mm = matmul_tflops()
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: bf16 matmul {mm:.0f} TFLOP/s\n", flush=True)
    print("| heads | layout | call ms | TFLOP/s (% matmul) | kernel | launches | ms a call | share |\n"
          "|---|---|---|---|---|---|---|---|")
    summary = []
    with torch.inference_mode():
        for H in (int(h) for h in args.heads.split(",")):
            for layout in args.layouts.split(","):
                prompts, length = (int(x) for x in layout.split("x"))
                lb = None if H == 32 else -5.0  # kimi-linear's gate, K3's
                kw = inputs(prompts, length, H, lb, g)
                kw["chunk_indices"] = prepare_chunk_indices(kw["cu_seqlens"], CHUNK, kw["cu_seqlens_cpu"])
                calls = {"fla": lambda: chunk_kda_fwd(**kw, safe_gate=False)[0]}
                if safe_gate(lb):  # K3's bounded gate: fla's safe_gate path, and FlashKDA where installed
                    calls["fla safe_gate"] = lambda: chunk_kda_fwd(**kw, safe_gate=True)[0]
                    if _flash_kda() is not None:
                        fk = (kw["q"][0], kw["k"][0], kw["v"][0], kw["g"][0], kw["beta"][0], kw["scale"], None,
                              (kw["A_log"], kw["dt_bias"], lb), kw["cu_seqlens"])
                        calls["FlashKDA (served adapter)"] = lambda: _flash_kda_prefill(*fk)[0]
                ref, times, errs = None, {}, {}
                for label, fn in calls.items():
                    o = fn().float().reshape(-1)
                    errs[label] = f"rel err vs fla {rel(o, ref):.1e}" if ref is not None else ""
                    err = f", {errs[label]}" if ref is not None else ""
                    ref = o if ref is None else ref
                    ms = times[label] = gpu_ms(fn)
                    tf = chunk_flops(prompts * length, H) / (ms / 1e3) / 1e12
                    rows = by_kernel(fn)
                    total = sum(r[2] for r in rows)
                    head = f"| {H} {label} | {layout.strip()}{err} | {ms:.3f} | {tf:.0f} ({100 * tf / mm:.0f} %) "
                    for i, (name, n, kms) in enumerate(rows):
                        print((head if i == 0 else "| | | | ") + f"| {name} | {n} | {kms:.4f} | {100 * kms / total:.0f} % |")
                served = list(calls)[-1]  # (the model's order of preference: FlashKDA, safe_gate, plain)
                summary.append(Row(f"KDA chunked prefill, {served}", f"{layout.strip()}, H {H}, D 128",
                                   times[served], chunk_flops(prompts * length, H), "matmul",
                                   *(("fla chunk_kda", times["fla"]) if served != "fla" else ("", float("nan"))),
                                   errs[served] or "fla's (kda_core vs torch: gpu_check_model.py)"))
    return summary


if __name__ == "__main__":
    main()
