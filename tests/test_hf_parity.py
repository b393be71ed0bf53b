"""Parity with HF transformers' own KimiLinearForCausalLM (the published Kimi-Linear reference)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from k3serve.config import ModelConfig  # noqa: E402
from k3serve.model.batch import CacheHandles, ForwardBatch, SeqChunk  # noqa: E402
from k3serve.model.loader import load_model  # noqa: E402

PAGE = 8
VOCAB = 512


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
        v_head_dim=24, qk_nope_head_dim=16, num_local_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1,
        routed_scaling_factor=2.446, linear_head_dim=16, linear_num_heads=4, n_shared_experts=1,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"],
        pad_token_id=VOCAB - 1, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(1234)
    model = KimiLinearForCausalLM(cfg).float().eval()
    # Re-draw every weight at fan-in scale and perturb norms / biases, so nothing is trivially 1 or 0.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(("A_log", "dt_bias")):
                continue
            elif p.dim() >= 2:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    out = tmp_path_factory.mktemp("hf_kimi_linear")
    model.save_pretrained(out)
    return out, model


def test_config_layouts_agree(hf_dir):
    """The transformers-5 layout and the original Moonshot layout normalise to the same config."""
    path, _ = hf_dir
    raw = json.loads((path / "config.json").read_text())
    cfg5 = ModelConfig.from_dict(raw)
    moonshot = {k: v for k, v in raw.items() if k not in ("layer_types", "mlp_layer_types", "linear_head_dim",
                                                          "linear_num_heads", "linear_conv_kernel_dim")}
    moonshot["linear_attn_config"] = {"kda_layers": [1, 2, 4], "full_attn_layers": [3, 5], "num_heads": 4,
                                      "head_dim": 16, "short_conv_kernel_size": 4}
    moonshot["first_k_dense_replace"] = 1
    cfg_m = ModelConfig.from_dict(moonshot)
    assert cfg5.kda_layers == cfg_m.kda_layers == (0, 1, 3)
    assert cfg5.to_dict() == cfg_m.to_dict()


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("fused", [False, True])
def test_prefill_and_decode_match_hf(hf_dir, fused):
    """fused: the serving form (fuse_projections, no autograd): merged input GEMMs, Kimi-Linear's
    low-rank f / g up-projections as one batched GEMM."""
    path, hf = hf_dir
    ours = load_model(path, dtype="float32", device="cpu", progress=False)
    if fused:
        ours.fuse_projections()
        assert all(m.fg_b is not None for m in ours.modules() if hasattr(m, "fg_b"))
    with torch.inference_mode(fused):
        _compare(ours, hf)


def _compare(ours, hf):
    assert ours.config.num_expert_group == 2 and ours.config.routed_scaling_factor == pytest.approx(2.446)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB - 1, (n,), generator=gen).tolist() for n in (11, 70, 29)]
    pages = [list(range(i * 16, i * 16 + 16)) for i in range(3)]
    caches = CacheHandles.allocate(ours.config, num_slots=3, num_pages=48, page_size=PAGE, dtype=torch.float32)

    # One flat batch holding three prefills of different lengths.
    batch = ForwardBatch.build([SeqChunk(p, 0, i, pages[i]) for i, p in enumerate(prompts)], PAGE)
    logits = ours.compute_logits(ours(batch, caches))
    start = 0
    for p in prompts:
        ref = _hf_logits(hf, p)
        err = rel_err(logits[start:start + len(p)], ref)
        print("prefill rel err", err)
        assert err <= 1e-4
        start += len(p)

    # 16 greedy decode steps, all three sequences batched in each step.
    seqs = [list(p) for p in prompts]
    step_logits = [[] for _ in prompts]
    last = logits[batch.logits_indices]
    for _ in range(16):
        nxt = last.argmax(-1).tolist()
        chunks = []
        for i, s in enumerate(seqs):
            s.append(nxt[i])
            chunks.append(SeqChunk([nxt[i]], len(s) - 1, i, pages[i]))
        b = ForwardBatch.build(chunks, PAGE)
        assert b.num_decodes == 3
        last = ours.compute_logits(ours(b, caches))
        for i in range(3):
            step_logits[i].append(last[i])
    for i, p in enumerate(prompts):
        ref = _hf_logits(hf, seqs[i])[len(p):]  # logits at positions of the generated tokens
        assert rel_err(torch.stack(step_logits[i]), ref) <= 1e-4
        # Greedy continuation identical to HF's own generate (its KDA cache path).
        hf_out = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                             pad_token_id=VOCAB - 1)
        assert hf_out[0, len(p):].tolist() == seqs[i][len(p):len(p) + 16]
