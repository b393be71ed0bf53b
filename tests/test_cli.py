"""The README's main command path: make-model then check, through the real CLI entry point."""

import json

from k3serve.cli import main


def test_make_model_then_check(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--mxfp4", "--seed", "2"]) == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert (out / "tiktoken.model").read_text().count("\n") == 256
    specials = json.loads((out / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert specials[str(2048 - 256 + 2)]["content"] == "<|end_of_msg|>"  # K3's eos at its usual offset
    capsys.readouterr()
    assert main(["check", "--model", str(out), "--verify-checksums", "--prompt-len", "20", "--steps", "3"]) == 0
    text = capsys.readouterr().out
    assert "experts mxfp4" in text and "greedy tokens" in text
    assert main(["check", "--preset", "tiny", "--prompt-len", "8", "--steps", "2"]) == 0


def test_generate_streams_and_batches(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["make-model", "--preset", "tiny", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--token-ids", "5 6 7", "--max-tokens", "4",
                 "--ignore-eos"]) == 0
    assert "[length, 4 tokens]" in capsys.readouterr().err
    # a preset has no tokenizer: the streamed output is the token ids themselves
    assert main(["generate", "--preset", "tiny", "--token-ids", "5 6 7", "--max-tokens", "4", "--ignore-eos"]) == 0
    cap = capsys.readouterr()
    assert len(cap.out.split()) == 4 and all(t.isdigit() for t in cap.out.split())
    assert main(["generate", "--model", str(out), "hello", "world", "--max-tokens", "3", "--ignore-eos",
                 "--temperature", "0.7", "--seed", "3"]) == 0
    cap = capsys.readouterr()
    assert cap.out.count("--- req-") == 2 and "2 requests, 6 tokens" in cap.err
    assert main(["generate", "--model", str(out), "x", "--temperature", "-1"]) == 2


def test_bad_input_is_one_error_line_not_a_traceback(tmp_path, capsys):
    """A misspelt model, a missing file, a checkpoint in the wrong dtype, a bad value: exit 2 and
    ``error: ...`` (they were tracebacks with exit 1)."""
    import shutil

    import pytest
    from safetensors.torch import load_file, save_file

    out = tmp_path / "tiny"
    assert main(["make-model", "--preset", "tiny", "--out", str(out)]) == 0
    cases = [
        (["generate", "--model", "tinyy", "x"], "no model directory 'tinyy', and no bundled model"),
        (["check", "--model", str(tmp_path / "nope")], "no model directory"),
        (["generate", "--model", str(out), "--prompts-file", str(tmp_path / "none.txt")], "none.txt"),
        (["generate", "--model", str(out), "--token-ids", "1 2 abc"], "invalid literal"),
        (["generate", "--model", str(out), "--token-ids", "1 2 999999"], "prompt token ids must be integers"),
        (["generate", "--model", str(out), "--cache-memory", "abc", "x"], "abc"),
        (["generate", "--model", str(out), "--device", "cuda:7", "x"], "--device cuda:7"),  # (CPU torch: was an
    ]                                                                                       # AssertionError)
    cases += [
    ]
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    shard = next(bad.glob("*.safetensors"))
    tensors = load_file(shard)
    name = next(k for k in tensors if k.endswith("up_proj.weight"))
    tensors[name] = tensors[name].to(dtype=__import__("torch").int32)  # (an integer weight loaded silently)
    save_file(tensors, shard, metadata={"format": "pt"})
    cases.append((["check", "--model", str(bad), "--steps", "1"], f"tensor {name}: dtype torch.int32"))
    nan = tmp_path / "nan"
    shutil.copytree(out, nan)
    tensors = load_file(shard := next(nan.glob("*.safetensors")))
    name = next(k for k in tensors if k.endswith("q_proj.weight") or k.endswith("q_a_proj.weight"))
    tensors[name][2, 3] = float("nan")  # (it loaded and ran: the logits came out NaN, no tensor named)
    save_file(tensors, shard, metadata={"format": "pt"})
    cases.append((["check", "--model", str(nan), "--steps", "1"], f"tensor {name}: 1 non-finite values"))
    for argv, needle in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        last = err.replace("\r", "\n").strip().splitlines()[-1]  # (after any progress bar)
        assert last.startswith("error: ") and needle in last and "Traceback" not in err, (argv, err)
    for flag in ("-tp", "--max-num-seqs", "--max-tokens"):  # sizes and degrees: >= 1, refused by argparse
        with pytest.raises(SystemExit) as exc:
            main(["generate", "--model", str(out), flag, "0", "x"])
        assert exc.value.code == 2 and "must be >= 1" in capsys.readouterr().err


def test_make_model_refuses_to_mix_checkpoints(tmp_path, capsys):
    """A second checkpoint written over a first left both sets of shards (loading then failed with
    a tensor that "appears twice")."""
    out = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--max-shard-gib", "0.001"]) == 0
    capsys.readouterr()
    assert main(["make-model", "--preset", "tiny", "--out", str(out)]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    assert main(["make-model", "--preset", "tiny", "--out", str(tmp_path / "f")]) == 2


def test_a_model_larger_than_host_memory_is_refused_before_loading(capsys):
    """K3 on CPU (~1.5 TiB as loaded) allocated until the machine ran out; now refused at once."""
    for argv in (["check", "--preset", "k3", "--device", "cpu"],
                 ["generate", "--preset", "k3", "--device", "cpu", "--token-ids", "1 2 3"]):
        assert main(argv) == 2
        assert "in host memory as loaded, more than the" in capsys.readouterr().err
