"""The two-cache prefix hit rule (seed 003): MLA pages can be shared at any hash-block boundary,
but KDA state only exists where a checkpoint was saved, so a prefix is reusable only up to the
longest hash-aligned position inside the token match that has a KDA checkpoint."""

from __future__ import annotations


def hit_boundary(matched_tokens: int, kda_checkpoints: set[int] | frozenset[int], hash_block: int = 512) -> int:
    """Tokens of prefill a request may skip; 0 when nothing is reusable."""
    best = (matched_tokens // hash_block) * hash_block
    while best > 0 and best not in kda_checkpoints:
        best -= hash_block
    return best
