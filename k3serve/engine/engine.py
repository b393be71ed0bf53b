"""LLMEngine (one step: schedule -> run -> sample -> outputs) and the offline ``LLM`` API."""

from __future__ import annotations

import itertools
import logging
import numbers
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..bundled import resolve_model
from ..cache.owners import PoolOwners
from ..cache.pool import ALIGN, PoolLayout, UnifiedPool, parse_bytes
from ..cache.prefix import PrefixCache
from ..model.k3 import K3ForCausalLM
from ..model.loader import load_model
from .decode_graphs import DecodeGraphs, capture_blockers
from .prefill_graphs import PrefillGraphs, prefill_blockers
from .request import Request, Sequence, Status, new_request
from .runner import ModelRunner
from .sampler import Sampler, SamplingRow
from .sampling_params import SamplingParams
from .scheduler import RequestRejected, ScheduledSeq, Scheduler
from .transfer import readback_stream, to_device

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    max_model_len: int | None = None  # default: the model's context length
    page_size: int = 64
    cache_memory: str | int | None = None  # pool bytes; default on CPU "1GiB"
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the device for weights + activations + pool
    unified_memory: bool = True
    kda_fraction: float = 0.5  # static-split mode only
    enable_prefix_caching: bool = True
    prefix_block_size: int = 512
    kda_checkpoint_interval: int = 4096
    # Decode steps as CUDA graphs per batch bucket (engine/decode_graphs.py): "auto" captures on
    # CUDA when every decode op can be captured, "off" is vLLM's --enforce-eager, "on" insists
    # (on CPU it runs the same padded static steps eagerly, which the tests use).
    decode_graphs: str = "auto"
    max_graph_batch: int = 256
    # Prefill steps of new prompts as CUDA graphs per token bucket (engine/prefill_graphs.py): a
    # short prompt's eager step is host-bound (launches; kimi-linear-48b, 512 tokens: time to first
    # token 53 -> 35 ms). Same modes as decode_graphs; steps of up to
    # max_prefill_graph_seqs prompts and fewer than max_prefill_graph_tokens tokens, after up to
    # max_prefill_graph_decodes decode rows (then fewer than prefill_graphs.MIXED_MAX_TOKENS tokens).
    prefill_graphs: str = "auto"
    max_prefill_graph_tokens: int = 2048
    max_prefill_graph_seqs: int = 1
    max_prefill_graph_decodes: int = 16  # decode rows such a step may lead with (0: new prompts only)
    # Prompts on cached context (prefix-cache hits: a chat's or an agent's next turn) in such steps,
    # contexts up to this many tokens (and max_model_len) in power-of-two buckets from 1,024 (0:
    # off). kimi-linear-48b, turns of 200 tokens on 1.5-2.6K of history: TTFT 91 -> 27 ms.
    max_prefill_graph_context: int = 32768
    # ... and such prompts after decode rows (another user's next turn while others decode), the
    # rows padded to the largest decode bucket: 3 token buckets x context buckets more graphs (18
    # with the defaults). kimi-linear-48b, 4 users' chats: next-turn TTFT 67 -> 32 ms.
    prefill_graph_context_decodes: bool = True
    # Overlapped scheduling (SGLang's overlap scheduler, vLLM's --async-scheduling): step k+1 is
    # scheduled and launched before step k's tokens are read back, so host work hides behind the
    # GPU's. "auto": on CUDA; outputs then arrive one step later. Falls back to plain steps while
    # a request uses penalties, a grammar or n > 1 before its fork.
    async_scheduling: str = "auto"
    # "fcfs", or "priority" (vLLM's --scheduling-policy): requests carry a priority, lower first
    # (scheduler.py: admission, scheduling and preemption order).
    scheduling_policy: str = "fcfs"


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list | None = None  # per token: (token_id, logprob, [(alt_id, alt_logprob), ...])
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None  # (with logprobs: the sum of the sampled tokens')


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # params.prompt_logprobs: one entry a prompt token, None for the first, else (token_id, logprob,
    # [(alt_id, alt_logprob), ...], rank); once the prompt is computed (delta outputs: that once)
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache, not computed


PLACEHOLDER = -1  # a sampled token not yet read back (overlap); the device holds the real one


@dataclass
class _HostTokens:
    """A step's sampled tokens (and logprobs) copied to the host, ready once ``event`` is."""
    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    event: object | None  # torch.cuda.Event; None on CPU (the copies were synchronous)


@dataclass
class _Launched:
    """A step whose sampling ran (or is queued) on the device."""
    seqs: list  # Sequence per sampled row
    positions: list[int]  # where each row's token goes in its sequence's token_ids
    token_ids: torch.Tensor  # [rows] on the device: the next step's inputs read placeholders from it
    host: _HostTokens


def _to_host(out) -> _HostTokens:
    """Start copying the sampler's outputs to (pinned) host memory without waiting for them, from a
    side stream: the step's stream goes on to the next step without a copy-engine operation in
    between (~10 us of GPU time at batch 1, bench/graph_start_probe.py)."""
    tensors = (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)
    if out.token_ids.device.type != "cuda":
        return _HostTokens(*tensors, None)
    stream = readback_stream(out.token_ids.device)
    stream.wait_stream(torch.cuda.current_stream(out.token_ids.device))
    with torch.cuda.stream(stream):
        host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for t in tensors]
        event = torch.cuda.Event()
        event.record(stream)
    for t in tensors:
        if t is not None:
            t.record_stream(stream)  # (the allocator reuses their memory only after the copies)
    return _HostTokens(*host, event)


class LLMEngine:
    def __init__(self, model: K3ForCausalLM, tokenizer=None, config: EngineConfig | None = None):
        self.model = model
        model.fuse_projections()
        self.tokenizer = tokenizer
        self.config = cfg = config or EngineConfig()
        self.device = next(model.parameters()).device
        mcfg = model.config
        self.max_model_len = cfg.max_model_len or mcfg.max_position_embeddings
        self.eos_ids = list(getattr(tokenizer, "eos_token_ids", None) or mcfg.eos_token_ids)
        shipped = 0
        if self.device.type == "cuda":  # shipped autotuning results first: the pool's sizing step tunes otherwise
            from ..ops import tuned_configs

            shipped = tuned_configs.apply(self.device)["applied"]
        self.pool = UnifiedPool(mcfg, self._pool_bytes(), model.dtype, self.device, cfg.page_size,
                                kda_fraction=None if cfg.unified_memory else cfg.kda_fraction)
        owners = PoolOwners(self.pool)
        self.prefix = (PrefixCache(owners, cfg.prefix_block_size, cfg.kda_checkpoint_interval)
                       if cfg.enable_prefix_caching else None)
        self.scheduler = Scheduler(self.pool, cfg.max_num_batched_tokens, cfg.max_num_seqs, self.max_model_len,
                                   self.prefix, owners, cfg.scheduling_policy)
        self.runner = ModelRunner(model, self.pool, self._decode_graphs(), self._prefill_graphs())
        if shipped:  # (sizing and captures reach most keys a server meets)
            tuned_here = tuned_configs.unshipped()
            if tuned_here:
                log.warning("autotuner keys met at start that the shipped file lacks (timed here, so their tiles and "
                            "numerics follow this machine; `python -m bench.tune_configs --merge` adds them): %s",
                            {name.rpartition(".")[2]: len(keys) for name, keys in tuned_here.items()})
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.timings = {"schedule": 0.0, "sample": 0.0, "output": 0.0}
        self.steps = 0
        if cfg.async_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"async_scheduling must be auto, on or off, got {cfg.async_scheduling!r}")
        self._async = cfg.async_scheduling == "on" or (cfg.async_scheduling == "auto" and self.device.type == "cuda")
        self._pending: _Launched | None = None  # overlap: the launched step whose tokens are unread
        self.overlapped_steps = 0  # steps launched while the previous one's tokens were unread
        self._no_overlap: set[str] = set()  # requests that need plain steps while they run (_blocks_overlap)
        self._scoring: set[str] = set()  # requests asking for prompt logprobs (the runner looks for their rows)

    @classmethod
    def from_pretrained(cls, model: str | Path | None = None, *, preset: str | None = None,
                        config: EngineConfig | None = None, tokenizer=None, **load_kw) -> "LLMEngine":
        config = config or EngineConfig()
        if preset is None:  # a path, a bundled model's name, or nothing: the bundled default
            model = resolve_model(model)
        validate_startup(model, preset, config, load_kw.get("device"),  # before any weight loads
                         quantization=load_kw.get("quantization"), dtype=load_kw.get("dtype"))
        net = load_model(model, preset=preset, **load_kw)
        if tokenizer is None:
            tokenizer = tokenizer_or_none(model)
        return cls(net, tokenizer, config)

    # ---- memory ---------------------------------------------------------------------------
    def _pool_bytes(self) -> int:
        cfg = self.config
        if cfg.cache_memory is not None:
            return parse_bytes(cfg.cache_memory)
        if self.device.type != "cuda":
            return 1 << 30
        return self._profile_gpu_pool_bytes()

    def _profile_gpu_pool_bytes(self) -> int:
        """Pool = utilisation x device memory - weights - the activation peak of the largest step,
        measured by running that step once on a throwaway pool."""
        from ..model.batch import ForwardBatch, SeqChunk

        cfg, mcfg = self.config, self.model.config
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # blocks freed while loading (fusing re-homes weights) are not "in use"
        free, total = torch.cuda.mem_get_info(self.device)
        tokens = min(cfg.max_num_batched_tokens, self.max_model_len)
        pages = -(-tokens // cfg.page_size)
        lay = PoolLayout.for_model(mcfg, self.model.dtype, cfg.page_size)
        scratch_bytes = lay.slot_bytes + pages * lay.page_bytes + 2 * ALIGN
        scratch = UnifiedPool(mcfg, scratch_bytes, self.model.dtype, self.device, cfg.page_size)
        slot = scratch.alloc_slot()
        page_ids = [scratch.alloc_page() for _ in range(pages)]
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        batch = ForwardBatch.build([SeqChunk([0] * tokens, 0, slot, page_ids)], cfg.page_size, self.device)
        with torch.inference_mode():
            self.model.compute_logits(self.model(batch, scratch.handles)[batch.logits_indices])
        torch.cuda.synchronize()
        activation_peak = torch.cuda.max_memory_allocated(self.device) - base
        del scratch, batch
        torch.cuda.empty_cache()
        used_by_others = total - free  # weights (and anything else resident) before profiling
        # Captured prefill graphs keep their activations in a pool of their own: about the peak
        # scaled to their largest bucket (activations grow with the tokens).
        graphs = 0
        if self._graph_mode(cfg.prefill_graphs, "prefill_graphs", prefill_blockers) != "off":
            graphs = activation_peak * min(1.0, cfg.max_prefill_graph_tokens / tokens)
            # with cached context: MLA's keys and values expanded over every context row (bf16), twice
            rows = min(cfg.max_prefill_graph_context, self.max_model_len)
            graphs += 4 * rows * (mcfg.num_attention_heads * (mcfg.qk_nope_head_dim + mcfg.v_head_dim)
                                  + mcfg.kv_lora_rank + mcfg.qk_rope_head_dim)
        budget = int(cfg.gpu_memory_utilization * total - used_by_others - activation_peak - graphs)
        if budget <= 0:
            raise RuntimeError(f"no memory left for the cache pool: {cfg.gpu_memory_utilization:.0%} of "
                               f"{total / 2**30:.1f} GiB minus {used_by_others / 2**30:.1f} GiB in use and a "
                               f"{activation_peak / 2**30:.1f} GiB activation peak; lower --max-num-batched-tokens "
                               "or raise --gpu-memory-utilization")
        log.info("cache pool %.2f GiB (activation peak %.2f GiB)", budget / 2**30, activation_peak / 2**30)
        return budget

    def _graph_mode(self, mode: str, name: str, blockers_of) -> str:
        """"off", or "eager" (static steps run eagerly: CPU tests, mode "on"), or "capture"."""
        if mode not in ("auto", "on", "off"):
            raise ValueError(f"{name} must be auto, on or off, got {mode!r}")
        cuda = self.device.type == "cuda"
        blockers = blockers_of(self.device)
        if mode == "off" or (mode == "auto" and blockers):
            if mode == "auto" and cuda:
                log.info("%s: steps run eagerly: %s", name, "; ".join(blockers))
            return "off"
        if mode == "on" and cuda and blockers:
            raise ValueError(f"{name}: cannot capture here: " + "; ".join(blockers))
        return "capture" if cuda else "eager"

    def _with_graphs(self, mode: str, name: str, make):
        """``make(capture)``, or None where the mode is off or capture fails in "auto" (an op that
        cannot be captured: serve eagerly rather than not at all)."""
        if mode == "off":
            return None
        try:
            return make(mode == "capture")
        except RuntimeError as exc:
            if getattr(self.config, name) == "on":
                raise
            log.warning("%s: capture failed, those steps run eagerly: %s", name, exc)
            return None

    def _decode_graphs(self) -> DecodeGraphs | None:
        cfg = self.config
        max_pages = -(-self.max_model_len // cfg.page_size)
        max_batch = min(cfg.max_graph_batch, cfg.max_num_seqs)
        return self._with_graphs(self._graph_mode(cfg.decode_graphs, "decode_graphs", capture_blockers),
                                 "decode_graphs",
                                 lambda capture: DecodeGraphs(self.model, self.pool, max_batch, max_pages, capture=capture))

    def _prefill_graphs(self) -> PrefillGraphs | None:
        cfg = self.config
        tokens = min(cfg.max_prefill_graph_tokens, cfg.max_num_batched_tokens)
        return self._with_graphs(self._graph_mode(cfg.prefill_graphs, "prefill_graphs", prefill_blockers),
                                 "prefill_graphs",
                                 lambda capture: PrefillGraphs(
                                     self.model, self.pool, tokens, min(cfg.max_prefill_graph_seqs, cfg.max_num_seqs),
                                     min(cfg.max_prefill_graph_decodes, cfg.max_num_seqs - 1),
                                     -(-self.max_model_len // cfg.page_size), capture=capture,
                                     max_context=min(cfg.max_prefill_graph_context, self.max_model_len),
                                     context_decodes=cfg.prefill_graph_context_decodes))

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prompt_text: str | None = None, grammar=None,
                    priority: int = 0) -> str:
        """``grammar``: a compiled grammar (serve/grammar.py) constraining every sample of the request;
        ``priority``: under the priority scheduling policy, lower runs first."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass the prompt as token ids")
            prompt_ids, text = self.tokenizer.encode(prompt), prompt
        else:
            prompt_ids, text = list(prompt), prompt_text
        vocab = self.model.config.vocab_size
        if any(not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab for t in prompt_ids):
            raise RequestRejected(f"prompt token ids must be integers in 0..{vocab - 1}")
        if grammar is not None and params.allowed_token_ids:  # (together they could leave no token at all)
            raise RequestRejected("allowed_token_ids cannot be combined with structured output")
        for name in ("logit_bias", "allowed_token_ids"):
            if any(t >= vocab for t in getattr(params, name) or ()):
                raise RequestRejected(f"{name}: token ids must be in 0..{vocab - 1}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.scheduler.check_admissible(len(prompt_ids))
        if params.n > self.scheduler.max_num_seqs:  # (its samples fork and run together)
            raise RequestRejected(f"n={params.n} is more than max_num_seqs ({self.scheduler.max_num_seqs}), the "
                                  "sequences a step runs")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise RequestRejected(f"priority must be an integer, got {priority!r}")
        if priority and self.scheduler.policy != "priority":
            raise RequestRejected(f"priority {priority} needs the priority scheduling policy (--scheduling-policy "
                                  "priority); this engine schedules first come, first served")
        req = new_request(request_id, prompt_ids, params, text, self.device, priority)
        for seq in req.seqs:
            self._attach_text_state(seq)
            seq.grammar = grammar.new_state() if grammar is not None else None
        self.requests[request_id] = req
        if self._blocks_overlap(req):
            self._no_overlap.add(request_id)
        if params.prompt_logprobs is not None:
            self._scoring.add(request_id)
        self.scheduler.add(req.seqs[0])  # siblings of n > 1 start from its prefill (fork)
        return request_id

    def _attach_text_state(self, seq: Sequence) -> None:
        if self.tokenizer is None:
            return
        from .detokenizer import IncrementalDetokenizer, StopStringMatcher

        seq.detok = IncrementalDetokenizer(self.tokenizer, seq.params.skip_special_tokens)
        seq.stopper = StopStringMatcher(seq.params.stop, seq.params.include_stop_str_in_output)

    def abort_request(self, request_id: str) -> None:
        """Ends the request now; its slot and pages go back to the pool before this returns."""
        req = self.requests.pop(request_id, None)
        self._no_overlap.discard(request_id)
        self._scoring.discard(request_id)
        if req is None:
            return
        for seq in req.seqs:
            while seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:  # overlap: tokens never to be read
                seq.token_ids.pop()
                seq.num_computed = min(seq.num_computed, seq.num_tokens)
            if not seq.finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._pending is not None

    # ---- one step -------------------------------------------------------------------------
    def step(self, cumulative: bool = True) -> list[RequestOutput]:
        """One engine step. With overlapped scheduling (``async_scheduling``) the step launches
        the next batch before it reads back the previous one's tokens, and returns the outputs
        of the previous step: the host's scheduling, input building and output processing then
        run while the GPU computes, instead of between its steps.

        ``cumulative=False`` (vLLM's RequestOutputKind.DELTA): each output's text, token_ids and
        logprobs hold only what is new, so a step's outputs cost O(new tokens), not O(answer
        length) a request (256 answers of 32K tokens: 27 ms a step of list copies on this workplace's
        CPU in the old cumulative form, 20 in this one)."""
        t0 = time.perf_counter()
        overlap = self._overlap_now()
        touched: dict[str, Request] = {}
        if not overlap and self._pending is not None:  # leaving overlap: settle the tokens in flight
            self._process(self._pending, touched)
            self._pending = None
        sched = self.scheduler.schedule()
        for seq in self.scheduler.finished_by_scheduler:
            self._finalize_text(seq)
            touched[seq.request_id] = self.requests[seq.request_id]
        self.scheduler.finished_by_scheduler.clear()
        t1 = time.perf_counter()
        self.timings["schedule"] += t1 - t0
        previous, self._pending = self._pending, None
        self.overlapped_steps += previous is not None and bool(sched)
        if sched:
            logits = self.runner.execute(sched, self._placeholder_fixup(sched, previous), bool(self._scoring))
            t2 = time.perf_counter()
            launched = self._launch(sched, logits, overlap)
            if overlap:
                self._pending = launched
            elif launched is not None:
                self._process(launched, touched)
            self.timings["sample"] += time.perf_counter() - t2
        if previous is not None:  # overlap: the previous step's tokens, read back after this launch
            t2 = time.perf_counter()
            self._process(previous, touched)
            self.timings["sample"] += time.perf_counter() - t2
        self.steps += 1
        t3 = time.perf_counter()
        outs = [self._request_output(req, cumulative) for req in touched.values()]
        for req in touched.values():
            if req.finished:
                self.requests.pop(req.request_id, None)
                self._no_overlap.discard(req.request_id)
                self._scoring.discard(req.request_id)
        self.timings["output"] += time.perf_counter() - t3
        return outs

    # ---- overlapped scheduling ------------------------------------------------------------
    def _overlap_now(self) -> bool:
        return self._async and not self._no_overlap

    @staticmethod
    def _blocks_overlap(req: Request) -> bool:
        """Overlap needs every sampled token's effect to be known on the device or only later on
        the host: not for penalties (they read the token history), grammars (the mask of a step
        needs the previous token accepted), or an n > 1 request before its samples fork."""
        p = req.params
        return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
                or req.seqs[0].grammar is not None or (len(req.seqs) > 1 and not req.forked))

    def _placeholder_fixup(self, sched: list[ScheduledSeq], previous: "_Launched | None"):
        """(flat positions, rows of ``previous``'s token tensor, that tensor): the inputs of this
        step that are tokens the previous step sampled and the host has not read yet."""
        if previous is None:
            return None
        dst, src, offset = [], [], 0
        for s in sched:
            seq = s.seq
            if seq.pending is not None and seq.pending[0] is previous:
                pos = seq.pending[2]
                if seq.num_computed <= pos < seq.num_computed + s.num_tokens:
                    dst.append(offset + pos - seq.num_computed)
                    src.append(seq.pending[1])
            offset += s.num_tokens
        return (dst, src, previous.token_ids) if dst else None

    def _launch(self, sched: list[ScheduledSeq], logits: torch.Tensor, overlap: bool) -> "_Launched | None":
        """Advance the scheduled sequences, sample on the device and start the tokens' copy to the
        host. With ``overlap`` each sampling sequence gets a placeholder token (the next step reads
        the real one from the device), and one whose next token ends it by length is held back."""
        sampling = [s for s in sched if s.samples]
        rows_seqs: list[Sequence] = []
        logit_rows: list[int] = []
        forks: list[tuple[Sequence, Sequence]] = []
        for i, s in enumerate(sampling):
            rows_seqs.append(s.seq)
            logit_rows.append(i)
            req = self.requests[s.seq.request_id]
            if s.seq.index == 0 and len(req.seqs) > 1 and not req.forked:
                req.forked = True
                if not self._blocks_overlap(req):
                    self._no_overlap.discard(req.request_id)
                for sib in req.seqs[1:]:
                    rows_seqs.append(sib)
                    logit_rows.append(i)
                    forks.append((s.seq, sib))
        for s in sched:
            s.seq.num_computed += s.num_tokens
            self.scheduler.after_step(s.seq, s.num_tokens)
        for parent, sib in forks:
            self._fork(parent, sib)
        if not rows_seqs:
            return None
        rows = [self._sampling_row(q) for q in rows_seqs]
        step_logits = logits
        if logit_rows != list(range(logits.shape[0])):  # forks repeat a row
            step_logits = logits[to_device(logit_rows, logits.device)]
        grammars = [q.grammar for q in rows_seqs]
        masked = step_logits
        if any(g is not None for g in grammars):
            from ..serve.grammar import apply_masks

            masked = apply_masks(step_logits, grammars)
        out = self.sampler(masked, rows, logprob_logits=step_logits)  # (logprobs: the model's, not the mask's)
        launched = _Launched(rows_seqs, [], out.token_ids, _to_host(out))
        for j, seq in enumerate(rows_seqs):
            launched.positions.append(seq.num_tokens)
            if overlap:
                seq.token_ids.append(PLACEHOLDER)
                seq.pending = (launched, j, seq.num_tokens - 1)
                p = seq.params
                seq.awaiting_final = ((p.max_tokens is not None and seq.num_output >= p.max_tokens)
                                      or seq.num_tokens >= self.max_model_len)
        return launched

    def _process(self, launched: "_Launched", touched: dict[str, Request]) -> None:
        """The sampled tokens on the host: record them, check stops, collect outputs."""
        host = launched.host
        if host.event is not None:
            host.event.synchronize()
        tokens = host.token_ids.tolist()
        lps = host.logprobs.tolist() if host.logprobs is not None else None
        top_ids = host.top_ids.tolist() if host.top_ids is not None else None
        top_lps = host.top_logprobs.tolist() if host.top_logprobs is not None else None
        now = time.monotonic()
        for j, (seq, tok, pos) in enumerate(zip(launched.seqs, tokens, launched.positions)):
            if seq.pending is not None and seq.pending[0] is launched:
                seq.pending = None
            if seq.pending is None:  # (a later step's token still on the way keeps a final one held back)
                seq.awaiting_final = False
            if seq.finished:  # aborted, or stopped by the step before (its extra step is dropped)
                continue
            if pos < seq.num_tokens:
                seq.token_ids[pos] = tok  # the placeholder
            else:
                seq.token_ids.append(tok)
            seq.first_token_time = seq.first_token_time or now
            if seq.params.logprobs is not None and lps is not None:
                k = seq.params.logprobs
                seq.logprobs.append((tok, lps[j], list(zip(top_ids[j][:k], top_lps[j][:k]))))
                seq.cumulative_logprob += lps[j]
            if seq.grammar is not None:
                seq.grammar.accept(tok)
            # A later step may already hold a placeholder for the next token: the stop checks
            # count tokens as of this one; if it stops here, that placeholder is dropped (the
            # sequence's state then covers every token it keeps).
            ahead = seq.token_ids[pos + 1:]
            del seq.token_ids[pos + 1:]
            self._check_stop(seq, tok)
            if not seq.finished:
                seq.token_ids += ahead
            touched[seq.request_id] = self.requests[seq.request_id]

    def _sampling_row(self, q: Sequence) -> SamplingRow:
        """Token histories are copied only for the requests whose sampling reads them."""
        p = q.params
        rep = p.repetition_penalty != 1.0
        needs_output = rep or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.min_tokens > 0
        return SamplingRow(p, q.token_ids[:q.num_prompt] if rep else [], q.output_ids if needs_output else [],
                           self.eos_ids, q.generator, grammar=q.grammar is not None)

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """n > 1: the child starts from a copy of the parent's prompt state (no second prefill):
        full pages shared by reference, the partly filled last page and the KDA slot copied.
        Without room for the copy it waits and recomputes the prompt instead."""
        sch = self.scheduler
        child.num_computed = 0
        n_full = parent.num_computed // self.pool.layout.page_size
        if sch.owners.can_allocate(slots=1, pages=len(parent.pages) - n_full):
            sch.owners.alloc_slot(child)
            self.pool.copy_slot(parent.kda_slot, child.kda_slot)
            for p in parent.pages[:n_full]:
                sch.owners.share_page(child, p)
            for p in parent.pages[n_full:]:
                self.pool.copy_page(p, sch.owners.alloc_page(child))
            child.num_computed = parent.num_computed
            child.status = Status.RUNNING
            sch.running.append(child)
        else:
            sch.release(child)
            sch.enqueue(child, preempted=True)

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        reason = None
        by_token = seq.num_output >= p.min_tokens and tok in p.stop_token_ids
        if by_token:
            reason, seq.stop_reason = "stop", tok
        elif seq.num_output >= p.min_tokens and not p.ignore_eos and tok in self.eos_ids:
            reason, seq.stop_reason = "stop", None
        by_string = False
        # A stop token's own text is output unless it is a special token (vLLM), EOS's never.
        if (reason is None or by_token) and seq.detok is not None:
            text = seq.detok.push(tok) if reason is None or not self._special(tok) else ""
            # (min_tokens: no stop of any kind before that many tokens, stop strings included)
            emit, by_string = seq.stopper.feed(text) if seq.num_output >= p.min_tokens else (text, False)
            if emit:
                seq.text_pieces.append(emit)
            if by_string and reason is None:
                reason, seq.stop_reason = "stop", seq.stopper.matched
        if reason is None and seq.grammar is not None and seq.grammar.is_terminated():
            reason = "stop"  # the structured output is complete (also under ignore_eos)
        if reason is None and p.max_tokens is not None and seq.num_output >= p.max_tokens:
            reason = "length"
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            if not by_string:
                self._finalize_text(seq)
            self.scheduler.finish(seq, reason)

    def _special(self, tok: int) -> bool:
        is_special = getattr(self.tokenizer, "is_special", None)
        return bool(is_special and is_special(tok))

    @staticmethod
    def _finalize_text(seq: Sequence) -> None:
        """Release text held back for a possible stop string (or an incomplete character)."""
        if seq.detok is None:
            return
        emit, stopped = seq.stopper.feed(seq.detok.flush())
        seq.text_pieces.append(emit)
        if stopped:
            seq.stop_reason = seq.stopper.matched
        else:
            seq.text_pieces.append(seq.stopper.flush())

    def _request_output(self, req: Request, cumulative: bool = True) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            end = seq.num_output
            if end and seq.token_ids[-1] == PLACEHOLDER:  # overlap: the token of the step in flight is not out yet
                end -= 1
            first = seq.num_prompt
            delta_ids = seq.token_ids[first + seq.emitted_tokens: first + end]
            delta_text = "".join(seq.text_pieces[seq.emitted_pieces:])
            lps = seq.logprobs if seq.params.logprobs is not None else None
            if cumulative:
                text, ids, lps = seq.text, seq.token_ids[first: first + end], None if lps is None else list(lps)
            else:
                text, ids, lps = delta_text, delta_ids, None if lps is None else lps[seq.emitted_tokens: end]
            seq.emitted_tokens, seq.emitted_pieces = end, len(seq.text_pieces)
            outs.append(CompletionOutput(seq.index, text, ids, seq.finish_reason, seq.stop_reason, lps,
                                         delta_text, delta_ids,
                                         seq.cumulative_logprob if seq.params.logprobs is not None else None))
        prompt_lps = None
        head = req.seqs[0]
        if req.params.prompt_logprobs is not None and not head.scoring_prompt and (cumulative or not req.scored_sent):
            prompt_lps, req.scored_sent = head.prompt_logprobs, True
        return RequestOutput(req.request_id, req.prompt_text, req.prompt_ids, outs, req.finished, prompt_lps,
                             head.num_cached_tokens)

    def prefix_stats(self) -> dict:
        return self.prefix.stats_dict() if self.prefix is not None else {}

    def step_kinds(self) -> dict[str, int]:
        """Forward steps by how they ran: eagerly, or as a static decode / prefill step."""
        r = self.runner
        return dict(eager=r.eager_steps, decode_graph=r.graph_steps, prefill_graph=r.prefill_graph_steps)

    def scheduled_tokens(self) -> dict[str, int]:
        """Tokens computed so far, prompt (or recomputed) and decode, and the steps with prompt tokens."""
        return dict(self.runner.scheduled_tokens, prefill_steps=self.runner.prefill_steps)

    def stats(self) -> dict:
        return dict(steps=self.steps, step_kinds=self.step_kinds(), scheduled_tokens=self.scheduled_tokens(),
                    prefix=self.prefix_stats(),
                    preemptions=self.scheduler.num_preemptions, running=len(self.scheduler.running),
                    waiting=len(self.scheduler.waiting), pool=self.pool.stats(),
                    timings={**self.timings, **self.runner.timings})


def tokenizer_or_none(model):
    """The checkpoint's tokenizer; None for a preset or a checkpoint without one (token-id prompts)."""
    if model is None:
        return None
    from ..tokenizer import load_tokenizer

    try:
        return load_tokenizer(model)
    except (FileNotFoundError, ValueError) as exc:
        log.warning("no tokenizer loaded (%s): prompts must be token ids", exc)
        return None


def validate_startup(model, preset, config: EngineConfig, device=None, check_memory: bool = True,
                     quantization: str | None = None, dtype=None) -> None:
    """The planner's layout and memory checks and the kernel-backend environment, run before a
    single weight is read (memory counted as served: ``quantization`` shrinks the experts).
    ``check_memory=False``: no CUDA call (a process that must not hold a CUDA context: the
    server's, whose engine process checks again with memory)."""
    from ..config import ModelConfig
    from ..ops.backend import check_environment
    from ..plan import validate_layout
    from ..presets import preset_config

    check_environment()
    mcfg = ModelConfig.from_pretrained(model) if model is not None else ModelConfig.from_dict(preset_config(preset))
    mcfg = mcfg.with_quantization(quantization)
    mem = None
    dev = torch.device(device or "cpu")
    if dev.type == "cuda" and not torch.backends.cuda.is_built():  # (asks no driver: the server's process too)
        raise ValueError(f"--device {device}: this torch ({torch.__version__}) was built without CUDA")
    if check_memory:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
            raise ValueError(f"--device {device}: no such CUDA device ({torch.cuda.device_count()} visible)")
        mem = torch.cuda.get_device_properties(dev).total_memory / 2**30 if dev.type == "cuda" else None
    validate_layout(mcfg, config.tensor_parallel_size, config.expert_parallel_size,
                    config.decode_context_parallel_size, gpu_memory_gib=mem)
    if check_memory and dev.type == "cpu":
        check_host_memory(mcfg, dtype)


def check_host_memory(mcfg, dtype=None) -> None:
    """A model larger than the host's available memory is refused before a weight loads (a large
    preset on CPU allocated until the machine ran out). Counted as loaded: floating-point weights in
    ``dtype`` (CPU's default fp32), MXFP4 experts as stored."""
    from ..model.loader import resolve_dtype
    from ..plan import LayoutError, checkpoint_bytes

    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return  # (not Linux: unknown)
    w = checkpoint_bytes(mcfg)
    scale = torch.tensor([], dtype=resolve_dtype(dtype, torch.device("cpu"))).element_size() / 2  # (stored bf16)
    need = w.other * scale + w.expert * (1 if mcfg.expert_format == "mxfp4" else scale)
    if need > avail:
        raise LayoutError(f"the weights need {need / 2**30:.1f} GiB in host memory as loaded, more than the "
                          f"{avail / 2**30:.1f} GiB available; use a GPU, a smaller model or --dtype bfloat16")


def _prompt_of(prompt):
    """A prompt as text or token ids; vLLM's prompt dicts ({"prompt": ...} / {"prompt_token_ids": ...}) too."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt["prompt_token_ids"]
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids' (got keys {sorted(prompt)})")
    return prompt


class LLM:
    """Offline batched generation: ``LLM(path).generate(prompts, params)``."""

    def __init__(self, model: str | Path | None = None, *, preset: str | None = None, tokenizer=None,
                 config: EngineConfig | None = None, generation_config: str = "auto",
                 override_generation_config: dict | None = None, **kw):
        """``generation_config``: where ``generate``'s default SamplingParams come from (vLLM's
        --generation-config: "auto" the model's generation_config.json, "vllm" none, or a directory);
        ``override_generation_config``: fields over it (vLLM's)."""
        from .sampling_params import generation_defaults

        engine_fields = set(EngineConfig.__dataclass_fields__)
        ecfg = config or EngineConfig(**{k: kw.pop(k) for k in list(kw) if k in engine_fields})
        self.defaults = generation_defaults(None if preset else resolve_model(model), generation_config,
                                            override_generation_config)
        self.engine = LLMEngine.from_pretrained(model, preset=preset, config=ecfg, tokenizer=tokenizer, **kw)

    @classmethod
    def from_engine(cls, engine: LLMEngine, defaults: dict | None = None) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine, llm.defaults = engine, dict(defaults or {})
        return llm

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended settings (its generation config), as vLLM's."""
        return SamplingParams(**self.defaults)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def chat(self, messages, params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             **chat_kw) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of OpenAI messages) or a list of them,
        rendered in the model's chat format (serve.chat.build_chat_prompt; ``chat_kw``: tools,
        tool_choice, reasoning_effort, add_generation_prompt, continue_final_message,
        chat_template_kwargs, ...), then generated."""
        from ..serve.chat import build_chat_prompt

        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer: chat needs one")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [build_chat_prompt(self.engine.tokenizer, self.engine.model.config.model_type, conv,
                                     **chat_kw).token_ids for conv in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """``priority``: one a prompt, under the priority scheduling policy (lower first)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts: a prompt (text, token ids or a prompt dict) or a non-empty list of them")
        if not (params is None or isinstance(params, SamplingParams) or
                (isinstance(params, list) and all(isinstance(sp, SamplingParams) for sp in params))):
            raise ValueError(f"params: a SamplingParams or a list of them (got {type(params).__name__})")
        one = params or self.get_default_sampling_params()
        params_list = params if isinstance(params, list) else [one] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams or one per prompt")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError("give one priority per prompt")
        ids: list[str] = []
        try:
            for p, sp, rank in zip(prompts, params_list, priority):
                ids.append(self.engine.add_request(_prompt_of(p), sp, priority=rank))
        except BaseException:  # (as vLLM: a refused prompt leaves none of the batch behind)
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finals: dict[str, RequestOutput] = {}
        from tqdm.auto import tqdm

        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        bar.update(1)
        return [finals[i] for i in ids]
