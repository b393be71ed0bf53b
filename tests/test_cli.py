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
