"""The fused Triton KDA decode step against the plain-torch gate + recurrence, on CPU through
Triton's interpreter (TRITON_INTERPRET=1); the GPU check and timing live in bench/."""

import textwrap

import pytest

pytest.importorskip("triton")

from interpreted import worst_error  # noqa: E402

SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.ops.kda_decode_triton import kda_decode
    from k3serve.ops.kda_ref import kda_gate, kda_recurrent_ref, l2norm
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    for N, H, D, lb in [(3, 2, 32, -5.0), (5, 4, 16, None), (2, 3, 64, -2.0)]:
        q, k, v, f = (torch.randn(N, H, D, generator=gen) * 2 for _ in range(4))
        b = torch.randn(N, H, generator=gen)
        A_log, dt_bias = torch.rand(H, generator=gen) * 2, torch.randn(H * D, generator=gen)
        # a pool view: slots of [H, D, D] at a stride larger than one slot, untouched slots around
        pool = torch.randn(9, H * D * D + 17, generator=gen)
        state = pool[:, :H * D * D].view(9, H, D, D)
        slots = torch.randperm(9, generator=gen)[:N]
        before = pool.clone()
        ref_s0 = state[slots].clone()
        o = kda_decode(q, k, v, f, b, A_log, dt_bias, lb, D ** -0.5, state, slots)
        g = kda_gate(f, A_log, dt_bias, lb)
        o_ref, s_ref = kda_recurrent_ref(l2norm(q)[:, None], l2norm(k)[:, None], v[:, None], g[:, None],
                                         torch.sigmoid(b)[:, None], D ** -0.5, ref_s0)
        worst = max(worst, ((o - o_ref[:, 0]).norm() / o_ref.norm()).item(),
                    ((state[slots] - s_ref).norm() / s_ref.norm()).item())
        others = [i for i in range(9) if i not in slots.tolist()]
        assert torch.equal(pool[others], before[others]), "untouched slots changed"
        assert torch.equal(pool[:, H * D * D:], before[:, H * D * D:]), "wrote outside the slots"
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_decode_matches_reference(seed):
    assert worst_error(SCRIPT, str(seed)) < 1e-5


FUSED = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.nn.functional as F
    from k3serve.model.batch import ForwardBatch, SeqChunk
    from k3serve.model.layers import rms_norm
    from k3serve.ops.kda import kda_core
    from k3serve.ops import kda_decode_triton
    from k3serve.ops.kda_decode_triton import kda_decode_fused
    from k3serve.ops.kda_ref import kda_gate
    from k3serve.ops.short_conv import short_conv_ref
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    for N, H, D, lb in [(4, 2, 32, -5.0), (3, 3, 16, None)]:
        P, W, S = H * D, 4, 7
        x = torch.randn(N, 3 * P, generator=gen)
        conv_w = torch.randn(3 * P, W, generator=gen) * 0.5
        f, gate = torch.randn(N, P, generator=gen) * 2, torch.randn(N, P, generator=gen)
        b = torch.randn(N, H, generator=gen)
        A_log, dt_bias = torch.rand(H, generator=gen) * 2, torch.randn(P, generator=gen)
        onw = torch.rand(D, generator=gen) + 0.5
        conv0 = torch.randn(S, 3 * P, W - 1, generator=gen)
        state0 = torch.randn(S, H, D, D, generator=gen) * 0.2
        slots = torch.randperm(S, generator=gen)[:N]
        ctx = [5, 0, 9, 3][:N]  # the second sequence is fresh: its slot must not be read
        batch = ForwardBatch.build([SeqChunk([0], c, int(s), [0]) for c, s in zip(ctx, slots.tolist())], 64)
        conv0[slots[1]] = float("nan")  # the fresh sequence's slot holds garbage that must never be read
        state0[slots[1]] = float("nan")
        conv_r, state_r = conv0.clone(), state0.clone()
        u = F.silu(short_conv_ref(x, conv_w, conv_r, batch))
        q, k, v = (t.reshape(N, H, D) for t in u.split(P, dim=-1))
        g = kda_gate(f.view(N, H, D), A_log, dt_bias, lb)
        o = kda_core(q, k, v, g, torch.sigmoid(b), D ** -0.5, state_r, batch, backend="torch")
        y_ref = (rms_norm(o, onw, 1e-5, torch.float32) * torch.sigmoid(gate.view(N, H, D))).reshape(N, P)
        # The kernel gets strided rows: column slices of one projection output, as the model's fused GEMM gives.
        packed = torch.cat([x, f, b, gate, torch.zeros(N, 3)], dim=-1)
        xs, fs, bs, gs = packed[:, :3 * P], packed[:, 3 * P:4 * P], packed[:, 4 * P:4 * P + H], packed[:, 4 * P + H:-3]
        assert not xs.is_contiguous() and torch.equal(gs, gate)
        # (value block, programs a head): one program looping over 1 or 4 blocks; 2 or 4 programs of
        # one block, 2 of two (the last of a head normalises it and shifts the q/k conv state); the
        # default rule. Each call must leave the per-head tickets at zero for the next. Then the
        # other launch orders.
        for bv, parts, order in ((D, 1, "sequences"), (D // 4, 1, "sequences"), (D // 2, 2, "sequences"),
                                 (D // 4, 4, "sequences"), (D // 4, 2, "sequences"), (D // 2, None, "sequences"),
                                 (D // 2, 2, "sequences"), (D // 2, 1, "heads"), (D // 4, 2, "heads"),
                                 (D // 2, 2, "memory"), (D // 4, 4, "memory")):
            kda_decode_triton.LAUNCH_ORDER = order
            conv_t, state_t = conv0.clone(), state0.clone()
            y = kda_decode_fused(xs, conv_w, conv_t, torch.tensor(ctx) > 0, fs, bs, A_log, dt_bias, gs, onw, 1e-5, lb,
                                 state_t, slots, H, block_v=bv, parts=parts)
            worst = max(worst, ((y - y_ref).norm() / y_ref.norm()).item(),
                        ((state_t - state_r).norm() / state_r.norm()).item(),
                        ((conv_t - conv_r).norm() / conv_r.norm()).item())
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_fully_fused_decode_matches_the_mixer_reference(seed):
    """conv update + SiLU + gates + L2 norms + delta rule + gated RMSNorm in one kernel."""
    assert worst_error(FUSED, str(seed)) < 1e-5
