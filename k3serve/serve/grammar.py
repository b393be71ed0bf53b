"""Structured output (OpenAI ``response_format`` / vLLM ``guided_*``) through xgrammar.

Flow: a request's constraint becomes a hashable :class:`GrammarSpec`; :class:`GrammarBackend`
compiles it (LRU-cached, optionally on a thread pool so compilation never blocks an engine step:
xgrammar releases the GIL while it compiles) into a :class:`CompiledGrammar`; each sequence gets
its own :class:`GrammarState` (``compiled.new_state()``). Every decode step the engine calls
:func:`apply_masks` on the [B, V] logits before sampling, then ``state.accept(token)`` with the
sampled token.

Vocabulary: the mask spans the model's logits width (``config.vocab_size``). Ids the tokenizer
does not know (holes, ids past its vocab) and all special / added tokens are never allowed by a
grammar; the EOS ids are allowed exactly when the grammar may end. Once the grammar cannot go on
(or after EOS was accepted) EOS is the only allowed token, so the engine stops the sequence.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import xgrammar as xgr

__all__ = ["GrammarError", "GrammarSpec", "GrammarBackend", "CompiledGrammar", "GrammarState",
           "allocate_bitmask", "fill_bitmask", "apply_bitmask", "apply_masks"]

KINDS = ("json_object", "json_schema", "regex", "choice", "ebnf")


class GrammarError(ValueError):
    """The constraint cannot be compiled (bad JSON schema, regex, ...): an HTTP 400."""


def _clean_xgr_error(e: Exception) -> str:
    """Drop xgrammar's ``[hh:mm:ss] /path/file.cc:123: Check failed: (...) is false:`` prefix."""
    msg = str(e).strip()
    msg = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", msg)
    msg = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", msg)
    return msg.splitlines()[0] if msg else type(e).__name__


# ---- specs --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain to. ``value``: None for json_object, the schema as a JSON string for
    json_schema, the pattern for regex, a JSON list of strings for choice."""

    kind: str  # "json_object" | "json_schema" | "regex" | "choice" | "ebnf" (server-built, e.g. tool calls)
    value: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if (self.value is None) != (self.kind == "json_object"):
            raise ValueError(f"grammar kind {self.kind!r} " + ("takes no value" if self.kind == "json_object"
                                                               else "needs a value"))

    @classmethod
    def json_schema(cls, schema: dict | str) -> "GrammarSpec":
        """Schema (dict or JSON text) re-serialised compactly, so equal schemas share a cache
        entry. Key order is kept: it is the order the properties are generated in."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("JSON schema must be a JSON object")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")))

    @classmethod
    def choice(cls, choices: Sequence[str]) -> "GrammarSpec":
        if isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not choices \
                or not all(isinstance(c, str) for c in choices):
            raise ValueError("guided_choice must be a non-empty list of strings")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def from_openai(cls, response_format: dict | None = None, guided_json: Any = None,
                    guided_regex: str | None = None, guided_choice: Sequence[str] | None = None,
                    guided_grammar: str | None = None, structured_outputs: dict | None = None
                    ) -> "GrammarSpec | None":
        """Map a chat/completions request's fields; None when nothing is constrained.

        ``response_format``: {"type": "text"} (no constraint), {"type": "json_object"} or
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
        (no schema: any JSON object). vLLM extras: ``guided_json`` (schema dict / JSON text),
        ``guided_regex``, ``guided_choice``, ``guided_grammar`` (EBNF, xgrammar's dialect: a
        ``root`` rule), and their newer form ``structured_outputs`` {json | regex | choice | grammar
        | json_object}. At most one constraint may be given.
        """
        if structured_outputs is not None:
            if not isinstance(structured_outputs, dict):
                raise ValueError("structured_outputs must be an object")
            known = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                     "grammar": "guided_grammar", "json_object": None}
            unknown = sorted(set(structured_outputs) - set(known))  # (vLLM's whitespace / property switches too)
            if unknown:
                raise ValueError(f"structured_outputs: {', '.join(unknown)} not supported (json, regex, choice, "
                                 "grammar, json_object are)")
            given = {k: v for k, v in structured_outputs.items() if k in known and v not in (None, False)}
            new = [cls("json_object")] if given.pop("json_object", None) else []
            new += [s for s in [cls.from_openai(**{known[k]: v}) for k, v in given.items()] if s is not None]
            if not new:
                raise ValueError("structured_outputs: give one of json, regex, choice, grammar, json_object")
            old = cls.from_openai(response_format, guided_json, guided_regex, guided_choice, guided_grammar)
            return cls._one(new + ([old] if old is not None else []))
        specs: list[GrammarSpec] = []
        if response_format is not None:
            if not isinstance(response_format, dict):
                raise ValueError("response_format must be an object")
            t = response_format.get("type")
            if t == "json_object":
                specs.append(cls("json_object"))
            elif t == "json_schema":
                js = response_format.get("json_schema")
                if not isinstance(js, dict):
                    raise ValueError("response_format.json_schema must be an object")
                schema = js.get("schema")
                specs.append(cls("json_object") if schema is None else cls.json_schema(schema))
            elif t != "text":
                raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {t!r}")
        if guided_json is not None:
            specs.append(cls.json_schema(guided_json))
        if guided_regex is not None:
            if not isinstance(guided_regex, str):
                raise ValueError("guided_regex must be a string")
            specs.append(cls("regex", guided_regex))
        if guided_choice is not None:
            specs.append(cls.choice(guided_choice))
        if guided_grammar is not None:
            if not isinstance(guided_grammar, str) or not guided_grammar.strip():
                raise ValueError("guided_grammar must be a non-empty EBNF string")
            specs.append(cls("ebnf", guided_grammar))
        return cls._one(specs)

    @staticmethod
    def _one(specs: list) -> "GrammarSpec | None":
        if len(specs) > 1:
            raise ValueError("give only one of response_format (json), guided_json, guided_regex, guided_choice, "
                             "guided_grammar (or structured_outputs)")
        return specs[0] if specs else None


# ---- compilation --------------------------------------------------------------------------------

_NOT_SCHEMAS = ("enum", "const", "default", "examples")


def _fix_string_lengths(node: Any) -> Any:
    """Work around xgrammar <= 0.2.9 (mlc-ai/xgrammar#800): a string with minLength/maxLength
    compiles to a character class that admits raw control characters (U+0000-U+001F but CR/LF),
    i.e. invalid JSON. An equivalent ``pattern`` goes through xgrammar's JSON-string-aware regex
    path instead, which only emits valid JSON. Schemas with their own pattern/format are kept."""
    if isinstance(node, list):
        return [_fix_string_lengths(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in _NOT_SCHEMAS else _fix_string_lengths(v)) for k, v in node.items()}
    lo, hi = out.get("minLength"), out.get("maxLength")
    if out.get("type") == "string" and (lo is not None or hi is not None) \
            and "pattern" not in out and "format" not in out \
            and all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in (lo, hi)):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = "^[\\s\\S]{%d,%s}$" % (lo or 0, "" if hi is None else hi)
    return out


class CompiledGrammar:
    """A compiled grammar bound to one vocabulary; ``new_state()`` per sequence."""

    def __init__(self, spec: GrammarSpec, compiled: xgr.CompiledGrammar, vocab_size: int,
                 eos_ids: Sequence[int]) -> None:
        self.spec = spec
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int64)
        for t in self.eos_ids:
            words[t // 32] |= 1 << (t % 32)
        self.eos_only_row = (words - (words >= 2**31) * 2**32).to(torch.int32)  # as signed int32

    def new_state(self) -> "GrammarState":
        return GrammarState(self)

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.spec.kind}, vocab_size={self.vocab_size})"


class GrammarBackend:
    """One per served model: the tokenizer's vocabulary as xgrammar sees it, plus a compiler.

    ``vocab_size`` is the model's logits width (may exceed ``tokenizer.vocab_size``).
    JSON whitespace: ``any_whitespace=True`` allows any JSON whitespace between tokens, at most
    ``max_whitespace`` characters in a row (None: unbounded); ``False`` forces compact output
    (", " / ": " separators). Both bounds keep weak models out of endless-whitespace loops.
    """

    def __init__(self, tokenizer, vocab_size: int, max_threads: int = 4, cache_size: int = 256,
                 any_whitespace: bool = True, max_whitespace: int | None = None,
                 marker_ids: tuple[int, ...] = ()) -> None:
        n = min(tokenizer.vocab_size, vocab_size)
        specials = set(tokenizer.special_tokens.values())
        # Special / added tokens get b"": xgrammar never lets a grammar produce an empty token,
        # so their literal text ("<|im_end|>") can't leak into structured output. ``marker_ids``
        # (K3's XTML markers) keep their text, so server-built grammars (tool calls) can emit them.
        markers = set(marker_ids)
        encoded = [tokenizer.token_bytes(i) if i in markers
                   else b"" if (i in specials or tokenizer.is_special(i)) else tokenizer.token_bytes(i)
                   for i in range(n)]
        self.eos_ids = [i for i in tokenizer.eos_token_ids if 0 <= i < vocab_size]
        if not self.eos_ids:
            raise ValueError("structured output needs at least one EOS token id inside the vocabulary")
        self.vocab_size = vocab_size
        self._json_kw = {"any_whitespace": any_whitespace}
        if any_whitespace and max_whitespace is not None:
            self._json_kw["max_whitespace_cnt"] = max_whitespace
        self.tokenizer_info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab_size,
                                                stop_token_ids=self.eos_ids)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._pending: dict[GrammarSpec, Future] = {}
        self._lock = threading.RLock()  # a done future runs its callback inline, under the lock

    def _compile_uncached(self, spec: GrammarSpec) -> CompiledGrammar:
        c = self.compiler
        try:
            if spec.kind == "json_object":
                g = c.compile_json_schema('{"type": "object"}', **self._json_kw)
            elif spec.kind == "json_schema":
                schema = _fix_string_lengths(json.loads(spec.value))
                g = c.compile_json_schema(json.dumps(schema), **self._json_kw)
            elif spec.kind == "regex":
                g = c.compile_regex(spec.value)
            elif spec.kind == "ebnf":
                g = c.compile_grammar(spec.value)
            else:  # choice: the exact text of one alternative (EBNF literals take JSON escapes)
                alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in json.loads(spec.value))
                g = c.compile_grammar(f"root ::= {alts}")
        except (RuntimeError, ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            what = {"json_object": "JSON", "json_schema": "JSON schema", "regex": "regex",
                    "choice": "guided_choice", "ebnf": "grammar"}[spec.kind]
            raise GrammarError(f"invalid {what}: {_clean_xgr_error(e)}") from None
        return CompiledGrammar(spec, g, self.vocab_size, self.eos_ids)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile (or fetch from the LRU cache); raises :class:`GrammarError`."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        out = self._compile_uncached(spec)
        with self._lock:
            out = self._cache.setdefault(spec, out)  # a racing compile keeps the first result
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return out

    def compile_async(self, spec: GrammarSpec) -> Future:
        """Future of ``compile(spec)``; concurrent requests for one spec share a single compile.
        The future raises :class:`GrammarError` for a bad constraint."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                fut: Future = Future()
                fut.set_result(hit)
                return fut
            fut = self._pending.get(spec)
            if fut is None:
                fut = self._pool.submit(self.compile, spec)
                self._pending[spec] = fut
                fut.add_done_callback(lambda _f, s=spec: self._drop_pending(s))
            return fut

    def _drop_pending(self, spec: GrammarSpec) -> None:
        with self._lock:
            self._pending.pop(spec, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---- per-sequence state -------------------------------------------------------------------------

class GrammarState:
    """Where one sequence stands in its grammar."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self._extra_eos = 0  # EOS tokens accepted after termination (not in the matcher's history)

    @property
    def vocab_size(self) -> int:
        return self.grammar.vocab_size

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this sequence's allowed-token bits into ``bitmask[row]`` (CPU int32
        [*, ceil(V/32)], bit j of word w = token 32*w + j)."""
        if self.matcher.is_terminated():
            bitmask[row] = self.grammar.eos_only_row
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar forbids it."""
        if self.matcher.is_terminated():
            ok = token_id in self.grammar.eos_ids
            self._extra_eos += ok
            return ok
        return bool(self.matcher.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        """True once EOS was accepted at a point where the grammar may end."""
        return self.matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the text so far is a complete match (EOS is allowed now)."""
        return self.matcher.is_completed()

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (speculative decoding); cheap."""
        k = min(n, self._extra_eos)
        self._extra_eos -= k
        if n - k:
            self.matcher.rollback(n - k)


# ---- batch masking ------------------------------------------------------------------------------

def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """CPU int32 [B, ceil(V/32)], all bits set (every token allowed)."""
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def fill_bitmask(states: Sequence[GrammarState | None], vocab_size: int,
                 bitmask: torch.Tensor | None = None) -> torch.Tensor | None:
    """One bitmask for the batch (None if no row has a grammar); rows without one stay all-ones."""
    if all(s is None for s in states):
        return None
    if bitmask is None:
        bitmask = allocate_bitmask(len(states), vocab_size)
    else:
        bitmask.fill_(-1)
    for i, s in enumerate(states):
        if s is not None:
            if s.vocab_size != vocab_size:
                raise ValueError(f"row {i}: grammar built for vocab {s.vocab_size}, logits have {vocab_size}")
            s.fill_mask(bitmask, i)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
    """Out of place: ``logits`` [B, V] with ``-inf`` where the bit is 0 (only ``rows``, if given).

    The bitmask may live on the CPU; it is copied to the logits' device. Vectorised: unpack the
    int32 words to bools with one shift/and and ``masked_fill``.
    """
    V, dev = logits.shape[1], logits.device
    if rows is not None:
        idx = torch.tensor(list(rows), dtype=torch.long)
        bitmask = bitmask[idx]
        idx = idx.to(dev)
    bm = bitmask.to(dev, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((bm.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :V]
    if rows is None:
        return logits.masked_fill(~allowed, float("-inf"))
    out = logits.clone()
    out[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return out


def apply_masks(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> torch.Tensor:
    """Grammar-mask a batch of logits [B, V] (out of place; returns ``logits`` itself when no row
    has a grammar). Rows whose state is None are left bit-identical."""
    assert logits.dim() == 2 and logits.shape[0] == len(states), "logits must be [B, V] with one state per row"
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    bitmask = fill_bitmask(states, logits.shape[1])
    return apply_bitmask(logits, bitmask, None if len(rows) == len(states) else rows)
