"""Autotuning results shipped per GPU model, as vLLM ships its fused-MoE configs per device.

An engine's first start on a fresh machine compiles and times every candidate config of every
autotuned Triton kernel (ours and fla's chunked KDA) at every key its shapes reach: on the H200
kimi-linear-48b took 166-204 s to start cold against ~60 s with the Triton cache warm (RESULTS.md
nineteenth session), and a later request of a new shape class (a longer context, a larger prefill)
paid its own tuning mid-serving. ``dump`` writes what the autotuners chose after a tuning run
(``python -m bench.tune_configs`` on the GPU); ``apply`` puts those choices into the autotuners'
caches at engine start, so Triton compiles only the chosen config of each key and times nothing.
Files are per device name and Triton minor version (``tuned/<device>-triton<X.Y>.json``); an
entry applies only where its kernel still exists and still offers that config (a changed kernel
or candidate list falls back to tuning, never to a stale tile); keys not in the file tune as before.
``K3SERVE_TUNED_CONFIGS=0`` turns it off (tune everything afresh); a path there names another file.
Shipped: the H200 with Triton 3.6 (57 keys: kimi-linear-48b and the K3 slice, 32K context), which
took kimi-linear-48b's cold start on a fresh machine from 166-204 s to 86 s (RESULTS.md twentieth
session); tests/test_tuned_configs.py checks that every shipped entry of ours names a live config.
An entry whose kernel's key has since changed (another output dtype, a new key argument) is never
looked up: that key tunes at first use on every fresh machine, and its tiles, so its numerics, then
follow that machine's timing (kimi-linear's MLA prefill with a bf16 output until the fifty-fourth
session); ``python -m bench.tune_configs --merge`` tunes just the keys the file lacks and adds them.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import sys
from pathlib import Path

import torch
import triton
from triton.runtime.autotuner import Autotuner

log = logging.getLogger(__name__)

TUNED_DIR = Path(__file__).parent / "tuned"
# modules whose autotuned kernels are covered: ours, and fla's (the chunked KDA prefill, its norms)
MODULE_PREFIXES = ("k3serve.", "fla.")


def file_for(device_name: str, triton_version: str = triton.__version__) -> Path:
    major_minor = ".".join(triton_version.split(".")[:2])
    return TUNED_DIR / f"{re.sub(r'[^0-9A-Za-z]+', '_', device_name).strip('_')}-triton{major_minor}.json"


def autotuners(prefixes: tuple[str, ...] = MODULE_PREFIXES) -> dict[str, Autotuner]:
    """Every autotuned kernel of the loaded modules under ``prefixes``, by "module.attribute"
    (through ``triton.heuristics`` wrappers)."""
    found, seen = {}, set()
    for mod_name, mod in sorted(sys.modules.items()):
        if mod is None or not mod_name.startswith(prefixes):
            continue
        try:
            members = sorted(vars(mod).items())
        except TypeError:  # (not a plain module)
            continue
        for attr, value in members:
            fn = _unwrap(value)
            if fn is not None and id(fn) not in seen:  # (an alias keeps the first name)
                seen.add(id(fn))
                found[f"{mod_name}.{attr}"] = fn
    return found


def _unwrap(value) -> Autotuner | None:
    for _ in range(4):  # (triton.heuristics and the like hold the autotuner as .fn)
        if value is None or isinstance(value, Autotuner):
            break
        value = getattr(value, "fn", None)
    return value if isinstance(value, Autotuner) else None


def _resolve(name: str) -> Autotuner | None:
    """The autotuner a file names ("module.attribute"), importing its module; None if gone."""
    module, _, attr = name.rpartition(".")
    try:
        return _unwrap(getattr(importlib.import_module(module), attr, None))
    except Exception:  # (a module that no longer imports: fla missing or renamed)
        return None


def _config_record(config: triton.Config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def _key(value):
    """A JSON key back to Triton's hashable form (lists were tuples)."""
    return tuple(_key(v) for v in value) if isinstance(value, list) else value


def dump(path: Path, device_name: str, prefixes: tuple[str, ...] = MODULE_PREFIXES) -> int:
    """Write every tuned key of the loaded autotuners to ``path``; returns the entries written.
    Keys are Triton's own cache keys (the key arguments' values, then the tensor arguments'
    dtypes), written as JSON lists."""
    kernels = {}
    for name, tuner in sorted(autotuners(prefixes).items()):
        entries = [{"key": list(key), "config": _config_record(config)} for key, config in tuner.cache.items()]
        if entries:
            kernels[name] = sorted(entries, key=lambda e: json.dumps(e["key"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": device_name, "triton": triton.__version__, "kernels": kernels},
                               indent=1, sort_keys=True) + "\n")
    return sum(len(v) for v in kernels.values())


_APPLIED: set[tuple[int, tuple]] = set()  # (id of the autotuner, key) put in by ``apply`` in this process


def unshipped(prefixes: tuple[str, ...] = MODULE_PREFIXES) -> dict[str, list[tuple]]:
    """The keys this process's autotuners hold that ``apply`` did not put in: tuned here, by this
    machine's timing (a shipped file missing them, or one whose kernel's key has since changed)."""
    out = {}
    for name, tuner in autotuners(prefixes).items():
        keys = [k for k in tuner.cache if (id(tuner), k) not in _APPLIED]
        if keys:
            out[name] = keys
    return out


def apply(device: torch.device | str | None = None, path: Path | None = None) -> dict[str, int]:
    """Pre-fill the loaded autotuners' caches from the shipped file for ``device`` (or ``path``):
    {"applied": entries put in, "stale": entries whose kernel or config no longer exists}. On a
    device without a file (or off CUDA) nothing changes. Keys a process already tuned stay."""
    setting = os.environ.get("K3SERVE_TUNED_CONFIGS", "")
    if setting == "0":
        return {"applied": 0, "stale": 0}
    if path is None and setting:
        path = Path(setting)
    if path is None:
        device = torch.device(device if device is not None else "cuda")
        if device.type != "cuda":
            return {"applied": 0, "stale": 0}
        path = file_for(torch.cuda.get_device_name(device))
    if not path.exists():
        log.info("no shipped autotuning results at %s: kernels tune at first use", path)
        return {"applied": 0, "stale": 0}
    try:
        kernels = json.loads(path.read_text())["kernels"]
    except (OSError, ValueError, KeyError) as exc:  # (a broken file costs tuning time, never the start)
        log.warning("autotuning results at %s unreadable, kernels tune at first use: %s", path, exc)
        return {"applied": 0, "stale": 0}
    applied = stale = 0
    for name, entries in kernels.items():
        tuner = _resolve(name)
        for entry in entries:
            try:
                match = None if tuner is None else next(
                    (c for c in tuner.configs if _config_record(c) == entry["config"]), None)
                if match is not None:
                    tuner.cache.setdefault(_key(entry["key"]), match)
                    _APPLIED.add((id(tuner), _key(entry["key"])))
            except (KeyError, TypeError):  # a malformed entry
                match = None
            applied += match is not None
            stale += match is None
    log.info("autotuning results from %s: %d applied, %d stale", path.name, applied, stale)
    return {"applied": applied, "stale": stale}
