"""Probe: the pipelined KDA mixer (producers LEAD groups ahead) against the default, checked then timed."""
import torch
import k3serve.ops.kda_decode_triton as K
from bench.ceilings import copy_tbs
from bench.timing import gpu_ms
from bench.kernels_kda_decode import inputs, mixer_inputs

ceil = copy_tbs()
H, D, lb = 96, 128, -5.0
rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731


def call(N, parts, lead, hp, st, cs, args):
    q, k, v, f, b, A_log, dt_bias, _, slots, x, conv_w, gate, has = args
    K.PIPELINE_HEADS = hp
    return K.kda_decode_fused(x, conv_w, cs, has, f.view(N, H * D), b, A_log, dt_bias, gate, torch.ones(D, device="cuda"),
                              1e-5, lb, st, slots, H, parts=parts, lead=lead)


worst = 0.0
for N in (1, 5, 64, 256):
    q, k, v, f, b, A_log, dt_bias, state, slots = inputs(N, H, D, max(N, 8), 3)
    x, conv_w, conv_state, gate, has = mixer_inputs(N, H, D, state.shape[0], 5)
    args = (q, k, v, f, b, A_log, dt_bias, state, slots, x, conv_w, gate, has)
    st, cs = state.clone(), conv_state.clone()
    y0 = call(N, 1, 0, 4, st, cs, args)
    for parts, lead, hp in ((1, 64, 4), (2, 64, 4), (1, 8, 8), (2, 300, 8)):
        st2, cs2 = state.clone(), conv_state.clone()
        y = call(N, parts, lead, hp, st2, cs2, args)
        worst = max(worst, rel(y, y0), rel(st2, st), rel(cs2, cs))
print(f"check: pipelined vs default (y, state, conv state), N 1 / 5 / 64 / 256: worst rel err {worst:.1e}")
print("| N | parts | lead (groups) | heads a group | ms | state % copy |\n|---|---|---|---|---|---|")
for N in (64, 256):
    q, k, v, f, b, A_log, dt_bias, state, slots = inputs(N, H, D, max(N, 8), 7)
    x, conv_w, conv_state, gate, has = mixer_inputs(N, H, D, state.shape[0], 11)
    args = (q, k, v, f, b, A_log, dt_bias, state, slots, x, conv_w, gate, has)
    for parts, lead, hp in [(1, 0, 4)] + [(p, l, h) for p in (1, 2) for h in (4, 8) for l in (16, 64, 256, 1024)]:
        ms = gpu_ms(lambda: call(N, parts, lead, hp, state, conv_state, args), rep=200)
        print(f"| {N} | {parts} | {lead} | {hp} | {ms:.3f} | {100 * N * H * D * D * 8 / (ms * 1e-3) / 1e12 / ceil:.0f} % |",
              flush=True)
