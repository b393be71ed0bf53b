"""Batched, vectorised token sampler with vLLM/OpenAI semantics.

One call handles a whole decode step: every row of ``logits`` [B, V] is one sequence,
each with its own :class:`SamplingParams`. All work is done on [B, V] tensors; the only
per-row Python is building small parameter/id tensors and drawing the noise of seeded rows.

Pipeline (the order matters and matches vLLM):

1. raw logprobs (``log_softmax`` of the input logits) if any row asked for logprobs;
2. ``allowed_token_ids`` (every other token -inf), ``logit_bias`` (added), then penalties:
   repetition (prompt + output tokens), frequency and presence (output only);
3. ``min_tokens``: EOS and stop token ids get ``-inf`` until enough tokens were generated;
4. greedy rows (temperature 0): argmax;
5. other rows: temperature, top-k, top-p, min-p, then an exponential race
   ``argmax(probs / q)``, ``q ~ Exp(1)``. That is an exact draw from ``probs``, and it lets a
   seeded request draw its noise row (shape [V]) from its own generator, so its tokens do
   not depend on what else is in the batch. On CUDA the filters and the race run in one Triton
   launch that finds what the filters keep as a threshold by radix selection instead of sorting
   the vocabulary (ops/sampling_triton.py; ``KERNEL``); ``filter_logits`` is its reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.transfer import to_device
from k3serve.ops.backend import triton_enabled

# The sampled rows' filters and draw in one Triton launch (ops/sampling_triton.py: no sort of the
# vocabulary) where the SAMPLE backend is Triton (CUDA by default); None: that choice, True / False:
# forced (tests under Triton's interpreter, A/B timing).
KERNEL: bool | None = None


@dataclass
class SamplingRow:
    """What the engine hands over per sequence for one step."""

    params: SamplingParams
    prompt_ids: list[int]  # repetition_penalty sees prompt + output tokens
    output_ids: list[int]  # presence/frequency penalties and min_tokens count these only
    eos_ids: list[int]  # masked while len(output_ids) < min_tokens (even with ignore_eos)
    generator: torch.Generator | None = None  # required when params.seed is set; on the logits' device
    # under a grammar: min_tokens masks the stops unless they are all the grammar allows (its end
    # wins; masking it too left nothing to sample)
    grammar: bool = False


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] fp32, raw-logit logprob of the sampled token
    top_ids: torch.Tensor | None = None  # [B, kmax] int64, kmax = max requested over the batch
    top_logprobs: torch.Tensor | None = None  # [B, kmax] fp32, sorted descending


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator a seeded request should own (create once, keep across steps)."""
    return torch.Generator(device=device).manual_seed(seed)


def _uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _token_counts(id_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(id_lists), vocab] fp32 occurrence counts, via one scatter_add over padded ids.

    Padding uses the id ``vocab`` so it lands in an extra column that is dropped.
    """
    width = max(1, max(len(ids) for ids in id_lists))
    padded = to_device([ids + [vocab] * (width - len(ids)) for ids in id_lists], device)
    counts = torch.zeros(len(id_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_token_biases(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """allowed_token_ids, then logit_bias, on the rows that set them (out of place; ``logits`` itself
    when no row does)."""
    allow = [(i, r.params.allowed_token_ids) for i, r in enumerate(rows) if r.params.allowed_token_ids]
    bias = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if not allow and not bias:
        return logits
    dev, out = logits.device, logits.clone()
    if allow:
        keep = torch.zeros(len(allow), logits.shape[1], dtype=torch.bool, device=dev)
        keep[to_device([j for j, (_, ids) in enumerate(allow) for _ in ids], dev),
             to_device([t for _, ids in allow for t in ids], dev)] = True
        picked = to_device([i for i, _ in allow], dev)
        out[picked] = out[picked].masked_fill(~keep, float("-inf"))
    if bias:
        index = (to_device([i for i, b in bias for _ in b], dev), to_device([t for _, b in bias for t in b], dev))
        out.index_put_(index, to_device([v for _, b in bias for v in b.values()], dev, out.dtype), accumulate=True)
    return out


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Return penalised logits (out of place; ``logits`` itself is untouched).

    repetition_penalty p (vLLM/CTRL): for tokens seen in prompt or output, logit/p if logit > 0
    else logit*p. Then, for tokens seen in the output only (OpenAI):
    ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
    Only rows that use a penalty are touched; with none, no count tensor is built at all.
    """
    picked = [i for i, r in enumerate(rows) if _uses_penalties(r.params)]
    if not picked:
        return logits
    vocab, dev = logits.shape[1], logits.device
    sel = [rows[i] for i in picked]
    idx = to_device(picked, dev)
    col = lambda xs: to_device(xs, dev, logits.dtype).unsqueeze(1)  # noqa: E731
    rep = col([r.params.repetition_penalty for r in sel])
    freq = col([r.params.frequency_penalty for r in sel])
    pres = col([r.params.presence_penalty for r in sel])

    sub = logits[idx]
    out_counts = _token_counts([r.output_ids for r in sel], vocab, dev)
    if any(r.params.repetition_penalty != 1.0 for r in sel):  # host-known: no device sync
        seen = (out_counts + _token_counts([r.prompt_ids for r in sel], vocab, dev)) > 0
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * out_counts - pres * (out_counts > 0).to(sub.dtype)
    out = logits.clone()
    out[idx] = sub
    return out


def mask_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Forbid (-inf) EOS and stop_token_ids for rows with fewer than min_tokens outputs.

    Out of place (returns ``logits`` itself when no row needs it). EOS is masked even with
    ignore_eos, like vLLM: min_tokens means no stop of any kind before that many tokens.
    """
    r_idx: list[int] = []
    t_idx: list[int] = []
    ruled: list[int] = []
    for i, r in enumerate(rows):
        if len(r.output_ids) < r.params.min_tokens:
            toks = [t for t in (*r.eos_ids, *r.params.stop_token_ids) if t < logits.shape[1]]
            r_idx += [i] * len(toks)
            t_idx += toks
            # (a grammar's end, or allowed_token_ids that are all stops: unmasked if nothing else is left)
            ruled += [i] if (r.grammar or r.params.allowed_token_ids) and toks else []
    if r_idx:
        dev = logits.device
        index = (to_device(r_idx, dev), to_device(t_idx, dev))
        masked = logits.index_put(index, torch.full((), float("-inf"), device=dev))
        if ruled:  # (on the device: no sync)
            g = to_device(ruled, dev)
            masked[g] = torch.where(torch.isfinite(masked[g]).any(dim=-1, keepdim=True), masked[g], logits[g])
        logits = masked
    return logits


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  sort_needed: bool | None = None, min_p_needed: bool | None = None) -> torch.Tensor:
    """Apply top-k, then top-p, then min-p to temperature-scaled logits [S, V]; dropped -> -inf.

    top_k [S] long (0 = off); top_p [S] (1 = off): keep the smallest prefix of the sorted
    distribution (renormalised after top-k) whose mass reaches top_p, always the top token;
    min_p [S] (0 = off): drop tokens with prob < min_p * max prob. min-p only compares ratios to
    the max token, which top-k/top-p never remove, so it can run on the unsorted tensor.
    ``sort_needed`` / ``min_p_needed``: whether any row uses top-k/top-p / min-p, when the caller
    knows it on the host (otherwise read from the tensors: a device sync each).
    """
    vocab = logits.shape[1]
    if sort_needed if sort_needed is not None else bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        pos = torch.arange(vocab, device=logits.device)
        k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(pos >= k, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # exclusive cumsum: 0 for the top token
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if min_p_needed if min_p_needed is not None else bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits


class Sampler:
    """Stateless apart from the generator used for unseeded rows (None: torch's global RNG)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 logprob_logits: torch.Tensor | None = None) -> SamplerOutput:
        """``logprob_logits``: the model's logits where ``logits`` were already masked (a grammar's
        -inf would otherwise be the logprobs reported, and not valid JSON)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "logits must be [B, V] with one row per request"
        logits = logits.float()
        dev = logits.device

        # 1. logprobs come from the raw model logits (vLLM's default), before any processing.
        ks = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        raw = logits if logprob_logits is None else logprob_logits.float()
        raw_logprobs = raw.log_softmax(dim=-1) if ks else None

        # 2-3. allowed tokens, biases and penalties, then min_tokens (out of place: the caller's
        # logits stay intact).
        processed = mask_min_tokens(apply_penalties(apply_token_biases(logits, rows), rows), rows)

        # 4. greedy rows: argmax (of every row, the sampled ones overwritten below; none if every
        # row is sampled, as when every request has the same settings: two launches fewer a step).
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        token_ids = processed.argmax(dim=-1) if len(sampled) < len(rows) or not sampled else None

        # 5. sampled rows.
        if sampled:
            ps = [rows[i].params for i in sampled]
            s_idx = to_device(sampled, dev)
            # (one upload: temperature, top-k, top-p, min-p a row; top-k exact in fp32 below 2^24)
            params = to_device([[p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps],
                                [p.min_p for p in ps]], dev, torch.float32)
            has_k, has_p = any(p.top_k > 0 for p in ps), any(p.top_p < 1.0 for p in ps)
            has_min = any(p.min_p > 0 for p in ps)

            # Exponential race. Seeded rows overwrite their noise row from their own generator,
            # a fixed-size [V] draw, so it depends only on that request's generator state.
            q = torch.empty(len(ps), processed.shape[1], device=dev).exponential_(generator=self.generator)
            for j, i in enumerate(sampled):
                if rows[i].params.seed is not None:
                    gen = rows[i].generator
                    if gen is None:
                        raise ValueError(f"row {i} has seed={rows[i].params.seed} but no generator")
                    q[j].exponential_(generator=gen)
            if KERNEL if KERNEL is not None else triton_enabled("SAMPLE", dev):
                from k3serve.ops.sampling_triton import sample_filtered

                drawn = sample_filtered(processed, s_idx, q, params, has_k, has_p, has_min)
            else:
                scaled = processed[s_idx] / params[0].unsqueeze(1)
                probs = filter_logits(scaled, params[1].long(), params[2], params[3], sort_needed=has_k or has_p,
                                      min_p_needed=has_min).softmax(dim=-1)
                q.clamp_(min=torch.finfo(q.dtype).tiny)  # exponential_ may return exactly 0
                drawn = (probs / q).argmax(dim=-1)
            if token_ids is None:  # (every row sampled: s_idx is 0..B-1 in order)
                token_ids = drawn
            else:
                token_ids[s_idx] = drawn

        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            out.logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
            out.top_logprobs, out.top_ids = raw_logprobs.topk(max(ks), dim=-1)
        return out
