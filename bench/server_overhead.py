"""The HTTP server process's own CPU per streamed token (any machine; no GPU needed).

The engine steps in its own process (engine/engine_process.py), so the server process's CPU time
is what HTTP, SSE, JSON, metrics and the message plumbing cost, whatever the model. This starts
``k3serve serve`` on a preset (default: tiny, on CPU), streams ``k3serve bench serve`` load at a
concurrency, and reads the server process's user + system time from /proc around each timed run.

  python -m bench.server_overhead [--concurrency 32] [--output-len 64] [--runs 5]
  python -m bench.server_overhead --input-len 512 --output-len 1   # what a request's intake costs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import httpx


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, this process only


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--server-args", default="", help="more `k3serve serve` arguments, e.g. '--api-key k'")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "k3serve.cli", "serve", "--preset", args.preset, "--device",
                               args.device, "--port", str(args.port), "--log-level", "warning",
                               *args.server_args.split()])
    key = next((a for a in args.server_args.split()[1:] if args.server_args.split()[0] == "--api-key"), None)
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit("the server exited")
            try:
                httpx.get(url + "/health", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        bench = [sys.executable, "-m", "k3serve.cli", "bench", "serve", "--url", url, "--range-ratio", "0",
                 "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                 "--concurrency", str(args.concurrency), "--json", *(["--api-key", key] if key else [])]
        subprocess.run(bench + ["--num-prompts", str(args.concurrency)], check=True, capture_output=True)  # warm-up
        per_token, per_request = [], []
        for _ in range(args.runs):
            c0 = _cpu_s(server.pid)
            out = subprocess.run(bench + ["--num-prompts", str(2 * args.concurrency)], check=True,
                                 capture_output=True, text=True).stdout
            cpu = _cpu_s(server.pid) - c0
            rep = json.loads(out)
            per_token.append(1e6 * cpu / rep["output_tokens"])
            per_request.append(1e3 * cpu / rep["completed"])
            print(json.dumps({"server_cpu_s": round(cpu, 3), "output_tokens": rep["output_tokens"],
                              "server_cpu_us_per_token": round(per_token[-1], 1),
                              "server_cpu_ms_per_request": round(per_request[-1], 3),
                              "itl_median_ms": round(rep["itl_ms"]["median"], 2)}), flush=True)
        print(f"server process CPU a streamed token: median {statistics.median(per_token):.1f} us "
              f"(min {min(per_token):.1f}, max {max(per_token):.1f}) over {args.runs} runs at concurrency "
              f"{args.concurrency}, {args.output_len} tokens a request; a request (prompt of {args.input_len}): "
              f"median {statistics.median(per_request):.3f} ms")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
