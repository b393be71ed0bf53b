"""Per-op backend choice (k3serve/ops/backend.py): CPU always runs the reference, CUDA follows
the environment or the default, and a misspelt choice is an error rather than a silent slow path."""

import pytest
import torch

from k3serve.engine.decode_graphs import capture_blockers
from k3serve.ops import backend


@pytest.fixture(autouse=True)
def fresh_snapshot(monkeypatch):
    """The backend reads the environment into a snapshot: each test re-reads after changing it,
    and the next test starts from the real environment again."""
    yield
    monkeypatch.undo()
    backend.reload()


def set_env(monkeypatch, **values):
    for k, v in values.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)
    backend.reload()


@pytest.mark.parametrize("op", ["MOE", "MLA", "KDA", "NORM", "ATTNRES", "GLU"])
def test_environment_picks_the_backend_on_cuda_only(op, monkeypatch):
    var = f"K3SERVE_{op}_BACKEND"
    set_env(monkeypatch, K3SERVE_BACKEND=None, **{var: "triton"})
    assert backend.triton_enabled(op, "cuda")
    assert not backend.triton_enabled(op, "cpu")  # CI's tested path whatever the environment
    set_env(monkeypatch, **{var: "torch"})
    assert not backend.triton_enabled(op, torch.device("cuda", 0))
    for default in (False, True):
        monkeypatch.setattr(backend, "TRITON_BY_DEFAULT", default)
        set_env(monkeypatch, **{var: None})
        assert backend.triton_enabled(op, "cuda") is default
        set_env(monkeypatch, **{var: "auto"})
        assert backend.triton_enabled(op, "cuda") is default
        assert not backend.triton_enabled(op, "cpu")


def test_the_environment_is_read_into_a_snapshot(monkeypatch):
    set_env(monkeypatch, K3SERVE_BACKEND=None, K3SERVE_MOE_BACKEND="triton")
    assert backend.triton_enabled("MOE", "cuda")
    monkeypatch.setenv("K3SERVE_MOE_BACKEND", "torch")  # not re-read on the hot path ...
    assert backend.triton_enabled("MOE", "cuda")
    backend.reload()  # ... until reloaded (every engine start does)
    assert not backend.triton_enabled("MOE", "cuda")


def test_bad_choices_are_errors(monkeypatch):
    monkeypatch.setenv("K3SERVE_MOE_BACKEND", "trition")
    with pytest.raises(ValueError, match="K3SERVE_MOE_BACKEND='trition'"):
        backend.reload()
    with pytest.raises(ValueError, match="K3SERVE_MOE_BACKEND='trition'"):
        backend.check_environment()
    set_env(monkeypatch, K3SERVE_MOE_BACKEND=None, K3SERVE_KDA_BACKEND="fla")  # fla-core without our fused decode
    assert not backend.triton_enabled("KDA", "cuda") and backend.choice("KDA") == "fla"
    monkeypatch.setenv("K3SERVE_MLA_BACKEND", "fla")
    with pytest.raises(ValueError, match="K3SERVE_MLA_BACKEND='fla'"):
        backend.reload()
    with pytest.raises(ValueError, match="unknown op"):
        backend.triton_enabled("ROPE", "cuda")


def test_capture_blockers_follow_the_backends(monkeypatch):
    assert capture_blockers(torch.device("cpu")) == ["not a CUDA device"]
    monkeypatch.setattr(backend, "TRITON_BY_DEFAULT", False)
    set_env(monkeypatch, K3SERVE_BACKEND=None, K3SERVE_MOE_BACKEND=None, K3SERVE_MLA_BACKEND="triton")
    assert [("MoE" in w, "MLA" in w) for w in capture_blockers(torch.device("cuda"))] == [(True, False)]
    set_env(monkeypatch, K3SERVE_MOE_BACKEND="triton")
    assert capture_blockers(torch.device("cuda")) == []


def test_engine_refuses_a_misspelt_backend_before_loading(monkeypatch):
    from k3serve.engine.engine import LLMEngine

    monkeypatch.setenv("K3SERVE_NORM_BACKEND", "tritn")
    with pytest.raises(ValueError, match="K3SERVE_NORM_BACKEND='tritn'"):
        LLMEngine.from_pretrained(preset="tiny", device="cpu")


def test_one_variable_sets_every_op_and_per_op_choices_win(monkeypatch):
    set_env(monkeypatch, K3SERVE_BACKEND="triton", **{f"K3SERVE_{op}_BACKEND": None for op in backend.OPS})
    monkeypatch.setattr(backend, "TRITON_BY_DEFAULT", False)
    assert all(backend.triton_enabled(op, "cuda") for op in backend.OPS)
    assert not any(backend.triton_enabled(op, "cpu") for op in backend.OPS)
    set_env(monkeypatch, K3SERVE_MLA_BACKEND="torch")  # a per-op choice overrides the global one
    assert not backend.triton_enabled("MLA", "cuda") and backend.triton_enabled("MOE", "cuda")
    monkeypatch.setattr(backend, "TRITON_BY_DEFAULT", True)
    set_env(monkeypatch, K3SERVE_BACKEND="torch")
    assert not backend.triton_enabled("MOE", "cuda")
    monkeypatch.setenv("K3SERVE_BACKEND", "fast")
    with pytest.raises(ValueError, match="K3SERVE_BACKEND='fast'"):
        backend.reload()


def test_pdl_is_off_on_cpu_and_when_switched_off(monkeypatch):
    pytest.importorskip("triton")
    from k3serve.ops import pdl

    assert pdl.launch(torch.device("cpu")) == {}
    pdl._enabled.cache_clear()
    monkeypatch.setenv("K3SERVE_PDL", "0")
    try:
        assert pdl._enabled(0) is False  # decided before any CUDA query
    finally:
        pdl._enabled.cache_clear()


def test_fresh_sequences_start_from_zero_state_and_others_keep_theirs():
    """fla_backend._zero_fresh: the slots of sequences with no cached context are zeroed (in place,
    whole slot), every other slot is left as it was; static steps zero nothing here."""
    from types import SimpleNamespace

    from k3serve.ops.fla_backend import _zero_fresh

    state = torch.randn(6, 2, 3, 4)
    before = state.clone()
    batch = SimpleNamespace(static_shapes=False, context_lens_host=[5, 0, 7, 0, 0],
                            kda_slots=torch.tensor([4, 1, 0, 5, 2]))
    _zero_fresh(state, batch, range(0, 4))  # sequences 1 and 3 are fresh: slots 1 and 5; sequence 4 not asked
    assert torch.equal(state[[1, 5]], torch.zeros(2, 2, 3, 4))
    assert torch.equal(state[[0, 2, 3, 4]], before[[0, 2, 3, 4]])
    _zero_fresh(state, SimpleNamespace(**{**vars(batch), "static_shapes": True}), range(5))
    assert torch.equal(state[2], before[2])


def test_fla_bounded_gate_path_only_for_gates_in_its_safe_range():
    """fla_backend.safe_gate: fla's safe_gate path (tensor-core intra-chunk blocks) needs every
    log decay in [lower_bound, 0) with -5 <= lower_bound < 0 (fla raises outside it); Kimi-Linear's
    unbounded gate (no lower bound) must never take it, and SAFE_GATE turns it off."""
    from k3serve.ops import fla_backend

    assert fla_backend.safe_gate(-5.0) and fla_backend.safe_gate(-0.5)
    assert not fla_backend.safe_gate(None)
    assert not fla_backend.safe_gate(-5.5) and not fla_backend.safe_gate(0.0)
    saved = fla_backend.SAFE_GATE
    try:
        fla_backend.SAFE_GATE = False
        assert not fla_backend.safe_gate(-5.0)
    finally:
        fla_backend.SAFE_GATE = saved


def _flash_kda_contract(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None,
                        final_state=None, cu_seqlens=None):
    """FlashKDA's documented ``flash_kda.fwd`` contract (its README) in plain torch: bf16 [1, T, H, 128]
    inputs, g the gate's pre-activation, beta bf16 logits, A_log [H] and dt_bias [H, K] fp32, states
    V-first [N, H, V, K], q and k L2-normalised inside, the bounded gate lower_bound * sigmoid(...)."""
    from k3serve.ops.kda_ref import kda_gate, kda_recurrent_ref, l2norm

    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in (q, k, v, g, beta, out))
    assert q.shape[0] == 1 and q.shape[-1] == 128 and beta.shape == q.shape[:3]
    assert A_log.dtype == dt_bias.dtype == torch.float32 and dt_bias.shape == (q.shape[2], 128)
    assert cu_seqlens.dtype == torch.int64 and final_state.dtype == torch.float32
    for n in range(cu_seqlens.numel() - 1):
        a, b = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        s0 = None if initial_state is None else initial_state[n].transpose(-1, -2)[None]
        decay = kda_gate(g[0, a:b], A_log, dt_bias.reshape(-1), lower_bound)
        o, s = kda_recurrent_ref(l2norm(q[0, a:b].float())[None], l2norm(k[0, a:b].float())[None],
                                 v[0, a:b][None], decay[None], torch.sigmoid(beta[0, a:b].float())[None], scale, s0)
        out[0, a:b] = o[0].bfloat16()
        final_state[n] = s[0].transpose(-1, -2)


@pytest.mark.parametrize("with_state", [False, True])
def test_flash_kda_adapter_keeps_the_pool_layout_and_post_sigmoid_beta(monkeypatch, with_state):
    """fla_backend._flash_kda_prefill turns our call (K-first fp32 pool states, beta after its sigmoid,
    dt_bias [H*K]) into FlashKDA's (V-first states, bf16 beta logits, dt_bias [H, K]) and back: through
    a torch stand-in of FlashKDA's documented contract, its output and final states equal the
    reference recurrence run on our own layout (states transposed, beta not, would fail)."""
    from types import SimpleNamespace

    from k3serve.ops import fla_backend
    from k3serve.ops.kda_ref import kda_gate, kda_recurrent_ref, l2norm

    monkeypatch.setattr(fla_backend, "_flash_kda", lambda: SimpleNamespace(fwd=_flash_kda_contract))
    gen = torch.Generator().manual_seed(3)
    H, D, lens = 2, 128, [5, 11]
    T = sum(lens)
    q, k, v = (torch.randn(T, H, D, generator=gen).bfloat16() for _ in range(3))
    f = torch.randn(T, H, D, generator=gen).bfloat16()
    beta = torch.sigmoid(torch.randn(T, H, generator=gen).bfloat16().float())
    beta[0, 0] = 1.0  # a saturated sigmoid: its logit is inf
    gate = (torch.rand(H, generator=gen), torch.randn(H * D, generator=gen) * 0.1, -5.0)
    init = torch.randn(len(lens), H, D, D, generator=gen) * 0.1 if with_state else None
    cu = torch.tensor([0, lens[0], T])
    o, ht = fla_backend._flash_kda_prefill(q, k, v, f, beta, D ** -0.5, init, gate, cu)
    assert o.shape == (T, H, D) and ht.shape == (len(lens), H, D, D) and ht.dtype == torch.float32
    for n, (a, b) in enumerate(((0, lens[0]), (lens[0], T))):
        s0 = None if init is None else init[n][None]
        ref_o, ref_s = kda_recurrent_ref(l2norm(q[a:b].float())[None], l2norm(k[a:b].float())[None], v[a:b][None],
                                         kda_gate(f[a:b], *gate)[None], beta[a:b][None], D ** -0.5, s0)
        assert ((o[a:b].float() - ref_o[0]).norm() / ref_o.norm()).item() < 1e-2
        assert ((ht[n] - ref_s[0]).norm() / ref_s.norm()).item() < 1e-2


def test_flash_kda_only_for_bounded_gates_of_128_wide_heads(monkeypatch):
    from types import SimpleNamespace

    from k3serve.ops import fla_backend

    monkeypatch.setattr(fla_backend, "_flash_kda", lambda: SimpleNamespace(fwd=None))
    bounded, unbounded = (None, None, -5.0), (None, None, None)
    monkeypatch.setattr(fla_backend, "FLASH_KDA", True)
    assert fla_backend.flash_kda_applies(bounded, 128)
    assert not fla_backend.flash_kda_applies(unbounded, 128)  # Kimi-Linear's gate
    assert not fla_backend.flash_kda_applies(None, 128)  # the decay passed in, not computed
    assert not fla_backend.flash_kda_applies(bounded, 64)
    monkeypatch.setattr(fla_backend, "_flash_kda", lambda: None)  # not installed
    assert not fla_backend.flash_kda_applies(bounded, 128)
    monkeypatch.setattr(fla_backend, "_flash_kda", lambda: SimpleNamespace(fwd=None))
    monkeypatch.setattr(fla_backend, "FLASH_KDA", False)
    assert not fla_backend.flash_kda_applies(bounded, 128)
