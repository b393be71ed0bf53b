"""The tiny-model trainer (tools/train_tiny.py): a CPU smoke run end to end, and Quantile Balancing."""

import importlib.util
import json
from pathlib import Path

import torch

from k3serve.model.loader import load_model
from k3serve.ops.moe_ref import route

_spec = importlib.util.spec_from_file_location("train_tiny", Path(__file__).parents[1] / "tools" / "train_tiny.py")
train_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_tiny)


def test_quantile_balancing_evens_the_load():
    """One QB update from a skewed router makes the per-expert load on that batch nearly uniform."""
    from k3serve.config import ModelConfig
    from k3serve.model.k3 import K3ForCausalLM

    cfg = ModelConfig.from_dict(train_tiny.tiny_config(512, small=True))
    model = K3ForCausalLM(cfg, torch.float32, "cpu")
    gate = model.model.layers[1].block_sparse_moe.gate
    gate.e_score_correction_bias.zero_()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4096, 16, generator=gen) + torch.linspace(-2, 2, 16)  # strongly skewed experts
    k = gate.args["top_k"]

    def load(bias):
        _, ids = route(logits, bias, k, 1, 1, True, 1.0)
        return torch.bincount(ids.flatten(), minlength=16).float()

    for layer in model.model.layers:  # only this layer has recorded scores
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            moe.gate.last_logits = None
    q = 4096 * k / 16
    before = load(gate.e_score_correction_bias)
    assert before.max() / before.min() > 5
    imbalance = []
    for _ in range(8):  # training applies it after every batch; here on the same batch
        gate.last_logits = logits
        train_tiny.quantile_balance(model)
        after = load(gate.e_score_correction_bias)
        imbalance.append(((after - q).abs().max() / q).item())
    assert imbalance[0] < 0.35 and imbalance[-1] <= 0.05  # converges to q = m k / n per expert
    assert all(b <= a + 0.01 for a, b in zip(imbalance, imbalance[1:]))


def test_smoke_run_trains_exports_and_reloads(tmp_path):
    res = train_tiny.main(["--out", str(tmp_path / "tiny"), "--device", "cpu", "--small", "--steps", "3",
                           "--max-files", "25", "--batch", "2", "--seq-len", "32", "--vocab", "512",
                           "--eval-tokens", "200"])
    assert res["steps"] == 3 and res["files_train"] > 0 and res["files_heldout"] > 0
    log = json.loads((tmp_path / "tiny" / "training_log.json").read_text())["log"]
    assert len(log) == 3 and all(r["loss"] == r["loss"] for r in log)  # finite
    for d in (tmp_path / "tiny", tmp_path / "tiny-mxfp4"):
        m = load_model(d, dtype="float32", device="cpu", progress=False)
        assert (m.config.expert_format == "mxfp4") == d.name.endswith("mxfp4")
    assert res["bytes_mxfp4"] < res["bytes_bf16"]
    assert res["heldout_ppl_bf16"] > 1 and abs(res["heldout_ppl_mxfp4"] / res["heldout_ppl_bf16"] - 1) < 0.1


def test_heldout_split_is_by_file_stable_and_never_empty():
    files = [(f"pkg/mod{i}.py", f"x = {i}\n") for i in range(30)]
    train, held = train_tiny.split_by_file(files)
    assert len(held) >= 1 and len(train) >= 1 and len(train) + len(held) == 30
    assert not set(train) & set(held)
    assert train_tiny.split_by_file(list(reversed(files))) == (train, held)  # order-independent
    assert len(train_tiny.split_by_file(files, heldout_percent=50)[1]) == 15


def test_batches_are_contiguous_windows_of_the_stream():
    stream = torch.arange(1000, dtype=torch.int32)
    x, y = next(train_tiny.batches(stream, 4, 16, "cpu", seed=0))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    assert torch.equal(x - x[:, :1], torch.arange(16).expand(4, 16))  # consecutive stream tokens


def test_finalize_only_keeps_the_training_machines_sample(tmp_path):
    out = tmp_path / "tiny"
    train_tiny.main(["--out", str(out), "--device", "cpu", "--small", "--steps", "1", "--max-files", "25",
                     "--batch", "2", "--seq-len", "32", "--vocab", "512", "--eval-tokens", "200"])
    (out / "heldout_sample.txt").write_text("def f(x):\n    return x + 1\n" * 20)
    ev = train_tiny.main(["--out", str(out), "--finalize-only"])
    assert (out / "heldout_sample.txt").read_text().startswith("def f(x):")
    assert ev["sample_seq_len"] == 32 and ev["sample_tokens"] > 32
    assert json.loads((out / "eval.json").read_text())["sample_ppl_bf16"] == ev["sample_ppl_bf16"]
