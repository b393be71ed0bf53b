"""The fused Triton KDA decode step against the plain-torch gate + recurrence, on CPU through
Triton's interpreter (TRITON_INTERPRET=1); the GPU check and timing live in bench/."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

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
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(seed)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert float(res.stdout.strip().splitlines()[-1]) < 1e-5
