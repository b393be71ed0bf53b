"""KDA decode kernel check + timing on the GPU ([gpu-kernels] item 1; not a CI test).

Checks k3serve's fused Triton decode step against the plain-torch reference on fresh random
inputs (several shapes, states in a slot pool), then times it at N = 1 / 64 / 256 sequences,
H = 96, D = 128 next to fla-core's fused_recurrent_kda_fwd (gate and L2 norm in kernel), as
state traffic (8 D^2 bytes per head) in TB/s and the fraction of a device copy measured in the
same run (the fused mixer also with all its bytes: conv states, inputs, output). Target: >= 90 %
of the copy ceiling at N >= 64 (fla: 69 %, anchors.md).

Usage: python bench/kernels_kda_decode.py [--fit]
(--fit: only the served mixer, the core step and torch's in-place ``mul_`` over the same state bytes at N 32-256,
each fitted as t = fixed + N x per-sequence: the fixed cost (launch, first programs' prologue, last wave's tail)
apart from the steady rate, which is what N >= 64 tends to; nothing else)
"""

import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench.ceilings import copy_tbs
from bench.overrides import constants
from bench.summary import Row
from bench.timing import gpu_ms

from k3serve.ops import kda_decode_triton as kdt
from k3serve.ops.kda_decode_triton import kda_decode, kda_decode_fused
from k3serve.ops.kda_ref import kda_gate, kda_recurrent_ref, l2norm


def inputs(N, H, D, slots_total, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    q, k, v, f = (r(N, H, D).bfloat16() for _ in range(4))
    b = r(N, H)
    A_log, dt_bias = torch.rand(H, device="cuda", generator=g) * 2, r(H * D)
    state = r(slots_total, H, D, D) * 0.1
    slots = torch.randperm(slots_total, device="cuda", generator=g)[:N]
    return q, k, v, f, b, A_log, dt_bias, state, slots


def check(N, H, D, lb):
    q, k, v, f, b, A_log, dt_bias, state, slots = inputs(N, H, D, N + 3, N * 31 + H)
    s0 = state[slots].clone()
    o = kda_decode(q, k, v, f, b, A_log, dt_bias, lb, D ** -0.5, state, slots)
    gg = kda_gate(f.float(), A_log, dt_bias, lb)
    o_ref, s_ref = kda_recurrent_ref(l2norm(q.float())[:, None], l2norm(k.float())[:, None], v.float()[:, None],
                                     gg[:, None], torch.sigmoid(b)[:, None], D ** -0.5, s0)
    return (((o - o_ref[:, 0]).norm() / o_ref.norm()).item(), ((state[slots] - s_ref).norm() / s_ref.norm()).item())


# (value block, warps, programs a head, Gluon); the default: 64-wide blocks, 4 warps, programs by
# ``kda_decode_fused``'s rule (one a value block while heads alone leave SMs idle, else one a head).
# Gluon: kda_decode_gluon's program a head (state copied to shared memory during the convs).
# (8 and 16 warps a head, whose rows the reductions then cross warps for: 35-58 % of copy, RESULTS.md
# fourteenth session.)
# (value block, warps, programs a head, Gluon, launch order, register cap)
DEFAULT_FUSED = (64, 4, None, False, kdt.LAUNCH_ORDER, None)
FUSED_VARIANTS = [(64, 4, 1, False, "sequences", None), (64, 4, 2, False, "sequences", None),
                  (32, 4, 4, False, "sequences", None), (64, 4, 1, True, "sequences", None),
                  (64, 4, 2, False, "memory", None), (32, 4, 4, False, "memory", None),
                  (64, 4, 1, False, "heads", 128), (64, 4, 1, False, "heads", 112), (32, 4, 1, False, "heads", None),
                  (32, 4, 1, False, "heads", 96), (32, 2, 1, False, "heads", None), (16, 2, 1, False, "heads", None),
                  (64, 4, 1, True, "heads", None)]


def fused_variant(variant, *args):
    """kda_decode_fused(*args) as ``variant`` (FUSED_VARIANTS' form) runs it."""
    bv, nw, parts, gluon, order, maxnreg = variant
    with constants(f"k3serve.ops.kda_decode_triton.LAUNCH_ORDER={order!r}"):
        return kda_decode_fused(*args, block_v=bv, num_warps=nw, parts=parts, gluon=gluon, maxnreg=maxnreg)


def mixer_inputs(N, H, D, num_slots, seed):
    """The fused mixer's other inputs: pre-conv q|k|v, conv weights and states, output gate."""
    P = H * D
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, 3 * P, device="cuda", generator=g).bfloat16()
    conv_w = torch.randn(3 * P, 4, device="cuda", generator=g)
    conv_state = torch.randn(num_slots, 3 * P, 3, device="cuda", generator=g).bfloat16()
    gate = torch.randn(N, P, device="cuda", generator=g).bfloat16()
    return x, conv_w, conv_state, gate, torch.ones(N, dtype=torch.bool, device="cuda")


def served_mixer(N, H, D, lb, f, b, A_log, dt_bias, state, slots):
    """A no-argument call of the served fused mixer (default variant) on fresh mixer inputs over ``state``."""
    x, conv_w, conv_state, gate, has = mixer_inputs(N, H, D, state.shape[0], 11)
    return lambda: kda_decode_fused(x, conv_w, conv_state, has, f.view(N, H * D), b, A_log, dt_bias, gate,
                                    torch.ones(D, device="cuda"), 1e-5, lb, state, slots, H)


def fused_check(N, H, D, lb):
    """Every fused variant on the same inputs: output, state and conv state equal to the default's."""
    q, k, v, f, b, A_log, dt_bias, state0, slots = inputs(N, H, D, max(N, 8), 3)
    x, conv_w, conv0, gate, has = mixer_inputs(N, H, D, state0.shape[0], 5)
    outs = []
    for variant in [DEFAULT_FUSED] + FUSED_VARIANTS:
        st, cs = state0.clone(), conv0.clone()
        y = fused_variant(variant, x, conv_w, cs, has, f.view(N, H * D), b, A_log, dt_bias, gate,
                          torch.ones(D, device="cuda"), 1e-5, lb, st, slots, H)
        outs.append((y, st, cs.float()))
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    return max(rel(got, want) for out in outs[1:] for got, want in zip(out, outs[0]))


def timing(N, H, D, lb=-5.0):
    q, k, v, f, b, A_log, dt_bias, state, slots = inputs(N, H, D, max(N, 8), 7)
    ours = lambda: kda_decode(q, k, v, f, b, A_log, dt_bias, lb, D ** -0.5, state, slots)  # noqa: E731
    row = {"ours_ms": gpu_ms(ours, rep=200)}
    # the fully fused mixer step (conv update + gates + norms + delta rule + gated RMSNorm)
    P = H * D
    row["fused_ms"] = gpu_ms(served_mixer(N, H, D, lb, f, b, A_log, dt_bias, state, slots), rep=200)
    x, conv_w, conv_state, gate, has = mixer_inputs(N, H, D, state.shape[0], 11)
    # fused-kernel variants: (value block width, warps, programs a head, Gluon, launch order, register cap)
    row["fused_variants"] = {}
    for variant in FUSED_VARIANTS:
        run = lambda: fused_variant(variant, x, conv_w, conv_state, has, f.view(N, P), b, A_log, dt_bias,  # noqa: E731
                                    gate, torch.ones(D, device="cuda"), 1e-5, lb, state, slots, H)
        row["fused_variants"][variant] = gpu_ms(run, rep=200)
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        fla = lambda: fused_recurrent_kda_fwd(  # noqa: E731
            q=q[:, None], k=k[:, None], v=v[:, None], g=f[:, None].float(), beta=b[:, None], A_log=A_log,
            dt_bias=dt_bias, initial_state=state, inplace_final_state=True, ssm_state_indices=slots,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            lower_bound=lb)
        row["fla_ms"] = gpu_ms(fla, rep=200)
    except Exception as exc:  # fla missing or its API moved: report, keep our figure
        row["fla_error"] = repr(exc)[:120]
    row["bytes"] = N * H * D * D * 4 * 2
    # the mixer's other bytes a sequence: pre-conv q|k|v, its conv-state rows read and rewritten,
    # f, the output gate, beta and the fp32 output (the 90 % target counts state bytes only)
    W = conv_w.shape[-1]
    row["mixer_bytes"] = N * (3 * P * x.element_size() + 2 * 3 * P * (W - 1) * conv_state.element_size()
                              + P * (f.element_size() + gate.element_size() + 4) + H * b.element_size())
    return row


@triton.jit
def _state_probe_kernel(STATE, DESC, SLOTS, OUT, stride_slot, H, D: tl.constexpr, BV: tl.constexpr,
                        IN_PLACE: tl.constexpr, TMA: tl.constexpr, V_FIRST: tl.constexpr = False):
    """The decode kernels' state traffic alone: each (sequence, head, value block) program reads
    its [D, BV] fp32 tile at the sequence's slot, scales it, and writes it back in place (or to a
    dense output, as a copy does), by per-thread loads or TMA; V_FIRST: the tile of a head stored
    value rows first ([V, K], fla's ``state_v_first``), [BV, D], one contiguous run. What this
    access pattern can reach bounds what the KDA decode kernels can reach."""
    n, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dk = tl.arange(0, D)
    dv = vb * BV + tl.arange(0, BV)
    slot = tl.load(SLOTS + n).to(tl.int64)
    if V_FIRST:
        tile = dv[:, None] * D + dk[None, :]
    else:
        tile = dk[:, None] * D + dv[None, :]
    if TMA:  # (in place only)
        s = DESC.load([slot.to(tl.int32), h, 0, vb * BV])
        DESC.store([slot.to(tl.int32), h, 0, vb * BV], s * 0.999)
    else:
        s = tl.load(STATE + slot * stride_slot + h * D * D + tile)
        if IN_PLACE:
            tl.store(STATE + slot * stride_slot + h * D * D + tile, s * 0.999)
        else:
            tl.store(OUT + (n * H + h).to(tl.int64) * D * D + tile, s * 0.999)


def compiled_registers() -> None:
    """Registers and spills of every fused-mixer kernel this run compiled (Triton's JIT caches)."""
    print("\nfused mixer kernels compiled (constexprs: registers, spills):")
    try:
        for kernel_cache, *_ in kdt._kda_decode_fused_kernel.device_caches.values():
            for k in kernel_cache.values():
                names = k.src.fn.arg_names  # constexprs keyed by name or by (argument index,)
                consts = {key if isinstance(key, str) else names[key[0]]: v for key, v in k.src.constants.items()}
                shown = {n: consts[n] for n in ("BV", "BLOCKS", "ORDER") if n in consts}
                print(f"  {shown} warps {k.metadata.num_warps}, cap {getattr(k.metadata, 'maxnreg', None)}: "
                      f"{k.n_regs} registers, {k.n_spills} spills")
    except Exception as exc:  # Triton's cache layout moved: report, not fail
        print("  (not readable:", repr(exc)[:120], ")")


def state_probes(ceil: float) -> None:
    """In-place read-modify-write of slot-indexed state tiles vs the same tiles copied out, by
    value-block width and warps: the attainable fraction of the copy ceiling for the decode's
    state traffic (the 90 % target is judged against the copy ceiling)."""
    print("\nstate access probes (read + write of N x 96 heads x 128 x 128 fp32 at random slots):")
    print("| N | pattern | value block | warps | ms | TB/s | % copy |\n|---|---|---|---|---|---|---|")
    H, D = 96, 128
    for N in (64, 256):
        state = torch.randn(N + 8, H, D, D, device="cuda")
        slots = torch.randperm(N + 8, device="cuda")[:N]
        out = torch.empty(N, H, D, D, device="cuda")
        for pattern in ("in place", "copy out", "in place, TMA", "in place, V first"):
            for bv, nw in ((32, 4), (64, 4), (64, 8), (128, 8)) + (((16, 2), (32, 2), (8, 8), (8, 4), (4, 4), (16, 8))
                                                                   if "V first" in pattern else ()):
                desc = TensorDescriptor(state, list(state.shape), list(state.stride()), [1, 1, D, bv])
                run = lambda: _state_probe_kernel[(N, H, D // bv)](  # noqa: E731
                    state, desc, slots, out, state.stride(0), H, D=D, BV=bv, IN_PLACE=pattern != "copy out",
                    TMA="TMA" in pattern, V_FIRST="V first" in pattern, num_warps=nw)
                ms = gpu_ms(run, rep=200)
                tbs = N * H * D * D * 8 / (ms * 1e-3) / 1e12
                print(f"| {N} | {pattern} | {bv} | {nw} | {ms:.3f} | {tbs:.2f} | {100 * tbs / ceil:.0f} % |", flush=True)


def fit(ns=(32, 64, 96, 128, 192, 256), H=96, D=128, lb=-5.0) -> None:
    """t(N) = fixed + N x per-sequence, least squares over ``ns``, for the served fused mixer, the core step and
    torch's in-place ``mul_`` on the same state bytes (the harness's own floor): fixed us and steady % of copy."""
    ceil = copy_tbs()
    seq_bytes = H * D * D * 4 * 2
    times = {"fused mixer (served)": [], "core step": [], "torch mul_ in place": []}
    for N in ns:
        q, k, v, f, b, A_log, dt_bias, state, slots = inputs(N, H, D, N + 8, 7)
        dense = state[:N]
        runs = {"fused mixer (served)": served_mixer(N, H, D, lb, f, b, A_log, dt_bias, state, slots),
                "core step": lambda: kda_decode(q, k, v, f, b, A_log, dt_bias, lb, D ** -0.5, state, slots),
                "torch mul_ in place": lambda: dense.mul_(0.999)}
        for name, run in runs.items():
            times[name].append(gpu_ms(run, rep=200))
    print(f"copy ceiling {ceil:.2f} TB/s; state bytes {seq_bytes / 1e6:.2f} MB a sequence (H {H}, D {D})\n"
          "| kernel | " + " | ".join(f"N {n} ms (% copy)" for n in ns) + " | fixed us | steady % copy |\n"
          "|---|" + "---|" * (len(ns) + 2))
    n_t = torch.tensor(ns, dtype=torch.float64)
    pct = lambda n, ms: 100 * n * seq_bytes / (ms * 1e-3) / 1e12 / ceil  # noqa: E731  (% of copy, n sequences)
    for name, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        slope = (((n_t - n_t.mean()) * (t - t.mean())).sum() / ((n_t - n_t.mean()) ** 2).sum()).item()
        fixed = t.mean().item() - slope * n_t.mean().item()
        cells = " | ".join(f"{ms:.4f} ({pct(n, ms):.1f} %)" for n, ms in zip(ns, ts))
        print(f"| {name} | {cells} | {1e3 * fixed:.1f} | {pct(1, slope):.1f} % |")


def main() -> list[Row]:
    """Prints its tables; returns the core step and the fused mixer at N 1 / 64 / 256 (state bytes,
    fla's fused recurrent kernel beside them) for ``bench.kernels``' one table."""
    ceil = copy_tbs()
    print(f"copy ceiling {ceil:.2f} TB/s")
    errs = []
    for shape in ((4, 2, 32, -5.0), (64, 96, 128, -5.0), (3, 32, 128, None)):
        errs.append(check(*shape))
        print("check", shape, "rel err out/state: %.2e / %.2e" % errs[-1])
    checked = "out / state rel err <= %.1e / %.1e (3 shapes)" % tuple(max(e[i] for e in errs) for i in (0, 1))
    print("| N | H | D | ours ms | ours TB/s | % copy | fused mixer ms | % copy | all its bytes, % copy | fla ms "
          "| fla TB/s | % copy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for N in (1, 64, 256):
        r = timing(N, 96, 128)
        tb = lambda ms: r["bytes"] / (ms * 1e-3) / 1e12  # noqa: E731
        fla = (f"{r['fla_ms']:.3f} | {tb(r['fla_ms']):.2f} | {100 * tb(r['fla_ms']) / ceil:.0f} %" if "fla_ms" in r
               else f"{r.get('fla_error')} | | ")
        print(f"| {N} | 96 | 128 | {r['ours_ms']:.3f} | {tb(r['ours_ms']):.2f} | {100 * tb(r['ours_ms']) / ceil:.0f} % | "
              f"{r['fused_ms']:.3f} | {100 * tb(r['fused_ms']) / ceil:.0f} % | "
              f"{100 * (r['bytes'] + r['mixer_bytes']) / (r['fused_ms'] * 1e-3) / 1e12 / ceil:.0f} % | {fla} |")
        rows.append((N, r))
    fused_err = fused_check(64, 96, 128, -5.0)
    summary = []
    for N, r in rows:
        fla = ("fla fused_recurrent_kda", r["fla_ms"]) if "fla_ms" in r else ("", float("nan"))
        summary += [Row("KDA decode core step (Triton)", f"N {N}, H 96, D 128, state bytes", r["ours_ms"], r["bytes"],
                        "copy", *fla, checked),
                    Row("KDA fused decode mixer (Triton)", f"N {N}, H 96, D 128, state bytes", r["fused_ms"],
                        r["bytes"], "copy", *fla, f"variants vs default {fused_err:.1e}")]
    print("\nfused mixer variants (value block, warps, programs a head, Gluon, launch order, register cap), "
          f"variants vs default rel err {fused_err:.1e}:\n| N | variant | ms | state TB/s | % copy |\n|---|---|---|---|---|")
    for N, r in rows:
        for var, ms in r["fused_variants"].items():
            tbs = r["bytes"] / (ms * 1e-3) / 1e12
            print(f"| {N} | {var} | {ms:.3f} | {tbs:.2f} | {100 * tbs / ceil:.0f} % |")
    compiled_registers()
    state_probes(ceil)
    return summary


if __name__ == "__main__":
    fit() if "--fit" in sys.argv else main()
    if gpu_ms.eager:
        print("timed by plain launches (not capturable):", *sorted(set(gpu_ms.eager)), sep="\n  ")
