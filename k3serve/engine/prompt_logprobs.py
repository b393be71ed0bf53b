"""Prompt logprobs (vLLM's ``prompt_logprobs``; the completions API's ``echo`` with ``logprobs``,
which scoring tools such as lm-eval use): each prompt token's logprob given the tokens before it.

They are read off the prefill's own hidden rows as its chunks run (row p scores token p + 1), so
the prompt is computed once, and in slices of rows, so a long chunk's [tokens, vocab] fp32 logits
never exist whole (kimi-linear's 163,840-token vocabulary: 655 KB a row).
"""

from __future__ import annotations

import torch

from .scheduler import ScheduledSeq

SLICE_BYTES = 256 << 20  # fp32 logits of one slice of rows


def rows_to_score(s: ScheduledSeq) -> tuple[int, int] | None:
    """(first row of the chunk, rows) whose logits score prompt tokens not scored yet; None if none
    (a prompt recomputed after preemption is not scored twice)."""
    seq = s.seq
    if not seq.scoring_prompt:
        return None
    start = max(seq.num_computed, len(seq.prompt_logprobs) - 1)
    end = min(seq.num_computed + s.num_tokens, seq.num_prompt - 1)
    return (start - seq.num_computed, end - start) if end > start else None


@torch.inference_mode()
def score(model, hidden: torch.Tensor, targets: list[int], k: int) -> list[tuple]:
    """(token, logprob, top ``k`` [(token, logprob)], rank) of each target under its hidden row
    (rank: 1 + the tokens more likely than it, vLLM's)."""
    rows = max(1, SLICE_BYTES // (4 * model.config.vocab_size))
    tgt = torch.tensor(targets, device=hidden.device)
    parts = []
    for i in range(0, len(targets), rows):
        lp = model.compute_logits(hidden[i: i + rows]).log_softmax(-1)
        chosen = lp.gather(1, tgt[i: i + rows, None])
        rank = (lp > chosen).sum(-1, keepdim=True).to(lp.dtype) + 1
        top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0])
        parts.append(torch.cat([chosen, rank, top_lp, top_ids.to(lp.dtype)], dim=1))
    host = torch.cat(parts).cpu().tolist()  # (one copy to the host for the chunk)
    return [(t, row[0], [(int(a), b) for a, b in zip(row[2 + k:], row[2: 2 + k])], int(row[1]))
            for t, row in zip(targets, host)]


def score_chunks(model, hidden: torch.Tensor, sched: list[ScheduledSeq]) -> None:
    """Appends the scores of this step's prompt rows to their sequences (``hidden``: the step's
    flat rows, ``sched`` order)."""
    offset = 0
    for s in sched:
        span = rows_to_score(s)
        if span is not None:
            first, n = span
            pos = s.seq.num_computed + first
            targets = s.seq.token_ids[pos + 1: pos + 1 + n]
            s.seq.prompt_logprobs += score(model, hidden[offset + first: offset + first + n], targets,
                                           s.seq.params.prompt_logprobs)
        offset += s.num_tokens
