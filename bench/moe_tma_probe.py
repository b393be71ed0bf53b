"""Probe, not served: Kimi-Linear's bf16 grouped GEMM at 8K-token prefill with the weights loaded by TMA
(host tensor descriptors), the activations gathered by pointer as served or pre-sorted by expert and
loaded by TMA too, against the served kernel at the same tiles; then a dense cuBLAS GEMM of the gate /
up shape (what the tensor cores give without the grouping). ``--ws``: Triton's automatic warp
specialisation over the TMA loop; ``--profile``: the model's call kernel by kernel. RESULTS.md
thirty-ninth session: TMA gains 0-5 % on gate / up (only with the activations pre-sorted, whose
gather costs 0.24 ms) and 3-9 % on the down projection; warp specialisation nothing. (Triton 3.9's
interpreter mis-reads bf16 through tensor descriptors, so a CPU check of this kernel runs fp32.)

    python3 -m bench.moe_tma_probe [--ws | --profile]
"""
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench.ceilings import matmul_tflops
from bench.timing import gpu_ms
from k3serve.ops.expert_sort import sort_by_expert
from k3serve.ops.glu_triton import glu
from k3serve.ops.moe_triton import grouped_gemm


@triton.jit
def _tma_kernel(X, XD, WD, WUD, OUT, ROWS, EXPERTS, num_assign, top_k, N, K, stride_xt, stride_on,
                A_TMA: tl.constexpr, GLU: tl.constexpr, OUT_SORTED: tl.constexpr, WS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    e = tl.load(EXPERTS + pid_m)
    slot = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(ROWS + slot)
    valid = rows < num_assign
    tok = tl.where(valid, rows // top_k, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wrow = (e * N + pid_n * BLOCK_N).to(tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_end = tl.where(tl.load(ROWS + pid_m * BLOCK_M) < num_assign, K, 0)
    for k0 in tl.range(0, k_end, BLOCK_K, warp_specialize=WS):
        if A_TMA:
            a = XD.load([pid_m * BLOCK_M, k0])
        else:
            a = tl.load(X + tok[:, None] * stride_xt + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=valid[:, None],
                        other=0.0)
        acc = tl.dot(a, WD.load([wrow, k0]).T, acc)
        if GLU:
            acc_up = tl.dot(a, WUD.load([wrow, k0]).T, acc_up)
    if GLU:
        acc = glu(acc, acc_up, 1.0, 1.0, False, False, False)
    orow = slot if OUT_SORTED else rows
    tl.store(OUT + orow.to(tl.int64)[:, None] * stride_on + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=valid[:, None] & (cols < N)[None, :])


def tma_gemm(x, xs, rows, block_expert, num_assign, top_k, w, w_up, n_out, bm, bn, bk, warps, stages, out,
             out_sorted=False, ws=False):
    E, N, K = w.shape
    wd = TensorDescriptor.from_tensor(w.view(E * N, K), [bn, bk])
    wud = TensorDescriptor.from_tensor(w_up.view(E * N, K), [bn, bk]) if w_up is not None else wd
    xd = TensorDescriptor.from_tensor(xs, [bm, bk]) if xs is not None else wd
    grid = (triton.cdiv(n_out, bn), min(rows.numel() // bm, num_assign))
    _tma_kernel[grid](x, xd, wd, wud, out, rows, block_expert, num_assign, top_k, N, K, x.stride(0), out.stride(0),
                      A_TMA=xs is not None, GLU=w_up is not None, OUT_SORTED=out_sorted, WS=ws, BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out


def profile_model_call():
    """Where experts_triton's 8K-token call goes, kernel by kernel (torch profiler, CUDA time)."""
    from bench.kernels_moe import kimi_linear_cases, kimi_linear_experts
    from k3serve.ops.moe_triton import experts_triton
    kl = kimi_linear_experts()
    T, z, w, ids, _ = kimi_linear_cases(kl, (8192,))[0]
    for _ in range(3):
        experts_triton(z, w, ids, kl)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            experts_triton(z, w, ids, kl)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


def main():
    if "--profile" in sys.argv:
        return profile_model_call()
    mm = matmul_tflops()
    T, E, top_k, d, inter = 8192, 256, 8, 2304, 1024
    g = torch.Generator(device="cuda").manual_seed(1)
    w1, w3 = ((torch.randn(E, inter, d, device="cuda", generator=g) * d ** -0.5).bfloat16() for _ in range(2))
    w2 = (torch.randn(E, d, inter, device="cuda", generator=g) * inter ** -0.5).bfloat16()
    ids = torch.rand(T, E, device="cuda", generator=g).topk(top_k, dim=-1).indices
    x = torch.randn(T, d, device="cuda", generator=g).bfloat16()
    A = T * top_k
    print(f"matmul {mm:.0f} TFLOP/s; {A} assignments")
    for bm in (128, 64):
        rows, be = sort_by_expert(ids, E, bm)
        sorted_tok = torch.where(rows < A, rows // top_k, 0)
        gather = lambda: x[sorted_tok]  # noqa: E731
        xs = gather()
        hs = torch.empty(rows.numel(), inter, dtype=torch.bfloat16, device="cuda")
        h_ref = grouped_gemm(x, rows, be, A, top_k, w1, None, inter, bm, up=(w3, None), out_dtype=torch.bfloat16,
                             tiles=dict(BLOCK_N=128, SWAP_AB=False, num_warps=8, num_stages=4, BLOCK_K=64,
                                        cols_first=True))
        flops_gu = 2 * A * d * 2 * inter
        flops_dn = 2 * A * d * inter
        print(f"\nrow blocks of {bm}: gather of sorted x {gpu_ms(gather, rep=40):.3f} ms\n"
              "| GEMM | variant | ms | TFLOP/s | % matmul | max err vs served |\n|---|---|---|---|---|---|")
        for bn, bk, w, st in ((128, 64, 8, 4), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 4), (256, 64, 8, 3),
                              (128, 128, 8, 2), (64, 128, 4, 3)):
            name = f"{bm}x{bn}x{bk} {w}w {st}s"
            served = lambda: grouped_gemm(x, rows, be, A, top_k, w1, None, inter, bm, up=(w3, None),  # noqa: E731
                                          out_dtype=torch.bfloat16, tiles=dict(BLOCK_N=bn, SWAP_AB=False, num_warps=w,
                                          num_stages=st, BLOCK_K=bk, cols_first=True))
            h = torch.empty(A, inter, dtype=torch.bfloat16, device="cuda")
            for label, fn, check in (
                    ("served", served, lambda: (served() - h_ref).abs().max()),
                    ("B by TMA", lambda: tma_gemm(x, None, rows, be, A, top_k, w1, w3, inter, bm, bn, bk, w, st, h),
                     lambda: (h - h_ref).abs().max()),
                    ("A, B by TMA", lambda: tma_gemm(x, xs, rows, be, A, top_k, w1, w3, inter, bm, bn, bk, w, st, h),
                     lambda: (h - h_ref).abs().max()),
                    ("A, B by TMA, out sorted", lambda: tma_gemm(x, xs, rows, be, A, top_k, w1, w3, inter, bm, bn, bk,
                                                                 w, st, hs, out_sorted=True),
                     lambda: (hs[rows < A] - h_ref[rows[rows < A]]).abs().max())):
                try:
                    h.zero_()
                    fn()
                    err = check().item()
                    ms = gpu_ms(fn, rep=40)
                    print(f"| gate/up | {name} {label} | {ms:.3f} | {flops_gu / ms / 1e9:.0f} | "
                          f"{100 * flops_gu / ms / 1e9 / mm:.0f} % | {err:.2e} |", flush=True)
                except Exception as exc:
                    print(f"| gate/up | {name} {label} | failed {type(exc).__name__}: {str(exc)[:120]!r} |", flush=True)
        hin = torch.randn(A, inter, device="cuda", generator=g).bfloat16()
        hsorted = hin[torch.where(rows < A, rows, 0)]
        y_ref = grouped_gemm(hin, rows, be, A, 1, w2, None, d, bm, out_dtype=torch.float32,
                             tiles=dict(BLOCK_N=128, SWAP_AB=False, num_warps=8, num_stages=4, BLOCK_K=64,
                                        cols_first=True))
        for bn, bk, w, st in ((128, 64, 8, 4), (128, 64, 4, 3), (256, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4)):
            name = f"{bm}x{bn}x{bk} {w}w {st}s"
            y = torch.empty(A, d, device="cuda")
            for label, fn in (
                    ("served", lambda: grouped_gemm(hin, rows, be, A, 1, w2, None, d, bm, out=y, tiles=dict(
                        BLOCK_N=bn, SWAP_AB=False, num_warps=w, num_stages=st, BLOCK_K=bk, cols_first=True))),
                    ("B by TMA", lambda: tma_gemm(hin, None, rows, be, A, 1, w2, None, d, bm, bn, bk, w, st, y)),
                    ("A, B by TMA", lambda: tma_gemm(hin, hsorted, rows, be, A, 1, w2, None, d, bm, bn, bk, w, st, y))):
                try:
                    y.zero_()
                    fn()
                    err = (y - y_ref).abs().max().item()
                    ms = gpu_ms(fn, rep=40)
                    print(f"| down | {name} {label} | {ms:.3f} | {flops_dn / ms / 1e9:.0f} | "
                          f"{100 * flops_dn / ms / 1e9 / mm:.0f} % | {err:.2e} |", flush=True)
                except Exception as exc:
                    print(f"| down | {name} {label} | failed {type(exc).__name__}: {str(exc)[:120]!r} |", flush=True)
    # a dense cuBLAS GEMM of the gate/up shape: what the tensor cores give these sizes without the grouping
    xa = torch.randn(A, d, device="cuda").bfloat16()
    wd = torch.randn(2 * inter, d, device="cuda").bfloat16()
    ms = gpu_ms(lambda: xa @ wd.T, rep=40)
    print(f"\ncuBLAS dense [{A} x {d}] @ [{d} x {2 * inter}]: {ms:.3f} ms, {100 * flops_gu / ms / 1e9 / mm:.0f} % matmul")


if __name__ == "__main__" and "--ws" not in sys.argv:
    main()


def ws_variants():
    """Triton's automatic warp specialization over the TMA loop (sorted activations), 128-row blocks."""
    mm = matmul_tflops()
    T, E, top_k, d, inter = 8192, 256, 8, 2304, 1024
    g = torch.Generator(device="cuda").manual_seed(1)
    w1, w3 = ((torch.randn(E, inter, d, device="cuda", generator=g) * d ** -0.5).bfloat16() for _ in range(2))
    ids = torch.rand(T, E, device="cuda", generator=g).topk(top_k, dim=-1).indices
    x = torch.randn(T, d, device="cuda", generator=g).bfloat16()
    A = T * top_k
    rows, be = sort_by_expert(ids, E, 128)
    xs = x[torch.where(rows < A, rows // top_k, 0)]
    hs = torch.empty(rows.numel(), inter, dtype=torch.bfloat16, device="cuda")
    ref = tma_gemm(x, xs, rows, be, A, top_k, w1, w3, inter, 128, 128, 64, 8, 4, hs.clone(), out_sorted=True)
    flops = 2 * A * d * 2 * inter
    for bn, bk, w, st in ((128, 64, 8, 4), (128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 4, 4), (64, 64, 4, 4),
                          (128, 128, 8, 2)):
        fn = lambda: tma_gemm(x, xs, rows, be, A, top_k, w1, w3, inter, 128, bn, bk, w, st, hs,  # noqa: E731
                              out_sorted=True, ws=True)
        try:
            fn()
            err = (hs - ref).abs().max().item()
            ms = gpu_ms(fn, rep=40)
            print(f"| gate/up WS | 128x{bn}x{bk} {w}w {st}s | {ms:.3f} | {100 * flops / ms / 1e9 / mm:.0f} % | {err:.2e} |",
                  flush=True)
        except Exception as exc:
            print(f"| gate/up WS | 128x{bn}x{bk} {w}w {st}s | failed {type(exc).__name__}: {str(exc)[:300]!r} |", flush=True)


if __name__ == "__main__" and "--ws" in sys.argv:
    ws_variants()
