"""Structured output (k3serve.serve.grammar) on the real tiny model and its byte-level tokenizer."""

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from k3serve.make_model import make_model
from k3serve.model.batch import CacheHandles, ForwardBatch, SeqChunk
from k3serve.model.loader import load_model
from k3serve.serve.grammar import (GrammarBackend, GrammarError, GrammarSpec, allocate_bitmask,
                                   apply_bitmask, apply_masks)
from k3serve.tokenizer import load_tokenizer

PAGE, PAGES = 64, 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_model("tiny", d, seed=0, progress=False)
    return d


@pytest.fixture(scope="module")
def tok(ckpt):
    return load_tokenizer(ckpt)


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, dtype="float32", device="cpu", progress=False)


@pytest.fixture(scope="module")
def backend(tok, model):
    be = GrammarBackend(tok, model.config.vocab_size, max_threads=2, max_whitespace=2)
    yield be
    be.shutdown()


def allowed_ids(state, vocab):
    bm = allocate_bitmask(1, vocab)
    state.fill_mask(bm, 0)
    bits = (bm[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.flatten()[:vocab]).flatten().tolist())


def generate(model, tok, compiled, prompt="Answer: ", max_new=80, nudge_after=40):
    """Greedy decode with the grammar mask before argmax, stopping at EOS.

    A random model may wander forever inside an unbounded string or array; after ``nudge_after``
    tokens the driver adds a bonus to EOS and closing characters. It only re-ranks tokens the
    grammar already allows, so the output is as grammar-checked as without it.
    """
    state = compiled.new_state()
    eos = tok.eos_token_ids[0]
    bonus = torch.zeros(model.config.vocab_size)
    bonus[[eos, ord('"'), ord("}"), ord("]")]] = 1e4
    caches = CacheHandles.allocate(model.config, 1, PAGES, PAGE, dtype=torch.float32)
    new, ctx, out = tok.encode(prompt), 0, []
    for step in range(max_new):
        batch = ForwardBatch.build([SeqChunk(new, ctx, 0, list(range(PAGES)))], PAGE)
        logits = model.compute_logits(model(batch, caches)[batch.logits_indices])
        ctx += len(new)
        if step >= nudge_after:
            logits = logits + bonus
        t = int(apply_masks(logits, [state]).argmax(-1))
        assert state.accept(t), f"grammar rejected its own masked choice {t}"
        if state.is_terminated():
            assert t == eos
            return tok.decode_bytes(out).decode("utf-8")  # strict: grammars emit valid UTF-8
        out.append(t)
        new = [t]
    raise AssertionError(f"no EOS within {max_new} tokens: {tok.decode(out)!r}")


# ---- generation under each kind of constraint --------------------------------------------------

def test_json_object(model, tok, backend):
    text = generate(model, tok, backend.compile(GrammarSpec.from_openai({"type": "json_object"})))
    assert isinstance(json.loads(text), dict)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}


def test_json_schema(model, tok, backend):
    spec = GrammarSpec.from_openai({"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    obj = json.loads(generate(model, tok, backend.compile(spec)))
    jsonschema.validate(obj, SCHEMA)
    assert list(obj) == ["name", "age", "color", "tags"]  # schema order


def test_bounded_string_rejects_control_chars(backend):
    """xgrammar#800 workaround: a maxLength string must not admit raw U+0000-U+001F."""
    g = backend.compile(GrammarSpec.json_schema({"type": "string", "maxLength": 3}))
    st = g.new_state()
    assert st.accept(ord('"'))
    allowed = allowed_ids(st, g.vocab_size)
    assert not allowed & set(range(0x20)) and {ord("a"), ord('"')} <= allowed
    assert all(st.accept(b) for b in b'abc"') and st.is_completed()


def test_regex(model, tok, backend):
    text = generate(model, tok, backend.compile(GrammarSpec.from_openai(guided_regex=r"\d{3}-[a-z]{2}")))
    assert re.fullmatch(r"\d{3}-[a-z]{2}", text), text


def test_choice(model, tok, backend):
    choices = ["yes", "no", "maybe"]
    for prompt in ("Answer: ", "Is it? ", "x"):
        text = generate(model, tok, backend.compile(GrammarSpec.from_openai(guided_choice=choices)), prompt)
        assert text in choices


def test_choice_escapes(tok, backend):
    """Choices are literal text, quotes / backslashes / newlines / non-ASCII included."""
    choices = ['a"b', "c\\d", "e\nf", "日本", "(x|y)*"]
    g = backend.compile(GrammarSpec.choice(choices))
    for c in choices:
        st = g.new_state()
        assert all(st.accept(b) for b in c.encode())
        assert allowed_ids(st, g.vocab_size) == set(tok.eos_token_ids)
    st = g.new_state()
    assert st.accept(ord("x")) is False  # "x" alone is no prefix of any choice


# ---- state semantics ----------------------------------------------------------------------------

def test_terminated_grammar_allows_only_eos(tok, backend):
    eos = tok.eos_token_ids[0]
    st = backend.compile(GrammarSpec.choice(["yes", "no"])).new_state()
    assert eos not in allowed_ids(st, backend.vocab_size)  # cannot end before a full choice
    for b in b"yes":
        assert st.accept(b)
    assert st.is_completed() and not st.is_terminated()
    assert allowed_ids(st, backend.vocab_size) == {eos}
    assert not st.accept(ord("!"))
    assert st.accept(eos) and st.is_terminated()
    assert allowed_ids(st, backend.vocab_size) == {eos}  # still only EOS after termination
    assert st.accept(eos) and not st.accept(ord("a"))


def test_rollback(backend):
    st = backend.compile(GrammarSpec("regex", r"ab|ac")).new_state()
    before = allowed_ids(st, backend.vocab_size)
    assert st.accept(ord("a"))
    mid = allowed_ids(st, backend.vocab_size)
    assert mid == {ord("b"), ord("c")}
    assert st.accept(ord("b"))
    st.rollback(1)
    assert allowed_ids(st, backend.vocab_size) == mid
    st.rollback(1)
    assert allowed_ids(st, backend.vocab_size) == before == {ord("a")}


def test_unused_and_special_ids_never_allowed(tok, backend):
    """Holes (256..1791) and all specials but EOS are masked, even inside a JSON string where
    almost every byte is legal; so are ids past the tokenizer's vocab when the model is wider."""
    eos = tok.eos_token_ids[0]
    holes = {i for i in range(tok.vocab_size) if not tok.token_bytes(i)}
    specials = set(tok.special_tokens.values())
    assert set(range(256, 1792)) <= holes and len(specials) == 256
    st = backend.compile(GrammarSpec("json_object")).new_state()
    for b in b'{"k": "':
        assert st.accept(b)
    allowed = allowed_ids(st, backend.vocab_size)
    assert ord("a") in allowed and 0xE6 in allowed  # ASCII and a UTF-8 lead byte
    assert not allowed & (holes | specials)

    wide = GrammarBackend(tok, tok.vocab_size + 100)
    st = wide.compile(GrammarSpec.choice(["ok"])).new_state()
    for b in b"ok":
        st.accept(b)
    assert allowed_ids(st, wide.vocab_size) == {eos}
    assert allowed_ids(wide.compile(GrammarSpec("json_object")).new_state(), wide.vocab_size) <= set(range(256))
    wide.shutdown()


# ---- errors -------------------------------------------------------------------------------------

def test_invalid_schema_raises(backend):
    with pytest.raises(GrammarError, match="nonsense"):
        backend.compile(GrammarSpec.json_schema({"type": "nonsense"}))
    with pytest.raises(GrammarError):
        backend.compile(GrammarSpec("json_schema", "not json"))


def test_invalid_regex_raises(backend):
    for bad in ("(ab", "[a-", "a{3,1}"):
        with pytest.raises(GrammarError) as e:
            backend.compile(GrammarSpec("regex", bad))
        assert ".cc:" not in str(e.value)  # xgrammar's source location is stripped


def test_from_openai():
    f = GrammarSpec.from_openai
    assert f() is None and f({"type": "text"}) is None
    assert f({"type": "json_object"}) == GrammarSpec("json_object")
    a = f({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": ["a"]}}})
    b = f(guided_json='{"type": "object",  "required": ["a"]}')  # same schema, other spacing
    assert a == b and a.kind == "json_schema" and json.loads(a.value)["required"] == ["a"]
    assert a != f(guided_json={"required": ["a"], "type": "object"})  # key order is meaningful
    assert f({"type": "json_schema", "json_schema": {"name": "x"}}) == GrammarSpec("json_object")
    assert f(guided_regex="a+") == GrammarSpec("regex", "a+")
    assert json.loads(f(guided_choice=["a", "b"]).value) == ["a", "b"]
    assert f(guided_grammar='root ::= "a"') == GrammarSpec("ebnf", 'root ::= "a"')
    so = lambda **kw: f(structured_outputs=kw)  # noqa: E731  (vLLM's newer field)
    assert so(regex="a+") == f(guided_regex="a+") and so(json={"type": "object"}) == f(guided_json={"type": "object"})
    assert so(choice=["a"]) == f(guided_choice=["a"]) and so(grammar='root ::= "a"') == f(guided_grammar='root ::= "a"')
    assert so(json_object=True) == GrammarSpec("json_object")
    for bad in (dict(response_format={"type": "xml"}), dict(response_format="json"),
                dict(response_format={"type": "json_schema"}), dict(guided_choice=[]),
                dict(guided_choice="ab"), dict(guided_json="{bad"), dict(guided_regex=1),
                dict(guided_regex="a", guided_choice=["a"]), dict(guided_grammar=""),
                dict(guided_regex="a", guided_grammar='root ::= "a"'), dict(structured_outputs="x"),
                dict(structured_outputs={"regex": "a", "choice": ["a"]}), dict(structured_outputs={"xml": "a"}),
                dict(structured_outputs={"regex": "a"}, guided_regex="b"), dict(structured_outputs={}),
                dict(structured_outputs={"json_object": False}),
                dict(structured_outputs={"json": {}, "disable_any_whitespace": True})):
        with pytest.raises(ValueError):
            f(**bad)
    with pytest.raises(ValueError):
        GrammarSpec("xml", "x")
    with pytest.raises(ValueError):
        GrammarSpec("ebnf")  # server-built grammars (tool calls) carry their EBNF text


# ---- compilation cache / async -----------------------------------------------------------------

def test_compile_cache(backend):
    spec = GrammarSpec.json_schema(SCHEMA)
    assert backend.compile(spec) is backend.compile(GrammarSpec.json_schema(json.dumps(SCHEMA)))
    assert backend.compile(GrammarSpec("regex", "a")) is not backend.compile(GrammarSpec("regex", "b"))


def test_compile_async(model, tok, backend):
    spec = GrammarSpec.choice(["alpha", "beta"])
    futs = [backend.compile_async(spec) for _ in range(4)]
    g = futs[0].result(timeout=60)
    assert all(f.result(timeout=60) is g for f in futs)
    assert backend.compile_async(spec).result() is g  # now a cache hit
    assert generate(model, tok, g) in ("alpha", "beta")
    with pytest.raises(GrammarError):
        backend.compile_async(GrammarSpec("regex", "(")).result(timeout=60)


# ---- batch masking ------------------------------------------------------------------------------

def test_apply_masks(backend):
    V = backend.vocab_size
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    s1 = backend.compile(GrammarSpec("regex", r"\d{3}-[a-z]{2}")).new_state()
    s3 = backend.compile(GrammarSpec("json_object")).new_state()
    out = apply_masks(logits, [None, s1, None, s3])
    assert out is not logits and torch.equal(logits, logits.clone())  # input untouched
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])  # bit-identical
    for row, state in ((1, s1), (3, s3)):
        allowed = torch.zeros(V, dtype=torch.bool)
        allowed[list(allowed_ids(state, V))] = True
        assert torch.equal(out[row][allowed], logits[row][allowed])
        assert torch.isneginf(out[row][~allowed]).all()
    assert allowed_ids(s1, V) == set(range(ord("0"), ord("9") + 1))

    # Matches xgrammar's own CPU kernel on the full batch bitmask.
    bm = allocate_bitmask(4, V)
    s1.fill_mask(bm, 1)
    s3.fill_mask(bm, 3)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bm, vocab_size=V)
    assert torch.equal(apply_bitmask(logits, bm), ref) and torch.equal(out, ref)

    assert apply_masks(logits, [None] * 4) is logits
    # The top-bit word (ids 32k+31) survives the signed int32 round trip.
    top = backend.compile(GrammarSpec("regex", "\x1f")).new_state()  # byte 31 = bit 31 of word 0
    assert allowed_ids(top, V) == {31}
    assert torch.isfinite(apply_masks(logits[:1], [top])[0]).nonzero().flatten().tolist() == [31]
