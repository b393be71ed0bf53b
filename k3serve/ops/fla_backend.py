"""fla-core (flash-linear-attention) kernels for the KDA core on CUDA; optional (``k3serve[gpu]``).

API facts this relies on (fla-core 0.6.0, checked on an H200, see the model-core issue note):
- ``chunk_kda`` takes a varlen batch as B=1 + ``cu_seqlens``, initial states [N, H, K, V] fp32,
  and returns the final states as a new tensor (so: gather slots, run, scatter back).
- the public ``fused_recurrent_kda`` ignores ``ssm_state_indices``; ``fused_recurrent_kda_fwd``
  with ``inplace_final_state=True`` updates the slot pool in place.
- plain mode takes ``g`` as the activated per-channel log decay, which is safe for any g <= 0.
  ``safe_gate=True`` (tensor-core matmuls for the intra-chunk sub-blocks) needs the gate bounded
  in [lower_bound, 0) with -5 <= lower_bound < 0: exactly K3's bounded form (model-spec: -5 <= λ < 0),
  so it is taken there (``SAFE_GATE``) and never for Kimi-Linear's unbounded gate.
- ``use_gate_in_kernel=True`` with ``A_log`` [H], ``dt_bias`` [H*K] and ``lower_bound`` computes
  the decay from the raw pre-activation inside the chunk cumsum: -exp(A_log) * softplus(f + dt_bias)
  without a lower bound (Kimi-Linear), lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) with one
  (K3) -- ``kda_ref.kda_gate``'s two forms.
"""

from __future__ import annotations

import functools

import torch

from ..engine.transfer import to_device
from ..model.batch import KDA_CHUNK, ForwardBatch
from .kda_ref import kda_gate


@functools.lru_cache(maxsize=1)
def available() -> bool:
    try:
        import fla.ops.kda  # noqa: F401
    except Exception:
        return False
    return True


def _zero_fresh(state: torch.Tensor, batch: ForwardBatch, seqs: range) -> None:
    """Sequences without cached context start from a zero state (host-known, no device sync).
    Static (graph) steps skip it: their decode rows have context (padding rows use the scratch
    slot), and their new prompts' initial states are zeroed on the device (``kda_core``).
    ``index_fill_`` takes the zero as a scalar argument: ``state[slots] = 0.0`` made a 0-dim CPU
    tensor of it and copied that to the GPU from pageable memory, which waits for the stream, so
    every KDA layer of an eager step that mixed new and continuing prompts stopped the host until
    the GPU caught up (py-spy, RESULTS.md thirty-fifth session: 16 % of the engine process's samples
    at concurrency 256 were on that line)."""
    if batch.static_shapes:
        return
    fresh = [i for i in seqs if batch.context_lens_host[i] == 0]
    if fresh:
        state.index_fill_(0, batch.kda_slots[to_device(fresh, state.device)], 0.0)


# fla's public chunk_kda reaches its forward through torch.compiler.disable, backend dispatch, an
# autograd Function, an input guard (a signature walk over every argument) and autocast wrappers:
# with its launches ~3.4 ms a call under cProfile, 40 % of an eager 512-token kimi-linear step's
# host time (RESULTS.md seventeenth session, 5th call). Inference needs none of the wrappers:
# ``DIRECT_FORWARD`` calls fla's forward (``chunk_kda_fwd``) with the chunk indices the public
# function would build, where q and k come normalised (``kda.CONV_NORMS_QK``). Written against
# fla-core 0.6.0's internals (checked at first use, else the public call). H200 (RESULTS.md,
# eighteenth session): bit for bit fla's public call, kda_core's host time 3.4 -> 2.4 ms a call
# under cProfile, kernels unchanged.
DIRECT_FORWARD = True

# fla's bounded-gate intra-chunk path (``safe_gate``) for gates with a lower bound (K3's form).
SAFE_GATE = True


@functools.lru_cache(maxsize=1)
def _direct_forward():
    """fla's chunk_kda_fwd and its chunk-index helpers where their signatures are the ones this
    module calls, else None."""
    import inspect

    try:
        from fla.ops.kda.chunk_fwd import chunk_kda_fwd
        from fla.ops.utils.index import prepare_chunk_indices_static
    except Exception:  # (fla imports need a GPU driver)
        return None
    need = {"chunk_indices", "chunk_offsets", "use_graph", "use_gate_in_kernel", "A_log", "dt_bias", "lower_bound"}
    if not need <= set(inspect.signature(chunk_kda_fwd).parameters):
        return None
    return chunk_kda_fwd, prepare_chunk_indices_static


def _chunk_kda(q, k, v, g, beta, scale: float, initial_state, batch: ForwardBatch, qk_normalized: bool, **in_kernel):
    """fla's chunk_kda on the batch's prefill sequences, one flat varlen batch ([1, T, ...] inputs):
    (o, final states). In an eager step the chunk indices are the batch's own (built without a
    host sync) where fla's internals take them, i.e. for q and k normalised already."""
    cu, cu_cpu = batch.prefill_cu_seqlens
    direct = _direct_forward() if DIRECT_FORWARD and qk_normalized else None
    if direct is None:
        from fla.ops.kda import chunk_kda

        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                         use_qk_l2norm_in_kernel=not qk_normalized, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, **in_kernel)
    chunk_kda_fwd, static_indices = direct
    chunk = KDA_CHUNK
    use_graph, max_num_seqs = in_kernel.pop("use_graph", False), in_kernel.pop("max_num_seqs", None)
    if use_graph:
        chunk_indices, chunk_offsets = static_indices(cu, chunk, -(-q.shape[1] // chunk) + max_num_seqs - 1)
    else:
        chunk_indices, chunk_offsets = batch.kda_chunk_indices, None
    o, ht, *_ = chunk_kda_fwd(
        q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous(), beta=beta.contiguous(), scale=scale,
        initial_state=initial_state, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
        chunk_indices=chunk_indices, chunk_size=chunk, use_graph=use_graph, chunk_offsets=chunk_offsets, **in_kernel)
    return o.type_as(q), ht


# FlashKDA (Moonshot AI's fused CUTLASS forward, package ``flash_kda``: two kernels, chunks of 16, the
# running state in bf16 on chip) for a step's prefill sequences where it applies: K3's
# bounded gate (it computes lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) only), D = 128, in
# eager and captured steps alike (no host sync; its grid is sized from the token count, the tiles
# from the device offsets). H200, 96 heads (``bench.kernels_kda_prefill``, RESULTS.md forty-second
# session): 0.124 vs fla safe_gate's 0.194 ms at 1 x 512, 1.43 vs 2.44 at 1 x 8192, 5.56 vs 9.60 at
# 1 x 32768, 1.32 vs 2.57 at 64 x 128; against the fp32 torch reference (``gpu_check_model.py``) out /
# state rel err 5.9e-3 / 3.5e-3 (fla 4.2e-3 / 2.2e-3: FlashKDA carries the state in bf16 on chip).
# Only where the package is installed (``bash bench/gpu_session.sh flashkda`` builds it); else fla.
FLASH_KDA = True


@functools.lru_cache(maxsize=1)
def _flash_kda():
    try:
        import flash_kda
    except Exception:  # (not installed, or built for another torch / CUDA)
        return None
    return flash_kda


def flash_kda_applies(gate: tuple | None, head_dim: int) -> bool:
    """Whether a prefill's KDA core goes through FlashKDA: switched on, a bounded gate in its range,
    128-wide heads, and the package importable."""
    return FLASH_KDA and gate is not None and safe_gate(gate[2]) and head_dim == 128 and _flash_kda() is not None


def _flash_kda_prefill(q, k, v, f, beta, scale: float, initial_state, gate: tuple, cu_seqlens: torch.Tensor):
    """FlashKDA on a flat varlen batch ([T, H, D] inputs; f the gate's pre-activation): (o [T, H, D]
    bf16, final states [N, H, K, V] fp32). It normalises q and k itself (idempotent on normalised
    ones), takes beta as bf16 logits (from the sigmoid's output: exact enough, as the logits came from
    a bf16 projection, and 1.0 maps to inf, whose sigmoid is 1 again) and keeps states V-first."""
    T, H, D = q.shape
    N = cu_seqlens.numel() - 1
    A_log, dt_bias, lower_bound = gate
    out = torch.empty(1, T, H, D, dtype=torch.bfloat16, device=q.device)
    final = torch.empty(N, H, D, D, dtype=torch.float32, device=q.device)
    init = initial_state.transpose(-1, -2).contiguous() if initial_state is not None else None
    bf16 = lambda x: x.to(torch.bfloat16).contiguous()[None]  # noqa: E731
    _flash_kda().fwd(bf16(q), bf16(k), bf16(v), bf16(f), bf16(torch.logit(beta.float())), scale, out,
                     A_log.float().contiguous(), dt_bias.float().reshape(H, D).contiguous(), float(lower_bound),
                     initial_state=init, final_state=final, cu_seqlens=cu_seqlens.long())
    return out[0], final.transpose(-1, -2)


def safe_gate(lower_bound: float | None) -> bool:
    """Whether fla may take its bounded-gate path: only for a gate computed in its kernel with a
    lower bound in fla's safe range (outside it fla raises; without one the gate is unbounded)."""
    return SAFE_GATE and lower_bound is not None and -5.0 <= lower_bound < 0.0


def kda_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             scale: float, state: torch.Tensor, batch: ForwardBatch, gate: tuple | None = None,
             qk_normalized: bool = False) -> torch.Tensor:
    """Same contract as ``ops.kda.kda_core``; q and k are L2-normalised inside fla's kernels unless
    ``qk_normalized`` (two launches a layer fewer: fla's l2norm on q and on k)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    T, H, K = q.shape
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    nd = batch.num_decodes
    if nd:
        _zero_fresh(state, batch, range(nd))
        g_dec = kda_gate(g[:nd], *gate) if gate is not None else g[:nd]
        o, _ = fused_recurrent_kda_fwd(
            q=q[:nd, None].contiguous(), k=k[:nd, None].contiguous(), v=v[:nd, None].contiguous(),
            g=g_dec[:, None].float().contiguous(), beta=beta[:nd, None].float().contiguous(),
            initial_state=state, scale=scale, inplace_final_state=True,
            ssm_state_indices=batch.kda_slots[:nd], use_qk_l2norm_in_kernel=not qk_normalized,
        )
        out[:nd] = o[:, 0]
    if nd < batch.num_seqs:
        slots = batch.kda_slots[nd:]
        # New prompts (no cached context, as most prefill steps): fla starts from zeros, so no
        # slot is zeroed and no state gathered (4 launches and a host copy a KDA layer fewer).
        fresh = all(c == 0 for c in batch.context_lens_host[nd:])
        if not fresh:
            _zero_fresh(state, batch, range(nd, batch.num_seqs))
        s = nd  # decode tokens come first, one each
        in_kernel = {} if gate is None else dict(use_gate_in_kernel=True, A_log=gate[0], dt_bias=gate[1],
                                                   lower_bound=gate[2], safe_gate=safe_gate(gate[2]))
        if batch.static_shapes:  # a CUDA graph: chunk indices built on the device
            in_kernel.update(use_graph=True, max_num_seqs=batch.prefill_cu_seqlens[0].shape[0] - 1)
        init = None if fresh else state[slots]
        if init is not None and batch.static_shapes:  # (no host zeroing there: new prompts' rows zeroed here)
            init = torch.where(batch.has_context[nd:, None, None, None] > 0, init, 0.0)
        if flash_kda_applies(gate, K):
            o, ht = _flash_kda_prefill(q[s:], k[s:], v[s:], g[s:], beta[s:], scale, init, gate,
                                       batch.prefill_cu_seqlens[0])
            o = o[None]
        else:
            o, ht = _chunk_kda(q[None, s:], k[None, s:], v[None, s:],
                               g[None, s:] if gate is not None else g[None, s:].float(), beta[None, s:].float(),
                               scale, init, batch, qk_normalized, **in_kernel)
        state[slots] = ht
        if nd == 0 and o.dtype == out.dtype:  # a prefill-only step: the kernel's output is the whole output
            return o[0]
        out[s:] = o[0]
    return out
