"""Shape-static prefill steps of new prompts (engine/prefill_graphs.py): the padded bucket step
computes what the eager step computes, the padding sequence writes only the pool's scratch units,
the device-built step inputs equal the host-built ones, and an engine running new prompts through
them generates the same tokens. On CPU the static step runs eagerly; on CUDA the same step is
captured (checked on the device by bench/gpu_check_graphs.py --parts prefill_graphs)."""

import random
import time

import pytest
import torch

from k3serve.cache.pool import UnifiedPool
from k3serve.engine.engine import EngineConfig, LLMEngine
from k3serve.engine.prefill_graphs import PrefillGraphs, prefill_blockers, token_buckets
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.batch import ForwardBatch, SeqChunk
from k3serve.model.loader import load_model

PAGE = 8


@pytest.fixture(scope="module")
def model():
    return load_model(preset="tiny", dtype="float32", device="cpu", seed=5)


def test_token_buckets_and_blockers():
    assert token_buckets(2048) == [128, 256, 512, 768, 1024, 1536, 2048]
    assert token_buckets(1200) == [128, 256, 512, 768, 1024, 1200]
    assert token_buckets(4096, 1024, None) == [1024, 2048, 4096]
    assert token_buckets(300) == [128, 256, 300]
    assert token_buckets(100) == [100]
    assert prefill_blockers(torch.device("cpu")) == ["not a CUDA device"]


def _twin(model, pool):
    twin = UnifiedPool(model.config, 4 << 20, torch.float32, "cpu", PAGE)
    twin.buffer.copy_(pool.buffer)
    twin.num_slots, twin.num_pages = pool.num_slots, pool.num_pages
    return twin


def _decoding(model, pool, contexts, rng):
    """Sequences prefilled to the given context lengths, as decode chunks of their next token."""
    chunks = []
    for ctx in contexts:
        slot, pages = pool.alloc_slot(), [pool.alloc_page() for _ in range(-(-(ctx + 1) // PAGE))]
        with torch.inference_mode():
            model(ForwardBatch.build([SeqChunk([rng.randrange(1500) for _ in range(ctx)], 0, slot, pages)], PAGE),
                  pool.handles)
        chunks.append(SeqChunk([rng.randrange(1500)], ctx, slot, pages))
    return chunks


@pytest.mark.parametrize("lens, contexts", [([2], []), ([13], []), ([40], []), ([3, 29], []), ([8, 8], []),
                                            ([13], [5]), ([2, 20], [9, 17, 3]), ([30], [1, 8, 16, 23])])
def test_padded_prefill_step_equals_eager_and_touches_only_scratch(model, lens, contexts):
    """New prompts, after decode rows where ``contexts`` lists them (padded to a decode bucket)."""
    rng = random.Random(sum(lens) + len(contexts))
    pool = UnifiedPool(model.config, 4 << 20, torch.float32, "cpu", PAGE)
    # a bystander with cached context first: its slot and pages must come out bit-identical
    b_slot, b_pages = pool.alloc_slot(), [pool.alloc_page() for _ in range(3)]
    with torch.inference_mode():
        model(ForwardBatch.build([SeqChunk([rng.randrange(1500) for _ in range(17)], 0, b_slot, b_pages)], PAGE),
              pool.handles)
    chunks = _decoding(model, pool, contexts, rng)
    for n in lens:  # some prompts hold a spare page past their tokens (as the engine may give them)
        pages = [pool.alloc_page() for _ in range(-(-n // PAGE) + rng.randrange(2))]
        chunks.append(SeqChunk([rng.randrange(1500) for _ in range(n)], 0, pool.alloc_slot(), pages))
    twin = _twin(model, pool)
    with torch.inference_mode():
        batch = ForwardBatch.build(chunks, PAGE)
        assert batch.num_decodes == len(contexts)
        eager = model.compute_logits(model(batch, twin.handles)[batch.logits_indices])
    graphs = PrefillGraphs(model, pool, max_tokens=64, max_seqs=2, max_decodes=4, max_pages=8, capture=False,
                           buckets=[16, 32, 64], mixed_max_tokens=64)
    assert graphs.fits(chunks)
    nd, d, b, c = graphs._split(chunks)
    assert nd == len(contexts) and d >= nd and b > sum(lens) and c == 0
    static = graphs.run(chunks)
    assert static.shape == eager.shape
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    live = slice(0, pool.total_bytes)
    torch.testing.assert_close(pool.buffer[live].view(torch.float32), twin.buffer[live].view(torch.float32),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(pool.slot_bytes_of(b_slot), twin.slot_bytes_of(b_slot))
    for p in b_pages:
        assert torch.equal(pool.page_bytes_of(p), twin.page_bytes_of(p))
    # the pages the prompts hold but did not fill are untouched too
    for c, n in zip(chunks[len(contexts):], lens):
        for p in c.pages[-(-n // PAGE):]:
            assert torch.equal(pool.page_bytes_of(p), twin.page_bytes_of(p))


@pytest.mark.parametrize("contexts", [[], [6, 11]])
def test_static_prefill_inputs_on_the_device_equal_the_host_built_ones(model, contexts):
    """What fla and the one-launch MLA prefill read in a captured step (cu_seqlens, the latent rows
    and sequence rows) equals ForwardBatch's host-built forms for the real prompts."""
    pool = UnifiedPool(model.config, 4 << 20, torch.float32, "cpu", PAGE)
    chunks = _decoding(model, pool, contexts, random.Random(2))
    lens = [5, 19]
    chunks += [SeqChunk(list(range(1, n + 1)), 0, pool.alloc_slot(), [pool.alloc_page() for _ in range(-(-n // PAGE))])
               for n in lens]
    graphs = PrefillGraphs(model, pool, max_tokens=64, max_seqs=2, max_decodes=2, max_pages=4, capture=False,
                           buckets=[32, 64])
    nd, d, b, c = graphs._split(chunks)
    assert (nd, d, b, c) == (len(contexts), len(contexts), 32, 0)
    qlens, ctx, width = graphs._fill_host(chunks, nd, d, b)
    assert width == max(len(c.pages) for c in chunks)
    graphs.inputs.upload((d + 3) * width)  # the step's pages alone (its table is page-major)
    static = graphs._static_batch(d, 2, b, c, qlens, ctx)
    host = ForwardBatch.build(chunks, PAGE)
    assert static.num_decodes == host.num_decodes == d
    cu, cu_cpu = static.prefill_cu_seqlens
    assert cu_cpu is None and cu.tolist() == [0, 5, 24, 32]
    assert torch.equal(cu[:3], host.prefill_cu_seqlens[0])
    page, offset, seqs, max_new = static.prefill_latents
    h_page, h_offset, h_seqs, h_max = host.prefill_latents
    assert torch.equal(page[:24], h_page) and torch.equal(offset[:24], h_offset)
    assert torch.equal(seqs[:2], h_seqs) and seqs[2].tolist() == [24, 24, 0, 8]
    assert max_new == 32 >= h_max
    assert (page[24:] == pool.scratch_page).all()  # the padding's latent rows: the scratch page only
    assert static.kda_slots[d + 2].item() == pool.scratch_slot
    T = d + 24
    for name in ("input_ids", "logits_indices", "kda_slots", "context_lens", "seq_lens"):
        got, want = getattr(static, name), getattr(host, name)
        assert torch.equal(got[:want.shape[0]], want), name
    assert torch.equal(static.slot_mapping[:T], host.slot_mapping)
    assert torch.equal(static.token_seq[:T], host.token_seq) and (static.token_seq[T:] == d + 2).all()


def test_fits_only_new_prompts_under_the_largest_bucket(model):
    pool = UnifiedPool(model.config, 4 << 20, torch.float32, "cpu", PAGE)
    graphs = PrefillGraphs(model, pool, max_tokens=64, max_seqs=2, max_decodes=3, max_pages=8, capture=False,
                           buckets=[16, 32, 64], mixed_max_tokens=32)
    assert graphs.decode_buckets == [0, 1, 2, 3]
    slot, pages = pool.alloc_slot(), [pool.alloc_page() for _ in range(8)]
    new = lambda n, ctx=0: SeqChunk([1] * n, ctx, slot, pages)  # noqa: E731
    dec = lambda ctx=5: SeqChunk([1], ctx, slot, pages)  # noqa: E731
    assert graphs.fits([new(15)]) and graphs.bucket_for(15) == 16 and graphs.bucket_for(16) == 32
    assert graphs.fits([new(30), new(33)])
    assert not graphs.fits([new(64)])  # the padding needs a token of its own
    assert not graphs.fits([new(5, ctx=8)])  # cached context: eager
    assert not graphs.fits([new(2)] * 3)  # more prompts than captured
    assert not graphs.fits([new(1)]) and not graphs.fits([new(1), new(9)])  # a one-token prompt: a decode row
    # decode rows first, up to the largest decode bucket, then prompts under the mixed cap
    assert graphs._split([dec(), dec(9), new(20)]) == (2, 2, 32, 0)
    assert graphs._split([dec(), new(31)]) == (1, 1, 32, 0) and graphs._split([dec(), new(32)]) is None  # mixed: < 32
    assert graphs._split([dec()] * 3 + [new(4)]) == (3, 3, 16, 0)
    assert not graphs.fits([dec()] * 4 + [new(4)])  # more decode rows than captured
    assert not graphs.fits([new(4), dec()])  # a decode row after a prompt: as the eager step, a prefill row
    assert not graphs.fits([dec()])  # no prompt: the decode graphs' step
    assert not graphs.fits([dec(ctx=8 * PAGE), new(4)])  # past the block table's width


def test_static_prefill_refuses_missing_pages_and_ids_outside_the_pool(model):
    pool = UnifiedPool(model.config, 4 << 20, torch.float32, "cpu", PAGE)
    graphs = PrefillGraphs(model, pool, max_tokens=64, capture=False, buckets=[64])
    slot, page = pool.alloc_slot(), pool.alloc_page()
    with pytest.raises(ValueError, match="needs 2 pages"):
        graphs.run([SeqChunk([7] * (PAGE + 1), 0, slot, [page])])
    with pytest.raises(ValueError, match="page id out of range"):
        graphs.run([SeqChunk([7, 8], 0, slot, [pool.page_capacity])])
    with pytest.raises(ValueError, match="KDA slot out of range"):
        graphs.run([SeqChunk([7, 8], 0, pool.slot_capacity, [page])])
    graphs.run([SeqChunk([7, 8], 0, slot, [page])])  # in range: runs


@pytest.mark.parametrize("system, decodes, context", [(0, 0, 0), (24, 0, 0), (0, 4, 0), (24, 0, 128), (24, 4, 128)])
def test_engine_with_static_prefill_generates_the_same_tokens(model, system, decodes, context):
    """New prompts through static prefill steps (one or two a step), the rest eager: chunked long
    prompts, and with a shared system prompt prefix-cache hits (cached context: eager)."""
    def engine(mode):
        return LLMEngine(model, None, EngineConfig(cache_memory="32MiB", page_size=PAGE, max_model_len=128,
                                                   max_num_batched_tokens=48, max_num_seqs=6,
                                                   prefix_block_size=8, kda_checkpoint_interval=16 if context else 64,
                                                   decode_graphs="off", prefill_graphs=mode,
                                                   max_prefill_graph_tokens=40, max_prefill_graph_seqs=2,
                                                   max_prefill_graph_decodes=decodes,
                                                   max_prefill_graph_context=context,
                                                   prefill_graph_context_decodes=bool(decodes and context)))

    rng = random.Random(11 + system)
    head = [rng.randrange(1500) for _ in range(system)]
    prompts = [head + [rng.randrange(1500) for _ in range(n)] for n in (9, 17, 30, 70, 2, 30, 1, 9, 17)]
    params = [SamplingParams(max_tokens=rng.randrange(2, 9), temperature=0.0, ignore_eos=True) for _ in prompts]
    outs = {}
    for mode in ("off", "on"):
        eng = engine(mode)
        finals, ids = {}, []

        def step():
            for out in eng.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0].token_ids

        at = 0
        for wave in (1, 2, 1, 2, 2, 1):  # each wave's first step is new prompts only (if they fit)
            for p, sp in zip(prompts[at:at + wave], params[at:at + wave]):
                ids.append(eng.add_request(p, sp))
                if decodes:  # arrivals while others decode: mixed steps
                    step()
            at += wave
            while eng.has_unfinished_requests():
                step()
        outs[mode] = [finals[i] for i in ids]
        if mode == "on":
            # waves 1, 4 and 6 fit (9, 2 + 30 and 17 tokens; not 17 + 30 = 47 >= 40, one 70-token
            # prompt in chunks, 1 + 9 with a one-token prompt); with the system prompt only the first
            # wave is new (the later ones hit the prefix cache)
            # (with context buckets: KDA checkpoints every 16 tokens, so prompts run in chunks, and
            # the last chunk of each, on its cached context, runs static, as do prefix-cache hits)
            expected = 1 if system else 3
            if context:
                assert eng.runner.prefill_graph_steps >= 5 and eng.prefix_stats()["hits"] > 0
            else:
                assert eng.runner.prefill_graph_steps >= expected if decodes else eng.runner.prefill_graph_steps == expected
            assert eng.runner.prefill_graphs is not None
        else:
            assert eng.runner.prefill_graphs is None and eng.runner.prefill_graph_steps == 0
    assert outs["on"] == outs["off"] and all(o for o in outs["on"])


def test_bad_prefill_graph_mode_is_refused(model):
    with pytest.raises(ValueError, match="prefill_graphs"):
        LLMEngine(model, None, EngineConfig(cache_memory="32MiB", prefill_graphs="sometimes"))


def _cached(model, pool, ctx_len, new_len, rng):
    """A sequence prefilled to ``ctx_len`` tokens, as the chunk of its next ``new_len`` (a prefix hit)."""
    slot, pages = pool.alloc_slot(), [pool.alloc_page() for _ in range(-(-(ctx_len + new_len) // PAGE))]
    with torch.inference_mode():
        model(ForwardBatch.build([SeqChunk([rng.randrange(1500) for _ in range(ctx_len)], 0, slot, pages)], PAGE),
              pool.handles)
    return SeqChunk([rng.randrange(1500) for _ in range(new_len)], ctx_len, slot, pages)


@pytest.mark.parametrize("prompts, decodes", [([(19, 6)], []), ([(40, 25)], []), ([(0, 9), (33, 12)], []),
                                             ([(70, 2), (5, 30)], []), ([(40, 25)], [7]), ([(0, 9), (33, 12)], [5, 30])])
def test_prompts_on_cached_context_equal_eager(model, prompts, decodes):
    """Context buckets (``max_context``): prompts on cached context (and new ones beside them, and
    with ``context_decodes`` decode rows before them) in a static step equal the eager step; their
    slots and pages, a bystander's and the rest of the pool as the eager run leaves them; the
    device-built latent rows cover each prompt's context."""
    rng = random.Random(len(prompts) + prompts[0][0] + len(decodes))
    pool = UnifiedPool(model.config, 4 << 20, torch.float32, "cpu", PAGE)
    b_slot, b_pages = pool.alloc_slot(), [pool.alloc_page() for _ in range(3)]
    with torch.inference_mode():
        model(ForwardBatch.build([SeqChunk([rng.randrange(1500) for _ in range(17)], 0, b_slot, b_pages)], PAGE),
              pool.handles)
    chunks = _decoding(model, pool, decodes, rng) + [
        _cached(model, pool, c, n, rng) if c else
        SeqChunk([rng.randrange(1500) for _ in range(n)], 0, pool.alloc_slot(),
                 [pool.alloc_page() for _ in range(-(-n // PAGE))]) for c, n in prompts]
    nd = len(decodes)
    twin = _twin(model, pool)
    with torch.inference_mode():
        batch = ForwardBatch.build(chunks, PAGE)
        eager = model.compute_logits(model(batch, twin.handles)[batch.logits_indices])
    graphs = PrefillGraphs(model, pool, max_tokens=64, max_seqs=2, max_decodes=2, capture=False,
                           buckets=[16, 32, 64], max_context=128, mixed_max_tokens=64, context_decodes=bool(nd))
    assert graphs.context_buckets == [0, 128] and graphs.max_pages >= (128 + 64) // PAGE
    d_bucket = 2 if nd else 0  # (decode rows before prompts on context pad to the largest decode bucket)
    assert graphs._split(chunks) == (nd, d_bucket, graphs.bucket_for(sum(n for _, n in prompts), nd), 128)
    _, d, b, c = graphs._split(chunks)
    static = graphs.run(chunks)
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    live = slice(0, pool.total_bytes)
    torch.testing.assert_close(pool.buffer[live].view(torch.float32), twin.buffer[live].view(torch.float32),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(pool.slot_bytes_of(b_slot), twin.slot_bytes_of(b_slot))
    # the device-built latent rows (what a captured step's MLA prefill reads) equal the host-built ones
    qlens, ctx, width = graphs._fill_host(chunks, nd, d, b)
    graphs.inputs.upload((d + len(prompts) + 1) * width)
    page, offset, seqs, max_new = graphs._static_batch(d, len(prompts), b, c, qlens, ctx).prefill_latents
    h_page, h_offset, h_seqs, _ = batch.prefill_latents
    rows = h_page.shape[0]
    assert page.shape[0] == c + b and torch.equal(page[:rows], h_page) and torch.equal(offset[:rows], h_offset)
    assert torch.equal(seqs[:len(prompts)], h_seqs) and max_new == b


def test_context_buckets_fit_rules(model):
    pool = UnifiedPool(model.config, 4 << 20, torch.float32, "cpu", PAGE)
    graphs = PrefillGraphs(model, pool, max_tokens=64, max_seqs=2, max_decodes=2, capture=False,
                           buckets=[16, 64], max_context=3000)
    assert graphs.context_buckets == [0, 1024, 2048, 3000]
    slot, pages = pool.alloc_slot(), [pool.alloc_page() for _ in range(graphs.max_pages)]
    p = lambda n, ctx=0: SeqChunk([1] * n, ctx, slot, pages)  # noqa: E731
    assert graphs._split([p(5, 700)]) == (0, 0, 16, 1024)
    assert graphs._split([p(5, 700), p(5, 600)]) == (0, 0, 16, 2048)  # the contexts' sum
    assert graphs._split([p(5, 3000)]) == (0, 0, 16, 3000) and not graphs.fits([p(5, 3001)])
    assert not graphs.fits([SeqChunk([1], 9, slot, pages), p(5, 700)])  # no decode rows beside cached prompts
    both = PrefillGraphs(model, pool, max_tokens=64, max_seqs=2, max_decodes=2, capture=False,
                         buckets=[16, 64], max_context=3000, context_decodes=True, mixed_max_tokens=16)
    assert both._split([SeqChunk([1], 9, slot, pages), p(5, 700)]) == (1, 2, 16, 1024)  # unless asked for:
    assert both._split([SeqChunk([1], 9, slot, pages), p(5)]) == (1, 1, 16, 0)  # the largest decode bucket
    assert not both.fits([SeqChunk([1], 9, slot, pages), p(20, 700)])  # (the mixed steps' token cap)
    # the keys: decode rows before cached prompts only at the largest decode bucket
    with_context = [k for k in both.keys() if k[0] and k[3]]
    assert {k[0] for k in with_context} == {2} and len(with_context) == 3 * 2 * 1  # contexts x prompts x buckets
    # decodes 0: contexts (0 too) x buckets x prompts; decodes 1, 2 on new prompts: bucket 16 x prompts
    assert len(both.keys()) == 4 * 2 * 2 + 2 * 2 + len(with_context)
    without = PrefillGraphs(model, pool, max_tokens=64, max_seqs=2, max_decodes=2, capture=False,
                            buckets=[16, 64], max_context=3000, mixed_max_tokens=16)
    assert set(both.keys()) - set(with_context) == set(without.keys())
    no_rows = PrefillGraphs(model, pool, max_tokens=64, max_seqs=2, max_decodes=0, capture=False,
                            buckets=[16, 64], max_context=3000, context_decodes=True)
    assert not no_rows.fits([SeqChunk([1], 9, slot, pages), p(5, 700)]) and no_rows.fits([p(5, 700)])
    plain = PrefillGraphs(model, pool, max_tokens=64, capture=False, buckets=[64])
    assert plain.context_buckets == [0] and not plain.fits([p(5, 700)])  # off by default


def test_static_only_where_the_replay_beats_eager(model):
    """With timings (replay ms, eager ms) per key, a step runs static only where the replay beats
    the eager time interpolated at its token count from the bucket below; a key whose replay does
    not beat its own bucket's eager step is dropped; untimed keys always run static."""
    pool = UnifiedPool(model.config, 4 << 20, torch.float32, "cpu", PAGE)
    graphs = PrefillGraphs(model, pool, max_tokens=64, capture=False, buckets=[16, 32, 64])
    slot, pages = pool.alloc_slot(), [pool.alloc_page() for _ in range(graphs.max_pages)]
    new = lambda n: SeqChunk([1] * n, 0, slot, pages)  # noqa: E731
    assert graphs.fits([new(5)]) and graphs.fits([new(40)])  # untimed
    keys = [(0, 1, 16, 0), (0, 1, 32, 0), (0, 1, 64, 0)]
    graphs.graphs = {k: f"graph {k[2]}" for k in keys}  # (stand-ins: nothing replays here)
    graphs.outputs = dict.fromkeys(graphs.graphs)
    # eager: 10 ms (host-bound) up to 32 tokens, 40 ms at 64 (GPU-bound); replays 4 / 8 / 30 ms
    graphs.set_timings({(0, 1, 16, 0): (4.0, 10.0), (0, 1, 32, 0): (8.0, 10.0), (0, 1, 64, 0): (30.0, 40.0)})
    assert graphs.fits([new(5)]) and graphs.fits([new(31)])
    # 32..63 tokens: eager 10 + 30 (n - 32) / 32 ms against the 30 ms replay: static from 54 tokens
    assert not graphs.fits([new(40)]) and not graphs.fits([new(53)])
    assert graphs.fits([new(54)]) and graphs.fits([new(63)])
    assert graphs.faster((0, 1, 64, 0), 54) and not graphs.faster((0, 1, 64, 0), 53)
    assert list(graphs.graphs) == keys
    graphs.set_timings({(0, 1, 32, 0): (12.0, 10.0)})  # not faster even at its bucket's top: dropped
    assert list(graphs.graphs) == [(0, 1, 16, 0), (0, 1, 64, 0)] and (0, 1, 32, 0) not in graphs.outputs
    assert not graphs.fits([new(20)]) and not graphs.fits([new(31)]) and graphs.fits([new(5)])
    assert graphs.fits([new(63)]) and not graphs.fits([new(40)])  # (the 32 bucket's eager time still interpolates)


def test_time_all_times_replay_against_the_eager_step(model, monkeypatch):
    """``time_all`` on CPU with stand-ins for the CUDA timing calls and the graphs: every key's
    eager step runs on the scratch buffers (live state untouched), its replay is timed (again
    unless it took under half the eager step), and the measured pairs decide what ``set_timings``
    keeps."""
    class Event:  # a CUDA event's timing contract on the host clock
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    pool = UnifiedPool(model.config, 4 << 20, torch.float32, "cpu", PAGE)
    graphs = PrefillGraphs(model, pool, max_tokens=64, capture=False, buckets=[16, 64])
    live = pool.alloc_slot()
    before = pool.slot_bytes_of(live).clone()
    replays = []

    class Graph:
        def __init__(self, key, ms):
            self.key, self.ms = key, ms

        def replay(self):
            replays.append(self.key)
            time.sleep(self.ms / 1e3)

    graphs.graphs = {(0, 1, 16, 0): Graph((0, 1, 16, 0), 0.0), (0, 1, 64, 0): Graph((0, 1, 64, 0), 50.0)}
    graphs.outputs = dict.fromkeys(graphs.graphs)
    timings = graphs.time_all(repeats=2)
    assert replays == [(0, 1, 16, 0), (0, 1, 64, 0), (0, 1, 64, 0)]  # a clear win is not timed twice
    assert all(replay >= 0 and eager > 0 for replay, eager in timings.values())
    assert timings[(0, 1, 64, 0)][0] >= 50.0  # the replay's time, not the eager step's
    assert torch.equal(pool.slot_bytes_of(live), before)
    graphs.set_timings(timings)
    assert set(graphs.graphs) == {k for k, (replay, eager) in timings.items() if replay < eager}
