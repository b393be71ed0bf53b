"""Checkpoint loading: layouts, names, determinism, and every bad-checkpoint case named clearly."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3serve.config import ConfigError
from k3serve.make_model import make_model
from k3serve.model.loader import load_model
from k3serve.model.weights import CheckpointError


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_src")
    make_model("tiny", out, seed=5, mxfp4=True, max_shard_bytes=1 << 20, progress=False)
    return out


@pytest.fixture
def ckpt(source, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(source, dst)
    return dst


def _load(path, **kw):
    return load_model(path, dtype="float32", device="cpu", progress=False, **kw)


def _index(path):
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def _edit_shard(path, tensor_name, edit):
    """Rewrite the shard holding ``tensor_name``; ``edit`` mutates the dict of its tensors."""
    shard = path / _index(path)[tensor_name]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard)


NAME = "language_model.model.layers.1.self_attn.k_proj.weight"


def test_sharded_k3_layout_loads_and_equals_dummy(ckpt):
    assert len(set(_index(ckpt).values())) > 1  # really sharded
    a = _load(ckpt, verify_checksums=True)
    b = load_model(preset="tiny", load_format="dummy", dtype="float32", device="cpu", seed=5, mxfp4=True)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    assert a.model.layers[1].block_sparse_moe.experts.w1_packed.dtype == torch.uint8  # kept packed


def test_make_model_is_deterministic(tmp_path):
    make_model("tiny", tmp_path / "a", seed=9, progress=False)
    make_model("tiny", tmp_path / "b", seed=9, progress=False)
    make_model("tiny", tmp_path / "c", seed=10, progress=False)
    sums = [(tmp_path / d / "checksums.sha256").read_text() for d in "abc"]
    assert sums[0] == sums[1] and sums[0] != sums[2]


def test_single_file_and_name_variants(ckpt, tmp_path):
    """One model.safetensors; K3's language_model.layers.N alias; legacy conv / A_log shapes;
    vision tensors ignored."""
    tensors = {}
    for f in sorted(ckpt.glob("model-*.safetensors")):
        tensors.update(load_file(f))
    ref = _load(ckpt)
    variant = {}
    for name, t in tensors.items():
        if name.endswith("self_attn.A_log"):
            t = torch.cat([t, torch.zeros(7)])  # K3 ships A_log longer than H; the first H are used
        if name.endswith("_conv1d.weight"):
            t = t[:, 0]  # accept [P, W]
        variant[name.replace("language_model.model.layers.", "language_model.layers.")] = t
    variant["vision_tower.patch_embed.proj.weight"] = torch.zeros(4, 4)
    single = tmp_path / "single"
    single.mkdir()
    for f in ("config.json", "tiktoken.model", "tokenizer_config.json"):
        shutil.copy(ckpt / f, single / f)
    save_file(variant, single / "model.safetensors")
    got = _load(single)
    for (n, a), (_, b) in zip(got.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), n


def test_missing_tensor(ckpt):
    _edit_shard(ckpt, NAME, lambda t: t.pop(NAME))
    with pytest.raises(CheckpointError, match=f"missing tensor {NAME}"):
        _load(ckpt)


def test_unexpected_tensor(ckpt):
    _edit_shard(ckpt, NAME, lambda t: t.update({"language_model.model.layers.1.self_attn.bogus.weight": torch.ones(2)}))
    with pytest.raises(CheckpointError, match="unexpected tensor language_model.model.layers.1.self_attn.bogus.weight"):
        _load(ckpt)


def test_shape_mismatch(ckpt):
    _edit_shard(ckpt, NAME, lambda t: t.update({NAME: t[NAME][:-1]}))
    with pytest.raises(CheckpointError, match=rf"tensor {NAME}: shape \[127, 128\] in the checkpoint, expected \[128, 128\]"):
        _load(ckpt)


def test_wrong_dtype_for_packed_experts(ckpt):
    name = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
    _edit_shard(ckpt, name, lambda t: t.update({name: t[name].float()}))
    with pytest.raises(CheckpointError, match=f"tensor {name}: dtype"):
        _load(ckpt)


def test_nan_mxfp4_scale(ckpt):
    name = "language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight_scale"
    _edit_shard(ckpt, name, lambda t: t[name].view(-1).__setitem__(0, 255))
    with pytest.raises(CheckpointError, match=f"tensor {name}: E8M0 scale byte 255"):
        _load(ckpt)


def test_truncated_shard(ckpt):
    shard = ckpt / _index(ckpt)[NAME]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"shard {shard.name} is unreadable or truncated"):
        _load(ckpt)


def test_garbage_shard(ckpt):
    shard = ckpt / _index(ckpt)[NAME]
    shard.write_bytes(b"\x00not a safetensors file at all" * 10)
    with pytest.raises(CheckpointError, match=f"shard {shard.name} is unreadable or truncated"):
        _load(ckpt)


def test_index_names_a_missing_shard(ckpt):
    shard = ckpt / _index(ckpt)[NAME]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard.name} listed in model.safetensors.index.json"):
        _load(ckpt)


def test_checksum_mismatch(ckpt):
    shard = ckpt / _index(ckpt)[NAME]
    _edit_shard(ckpt, NAME, lambda t: t[NAME].mul_(2))
    with pytest.raises(CheckpointError, match=f"shard {shard.name}: sha256 does not match"):
        _load(ckpt, verify_checksums=True)
    _load(ckpt)  # without verification the (valid) file still loads


def test_unknown_model_type(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["model_type"] = "deepseek_v3"
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="unknown model_type 'deepseek_v3'"):
        _load(ckpt)
