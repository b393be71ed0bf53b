"""``--quantization mxfp4``: bf16 routed experts served as MXFP4, quantised as they load.

The reference is the offline route: the same checkpoint with its experts quantised by
``quantize_mxfp4`` and written as K3 ships them. Loading at quantisation time must give the very
same model, byte for byte, through the files and through the dummy loader."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3serve.cli import build_parser, engine_from_args, main
from k3serve.config import ConfigError, ModelConfig
from k3serve.engine.engine import LLM
from k3serve.engine.sampling_params import SamplingParams
from k3serve.make_model import make_model
from k3serve.model.loader import load_model
from k3serve.model.weights import CheckpointError
from k3serve.model.moe import MoE
from k3serve.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from k3serve.plan import checkpoint_bytes
from k3serve.presets import MXFP4_QUANT, preset_config

EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight"


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_bf16")
    make_model("tiny", out, seed=3, max_shard_bytes=1 << 20, progress=False)
    return out


def _tensors(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        out.update(load_file(path / shard))
    return out


@pytest.fixture(scope="module")
def offline_dir(bf16_dir, tmp_path_factory):
    """The bf16 checkpoint with every routed expert matrix quantised offline, in K3's layout."""
    out = tmp_path_factory.mktemp("tiny_offline_mxfp4")
    tensors = {}
    for name, t in _tensors(bf16_dir).items():
        if ".experts." in name:
            packed, scale = quantize_mxfp4(t)
            tensors[name + "_packed"], tensors[name + "_scale"] = packed, scale
        else:
            tensors[name] = t
    save_file(tensors, out / "model.safetensors")
    raw = json.loads((bf16_dir / "config.json").read_text())
    raw["text_config"]["quantization_config"] = dict(MXFP4_QUANT)
    (out / "config.json").write_text(json.dumps(raw))
    return out


def _load(path, **kw):
    return load_model(path, dtype="float32", device="cpu", progress=False, **kw)


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


def test_quantised_at_load_equals_the_offline_checkpoint(bf16_dir, offline_dir):
    online = _load(bf16_dir, quantization="mxfp4")
    offline = _load(offline_dir)
    assert online.config.expert_format == "mxfp4" and online.config.experts_quantized_at_load
    assert not offline.config.experts_quantized_at_load
    experts = online.model.layers[1].block_sparse_moe.experts
    assert experts.mxfp4 and experts.w1_packed.dtype == torch.uint8
    _assert_same_weights(online, offline)
    # the served tokens too, through the engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 300, 41, 7], list(range(100, 137))]
    kw = dict(dtype="float32", device="cpu", cache_memory="64MiB", page_size=16)
    a = LLM(str(bf16_dir), quantization="mxfp4", **kw).generate(prompts, params, use_tqdm=False)
    b = LLM(str(offline_dir), **kw).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    # and the quantisation is real: the bf16 model answers from other weights
    plain = _load(bf16_dir)
    w = plain.model.layers[1].block_sparse_moe.experts.w1
    assert not torch.equal(experts.expert(0)[0], w[0])


def test_dummy_weights_quantise_the_bf16_dummy_weights():
    q = load_model(preset="tiny", dtype="float32", device="cpu", seed=6, quantization="mxfp4")
    f = load_model(preset="tiny", dtype="float32", device="cpu", seed=6)
    fs, qs = f.state_dict(), q.state_dict()
    n_experts = 0
    for name, t in fs.items():
        if ".experts.w" in name and "_joined" not in name:
            packed, scale = quantize_mxfp4(t)
            assert torch.equal(qs[name + "_packed"], packed) and torch.equal(qs[name + "_scale"], scale), name
            n_experts += 1
        elif name in qs:
            assert torch.equal(qs[name], t), name
    assert n_experts == 3 * sum(1 for m in f.modules() if type(m).__name__ == "RoutedExperts") > 0


def test_an_mxfp4_checkpoint_is_served_as_it_is(offline_dir):
    cfg = ModelConfig.from_pretrained(offline_dir)
    assert cfg.with_quantization("mxfp4") is cfg and cfg.with_quantization(None) is cfg
    _assert_same_weights(_load(offline_dir, quantization="mxfp4"), _load(offline_dir))


def test_bad_requests_and_bad_tensors_are_named(bf16_dir, tmp_path):
    cfg = ModelConfig.from_dict(preset_config("tiny"))
    with pytest.raises(ConfigError, match="unknown quantization 'fp8'"):
        cfg.with_quantization("fp8")
    with pytest.raises(ConfigError, match="routed experts, and this model has none"):
        dataclasses.replace(cfg, num_experts=None).with_quantization("mxfp4")
    with pytest.raises(ConfigError, match="moe_intermediate_size=48 divisible by the group size 32"):
        dataclasses.replace(cfg, moe_intermediate_size=48).with_quantization("mxfp4")
    for bad, message in ((lambda t: t.to(torch.int16), "dtype torch.int16 in the checkpoint, expected a floating"),
                         (lambda t: t.index_fill(0, torch.tensor([3]), float("inf")), "non-finite")):
        tensors = _tensors(bf16_dir)
        tensors[EXPERT] = bad(tensors[EXPERT])
        path = tmp_path / message[:5]
        path.mkdir()
        save_file(tensors, path / "model.safetensors")
        (path / "config.json").write_text((bf16_dir / "config.json").read_text())
        with pytest.raises(CheckpointError, match=f"tensor {EXPERT}: .*{message}"):
            _load(path, quantization="mxfp4")


def test_memory_plan_counts_the_served_experts():
    cfg = ModelConfig.from_dict(preset_config("kimi-linear-48b"))
    bf16, q = checkpoint_bytes(cfg), checkpoint_bytes(cfg.with_quantization("mxfp4"))
    assert q.other == bf16.other
    assert q.expert * 64 == bf16.expert * 17  # 4.25 bits a weight against 16


def test_cli_flag(capsys):
    plan = ["plan", "--preset", "kimi-linear-48b", "--gpus", "1", "--gpu-memory", "139GiB", "--json"]
    assert main(plan) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert main(plan + ["-q", "mxfp4"]) == 0
    q = json.loads(capsys.readouterr().out)
    assert q["other_gib"] == bf16["other_gib"] and q["expert_gib"] == pytest.approx(bf16["expert_gib"] * 17 / 64, abs=0.01)
    for cmd in ("serve", "generate", "check"):
        args = build_parser().parse_args([cmd, "--preset", "tiny", "-q", "mxfp4"] + (["x"] if cmd == "generate" else []))
        assert args.quantization == "mxfp4"
    assert main(["check", "--preset", "tiny", "--quantization", "mxfp4", "--prompt-len", "8", "--steps", "2"]) == 0
    assert "experts mxfp4 (quantised at load)" in capsys.readouterr().out
    # the server's engine process builds its engine from the same flags
    args = build_parser().parse_args(["serve", "--preset", "tiny", "-q", "mxfp4", "--cache-memory", "64MiB"])
    assert engine_from_args(args).model.config.experts_quantized_at_load


def test_a_joinable_shared_expert_is_quantised_into_the_stacks():
    """kimi-linear's shared MLP (the routed width, no latent projections) joins the quantised
    stacks as expert E, so every batch reads it from there in MXFP4 and its bf16 MLP is dropped."""
    cfg = dataclasses.replace(ModelConfig.from_dict(preset_config("kimi-linear-48b")), hidden_size=64,
                              moe_intermediate_size=32, num_experts=12, num_experts_per_token=3)
    cfg = cfg.with_quantization("mxfp4")
    gen = torch.Generator().manual_seed(1)
    moe = MoE(cfg, torch.float32)
    for name, p in moe.named_parameters():
        if name.endswith("_packed"):
            p.data.copy_(torch.randint(0, 256, p.shape, generator=gen, dtype=torch.uint8))
        elif name.endswith("_scale"):
            p.data.copy_(torch.randint(121, 125, p.shape, generator=gen, dtype=torch.uint8))
        else:  # shared MLP weights MXFP4 can hold exactly: the join then loses nothing
            w = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
            p.data.copy_(dequantize_mxfp4(*quantize_mxfp4(w), torch.float32) if "shared" in name else w)
    x = torch.randn(5, 64, generator=gen)
    with torch.inference_mode():
        ref = moe(x)  # shared MLP + routed experts apart
        shared = [getattr(moe.shared_experts, n).weight.clone() for n in ("gate_proj", "up_proj", "down_proj")]
        moe.join_shared_experts()
        assert moe.shared_experts is None and moe.experts.num_shared == 1
        for name, w in zip(("w1", "w3", "w2"), shared):
            packed, scale = moe.experts.stack(name)
            assert packed.shape[0] == 13 and torch.equal(dequantize_mxfp4(packed[12], scale[12], torch.float32), w)
        joined = moe(x)
        with torch.enable_grad():  # every path reads it from the stacks now
            assert torch.allclose(moe(x), joined)
    assert ((joined - ref).norm() / ref.norm()).item() < 1e-6
    bf16 = dataclasses.replace(cfg, expert_format="mxfp4", experts_quantized_at_load=False)
    assert not MoE(bf16, torch.float32).experts.join_shared(MoE(bf16, torch.float32).shared_experts)
