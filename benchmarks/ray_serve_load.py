"""Plain `spirit serve` against Ray Serve with 1 and 2 replicas, on this machine (loopback).

    python benchmarks/ray_serve_load.py --model smollm2-135m --method vanilla --max-tokens 32

For each setting, one after the other (never two at once):
1. added latency: `--latency-rounds` greedy requests one at a time; per request, the
   client's latency minus the engine's own time for it (the response's `spirit.wall_time_s`):
   what HTTP, JSON, the queue and, under Ray, the proxy and its routing cost (median);
2. sustained load: `--concurrency` clients for `--duration` seconds (loadtest.sustained):
   requests per minute and completion tokens per second.

Settings: plain `spirit serve` as a subprocess, with every core's threads and with one;
Ray Serve, 1 replica reserving every core (as many threads); Ray Serve, `--replicas` replicas
sharing the cores (cores / replicas each). On a 2-core machine two replicas cannot be
faster: each decodes with half the cores, and Ray's proxy and controller take CPU too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import httpx

from spirit.server.loadtest import PROMPTS, sustained


def added_latency(url: str, rounds: int, max_tokens: int) -> dict:
    latency, overhead = [], []
    with httpx.Client(timeout=300) as c:
        for i in range(rounds):
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions",
                       json={"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0})
            latency.append(time.perf_counter() - t0)
            r.raise_for_status()
            overhead.append(latency[-1] - r.json()["spirit"]["wall_time_s"])
    return {"latency_ms": 1000 * statistics.median(latency), "overhead_ms": 1000 * statistics.median(overhead)}


def measure(name: str, url: str, args: argparse.Namespace) -> dict:
    httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4}, timeout=300)  # warm up
    row = {"setting": name, **added_latency(url, args.latency_rounds, args.max_tokens)}
    row.update(sustained(url, args.concurrency, args.duration, args.max_tokens))
    print(f"{name}: latency {row['latency_ms']:.1f} ms, overhead {row['overhead_ms']:.1f} ms (median of "
          f"{args.latency_rounds}); {args.concurrency} clients x {row['wall_s']:.0f} s: {row['ok']}/{row['requests']} ok, "
          f"{row['requests_per_min']:.1f} requests/min, {row['tokens_per_s']:.1f} tokens/s", flush=True)
    return row


def plain(args: argparse.Namespace, port: int, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # torch's default thread count
    server = subprocess.Popen([sys.executable, "-m", "spirit.cli", "serve", "--model", args.model, "--method",
                               args.method, "--port", str(port), "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("spirit serve did not start")
            time.sleep(0.5)
        return measure(f"plain spirit serve, {threads} thread(s)", url, args)
    finally:
        server.terminate()
        server.wait(30)


def on_ray(args: argparse.Namespace, port: int, replicas: int) -> dict:
    from ray import serve

    from spirit.server.config import ServerConfig
    from spirit.server.ray_serve import ModelSpec, RayOptions, run

    cores = os.cpu_count() or 1
    options = RayOptions(replicas=replicas, cpus_per_replica=cores / replicas)
    url = run(ModelSpec(args.model), ServerConfig(method=args.method), options, port=port)
    try:
        return measure(f"Ray Serve, {replicas} replica(s) x {options.threads} thread(s)", url, args)
    finally:
        serve.delete(options.app_name)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="vanilla")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--latency-rounds", type=int, default=10)
    p.add_argument("--replicas", type=int, default=2, help="the scaled-out setting's replicas")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--plain-threads", type=lambda text: [int(t) for t in text.split(",")],
                   default=[os.cpu_count() or 1, 1], help="torch threads of each plain `spirit serve` run")
    args = p.parse_args(argv)

    import ray

    print(f"{args.model}, {args.method}, max_tokens {args.max_tokens}, {os.cpu_count()} cores", flush=True)
    rows = [plain(args, args.port, threads) for threads in args.plain_threads]
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    for replicas in (1, args.replicas):
        rows.append(on_ray(args, args.port + 1, replicas))
    ray.shutdown()
    print("\n| setting | latency (ms) | added over the engine (ms) | requests/min | tokens/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['latency_ms']:.1f} | {r['overhead_ms']:.1f} | {r['requests_per_min']:.1f} | "
              f"{r['tokens_per_s']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
