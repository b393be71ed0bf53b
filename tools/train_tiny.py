"""Train the small K3-architecture model k3serve ships as its default (issue [tiny-model]).

Every K3 feature is in the network: KDA with the lower-bounded gate and full-rank gates, gated NoPE
MLA, a dense first layer, Stable LatentMoE with SiTU-GLU and a shared expert, Block AttnRes with
two blocks. The router bias is set by Quantile Balancing (seed 002; aux-loss free): after every
step, each expert's bias moves so that exactly q = m*k/n of the batch's m tokens would have cleared
their cutoff (the (k+1)-th best biased score), i.e. the bias is minus the (q+1)-th largest margin.

Corpus: Python source files found offline (the standard library and site-packages), split into
train / held-out by file. Tokenizer: byte-level BPE trained with `tokenizers`, plus the K3
special tokens in the top 256 ids. Output: a checkpoint directory in the normal layout (bf16) and
an MXFP4-experts variant, with held-out perplexity for both.

    python tools/train_tiny.py --out k3serve/data/tiny --minutes 15          # on the H200
    python tools/train_tiny.py --out /tmp/t --steps 3 --device cpu --small   # smoke run
"""

from __future__ import annotations

import argparse
import copy
import functools
import dataclasses
import hashlib
import os
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3serve.config import ModelConfig  # noqa: E402
from k3serve.make_model import special_tokens  # noqa: E402
from k3serve.model.batch import CacheHandles, ForwardBatch, SeqChunk  # noqa: E402
from k3serve.model.k3 import K3ForCausalLM  # noqa: E402
from k3serve.ops import backend  # noqa: E402
from k3serve.ops import kda as kda_ops  # noqa: E402
from k3serve.model.weights import _full_shape, checkpoint_dtype, checkpoint_targets, load_dummy  # noqa: E402
from k3serve.ops.mxfp4 import quantize_mxfp4  # noqa: E402
from k3serve.presets import MXFP4_QUANT  # noqa: E402


# ---- corpus and tokenizer -------------------------------------------------------------------

def collect_corpus(max_files: int, max_bytes: int = 200_000, min_bytes: int = 512) -> list[tuple[str, str]]:
    """Python files from the stdlib and site-packages; empty stubs (most __init__.py) are skipped."""
    roots = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]}
    files = []
    for root in sorted(roots):
        for path in sorted(Path(root).rglob("*.py")):
            try:
                if not min_bytes <= path.stat().st_size <= max_bytes:
                    continue
                files.append((str(path.relative_to(root)), path.read_text(encoding="utf-8")))
            except (OSError, UnicodeDecodeError, ValueError):
                continue
            if len(files) >= max_files:
                return files
    return files


def split_by_file(files: list[tuple[str, str]], heldout_percent: int = 5):
    """Held-out files chosen by a hash of their path (stable across runs and machines): the
    ``heldout_percent`` of files with the smallest hashes, at least one, and never all of them."""
    if len(files) < 2:
        raise ValueError(f"need at least 2 corpus files to split, got {len(files)}")
    ranked = sorted(files, key=lambda f: hashlib.sha1(f[0].encode()).hexdigest())
    n_held = min(len(files) - 1, max(1, round(len(files) * heldout_percent / 100)))
    return [text for _, text in ranked[n_held:]], [text for _, text in ranked[:n_held]]


TOKENIZER_CHARS = 60_000_000  # BPE merges are learnt from this much text (a GPU machine's corpus is larger)


def _prefix_by_chars(texts: list[str], limit: int) -> list[str]:
    out, n = [], 0
    for t in texts:
        if n >= limit:
            break
        out.append(t)
        n += len(t)
    return out


def train_tokenizer(texts: list[str], vocab_size: int, cfg: ModelConfig):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers import AddedToken

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_prefix_by_chars(texts, TOKENIZER_CHARS), trainer)
    specials = special_tokens(cfg)
    tok.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)])
    for i, s in specials.items():
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s} landed on id {tok.token_to_id(s)}, expected {i}")
    return tok


# ---- model ----------------------------------------------------------------------------------

def tiny_config(vocab: int, small: bool = False) -> dict:
    h = 64 if small else 160  # 160: bf16 + MXFP4 checkpoints together stay under 20 MB
    text = {
        "model_type": "kimi_linear", "vocab_size": vocab, "hidden_size": h, "num_hidden_layers": 8,
        "intermediate_size": 4 * h, "num_attention_heads": 4, "num_key_value_heads": 4,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5, "model_max_length": 8192, "tie_word_embeddings": False,
        "bos_token_id": vocab - 256, "eos_token_id": vocab - 254, "pad_token_id": vocab - 1,
        "q_lora_rank": h // 2, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32,
        "v_head_dim": 32 if small else 48, "mla_use_nope": True, "mla_use_output_gate": True,
        "num_experts": 16, "num_experts_per_token": 4, "moe_intermediate_size": 64, "num_shared_experts": 1,
        "routed_scaling_factor": 1.0, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_expert_hidden_size": 32 if small else 96,
        "latent_moe_use_norm": True, "attn_res_block_size": 4, "num_nextn_predict_layers": 0,
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8],
                               "num_heads": 4, "head_dim": 32 if small else 48, "short_conv_kernel_size": 4,
                               "use_full_rank_gate": True, "gate_lower_bound": -5.0},
        "dtype": "bfloat16",
    }
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
            "bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"],
            "pad_token_id": text["pad_token_id"]}


@functools.lru_cache(maxsize=8)
def _layout(B: int, T: int, device: torch.device) -> ForwardBatch:
    """The batch layout of B fresh sequences of T tokens (token ids are swapped in per call, so a
    training step needs no host copy of its tokens)."""
    n_pages = -(-T // 64)
    return ForwardBatch.build([SeqChunk([0] * T, 0, i, list(range(i * n_pages, (i + 1) * n_pages)))
                               for i in range(B)], 64, device)


def sequence_logits(model: K3ForCausalLM, x: torch.Tensor) -> torch.Tensor:
    """Full-sequence forward of a [B, T] batch through the serving model (fresh caches)."""
    B, T = x.shape
    batch = dataclasses.replace(_layout(B, T, x.device), input_ids=x.reshape(-1))
    caches = CacheHandles.allocate(model.config, B, B * -(-T // 64), 64, device=x.device, dtype=model.dtype)
    return model.compute_logits(model(batch, caches)).view(B, T, -1)


@torch.no_grad()
def quantile_balance(model: K3ForCausalLM) -> float:
    """QB bias update for every MoE layer from the last batch's router logits; returns the mean
    |update| (it shrinks as the load evens out)."""
    total, n = 0.0, 0
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is None or getattr(moe.gate, "last_logits", None) is None:
            continue
        gate = moe.gate
        k = gate.args["top_k"]
        scores = torch.sigmoid(gate.last_logits)  # [m, n]
        m, E = scores.shape
        biased = scores + gate.e_score_correction_bias
        cutoff = biased.topk(k + 1, dim=-1).values[:, k:k + 1]  # (k+1)-th best per token
        margins = (biased - cutoff).sort(dim=0, descending=True).values  # per expert, over tokens
        q = min(m - 1, (m * k) // E)
        delta = -margins[q]  # the (q+1)-th largest margin moves to zero: q tokens stay above
        gate.e_score_correction_bias.add_(delta)
        total += delta.abs().mean().item()
        n += 1
        gate.last_logits = None
    return total / max(n, 1)


def encode_corpus(texts: list[str], tok, eos: int) -> torch.Tensor:
    """All training files as one token stream (files separated by EOS), encoded in parallel."""
    parts = []
    for enc in tok.encode_batch(texts):
        parts.append(torch.tensor(enc.ids + [eos], dtype=torch.int32))
    return torch.cat(parts)


def batches(stream: torch.Tensor, batch: int, seq_len: int, device, seed: int):
    """Random windows of the token stream (sampled on the device: no per-step host work)."""
    data = stream.to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    span = torch.arange(seq_len + 1, device=device)
    if data.numel() <= seq_len + 1:
        raise ValueError(f"corpus of {data.numel()} tokens is shorter than one window of {seq_len + 1}")
    while True:
        start = torch.randint(0, data.numel() - seq_len - 1, (batch, 1), device=device, generator=gen)
        t = data[start + span].long()
        yield t[:, :-1], t[:, 1:]


@torch.no_grad()
def perplexity(model: K3ForCausalLM, ids: list[int], seq_len: int, device, batch: int = 16) -> float:
    """exp(mean next-token NLL) over consecutive seq_len windows of ``ids``, ``batch`` windows a pass."""
    n = (len(ids) - 1) // seq_len
    if n == 0:
        raise ValueError(f"need more than {seq_len} held-out tokens, got {len(ids)}")
    windows = torch.tensor([ids[i * seq_len: (i + 1) * seq_len + 1] for i in range(n)], device=device)
    nll = 0.0
    for s in range(0, n, batch):
        w = windows[s:s + batch]
        logits = sequence_logits(model, w[:, :-1])
        nll += F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
    return math.exp(nll / (n * seq_len))


# ---- export ---------------------------------------------------------------------------------

def export(model: K3ForCausalLM, raw: dict, tok, out: Path, mxfp4: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    raw = copy.deepcopy(raw)
    if mxfp4:
        raw["text_config"]["quantization_config"] = copy.deepcopy(MXFP4_QUANT)
    cfg = ModelConfig.from_dict(raw)
    tensors = {}
    for name, target in checkpoint_targets(model).items():
        t = target.param.data if target.expert is None else target.param.data[target.expert]
        t = t.detach().reshape(_full_shape(name, target, cfg)).cpu()
        if mxfp4 and ".experts." in name:
            packed, scale = quantize_mxfp4(t.float())
            tensors[name[: -len("weight")] + "weight_packed"] = packed
            tensors[name[: -len("weight")] + "weight_scale"] = scale
        else:
            tensors[name] = t.to(checkpoint_dtype(name, cfg)).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}) + "\n")
    tok.save(str(out / "tokenizer.json"))


# ---- evaluation and model card -----------------------------------------------------------------

# Fixed prompts for the golden continuations, the bracket checks and the model card's examples.
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(",
    "class Config:\n    def __init__(self, name, value):\n        self.",
    "def read_file(path):\n    with open(path",
    "for i in range(len(items)):\n    if ",
    "    def __repr__(self):\n        return ",
    "try:\n    import json\nexcept ImportError:\n",
]
GOLDEN_TOKENS = 32
WARMUP_STEPS = 2
SAMPLE_CHARS = 16_000


def heldout_sample(held_texts: list[str], chars: int = SAMPLE_CHARS) -> str:
    """The first ``chars`` characters of the held-out files (whole lines), shipped for the CI check."""
    text = "\n\n".join(held_texts)[:chars]
    return text[: text.rfind("\n") + 1]


def sample_perplexity(model: K3ForCausalLM, tok, text: str, seq_len: int) -> float:
    """Perplexity of ``text`` as the engine tokenizes it (k3serve's Tokenizer)."""
    return perplexity(model, tok.encode(text), seq_len, next(model.parameters()).device)


def greedy_completions(model_dir: Path, prompts: list[str], max_tokens: int) -> list[dict]:
    """Greedy continuations through the serving engine (CPU, fp32), each with the smallest top-1
    margin over its steps from one uncached full-sequence forward (the golden test's robustness)."""
    from k3serve.engine.engine import LLM
    from k3serve.engine.sampling_params import SamplingParams

    llm = LLM(str(model_dir), dtype="float32", device="cpu")
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    rows = []
    for prompt, out in zip(prompts, outs):
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = sequence_logits(llm.engine.model, torch.tensor([ids[:-1]]))[0, len(out.prompt_token_ids) - 1:]
        top2 = logits.float().topk(2, dim=-1).values
        rows.append({"prompt": prompt, "token_ids": list(out.outputs[0].token_ids), "text": out.outputs[0].text,
                     "min_margin": round((top2[:, 0] - top2[:, 1]).min().item(), 4),
                     "uncached_argmax_equal": logits.argmax(-1).tolist() == list(out.outputs[0].token_ids)})
    return rows


def finalize(out: Path, held_texts: list[str] | None, seq_len: int) -> dict:
    """Evaluate the exported checkpoints the way users load them and write what ships with them:
    heldout_sample.txt, eval.json (sample perplexities, golden continuations) and the model card.
    With ``held_texts`` None the existing sample is kept (re-evaluating on another machine, whose
    corpus differs from the training machine's)."""
    from k3serve.model.loader import load_model
    from k3serve.tokenizer import load_tokenizer

    if held_texts is None:
        sample = (out / "heldout_sample.txt").read_text()
    else:
        sample = heldout_sample(held_texts)
        (out / "heldout_sample.txt").write_text(sample)
    tok = load_tokenizer(out)
    ev = {"sample_seq_len": seq_len, "sample_tokens": len(tok.encode(sample))}
    for variant, d in (("bf16", out), ("mxfp4", out.with_name(out.name + "-mxfp4"))):
        model = load_model(d, dtype="float32", device="cpu", progress=False)
        ev[f"sample_ppl_{variant}"] = round(sample_perplexity(model, tok, sample, seq_len), 4)
    ev["golden"] = greedy_completions(out, PROMPTS, GOLDEN_TOKENS)
    (out / "eval.json").write_text(json.dumps(ev, indent=1) + "\n")
    train = json.loads((out / "training_log.json").read_text())["result"]
    (out / "README.md").write_text(model_card(json.loads((out / "config.json").read_text()), train, ev))
    return ev


CPU_NOTE = """
This run was made on a CPU because no GPU time was left; the intended run is about 15 minutes on
one H200 (`python tools/train_tiny.py --out k3serve/data/tiny --minutes 15`), which sees far more
tokens."""


def _compile_note(train: dict) -> str:
    w = train.get("compile_warmup_seconds") or 0
    why = ("Triton compiling and autotuning fla's kernels" if train.get("kda_train_backend") == "fla"
           else "CUDA context and kernel warm-up")
    return f" (the first {WARMUP_STEPS} steps took {w:.0f} s: {why})" if w else ""


def _kda_note(train: dict) -> str:
    if train.get("kda_train_backend") != "torch":
        return ""
    return (f", the KDA core in k3serve's chunked torch form (chunks of {train.get('kda_chunk')}; fla's Triton "
            "backward took longer to compile than the whole run's budget)")


def model_card(raw: dict, train: dict, ev: dict) -> str:
    t = raw["text_config"]
    la = t["linear_attn_config"]
    examples = "\n".join(f"```python\n{g['prompt']}\u2588{g['text']}\n```" for g in ev["golden"][:4])
    return f"""# k3serve tiny: a small trained Kimi-K3-architecture model

The default model of `k3serve serve` / `k3serve generate` (bundled as package data), trained by
`tools/train_tiny.py` on Python source code. It exists to make the engine useful offline and to
measure quality (quantisation error, cached-vs-uncached identity, speculative acceptance) on a
model that has learnt something. It writes Python-looking code; it is not an assistant.

## Architecture (every K3 feature)
| | |
|---|---|
| parameters | {train['params'] / 1e6:.2f} M |
| layers | {t['num_hidden_layers']}: KDA at {la['kda_layers']}, gated NoPE MLA at {la['full_attn_layers']} (1-based) |
| hidden | {t['hidden_size']}, vocabulary {t['vocab_size']} (byte-level BPE; the top 256 ids are K3's special tokens) |
| KDA | {la['num_heads']} heads x {la['head_dim']}, short conv {la['short_conv_kernel_size']}, full-rank gates, lower-bounded sigmoid gate ({la['gate_lower_bound']}) |
| MLA | {t['num_attention_heads']} heads, q LoRA {t['q_lora_rank']}, latent {t['kv_lora_rank']} + {t['qk_rope_head_dim']} shared, output gate |
| MoE | dense first layer; Stable LatentMoE: {t['num_experts']} experts, top {t['num_experts_per_token']}, latent {t['routed_expert_hidden_size']}, expert width {t['moe_intermediate_size']}, {t['num_shared_experts']} shared expert, SiTU-GLU, latent RMSNorm; sigmoid router with bias set by Quantile Balancing (no aux loss) |
| Block AttnRes | blocks of {t['attn_res_block_size']} layers ({t['num_hidden_layers'] // t['attn_res_block_size']} blocks) |

## Training
`{train.get('command', 'python tools/train_tiny.py')}`

Corpus: the Python files (512 B to 200 KB) of the training machine's standard library and
site-packages, first {train['max_files']} in sorted order; 5 % of the files, chosen by a hash of the
path, held out. {train['steps']} steps of {train['batch']} x {train['seq_len']} tokens
({train['tokens_seen'] / 1e6:.1f} M tokens), AdamW, peak lr {train['lr']} with warm-up and cosine decay,
{train['train_seconds'] / 60:.1f} minutes on {train['device']}{_compile_note(train)}{_kda_note(train)}{f" ({train['threads']} threads)" if train.get('threads') else ""}; final training loss {train['final_loss']}.{CPU_NOTE if train['device'] == 'cpu' else ''}

## Quality
| | bf16 checkpoint | MXFP4 experts |
|---|---|---|
| held-out perplexity (first {train['heldout_tokens']} held-out tokens, fp32) | {train['heldout_ppl_bf16']} | {train['heldout_ppl_mxfp4']} ({100 * (train['heldout_ppl_mxfp4'] / train['heldout_ppl_bf16'] - 1):+.2f} %) |
| perplexity on `heldout_sample.txt` ({ev['sample_tokens']} tokens, fp32 on CPU; CI checks it stays at or below) | {ev['sample_ppl_bf16']} | {ev['sample_ppl_mxfp4']} |
| checkpoint size | {train['bytes_bf16'] / 1e6:.1f} MB | {train['bytes_mxfp4'] / 1e6:.1f} MB |

## Example completions (greedy, prompt then \u2588)
{examples}
"""


# ---- main -----------------------------------------------------------------------------------

def train_loss(model: K3ForCausalLM, x: torch.Tensor, y: torch.Tensor, autocast) -> torch.Tensor:
    """Next-token cross-entropy of one batch, backpropagated."""
    with autocast:
        logits = sequence_logits(model, x)
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss


def main(argv: list[str] | None = None) -> dict:
    """Train (or --finalize-only); the KDA backend choice is process-wide only while this runs."""
    prev = os.environ.get("K3SERVE_KDA_BACKEND")
    try:
        return _main(argv)
    finally:
        backend.override("KDA", prev)


def _main(argv: list[str] | None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--max-wall-minutes", type=float, default=None,
                    help="stop training this long after the start, whatever --minutes says (device leases)")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: time budget)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--max-files", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="smoke-test shapes")
    ap.add_argument("--eval-tokens", type=int, default=200_000)
    ap.add_argument("--kda-chunk", type=int, default=32, help="chunk of the torch KDA reference")
    ap.add_argument("--kda-backend", choices=["torch", "fla"], default="torch",
                    help="KDA core for training: the torch reference (equal-length sequences folded into heads, "
                         "no compile step) or fla-core's chunk_kda (its Triton kernels compile and autotune for "
                         "~7 minutes on a fresh H200 before the first step)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads")
    ap.add_argument("--finalize-only", action="store_true",
                    help="only (re)write heldout_sample.txt, eval.json and the card of an existing --out")
    args = ap.parse_args(argv)
    kda_ops.REF_CHUNK_SIZE = args.kda_chunk
    backend.override("KDA", args.kda_backend)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    t_start = time.perf_counter()
    if args.finalize_only and (out / "heldout_sample.txt").exists():
        return finalize(out, None, json.loads((out / "training_log.json").read_text())["result"]["seq_len"])
    files = collect_corpus(args.max_files)
    train_texts, held_texts = split_by_file(files)
    if args.finalize_only:
        return finalize(out, held_texts, args.seq_len)
    out.mkdir(parents=True, exist_ok=True)
    (out / "heldout_sample.txt").write_text(heldout_sample(held_texts))  # early: a cut-off run can still finalize
    raw = tiny_config(args.vocab, args.small)
    cfg = ModelConfig.from_dict(raw)
    tok = train_tokenizer(train_texts, args.vocab, cfg)
    eos = cfg.eos_token_ids[0]
    device = torch.device(args.device)
    model = K3ForCausalLM(cfg, torch.float32, device)
    load_dummy(model, seed=args.seed)  # fan-in-scaled random init, valid gates
    for name, p in model.named_parameters():
        p.requires_grad_(not name.endswith("e_score_correction_bias"))  # the bias is set by QB, not by SGD
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    stream = encode_corpus(train_texts, tok, eos)
    print(f"corpus: {len(train_texts)} train files, {stream.numel()} tokens; "
          f"{time.perf_counter() - t_start:.0f} s", flush=True)
    data = batches(stream, args.batch, args.seq_len, device, args.seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    budget = args.minutes * 60
    wall_end = t_start + args.max_wall_minutes * 60 if args.max_wall_minutes else math.inf
    log, step, t0, warmup_s = [], 0, time.perf_counter(), 0.0

    def running() -> bool:
        if time.perf_counter() >= wall_end:
            return False
        if args.steps is not None:
            return step < args.steps
        return time.perf_counter() - t0 < budget

    while running():
        x, y = next(data)
        progress = step / args.steps if args.steps else (time.perf_counter() - t0) / budget
        lr = args.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        try:
            loss = train_loss(model, x, y, autocast)
        except Exception as exc:  # fla's backward untried on this machine: fall back, say so
            if step > 0 or backend.choice("KDA") != "fla":
                raise
            print(f"KDA training through fla failed ({exc!r}); using the torch reference", flush=True)
            backend.override("KDA", "torch")
            loss = train_loss(model, x, y, autocast)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        if not (math.isfinite(loss.item()) and math.isfinite(grad_norm.item())):
            raise RuntimeError(f"step {step}: loss {loss.item()}, gradient norm {grad_norm.item()}; nothing exported")
        opt.step()
        qb = quantile_balance(model)
        log.append({"step": step, "loss": round(loss.item(), 4), "qb_update": round(qb, 5)})
        if step % 50 == 0 or step < WARMUP_STEPS:
            print(json.dumps({**log[-1], "elapsed_s": round(time.perf_counter() - t_start, 1)}), flush=True)
        step += 1
        if step == WARMUP_STEPS and device.type == "cuda" and args.steps is None:
            # Triton compiles and autotunes fla's kernels in the first steps (minutes on a fresh
            # machine): the time budget counts training, not compilation.
            warmup_s, t0 = time.perf_counter() - t0, time.perf_counter()
    train_s = time.perf_counter() - t0 + warmup_s
    model.eval()
    held_ids = []
    for text in held_texts:
        held_ids += tok.encode(text).ids + [eos]
        if len(held_ids) >= args.eval_tokens:
            break
    held_ids = held_ids[: args.eval_tokens + 1]
    result = {"steps": step, "train_seconds": round(train_s, 1), "compile_warmup_seconds": round(warmup_s, 1), "final_loss": log[-1]["loss"] if log else None,
              "files_train": len(train_texts), "files_heldout": len(held_texts), "heldout_tokens": len(held_ids),
              "params": sum(
                  p.numel() for p in model.parameters())}
    for variant, mx in (("bf16", False), ("mxfp4", True)):
        d = out if not mx else out.with_name(out.name + "-mxfp4")
        export(model, raw, tok, d, mx)
        from k3serve.model.loader import load_model

        loaded = load_model(d, dtype="float32", device=args.device, progress=False)
        result[f"heldout_ppl_{variant}"] = round(perplexity(loaded, held_ids, args.seq_len, device), 3)
        result[f"bytes_{variant}"] = (d / "model.safetensors").stat().st_size
    result["total_seconds"] = round(time.perf_counter() - t_start, 1)
    result.update({"command": "python tools/train_tiny.py " + " ".join(sys.argv[1:] if argv is None else argv),
                   "device": str(device), "threads": torch.get_num_threads() if device.type == "cpu" else None,
                   "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
                   "max_files": args.max_files, "tokens_seen": step * args.batch * args.seq_len,
                   "train_tokens": stream.numel(),
                   "kda_train_backend": backend.choice("KDA"), "kda_chunk": args.kda_chunk})
    (out / "training_log.json").write_text(json.dumps({"result": result, "log": log}, indent=1))
    finalize(out, None, args.seq_len)  # the held-out sample was written before training
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
