"""The KDA decode kernels at N = 256 sequences, H = 96, D = 128, one launch each between
cudaProfilerStart / Stop, for Nsight Compute: the bare state traffic (the probe, in place, 64-wide
blocks, 4 warps), the core step (inputs precomputed), the fused Triton mixer (the default) and the
fused Gluon mixer, in that order. Why the fused mixers stay under the probe's 93 % of copy is a
question of occupancy, bytes in flight and stalls, which ncu measures and timings cannot.

Usage (device): ncu --profile-from-start off --section SpeedOfLight --section Occupancy \\
    --section WarpStateStats --section LaunchStats python3 -m bench.ncu_kda [N]
"""

import sys

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from bench.kernels_kda_decode import _state_probe_kernel, inputs, mixer_inputs
from k3serve.ops.kda_decode_triton import kda_decode, kda_decode_fused


def main() -> None:
    N, H, D, lb = (int(sys.argv[1]) if len(sys.argv) > 1 else 256), 96, 128, -5.0
    q, k, v, f, b, A_log, dt_bias, state, slots = inputs(N, H, D, N + 8, 7)
    x, conv_w, conv_state, gate, has = mixer_inputs(N, H, D, state.shape[0], 11)
    onw = torch.ones(D, device="cuda")
    desc = TensorDescriptor(state, list(state.shape), list(state.stride()), [1, 1, D, 64])
    runs = {
        "probe": lambda: _state_probe_kernel[(N, H, 2)](state, desc, slots, state, state.stride(0), H, D=D, BV=64,
                                                        IN_PLACE=True, TMA=False, num_warps=4),
        "core step": lambda: kda_decode(q, k, v, f, b, A_log, dt_bias, lb, D ** -0.5, state, slots),
        "fused Triton": lambda: kda_decode_fused(x, conv_w, conv_state, has, f.view(N, H * D), b, A_log, dt_bias,
                                                 gate, onw, 1e-5, lb, state, slots, H),
        "fused Gluon": lambda: kda_decode_fused(x, conv_w, conv_state, has, f.view(N, H * D), b, A_log, dt_bias,
                                                gate, onw, 1e-5, lb, state, slots, H, gluon=True),
    }
    for run in runs.values():  # compile outside the profiled range
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, run in runs.items():
        print("launch:", name, flush=True)
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
