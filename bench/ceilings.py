"""The two ceilings every benchmark reports against, measured in the same run (figures drift)."""

import torch
import triton


def copy_tbs() -> float:
    """Device-to-device copy, bytes read + written, TB/s."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    return 2 * x.numel() / (ms * 1e-3) / 1e12


def matmul_tflops() -> float:
    """bf16 8192^3 matmul through cuBLAS, TFLOP/s."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ a, return_mode="median")
    return 2 * 8192 ** 3 / (ms * 1e-3) / 1e12


def copy_bench_setup() -> tuple[float, int, torch.Generator]:
    """What a bandwidth bench starts with: the copy ceiling measured now (printed with the SM
    count), the SM count, and a seeded CUDA generator for its data."""
    copy = copy_tbs()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy {copy:.2f} TB/s, {sms} SMs\n")
    return copy, sms, torch.Generator("cuda").manual_seed(0)
