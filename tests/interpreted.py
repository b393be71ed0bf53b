"""Run a Triton-kernel check script on CPU under TRITON_INTERPRET=1 in a fresh interpreter (the
flag must be set before triton is imported) and return the worst relative error it prints."""

import os
import subprocess
import sys


def worst_error(script: str, *args: str) -> float:
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return float(res.stdout.strip().splitlines()[-1])
