"""Tokenizer loading (tiktoken Kimi layout, tokenizer.json), incremental detokenization, stop strings."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3serve.config import ModelConfig
from k3serve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher, apply_stop_strings
from k3serve.make_model import write_tokenizer
from k3serve.presets import preset_config
from k3serve.tokenizer import KIMI_PAT_STR, TiktokenTokenizer, load_tokenizer

SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog. It's 2025.",
    "你好，世界！这是一个测试。中文分词",
    "emoji 😀🎉👩‍👩‍👧 and flags 🇯🇵 — done",
    "mixed: café naïve Ünïcödé 日本語のテキスト 한국어 Привет\n\n\ttabs  and   spaces ",
    "",
]

PARAGRAPH = (
    "The Kimi models use a byte-level BPE tokenizer. The tokenizer splits text with a regular "
    "expression and then merges bytes. The merges are learned from text, and the most frequent "
    "pairs are merged first. 中文文本也会被分词，中文字符通常是三个字节。 Emoji like 😀 are four bytes. "
) * 4


# ---- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_cfg() -> ModelConfig:
    return ModelConfig.from_dict(preset_config("tiny"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tiny_cfg) -> Path:
    d = tmp_path_factory.mktemp("tiny_tok")
    write_tokenizer(tiny_cfg, d)
    return d


@pytest.fixture(scope="module")
def tiny_tok(tiny_dir):
    return load_tokenizer(tiny_dir)


def _train_bytelevel_bpe(vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([PARAGRAPH], trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def merged_dir(tmp_path_factory) -> Path:
    """A Kimi-layout dir whose tiktoken.model has real merges (from a trained byte-level BPE)."""
    from k3serve.tokenizer import _CHAR_TO_BYTE

    hf = _train_bytelevel_bpe()
    vocab = hf.get_vocab()
    # HF assigns ids in merge order after the 256-char alphabet, so the id is a valid merge rank
    ranks = {bytes(_CHAR_TO_BYTE[c] for c in tok): i for tok, i in vocab.items()}
    assert len(ranks) == len(vocab) and len(ranks) > 256
    d = tmp_path_factory.mktemp("merged_tok")
    lines = [f"{base64.b64encode(b).decode()} {r}" for b, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = max(ranks.values()) + 1
    specials = {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|im_end|>", n + 3: "<|im_user|>"}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "[BOS]", "eos_token": {"content": "<|im_end|>"},
        "added_tokens_decoder": {str(i): {"content": s, "special": True} for i, s in specials.items()},
    }))
    return d


@pytest.fixture(scope="module")
def merged_tok(merged_dir):
    return load_tokenizer(merged_dir)


# ---- tiktoken layout from make_model -------------------------------------------------------------

def test_make_model_layout_roundtrip(tiny_tok, tiny_cfg):
    tok = tiny_tok
    assert isinstance(tok, TiktokenTokenizer)
    assert tok.vocab_size == tiny_cfg.vocab_size
    for text in SAMPLES:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode_bytes(ids) == text.encode("utf-8")
        # byte-level vocabulary without merges: one token per byte
        assert len(ids) == len(text.encode("utf-8"))
        assert all(0 <= i < 256 for i in ids)


def test_make_model_specials(tiny_tok, tiny_cfg, tiny_dir):
    tok = tiny_tok
    V = tiny_cfg.vocab_size
    open_id = V - 256 + 3
    assert tok.special_tokens["<|open|>"] == open_id
    assert tok.token_to_id("<|open|>") == open_id
    assert len(tok.special_tokens) == 256
    assert set(tok.special_tokens.values()) == set(range(V - 256, V))
    named = json.loads((tiny_dir / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    for i, v in named.items():
        assert tok.special_tokens[v["content"]] == int(i)

    plain = tok.encode("<|open|>")
    assert plain == list(b"<|open|>") and len(plain) > 1
    assert tok.encode("<|open|>", allow_special=True) == [open_id]
    mixed = tok.encode("a<|open|>b<|sep|>", allow_special=True)
    assert mixed == [ord("a"), open_id, ord("b"), V - 256 + 5]
    # no spaces between specials; skip_special_tokens drops them
    ids = tok.encode("<|open|>message<|sep|><|close|><|sep|>", allow_special=True)
    assert tok.decode(ids) == "<|open|>message<|sep|><|close|><|sep|>"
    assert tok.decode(ids, skip_special_tokens=True) == "message"
    assert tok.decode_bytes([open_id]) == b"<|open|>"
    # eos / bos from tokenizer_config.json only (no config.json here)
    assert tok.eos_token_ids == tiny_cfg.eos_token_ids == [V - 256 + 2]
    assert tok.bos_token_id == V - 256
    # ids in the hole between the byte ranks and the specials decode to nothing
    assert tok.decode([ord("x"), 300, ord("y")]) == "xy"
    assert tok.id_to_token(300) is None and tok.id_to_token(ord("x")) == "x"
    assert tok.token_to_id("x") == ord("x") and tok.token_to_id("not a token") is None


def test_eos_from_generation_config(tmp_path, tiny_cfg):
    write_tokenizer(tiny_cfg, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(preset_config("tiny")))
    assert load_tokenizer(tmp_path).eos_token_ids == tiny_cfg.eos_token_ids
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9], "bos_token_id": 1}))
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_ids == [7, 9] and tok.bos_token_id == 1


def test_reserved_names_filled(tmp_path):
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    (tmp_path / "tiktoken.model").write_text("\n".join(lines))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "[EOS]", "added_tokens_decoder": {"256": {"content": "[BOS]", "special": True},
                                                        "257": {"content": "[EOS]", "special": True}}}))
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == 512
    assert tok.special_tokens["<|reserved_token_300|>"] == 300
    assert tok.encode("<|reserved_token_300|>", allow_special=True) == [300]
    assert tok.eos_token_ids == [257] and tok.bos_token_id is None


def test_missing_tokenizer_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope")


# ---- tiktoken with real merges ------------------------------------------------------------------

def test_tiktoken_real_merges(merged_dir):
    tok = load_tokenizer(merged_dir)
    assert isinstance(tok, TiktokenTokenizer)
    for text in SAMPLES + [PARAGRAPH, "The tokenizer merges 中文 bytes"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    text = "The tokenizer merges the most frequent pairs. 中文字符"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode("utf-8")) // 2
    # words seen in training are single tokens (a 9-byte Han word included) and agree with the
    # HF BPE the ranks came from
    hf = _train_bytelevel_bpe()
    for word in ["中文字", "中文", " tokenizer", " merges", "The"]:
        ids = tok.encode(word)
        assert len(ids) == 1 and tok.decode_bytes(ids) == word.encode()
        assert ids == hf.encode(word).ids
        assert tok.token_to_id(word) == ids[0]
    assert tok.special_tokens["<|im_end|>"] == tok.eos_token_ids[0]
    assert tok.encode("x<|im_end|>", allow_special=True)[-1] == tok.eos_token_ids[0]
    assert tok.bos_token_id == tok.special_tokens["[BOS]"]


def test_tiktoken_hand_written_merges(tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    for m in [b"\xe4\xb8", b"\xe4\xb8\xad", b"th", b"the", b" the", b"\xf0\x9f", b"\xf0\x9f\x98", b"\xf0\x9f\x98\x80"]:
        ranks[m] = len(ranks)
    (tmp_path / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(b).decode()} {r}\n" for b, r in ranks.items()))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("中") == [ranks["中".encode()]]
    assert tok.encode("😀") == [ranks["😀".encode()]]
    assert tok.encode("in the") == [ord("i"), ord("n"), ranks[b" the"]]
    assert tok.decode(tok.encode("中中 the 😀😁")) == "中中 the 😀😁"
    # no tokenizer_config.json: as tokenization_kimi.py, 256 reserved ids follow the ranks
    assert tok.special_tokens == {f"<|reserved_token_{i}|>": i for i in range(264, 520)}
    assert tok.vocab_size == 520 and tok.eos_token_ids == [] and tok.bos_token_id is None


def test_pretokenizer_pattern_matches_regex_module():
    """tiktoken must split exactly like the spec's regex under V1 semantics (&& intersections)."""
    import tiktoken

    regex = pytest.importorskip("regex")
    pat = regex.compile(KIMI_PAT_STR, regex.V1)
    texts = ["À中", "ÀÉ中文ab", "a中b中C中DE中", "x\u0301中\u0301abc", "I'LL DON'T we'Re",
             "1234567 中1 ab1", "  \r\n\t x", "$$$中..\n\n", *SAMPLES[:4]]
    for text in texts:
        pieces = pat.findall(text)
        # give every prefix of every expected piece a rank: each piece then merges to one token
        ranks = {bytes([b]): b for b in range(256)}
        for p in pieces:
            b = p.encode()
            for k in range(2, len(b) + 1):
                ranks.setdefault(b[:k], len(ranks))
        enc = tiktoken.Encoding("t", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})
        got = [enc.decode_single_token_bytes(t).decode() for t in enc.encode_ordinary(text)]
        assert got == pieces, text


def test_long_run_split_matches_reference():
    from k3serve.tokenizer import _split_long_runs

    def ref(s, limit):  # tokenization_kimi._split_whitespaces_or_nonwhitespaces
        cur_len, cur_space, start = 0, (s[0].isspace() if s else False), 0
        for i in range(len(s)):
            now = s[i].isspace()
            if cur_space ^ now:
                cur_len, cur_space = 1, now
            else:
                cur_len += 1
                if cur_len > limit:
                    yield s[start:i]
                    start, cur_len = i, 1
        yield s[start:]

    rng = random.Random(0)
    for _ in range(300):
        s = "".join(rng.choice("ab \n\u3000中") * rng.randint(1, 12) for _ in range(rng.randint(0, 12)))
        for limit in (1, 3, 7):
            assert _split_long_runs(s, limit) == list(ref(s, limit)), (s, limit)


def test_long_input(tiny_tok):
    text = "x" * 60_000 + " " * 30_000 + "中" * 10
    ids = tiny_tok.encode(text)
    assert tiny_tok.decode(ids) == text


# ---- tokenizer.json path ------------------------------------------------------------------------

def test_tokenizer_json(tmp_path):
    from tokenizers import AddedToken

    hf = _train_bytelevel_bpe()
    hf.add_special_tokens([AddedToken("<|im_end|>", special=True), AddedToken("<|im_user|>", special=True)])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    # tiktoken.model next to it is ignored: tokenizer.json wins
    (tmp_path / "tiktoken.model").write_text("garbage\n")
    tok = load_tokenizer(tmp_path)
    for text in SAMPLES + [PARAGRAPH]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode_bytes(ids) == text.encode()
    assert len(tok.encode("The tokenizer merges")) < len("The tokenizer merges")
    end = tok.special_tokens["<|im_end|>"]
    assert tok.eos_token_ids == [end] and tok.bos_token_id is None
    assert tok.encode("hi<|im_end|>", allow_special=True)[-1] == end
    plain = tok.encode("hi<|im_end|>")
    assert end not in plain and tok.decode(plain) == "hi<|im_end|>"
    ids = tok.encode("<|im_user|><|im_end|>", allow_special=True)
    assert tok.decode(ids) == "<|im_user|><|im_end|>"
    assert tok.decode(tok.encode("a<|im_end|>b", allow_special=True), skip_special_tokens=True) == "ab"
    assert tok.token_to_id(" the") == hf.token_to_id("Ġthe")
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True)


# ---- incremental detokenization -----------------------------------------------------------------

def _stream(tok, ids, skip=False):
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    parts = [det.push(i) for i in ids]
    return parts, det.flush()


def test_detok_emits_when_char_completes(tiny_tok):
    ids = list("a中😀".encode())  # byte-level: 1 + 3 + 4 tokens
    parts, tail = _stream(tiny_tok, ids)
    assert parts == ["a", "", "", "中", "", "", "", "😀"] and tail == ""


def test_detok_specials(tiny_tok):
    V = tiny_tok.vocab_size
    ids = [V - 256 + 3] + list("héllo".encode()) + [V - 256 + 5, V - 256 + 3]
    parts, tail = _stream(tiny_tok, ids)
    assert "".join(parts) + tail == "<|open|>héllo<|sep|><|open|>"
    parts, tail = _stream(tiny_tok, ids, skip=True)
    assert "".join(parts) + tail == "héllo"


def test_detok_incomplete_tail_flushed(tiny_tok):
    ids = list("ab".encode()) + list("中".encode())[:2]
    parts, tail = _stream(tiny_tok, ids)
    assert "".join(parts) == "ab" and tail == "\ufffd"
    assert "".join(parts) + tail == tiny_tok.decode(ids)


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=0, max_size=40), st.integers(0, 2**32 - 1))
def test_detok_random_valid_streams(merged_tok, text, seed):
    """Valid UTF-8 split across byte tokens and merged tokens: incremental == full, no U+FFFD."""
    tok = merged_tok
    rng = random.Random(seed)
    V = tok.vocab_size
    ids = tok.encode(text)
    # sprinkle specials at character boundaries (a token may end inside a character)
    def at_boundary(k):
        try:
            tok.decode_bytes(ids[:k]).decode()
            return True
        except UnicodeDecodeError:
            return False

    boundaries = [k for k in range(len(ids) + 1) if at_boundary(k)]
    for k in sorted(rng.choices(boundaries, k=rng.randint(0, 3)), reverse=True):
        ids.insert(k, rng.choice(list(tok.special_tokens.values())))
    # also a raw byte-level rendering of the same text (every multi-byte char split)
    byte_ids = [tok.encoding.encode_single_token(bytes([b])) for b in text.encode()]
    for seq in (ids, byte_ids):
        parts, tail = _stream(tok, seq)
        full = tok.decode(seq)
        assert "".join(parts) + tail == full
        assert "\ufffd" not in "".join(parts) and tail == ""
        # each emitted piece is the decode of a byte prefix: emitted as soon as complete
        acc = b""
        out = ""
        for i, p in zip(seq, parts):
            acc += tok.decode_bytes([i])
            out += p
            valid = acc
            while valid:
                try:
                    valid.decode()
                    break
                except UnicodeDecodeError:
                    valid = valid[:-1]
            assert out == valid.decode()
    assert V > 256


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2047), max_size=60))
def test_detok_random_ids_match_full_decode(tiny_tok, ids):
    """Arbitrary ids (invalid UTF-8, holes, specials): incremental == one-shot decode."""
    tok = tiny_tok
    for skip in (False, True):
        parts, tail = _stream(tok, ids, skip)
        assert "".join(parts) + tail == tok.decode(ids, skip_special_tokens=skip)


# ---- stop strings -------------------------------------------------------------------------------

def _run(stops, chunks, include_stop=False):
    m = StopStringMatcher(stops, include_stop)
    out, emits = "", []
    stopped = False
    for c in chunks:
        e, stopped = m.feed(c)
        emits.append(e)
        out += e
        if stopped:
            break
    if not stopped:
        out += m.flush()
    return out, stopped, emits, m


def test_stop_exact_cut():
    out, stopped, _, m = _run(["STOP"], ["hello STOP world"])
    assert out == "hello " and stopped and m.matched == "STOP"
    out, stopped, _, _ = _run(["STOP"], ["hello STOP world"], include_stop=True)
    assert out == "hello STOP" and stopped


def test_stop_spanning_three_pushes():
    m = StopStringMatcher(["</end>"], include_stop=False)
    assert m.feed("abc</") == ("abc", False)
    assert m.feed("en") == ("", False)
    assert m.feed("d>tail") == ("", True)
    assert m.feed("more") == ("", True) and m.flush() == ""
    m = StopStringMatcher(["</end>"], include_stop=True)
    emitted = [m.feed(c)[0] for c in ["abc</", "en", "d>tail"]]
    assert "".join(emitted) == "abc</end>" and m.stopped


def test_stop_near_miss_held_then_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("go ST") == ("go ", False)
    assert m.held == "ST"
    assert m.feed("O") == ("", False)
    assert m.feed("P!")[1] is True  # completes
    m = StopStringMatcher(["STOP"])
    assert m.feed("go ST") == ("go ", False)
    assert m.feed("OX") == ("STOX", False)  # near miss released as soon as it cannot match
    assert m.feed("STO") == ("", False)
    assert m.flush() == "STO"  # end of stream releases the held prefix
    assert not m.stopped


def test_stop_earliest_wins():
    # both complete in one chunk: the one completing first wins
    out, _, _, m = _run(["world", "lo w"], ["hello world"])
    assert out == "hel" and m.matched == "lo w"
    # a longer stop that started earlier but has not completed does not delay a completed one
    for chunks in (["xabcdef"], list("xabcdef"), ["xab", "cdef"]):
        out, stopped, _, m = _run(["abcde", "bc"], chunks)
        assert (out, stopped, m.matched) == ("xa", True, "bc")
    # same end: the longer (earlier-starting) one
    out, _, _, m = _run(["cd", "abcd"], ["xxabcdyy"])
    assert out == "xx" and m.matched == "abcd"
    # overlapping stop prefixes: "aab" inside "aaab"
    out, _, _, _ = _run(["aab"], ["a", "a", "a", "b", "c"])
    assert out == "a"


def test_nothing_after_stop():
    m = StopStringMatcher(["\n\n"], include_stop=True)
    seen = ""
    for c in ["line1\n", "\nline2", "line3", "\n\n"]:
        e, _ = m.feed(c)
        seen += e
    seen += m.flush()
    assert seen == "line1\n\n"


def test_no_stops_and_empty_stops():
    m = StopStringMatcher(["", ""])
    assert m.feed("abc") == ("abc", False) and m.flush() == ""


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="abc\n", max_size=30),
       st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3),
       st.booleans(), st.randoms(use_true_random=False))
def test_stop_streaming_equals_reference(text, stops, include_stop, rnd):
    cuts = sorted(rnd.sample(range(len(text) + 1), k=min(len(text) + 1, rnd.randint(0, 8))))
    bounds = [0, *cuts, len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    expected, matched = apply_stop_strings(text, stops, include_stop)
    m = StopStringMatcher(stops, include_stop)
    out = ""
    for c in chunks:
        e, stopped = m.feed(c)
        out += e
        # never emit anything beyond the final answer
        assert expected.startswith(out)
        # never emit text that could still begin a stop string: every suffix of what was seen
        # that is a proper prefix of a stop lies inside the held-back text
        if not stopped:
            seen = out + m.held
            for s in stops:
                for k in range(1, len(s)):
                    if seen.endswith(s[:k]):
                        assert k <= len(m.held)
        else:
            assert m.feed("more") == ("", True)
    out += m.flush()
    assert out == expected
    assert m.matched == matched and m.stopped == (matched is not None)
