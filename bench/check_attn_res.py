"""The AttnRes mixer's GPU checks alone (``gpu_check_kernels.check_attn_res_partial``), every shape
split between programs wherever it may be and never, then the block summaries
(``check_attn_res_summary``): a quick re-check after a change to the mixer.

Usage: python3 bench/check_attn_res.py
"""

import sys

import torch

from k3serve.ops import attn_res_triton

# K3's width: a few tokens' rows split between programs (up to attn_res_triton.SPLIT_TOKENS, 28 programs of
# 256 columns a row), more a program a token (1 / 1 / 2 chunks at 2 / 5 / 9 sources); other widths
SHAPES = ((1, 2, 7168), (2, 1, 7168), (5, 7, 7168), (9, 1, 7168), (9, 4, 7168), (9, 16, 7168), (9, 64, 7168),
          (16, 3, 7168), (9, 300, 200), (4, 5, 2304), (3, 33, 7168))


# block summaries (blocks, tokens, width, queries): K3's 5-8 blocks and 24 / 19 queries, the most (16, 32)
SUMMARIES = ((5, 1, 7168, 24), (8, 1, 7168, 24), (8, 4, 7168, 19), (8, 2, 7168, 24), (16, 3, 7168, 32),
             (3, 2, 2304, 24), (1, 1, 7168, 3))


def run_summaries(check, gen: torch.Generator) -> None:
    for M, T, D, Q in SUMMARIES:
        check(M, T, D, Q, gen)


def run(check, gen: torch.Generator) -> None:
    """``check(M, T, D, gen)`` at each shape with SPLIT_MIN_SOURCES 1 (split wherever it may be) and 17
    (never)."""
    min_sources = attn_res_triton.SPLIT_MIN_SOURCES
    try:
        for attn_res_triton.SPLIT_MIN_SOURCES in (1, 17):
            for M, T, D in SHAPES:
                check(M, T, D, gen)
    finally:
        attn_res_triton.SPLIT_MIN_SOURCES = min_sources


if __name__ == "__main__":
    import bench.gpu_check_kernels as checks

    gen = torch.Generator(device=checks.DEV).manual_seed(0)
    run(checks.check_attn_res_partial, gen)
    run_summaries(checks.check_attn_res_summary, gen)
    sys.exit(checks.report())
