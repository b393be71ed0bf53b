"""Shipped autotuning results (ops/tuned_configs.py): what a tuning run chose is written per key,
and a fresh process given the file runs each listed key on that config without timing any, while
keys not in the file still tune; entries whose kernel or config is gone are skipped. Real Triton
autotuners over a real kernel, run under its CPU interpreter (in subprocesses: the interpreter flag
must be set before triton is imported)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

FIXTURE = textwrap.dedent('''
    import triton
    import triton.language as tl

    @triton.jit
    def _fill_block(OUT, N, BLOCK: tl.constexpr, PAD: tl.constexpr):
        """Writes the tile width it was launched with: which config ran is visible."""
        i = tl.arange(0, BLOCK)
        tl.store(OUT + i, tl.full([BLOCK], BLOCK + PAD, tl.int32), mask=i < N)

    CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((16, 4), (32, 4), (32, 8))]
    fill_block = triton.autotune(CONFIGS, key=["N"])(_fill_block)
    also_fill_block = fill_block  # (an alias: listed once)
    wrapped = triton.heuristics({"PAD": lambda args: 0})(triton.autotune(CONFIGS, key=["N"])(_fill_block))
''')

RUN = textwrap.dedent('''
    import json, sys, torch
    from pathlib import Path
    import k3serve_tuned_fixture as fx
    from k3serve.ops import tuned_configs

    def launch(kernel, n):
        out = torch.zeros(8, dtype=torch.int32)
        if kernel is fx.wrapped:
            kernel[(1,)](out, n)
        else:
            kernel[(1,)](out, n, PAD=0)
        return int(out[0])

    mode, path, listed = sys.argv[1], Path(sys.argv[2]), [int(n) for n in sys.argv[3].split(",")]
    tuners = tuned_configs.autotuners(("k3serve_tuned_fixture",))
    inner = fx.wrapped.fn
    if mode == "tune":  # a tuning run: (32, 8 warps) times fastest; what ran and what was chosen
        fake = lambda *a, config, **k: [1.0 if (config.kwargs["BLOCK"], config.num_warps) == (32, 8) else 2.0]
        fx.fill_block._bench = inner._bench = fake
        ran = [launch(fx.fill_block, n) for n in listed] + [launch(fx.wrapped, 6)]
        written = tuned_configs.dump(path, "Fake GPU", ("k3serve_tuned_fixture",))
        print(json.dumps({"names": sorted(tuners), "ran": ran, "written": written}))
    else:  # a fresh process given the file: no timing allowed for the listed keys
        def no_timing(*a, **k):
            raise AssertionError("timed a config")
        fx.fill_block._bench = inner._bench = no_timing
        counts = tuned_configs.apply(path=path)
        ran = [launch(fx.fill_block, n) for n in listed] + [launch(fx.wrapped, 6)]
        chosen = [c.num_warps for t in (fx.fill_block, inner) for c in t.cache.values()]
        try:
            launch(fx.fill_block, 3)  # a key not in the file tunes as before
            unlisted = "ran untimed"
        except AssertionError:
            unlisted = "timed"
        before = tuned_configs.unshipped(("k3serve_tuned_fixture",))
        fx.fill_block._bench = lambda *a, config, **k: [1.0]  # the unlisted key tuned here
        launch(fx.fill_block, 3)
        after = {n: [k[0] for k in keys] for n, keys in tuned_configs.unshipped(("k3serve_tuned_fixture",)).items()}
        print(json.dumps({"counts": counts, "ran": ran, "warps": chosen, "unlisted": unlisted,
                          "unshipped": [before, after]}))
''')


def _run(tmp_path, *args):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", ""), os.getcwd()]),
               K3SERVE_TUNED_CONFIGS="")
    res = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_dumped_choices_run_untimed_in_a_fresh_process(tmp_path):
    (tmp_path / "k3serve_tuned_fixture.py").write_text(FIXTURE)
    path = tmp_path / "tuned.json"
    tuned = _run(tmp_path, "tune", str(path), "5,7")
    assert tuned["names"] == ["k3serve_tuned_fixture.also_fill_block", "k3serve_tuned_fixture.wrapped"]
    assert tuned["ran"] == [32, 32, 32] and tuned["written"] == 3
    data = json.loads(path.read_text())
    assert data["device"] == "Fake GPU" and {len(v) for v in data["kernels"].values()} == {1, 2}
    assert all(e["config"] == {"kwargs": {"BLOCK": 32}, "num_warps": 8, "num_stages": 3, "num_ctas": 1,
                               "maxnreg": None} for v in data["kernels"].values() for e in v)

    fresh = _run(tmp_path, "apply", str(path), "5,7")
    assert fresh["counts"] == {"applied": 3, "stale": 0}
    assert fresh["ran"] == [32, 32, 32] and fresh["warps"] == [8, 8, 8]  # the file's config, untimed
    assert fresh["unlisted"] == "timed"
    # what was tuned in the process, not applied from the file: the unlisted key alone
    assert fresh["unshipped"] == [{}, {"k3serve_tuned_fixture.also_fill_block": [3]}]

    # entries whose kernel is gone or whose config the kernel no longer offers are skipped
    name = "k3serve_tuned_fixture.also_fill_block"
    data["kernels"][name][0]["config"]["kwargs"]["BLOCK"] = 64  # (the key N = 5)
    data["kernels"]["k3serve_tuned_fixture.gone"] = data["kernels"][name][1:]
    path.write_text(json.dumps(data))
    stale = _run(tmp_path, "apply", str(path), "7")
    assert stale["counts"] == {"applied": 2, "stale": 2} and stale["ran"] == [32, 32]


def test_no_file_or_switched_off_changes_nothing(tmp_path, monkeypatch):
    from k3serve.ops import tuned_configs

    assert tuned_configs.apply(path=tmp_path / "missing.json") == {"applied": 0, "stale": 0}
    assert tuned_configs.apply("cpu") == {"applied": 0, "stale": 0}
    (tmp_path / "t.json").write_text(json.dumps({"kernels": {"k3serve.ops.nothing.here": [{"key": [1], "config": {}}]}}))
    assert tuned_configs.apply(path=tmp_path / "t.json") == {"applied": 0, "stale": 1}
    monkeypatch.setenv("K3SERVE_TUNED_CONFIGS", "0")
    assert tuned_configs.apply(path=tmp_path / "t.json") == {"applied": 0, "stale": 0}
    monkeypatch.setenv("K3SERVE_TUNED_CONFIGS", str(tmp_path / "t.json"))
    assert tuned_configs.apply("cpu") == {"applied": 0, "stale": 1}  # a named file applies anywhere
    assert tuned_configs.file_for("NVIDIA H200", "3.6.0").name == "NVIDIA_H200-triton3.6.json"
    monkeypatch.delenv("K3SERVE_TUNED_CONFIGS")
    (tmp_path / "broken.json").write_text("{not json")
    assert tuned_configs.apply(path=tmp_path / "broken.json") == {"applied": 0, "stale": 0}
    (tmp_path / "odd.json").write_text(json.dumps({"kernels": {"k3serve.ops.gemv_triton._gemv_tuned": [{"key": [1]}]}}))
    assert tuned_configs.apply(path=tmp_path / "odd.json") == {"applied": 0, "stale": 1}  # (no config: skipped)
    assert tuned_configs._key([1, [2, "a"], "torch.bfloat16"]) == (1, (2, "a"), "torch.bfloat16")


SHIPPED_CHECK = textwrap.dedent('''
    import importlib, json, sys
    from k3serve.ops import tuned_configs
    out = {}
    for path in sorted(tuned_configs.TUNED_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        ours = {n: e for n, e in data["kernels"].items() if n.startswith("k3serve.")}
        misaligned = []
        for name, entries in ours.items():  # (fla's kernels do not import without CUDA)
            importlib.import_module(name.rpartition(".")[0])
            n = len(tuned_configs._resolve(name).keys)  # Triton's key: the named arguments, then tensor dtypes
            misaligned += [(name, e["key"]) for e in entries
                           if not (len(e["key"]) > n and str(e["key"][n]).startswith("torch.")
                                   and not any(str(v).startswith("torch.") for v in e["key"][:n]))]
        out[path.name] = {"device": data["device"], "triton": data["triton"],
                          "ours": sum(len(e) for e in ours.values()), "misaligned": misaligned,
                          "counts": tuned_configs.apply(path=path)}
    print(json.dumps(out))
''')


def test_shipped_files_match_the_kernels_candidate_lists():
    """Every shipped file is named for the device and Triton minor version it records, and each of
    its entries for our kernels still names a live kernel, one of its current candidate configs and
    as many key values as the kernel's autotuner names (a changed candidate list or a renamed kernel
    needs the file re-tuned on that GPU:
    ``python -m bench.tune_configs``). fla's entries cannot be checked without CUDA."""
    from k3serve.ops import tuned_configs

    files = sorted(tuned_configs.TUNED_DIR.glob("*.json"))
    assert files, "no shipped autotuning results under k3serve/ops/tuned/"
    # (not interpreted: there our autotuners hold a single config; nothing is launched here)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"K3SERVE_TUNED_CONFIGS": ""}
    res = subprocess.run([sys.executable, "-c", SHIPPED_CHECK], capture_output=True, text=True, env=env,
                         timeout=300, cwd=os.getcwd())
    assert res.returncode == 0, res.stderr[-3000:]
    for name, info in json.loads(res.stdout.strip().splitlines()[-1]).items():
        assert tuned_configs.file_for(info["device"], info["triton"]).name == name
        assert info["ours"] > 0
        # an entry whose key has more or fewer named values than its kernel's autotuner (a key argument
        # added or dropped) would never match: the kernel would tune afresh on every new machine
        assert info["misaligned"] == [], info["misaligned"][:3]
        # applied = our entries (all live); fla's are stale here only because fla cannot import
        assert info["counts"]["applied"] == info["ours"], (name, info)
