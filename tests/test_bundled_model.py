"""The bundled trained tiny model (k3serve/data/tiny, tools/train_tiny.py): loads through the normal
checkpoint path, is the CLI default, writes bracket-consistent Python, reproduces its golden greedy
continuations and keeps the held-out perplexity recorded in its model card."""

import importlib.util
import io
import json
import re
import tokenize
from pathlib import Path

import pytest
import torch

from k3serve.bundled import BUNDLED_MODELS, resolve_model
from k3serve.engine.engine import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.loader import load_model
from k3serve.tokenizer import load_tokenizer

_spec = importlib.util.spec_from_file_location("train_tiny", Path(__file__).parents[1] / "tools" / "train_tiny.py")
train_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_tiny)

TINY = resolve_model("tiny")
EVAL = json.loads((TINY / "eval.json").read_text())
PAIRS = {")": "(", "]": "[", "}": "{"}


@pytest.fixture(scope="module")
def llm():
    return LLM(str(TINY), dtype="float32", device="cpu")


def test_bundled_checkpoints_have_every_k3_feature_and_fit_the_size_budget():
    total = 0
    for name, path in BUNDLED_MODELS.items():
        model = load_model(path, dtype="float32", device="cpu", progress=False)  # the normal checkpoint path
        cfg = model.config
        assert (cfg.expert_format == "mxfp4") == name.endswith("mxfp4")
        assert cfg.num_kda_layers and cfg.num_mla_layers and cfg.first_k_dense_replace >= 1
        assert cfg.kda_gate_lower_bound == -5.0 and cfg.kda_full_rank_gate
        assert cfg.mla_use_output_gate and cfg.hidden_act == "situ" and cfg.num_shared_experts >= 1
        assert cfg.routed_expert_hidden_size < cfg.hidden_size and cfg.latent_moe_use_norm
        assert cfg.num_attn_res_blocks >= 2
        total += sum(f.stat().st_size for f in path.iterdir())
    assert total <= 20e6


def test_resolve_model_names_paths_and_default(tmp_path):
    assert resolve_model(None) == TINY and resolve_model("tiny-mxfp4") == BUNDLED_MODELS["tiny-mxfp4"]
    assert resolve_model(str(tmp_path)) == tmp_path  # a real path wins over a name
    with pytest.raises(FileNotFoundError, match="no model directory 'no/such/dir'.*bundled: tiny"):
        resolve_model("no/such/dir")  # (named at once: the loader said only that config.json was missing)


def test_cli_generate_defaults_to_the_bundled_model(capsys):
    from k3serve.cli import main

    assert main(["generate", EVAL["golden"][0]["prompt"], "--max-tokens", "8", "--ignore-eos"]) == 0
    out = capsys.readouterr()
    assert "[length, 8 tokens]" in out.err and out.out.strip()


def _bracket_errors(code: str) -> tuple[list[str], list[str]]:
    """Python-tokenize ``code`` (strings and comments are skipped by the tokenizer) and return
    (mismatched closers, openers left open)."""
    stack, bad = [], []
    try:
        for t in tokenize.generate_tokens(io.StringIO(code).readline):
            if t.type == tokenize.OP and t.string in "([{":
                stack.append(t.string)
            elif t.type == tokenize.OP and t.string in PAIRS:
                if not stack or stack.pop() != PAIRS[t.string]:
                    bad.append(f"{t.string} at {t.start}")
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # cut mid-statement or mid-string: judge what was read
    return bad, stack


@pytest.fixture(scope="module")
def completions(llm):
    prompts = [g["prompt"] for g in EVAL["golden"]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [(p, o.outputs[0].text) for p, o in zip(prompts, outs)]


def test_greedy_completions_never_mismatch_brackets(completions):
    """Every closing bracket in prompt + completion closes an opener of its own kind (random
    weights fail this on half of these prompts)."""
    for prompt, completion in completions:
        bad, _ = _bracket_errors(prompt + completion)
        assert not bad, f"mismatched brackets in {prompt + completion!r}: {bad}"


# Prompts that stop inside a bracket. The model (5.4 M parameters, 11.4 M tokens on the H200)
# answers `def main(` (index 0) with a newline and a docstring, leaving the parenthesis open: a
# known weakness of a model this small, kept visible as a strict xfail (a better model makes it
# pass, and then this test says so). The other prompts must close what they left open.
_LEFT_OPEN = [i for i, g in enumerate(EVAL["golden"]) if _bracket_errors(g["prompt"])[1]]
_UNCLOSED_KNOWN = {0}


@pytest.mark.parametrize("i", [pytest.param(i, marks=pytest.mark.xfail(
    strict=True, reason="the 5.4 M-parameter model leaves `def main(` open")) if i in _UNCLOSED_KNOWN else i
    for i in _LEFT_OPEN])
def test_greedy_completion_closes_the_bracket_the_prompt_left_open(completions, i):
    prompt, completion = completions[i]
    _, open_in_prompt = _bracket_errors(prompt)
    text = prompt + completion
    whole_lines = text[: text.rfind("\n") + 1] if "\n" in completion else text
    _, left = _bracket_errors(whole_lines)
    assert len(left) < len(open_in_prompt), f"bracket opened in the prompt never closed: {text!r}"


def test_golden_continuations_are_reproduced(llm):
    """Exact greedy tokens recorded at training time (fp32, CPU); only steps with a clear top-1
    margin are pinned so a different CPU's rounding cannot flip a near tie."""
    stable = [g for g in EVAL["golden"] if g["min_margin"] > 1e-3]
    assert len(stable) >= 4
    outs = llm.generate([g["prompt"] for g in stable],
                        SamplingParams(max_tokens=len(stable[0]["token_ids"]), temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    for g, out in zip(stable, outs):
        assert list(out.outputs[0].token_ids) == g["token_ids"], g["prompt"]
        assert out.outputs[0].text == g["text"]
    assert all(g["uncached_argmax_equal"] for g in EVAL["golden"])  # engine decode == one full forward


def test_heldout_sample_perplexity_stays_at_the_model_card_value():
    tok = load_tokenizer(TINY)
    sample = (TINY / "heldout_sample.txt").read_text()
    ppl = {}
    for variant, path in (("bf16", TINY), ("mxfp4", BUNDLED_MODELS["tiny-mxfp4"])):
        model = load_model(path, dtype="float32", device="cpu", progress=False)
        with torch.no_grad():
            ppl[variant] = train_tiny.sample_perplexity(model, tok, sample, EVAL["sample_seq_len"])
        assert ppl[variant] <= EVAL[f"sample_ppl_{variant}"] * (1 + 1e-4)
    assert abs(ppl["mxfp4"] / ppl["bf16"] - 1) < 0.02
    card = (TINY / "README.md").read_text()
    recorded = re.search(r"heldout_sample\.txt.*?\| ([0-9.]+) \| ([0-9.]+) \|", card)
    assert recorded and float(recorded.group(1)) == EVAL["sample_ppl_bf16"]
    untrained = load_model(TINY, dtype="float32", device="cpu", load_format="dummy", progress=False)
    with torch.no_grad():
        ppl_untrained = train_tiny.sample_perplexity(untrained, tok, sample, EVAL["sample_seq_len"])
    assert ppl["bf16"] < untrained.config.vocab_size / 20 < ppl_untrained  # learnt, not luck of the init


def test_prefix_cached_multi_turn_code_equals_uncached():
    """Cached-vs-uncached identity on meaningful text: a code 'session' whose turns extend the
    previous prompt + answer, served with prefix caching (KDA checkpoints + shared pages) and without."""
    from k3serve.engine.engine import EngineConfig, LLMEngine

    def engine(cache):
        return LLMEngine.from_pretrained(str(TINY), dtype="float32", device="cpu", progress=False, config=EngineConfig(
            cache_memory="64MiB", page_size=8, enable_prefix_caching=cache, prefix_block_size=16,
            kda_checkpoint_interval=32, max_num_batched_tokens=64))

    cached, plain = engine(True), engine(False)
    context = (TINY / "heldout_sample.txt").read_text()[:1500]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = context
    for turn, follow_up in enumerate(["\n\ndef helper(", "\n\nclass Result:\n    ", "\n\nif __name__ == "]):
        prompt += follow_up
        outs = [LLM.from_engine(e).generate([prompt], greedy, use_tqdm=False)[0].outputs[0] for e in (cached, plain)]
        assert outs[0].token_ids == outs[1].token_ids, turn
        prompt += outs[0].text
    stats = cached.prefix_stats()
    assert stats["hits"] == 2 and stats["hit_rate"] > 0.5
