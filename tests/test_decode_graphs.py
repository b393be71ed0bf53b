"""Shape-static decode steps (engine/decode_graphs.py): the padded bucket step computes what the
eager step computes, padding rows write only the pool's scratch units, and an engine running its
decode through them generates the same tokens. On CPU the static step runs eagerly; on CUDA the
same step is captured (checked on the device by bench/gpu_check_graphs.py)."""

import random

import pytest
import torch

from k3serve.cache.pool import UnifiedPool
from k3serve.engine.decode_graphs import DecodeGraphs, bucket_sizes, capture_blockers
from k3serve.engine.engine import EngineConfig, LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.batch import ForwardBatch, SeqChunk
from k3serve.model.loader import load_model

PAGE = 8


@pytest.fixture(scope="module")
def model():
    return load_model(preset="tiny", dtype="float32", device="cpu", seed=3)


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(5) == [1, 2, 4, 5]
    assert bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert "not a CUDA device" in capture_blockers(torch.device("cpu"))[0]


def test_scratch_units_lie_outside_every_allocatable_unit(model):
    pool = UnifiedPool(model.config, 1 << 20, torch.float32, "cpu", PAGE)
    lay = pool.layout
    scratch_slot = (pool.scratch_slot * lay.slot_bytes, (pool.scratch_slot + 1) * lay.slot_bytes)
    scratch_page = (pool._page_offset(pool.scratch_page), pool._page_offset(pool.scratch_page) + lay.page_bytes)
    assert scratch_page[0] >= pool.total_bytes and scratch_slot[0] >= scratch_page[1]
    assert pool.buffer.numel() >= scratch_slot[1]
    for h in pool.handles.kda:  # the views reach the scratch slot
        h.recurrent[pool.scratch_slot].fill_(1.0)
    for h in pool.handles.mla:
        h.latent[pool.scratch_page].fill_(1.0)
    assert not pool.buffer[: pool.total_bytes].any()  # ... and nothing below total_bytes


def _prefill(model, pool, lens, rng):
    """Allocate and prefill sequences of the given lengths; returns their (slot, pages, tokens)."""
    seqs = []
    for n in lens:
        slot = pool.alloc_slot()
        pages = [pool.alloc_page() for _ in range(-(-(n + 4) // PAGE))]
        toks = [rng.randrange(1500) for _ in range(n)]
        with torch.inference_mode():
            model(ForwardBatch.build([SeqChunk(toks, 0, slot, pages)], PAGE), pool.handles)
        seqs.append((slot, pages, toks))
    return seqs


@pytest.mark.parametrize("n_decode", [1, 3, 5])
def test_padded_static_step_equals_eager_and_touches_only_scratch(model, n_decode):
    rng = random.Random(n_decode)
    pool = UnifiedPool(model.config, 4 << 20, torch.float32, "cpu", PAGE)
    seqs = _prefill(model, pool, [rng.randrange(3, 20) for _ in range(n_decode + 1)], rng)  # last: bystander
    chunks = [SeqChunk([rng.randrange(1500)], len(t), s, p) for s, p, t in seqs[:n_decode]]
    twin = UnifiedPool(model.config, 4 << 20, torch.float32, "cpu", PAGE)
    twin.buffer.copy_(pool.buffer)
    twin.num_slots, twin.num_pages = pool.num_slots, pool.num_pages
    with torch.inference_mode():
        eager = model.compute_logits(model(ForwardBatch.build(chunks, PAGE), twin.handles))
    graphs = DecodeGraphs(model, pool, max_batch=8, max_pages=6, capture=False)
    assert graphs.fits(chunks)
    static = graphs.run(chunks)
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    live = pool.buffer[: pool.total_bytes].view(torch.float32)
    torch.testing.assert_close(live, twin.buffer[: pool.total_bytes].view(torch.float32), rtol=1e-5, atol=1e-5)
    slot, pages, _ = seqs[-1]  # the bystander's state is bit-identical
    assert torch.equal(pool.slot_bytes_of(slot), twin.slot_bytes_of(slot))
    for p in pages:
        assert torch.equal(pool.page_bytes_of(p), twin.page_bytes_of(p))


def _twin(model, pool, nbytes):
    twin = UnifiedPool(model.config, nbytes, torch.float32, "cpu", PAGE)
    twin.buffer.copy_(pool.buffer)
    twin.num_slots, twin.num_pages = pool.num_slots, pool.num_pages
    return twin


def test_a_wide_table_sends_only_the_steps_pages(model):
    """A table as wide as a long max_model_len makes: each step sends its rows' pages alone (the
    table is page-major, so they are one prefix of it; the device entries past them keep what they
    held), and steps of different buckets in a row, whose rows hold older layouts' entries past
    their own pages, still equal the eager step."""
    rng = random.Random(11)
    pool = UnifiedPool(model.config, 8 << 20, torch.float32, "cpu", PAGE)
    seqs = _prefill(model, pool, [rng.randrange(3, 30) for _ in range(5)], rng)
    graphs = DecodeGraphs(model, pool, max_batch=8, max_pages=512, capture=False)
    table = graphs.inputs.dev["block_table"]
    for n in (5, 1, 3, 5):
        chunks = [SeqChunk([rng.randrange(1500)], len(t), s, p) for s, p, t in seqs[:n]]
        twin = _twin(model, pool, 8 << 20)
        with torch.inference_mode():
            eager = model.compute_logits(model(ForwardBatch.build(chunks, PAGE), twin.handles))
        before = table.clone()
        torch.testing.assert_close(graphs.run(chunks), eager, rtol=1e-5, atol=1e-5)
        b = graphs.bucket_for(n)
        sent = b * max(len(c.pages) for c in chunks)
        assert sent < 8 * 6 and torch.equal(table[sent:], before[sent:])
        assert not torch.equal(table[:sent], before[:sent])
        for (_, _, t), c in zip(seqs, chunks):
            t.append(c.token_ids[0])


@pytest.mark.parametrize("pool, system", [("32MiB", 0), (1_000_000, 40)])
def test_engine_with_static_decode_generates_the_same_tokens(model, pool, system):
    """Plain batches; and a small pool (preemption by recompute) with a shared system prompt
    (prefix-cache hits restore KDA checkpoints into slots that static steps then decode)."""
    def engine(mode):
        return LLMEngine(model, None, EngineConfig(cache_memory=pool, page_size=PAGE, max_model_len=96,
                                                   max_num_batched_tokens=64, max_graph_batch=8,
                                                   prefix_block_size=16, kda_checkpoint_interval=32,
                                                   decode_graphs=mode))

    rng = random.Random(7)
    head = [rng.randrange(1500) for _ in range(system)]
    prompts = [head + [rng.randrange(1500) for _ in range(rng.randrange(2, 40))] for _ in range(11)]
    params = [SamplingParams(max_tokens=rng.randrange(4, 24), temperature=0.0, ignore_eos=True) for _ in prompts]
    outs, stats = {}, {}
    for mode in ("off", "on"):
        eng = engine(mode)
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        finals = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0].token_ids
        outs[mode] = [finals[i] for i in ids]
        stats[mode] = eng.stats()
        if mode == "on":  # 11 running > 8: larger steps fall back to eager, the rest are static
            assert eng.runner.graph_steps > 5 and eng.runner.graphs is not None
        else:
            assert eng.runner.graphs is None
    assert outs["on"] == outs["off"]
    if system:
        assert stats["on"]["preemptions"] > 0 and stats["on"]["prefix"]["hits"] > 0


def test_bad_mode_is_refused(model):
    with pytest.raises(ValueError, match="decode_graphs"):
        LLMEngine(model, None, EngineConfig(cache_memory="32MiB", decode_graphs="sometimes"))


def test_static_step_refuses_a_sequence_without_a_page_for_its_token(model):
    pool = UnifiedPool(model.config, 4 << 20, torch.float32, "cpu", PAGE)
    graphs = DecodeGraphs(model, pool, max_batch=4, max_pages=4, capture=False)
    slot, page = pool.alloc_slot(), pool.alloc_page()
    with pytest.raises(ValueError, match="needs 2 pages"):
        graphs.run([SeqChunk([7], PAGE, slot, [page])])  # token at position PAGE needs a second page


def test_static_step_refuses_page_and_slot_ids_outside_the_pool(model):
    pool = UnifiedPool(model.config, 4 << 20, torch.float32, "cpu", PAGE)
    graphs = DecodeGraphs(model, pool, max_batch=4, max_pages=4, capture=False)
    slot, page = pool.alloc_slot(), pool.alloc_page()
    with pytest.raises(ValueError, match="page id out of range"):
        graphs.run([SeqChunk([7], 3, slot, [pool.page_capacity])])
    with pytest.raises(ValueError, match="KDA slot out of range"):
        graphs.run([SeqChunk([7], 3, pool.slot_capacity, [page])])
    graphs.run([SeqChunk([7], 3, slot, [page])])  # in range: runs
