"""Tokenizers for the Kimi family (model-spec §4.1-4.2), behind one small interface.

Two on-disk layouts are loaded by :func:`load_tokenizer`:

- ``tokenizer.json`` (HF ``tokenizers``), when present;
- else the Kimi layout: ``tiktoken.model`` (one ``base64(token_bytes) rank`` per line) plus
  ``tokenizer_config.json`` whose ``added_tokens_decoder`` names the special ids. The reserved
  block is the 256 ids ``[vocab_size - 256, vocab_size)`` (vocab_size from config.json when it is
  there; else the block starts at the lowest named id above the ranks, or right after the ranks
  as the shipped ``tokenization_kimi.py`` does); unnamed ids in it become
  ``<|reserved_token_{id}|>``. Random checkpoints written by ``k3serve make-model`` have
  only the 256 single-byte ranks and a larger vocab; the ids in between are holes and decode to
  nothing.

Pre-tokenization uses the spec's regex verbatim: tiktoken's regex engine (fancy-regex over the
Rust ``regex`` crate) supports the ``&&`` class intersections, ``\\p{Han}`` and the ``(?!\\S)``
look-ahead, and the tests check its splits against the ``regex`` module (V1 semantics). Long
inputs are cut exactly as the shipped tokenizer does (400,000-char windows, runs of more than
25,000 whitespace / non-whitespace characters) before BPE.

Decoding works on bytes: every id maps to its token bytes (special tokens to their UTF-8 text),
``decode_bytes`` concatenates them — no spaces are ever inserted between special tokens — and
``decode`` is ``decode_bytes(...).decode("utf-8", "replace")``. The incremental detokenizer
(``k3serve.engine.detokenizer``) relies on that per-token byte table.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

__all__ = ["Tokenizer", "TiktokenTokenizer", "HFTokenizer", "load_tokenizer", "KIMI_PAT_STR",
           "NUM_RESERVED_SPECIAL_TOKENS", "read_tiktoken_ranks"]

# model-spec §4.1: alternation tried in order (the K2-family / K3 pattern).
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

NUM_RESERVED_SPECIAL_TOKENS = 256
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot parse {path}: {e}") from e


def _token_content(tok: Any) -> str | None:
    """tokenizer_config.json writes tokens either as strings or as AddedToken dicts."""
    if isinstance(tok, str):
        return tok
    if isinstance(tok, dict) and isinstance(tok.get("content"), str):
        return tok["content"]
    return None


def _id_list(v: Any) -> list[int] | None:
    if v is None:
        return None
    if isinstance(v, int):
        return [v]
    if isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v):
        return list(v)
    return None


class Tokenizer:
    """Backend-independent part: the id -> bytes table and everything built on it.

    Attributes: ``vocab_size`` (max id + 1), ``special_tokens`` (every added / special token,
    text -> id), ``eos_token_ids`` (list), ``bos_token_id`` (int or None), ``pad_token_id``.
    ``skip_special_tokens=True`` drops the ids flagged special (all reserved ids count as special).
    """

    def __init__(self, id_bytes: list[bytes | None], special_tokens: dict[str, int],
                 skip_ids: Iterable[int], encode_fn: Callable[[str, bool], list[int]],
                 eos_token_ids: list[int], bos_token_id: int | None, pad_token_id: int | None = None,
                 name_or_path: str = "") -> None:
        self._id_bytes = [b if b is not None else b"" for b in id_bytes]
        self._known = [b is not None for b in id_bytes]
        self._encode_fn = encode_fn
        self.vocab_size = len(id_bytes)
        self.special_tokens: dict[str, int] = dict(special_tokens)
        self.all_special_ids: frozenset[int] = frozenset(skip_ids)
        self.eos_token_ids: list[int] = list(eos_token_ids)
        self.bos_token_id: int | None = bos_token_id
        self.pad_token_id: int | None = pad_token_id
        self.name_or_path = name_or_path
        # skip table: same as _id_bytes with skipped specials emptied
        self._id_bytes_skip = list(self._id_bytes)
        for i in self.all_special_ids:
            if 0 <= i < self.vocab_size:
                self._id_bytes_skip[i] = b""

    # ---- encoding -------------------------------------------------------------------------------
    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added). ``allow_special=False``: special-token strings
        in ``text`` are ordinary text; ``True``: each one maps to its single id."""
        if not text:
            return []
        return self._encode_fn(text, allow_special)

    # ---- decoding -------------------------------------------------------------------------------
    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        """Bytes of one id; unknown ids (holes, out of range) decode to b""."""
        if 0 <= token_id < self.vocab_size:
            return (self._id_bytes_skip if skip_special_tokens else self._id_bytes)[token_id]
        return b""

    def decode_bytes(self, ids: Sequence[int], skip_special_tokens: bool = False) -> bytes:
        table = self._id_bytes_skip if skip_special_tokens else self._id_bytes
        n = self.vocab_size
        return b"".join([table[i] if 0 <= i < n else b"" for i in ids])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    # ---- lookups --------------------------------------------------------------------------------
    def token_to_id(self, token: str) -> int | None:
        """Id of the token whose text is exactly ``token`` (special or regular), else None."""
        if token in self.special_tokens:
            return self.special_tokens[token]
        return self._regular_token_to_id(token)

    def _regular_token_to_id(self, token: str) -> int | None:  # overridden
        return None

    def id_to_token(self, token_id: int) -> str | None:
        """Text of one id (invalid UTF-8 bytes replaced); None for holes / out of range."""
        if 0 <= token_id < self.vocab_size and self._known[token_id]:
            return self._id_bytes[token_id].decode("utf-8", errors="replace")
        return None

    def is_special(self, token_id: int) -> bool:
        return token_id in self.all_special_ids

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name_or_path!r}, vocab_size={self.vocab_size}, "
                f"specials={len(self.special_tokens)}, eos={self.eos_token_ids}, bos={self.bos_token_id})")


# ---- tiktoken (Kimi layout) ---------------------------------------------------------------------

def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{lineno}: expected 'base64(token) rank', got {line[:80]!r}")
        try:
            tok, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}") from e
        if tok in ranks:
            raise ValueError(f"{path}:{lineno}: duplicate token {tok!r}")
        ranks[tok] = rank
    if not ranks:
        raise ValueError(f"{path}: no ranks")
    if len(set(ranks.values())) != len(ranks):
        raise ValueError(f"{path}: duplicate ranks")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: single-byte tokens missing for bytes {missing[:8]}... "
                         "(a byte-level BPE needs all 256)")
    return ranks


_LONG_RUN = re.compile(r"\s{%d,}|\S{%d,}" % (MAX_NO_WHITESPACES_CHARS + 1, MAX_NO_WHITESPACES_CHARS + 1))


def _split_long_runs(s: str, limit: int = MAX_NO_WHITESPACES_CHARS) -> list[str]:
    """``tokenization_kimi._split_whitespaces_or_nonwhitespaces``: cut every run of same-class
    (str.isspace) characters after each ``limit`` characters. ``re``'s ``\\s`` on str is
    ``str.isspace``, so runs are found with one regex search and the common case costs nothing."""
    if len(s) <= limit:
        return [s]
    pat = _LONG_RUN if limit == MAX_NO_WHITESPACES_CHARS else re.compile(r"\s{%d,}|\S{%d,}" % (limit + 1, limit + 1))
    cuts = []
    for m in pat.finditer(s):
        cuts.extend(range(m.start() + limit, m.end(), limit))
    if not cuts:
        return [s]
    bounds = [0, *cuts, len(s)]
    return [s[a:b] for a, b in zip(bounds, bounds[1:])]


def _chunks(text: str) -> list[str]:
    out = []
    for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
        out.extend(_split_long_runs(text[i:i + TIKTOKEN_MAX_ENCODE_CHARS]))
    return out


class TiktokenTokenizer(Tokenizer):
    """``tiktoken.model`` + ``tokenizer_config.json`` (Moonshot ``TikTokenTokenizer``)."""

    def __init__(self, ranks: dict[bytes, int], specials: dict[int, tuple[str, bool]],
                 eos_token_ids: list[int], bos_token_id: int | None, pad_token_id: int | None = None,
                 pat_str: str = KIMI_PAT_STR, name: str = "kimi", name_or_path: str = "") -> None:
        import tiktoken

        rank_ids = set(ranks.values())
        clash = sorted(i for i in specials if i in rank_ids)
        if clash:
            raise ValueError(f"special token ids {clash[:8]} collide with BPE ranks")
        by_text: dict[str, int] = {}
        for i in sorted(specials):
            content = specials[i][0]
            if content in by_text:
                raise ValueError(f"special token {content!r} named twice (ids {by_text[content]}, {i})")
            by_text[content] = i
        self._ranks = ranks
        self.encoding = tiktoken.Encoding(name=name, pat_str=pat_str, mergeable_ranks=ranks,
                                          special_tokens=by_text)
        n = max(max(rank_ids), max(specials, default=-1)) + 1
        id_bytes: list[bytes | None] = [None] * n
        for tok, r in ranks.items():
            id_bytes[r] = tok
        for i, (content, _) in specials.items():
            id_bytes[i] = content.encode("utf-8")
        enc = self.encoding

        def encode_fn(text: str, allow_special: bool) -> list[int]:
            out: list[int] = []
            for piece in _chunks(text):
                if allow_special:
                    out.extend(enc.encode(piece, allowed_special="all"))
                else:
                    out.extend(enc.encode_ordinary(piece))
            return out

        super().__init__(id_bytes, by_text, [i for i, (_, sp) in specials.items() if sp], encode_fn,
                         eos_token_ids, bos_token_id, pad_token_id, name_or_path)

    def _regular_token_to_id(self, token: str) -> int | None:
        return self._ranks.get(token.encode("utf-8"))


# ---- HF tokenizers (tokenizer.json) -------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character map used by ByteLevel pre-tokenizers/decoders."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _component_types(node: Any) -> set[str]:
    """All ``type`` values in a (possibly Sequence-nested) tokenizer.json component."""
    out: set[str] = set()
    if isinstance(node, dict):
        if isinstance(node.get("type"), str):
            out.add(node["type"])
        for v in node.values():
            out |= _component_types(v)
    elif isinstance(node, list):
        for v in node:
            out |= _component_types(v)
    return out


class HFTokenizer(Tokenizer):
    """``tokenizer.json`` through HF ``tokenizers``.

    Token bytes: ByteLevel vocabularies map back through GPT-2's byte alphabet (exact); other
    vocabularies use ``<0xNN>`` byte-fallback tokens and ``▁`` -> space (Metaspace), else the
    token's UTF-8 text. Decoding is always the concatenation of token bytes (so a Metaspace
    tokenizer keeps the leading space of the first token, which is what a continuation needs).
    """

    def __init__(self, path: str | Path, eos_token_ids: list[int] | None = None,
                 bos_token_id: int | None = None, pad_token_id: int | None = None,
                 extra_specials: dict[str, int] | None = None, name_or_path: str = "") -> None:
        from tokenizers import Tokenizer as _HFTok

        self.hf = _HFTok.from_file(str(path))
        self._hf_plain = _HFTok.from_file(str(path))  # special strings encode as ordinary text
        self._hf_plain.encode_special_tokens = True
        spec = json.loads(self.hf.to_str())
        types = _component_types(spec.get("decoder")) | _component_types(spec.get("pre_tokenizer"))
        self.byte_level = "ByteLevel" in types
        metaspace = "Metaspace" in types or any(
            isinstance(d, dict) and d.get("type") == "Replace" and (d.get("pattern") or {}).get("String") == "▁"
            for d in ((spec.get("decoder") or {}).get("decoders") or []))
        byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))

        vocab = self.hf.get_vocab(with_added_tokens=True)
        added = self.hf.get_added_tokens_decoder()  # id -> AddedToken
        n = max(vocab.values(), default=-1) + 1
        id_bytes: list[bytes | None] = [None] * n
        for tok, i in vocab.items():
            if i in added:
                id_bytes[i] = added[i].content.encode("utf-8")
            elif self.byte_level and all(c in _CHAR_TO_BYTE for c in tok):
                id_bytes[i] = bytes(_CHAR_TO_BYTE[c] for c in tok)
            elif byte_fallback and (m := _BYTE_FALLBACK.fullmatch(tok)):
                id_bytes[i] = bytes([int(m.group(1), 16)])
            else:
                id_bytes[i] = (tok.replace("▁", " ") if metaspace else tok).encode("utf-8")
        specials = {t.content: i for i, t in added.items()}
        for s, i in (extra_specials or {}).items():
            specials.setdefault(s, i)
        skip = [i for i, t in added.items() if t.special]
        hf, plain = self.hf, self._hf_plain

        def encode_fn(text: str, allow_special: bool) -> list[int]:
            return (hf if allow_special else plain).encode(text, add_special_tokens=False).ids

        super().__init__(id_bytes, specials, skip, encode_fn, eos_token_ids or [], bos_token_id,
                         pad_token_id, name_or_path)

    def _regular_token_to_id(self, token: str) -> int | None:
        if self.byte_level:
            i = self.hf.token_to_id("".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8")))
            if i is not None:
                return i
        return self.hf.token_to_id(token)


# ---- loading ------------------------------------------------------------------------------------

def _model_config_ids(model_dir: Path) -> tuple[dict, dict]:
    """(generation_config.json, merged config.json view with text_config fallbacks)."""
    gen = _read_json(model_dir / "generation_config.json")
    cfg = _read_json(model_dir / "config.json")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    merged = {**text, **{k: v for k, v in cfg.items() if v is not None}}
    return gen, merged


def _resolve_ids(key: str, gen: dict, cfg: dict, tok_cfg: dict,
                 lookup: Callable[[str], int | None]) -> list[int] | None:
    for src in (gen, cfg):
        ids = _id_list(src.get(f"{key}_token_id"))
        if ids is not None:
            return ids
    content = _token_content(tok_cfg.get(f"{key}_token"))
    if content is not None:
        i = lookup(content)
        if i is not None:
            return [i]
    return None


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load the tokenizer shipped in ``model_dir``: ``tokenizer.json`` if present, else the Kimi
    ``tiktoken.model`` + ``tokenizer_config.json`` layout."""
    d = Path(model_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"tokenizer directory {str(d)!r} does not exist")
    tok_cfg = _read_json(d / "tokenizer_config.json")
    gen, cfg = _model_config_ids(d)
    added_cfg = tok_cfg.get("added_tokens_decoder") or {}
    added: dict[int, tuple[str, bool]] = {}
    for k, v in added_cfg.items():
        content = _token_content(v)
        if content is None:
            raise ValueError(f"{d / 'tokenizer_config.json'}: added_tokens_decoder[{k!r}] has no content")
        added[int(k)] = (content, bool(v.get("special", True)) if isinstance(v, dict) else True)

    if (d / "tokenizer.json").is_file():
        tok: Tokenizer = HFTokenizer(d / "tokenizer.json", name_or_path=str(d),
                                     extra_specials={c: i for i, (c, _) in added.items()})
    elif (d / "tiktoken.model").is_file():
        ranks = read_tiktoken_ranks(d / "tiktoken.model")
        vocab = cfg.get("vocab_size")
        n_ranks = max(ranks.values()) + 1
        above = [i for i in added if i >= n_ranks]
        if isinstance(vocab, int):
            base = vocab - NUM_RESERVED_SPECIAL_TOKENS
        else:  # no config.json: the block starts at the lowest named id above the ranks
            base = min(above) if above else n_ranks
        specials = dict(added)
        if base >= n_ranks:  # fill the unnamed reserved ids (never over a BPE rank)
            names = {c for c, _ in added.values()}
            for i in range(base, base + NUM_RESERVED_SPECIAL_TOKENS):
                if i not in specials and f"<|reserved_token_{i}|>" not in names:
                    specials[i] = (f"<|reserved_token_{i}|>", True)
        tok = TiktokenTokenizer(ranks, specials, [], None, name_or_path=str(d))
    else:
        raise FileNotFoundError(
            f"no tokenizer in {str(d)!r}: expected tokenizer.json or tiktoken.model "
            "(+ tokenizer_config.json)")

    eos = _resolve_ids("eos", gen, cfg, tok_cfg, tok.token_to_id)
    bos = _resolve_ids("bos", gen, cfg, tok_cfg, tok.token_to_id)
    pad = _resolve_ids("pad", gen, cfg, tok_cfg, tok.token_to_id)
    tok.eos_token_ids = eos or []
    tok.bos_token_id = bos[0] if bos else None
    tok.pad_token_id = pad[0] if pad else None
    return tok
