"""Load test of the server on loopback: throughput, the HTTP layer's added latency, memory.

    python -m spirit.server.loadtest --model smollm2-135m --method vanilla --max-tokens 32
    python -m spirit.server.loadtest --model tiny --memory-requests 500 --max-tokens 8

It starts the server on a thread of this process (a free 127.0.0.1 port) and prints:
1. sustained load: `--concurrency` clients send completions for `--duration` seconds;
   requests per minute and completion tokens per second over the wall time;
2. added latency: the same greedy requests through HTTP and through `lm.generate`, one at
   a time and interleaved; the difference of the medians is what HTTP + JSON + the queue cost;
3. memory: this process's RSS after `--memory-warmup` and after `--memory-requests` requests
   (the server is in this process, so the figure includes the small client side too).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

PROMPTS = [
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain what a hash table is.",
    "The three largest cities in Europe are",
    "Once upon a time, in a small village,",
    "import numpy as np\n\n# compute the mean of each column",
    "List five uses of a paperclip:",
    "Translate to French: good morning, how are you?",
]


def _rss_mb() -> float:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / 2**20


def _load(name: str, dtype: str | None):
    if name == "tiny":
        from spirit.testing import tiny_spirit

        return tiny_spirit("llama", num_layers=4)
    import spirit

    return spirit.load(name, dtype=dtype)


def sustained(url: str, concurrency: int, duration: float, max_tokens: int) -> dict:
    import httpx

    from spirit.server.client import run_clients

    issued = itertools.count()
    stop_at = time.perf_counter() + duration

    def send(client: httpx.Client, i: int) -> tuple[int, int]:  # (status, completion tokens)
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0}
        r = client.post(url + "/v1/completions", json=body)
        return r.status_code, r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0

    results, wall = run_clients(concurrency, lambda: next(issued) if time.perf_counter() < stop_at else None,
                                lambda: httpx.Client(timeout=300), send)
    done = list(results.values())
    ok = [n for status, n in done if status == 200]
    return {"wall_s": wall, "requests": len(done), "ok": len(ok), "requests_per_min": 60 * len(ok) / wall,
            "tokens_per_s": sum(ok) / wall, "statuses": sorted({s for s, _ in done})}


def added_latency(url: str, lm, method: str, rounds: int, max_tokens: int) -> dict:
    import httpx

    http_s, direct_s, overhead_s = [], [], []
    with httpx.Client(timeout=300) as c:
        for i in range(rounds):
            prompt = PROMPTS[i % len(PROMPTS)]
            for http_first in (i % 2 == 0, i % 2 == 1):  # alternate the order, against drift
                if http_first:
                    t0 = time.perf_counter()
                    r = c.post(url + "/v1/completions",
                               json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
                    http_s.append(time.perf_counter() - t0)
                    assert r.status_code == 200, r.text
                    # the same request's engine time, measured inside the server
                    overhead_s.append(http_s[-1] - r.json()["spirit"]["wall_time_s"])
                else:
                    t0 = time.perf_counter()  # the server is idle now: the engine may be used directly
                    out = lm.generate(prompt, method=method, max_new_tokens=max_tokens, temperature=0.0)
                    direct_s.append(time.perf_counter() - t0)
            assert out.text == r.json()["choices"][0]["text"]
    http_med, direct_med = statistics.median(http_s), statistics.median(direct_s)
    return {"http_ms": 1000 * http_med, "direct_ms": 1000 * direct_med, "added_ms": 1000 * (http_med - direct_med),
            "overhead_ms": 1000 * statistics.median(overhead_s)}


def memory(url: str, warmup: int, total: int, max_tokens: int) -> dict:
    import gc

    import httpx

    rss = {}
    with httpx.Client(timeout=300) as c:
        for i in range(total):
            body = {"prompt": PROMPTS[i % len(PROMPTS)] + f" ({i})", "max_tokens": max_tokens, "temperature": 0,
                    "stream": i % 2 == 1}
            r = c.post(url + ("/v1/completions" if i % 3 else "/v1/chat/completions"),
                       json=body if i % 3 else {**{k: v for k, v in body.items() if k != "prompt"},
                                                "messages": [{"role": "user", "content": body["prompt"]}]})
            assert r.status_code == 200, r.text
            if i + 1 in (warmup, total):
                gc.collect()
                rss[i + 1] = _rss_mb()
    return rss


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a model spirit.load knows, or 'tiny' (random, 4 layers)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--method", default="vanilla")
    p.add_argument("--skip", default=None, help="skip set for --method static")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of sustained load")
    p.add_argument("--latency-rounds", type=int, default=10)
    p.add_argument("--memory-warmup", type=int, default=10)
    p.add_argument("--memory-requests", type=int, default=500, help="0 skips the memory run")
    p.add_argument("--memory-max-tokens", type=int, default=8)
    args = p.parse_args(argv)

    import torch

    from spirit.server import ServerConfig, ServerThread

    lm = _load(args.model, args.dtype)
    config = ServerConfig(method=args.method, skip=args.skip, max_queue=max(16, args.concurrency))
    print(f"model {lm.name} ({lm.num_layers} layers, {str(lm.dtype).removeprefix('torch.')}), method {args.method}, "
          f"torch threads {torch.get_num_threads()}")
    kw = {"skip": args.skip} if args.method == "static" else {}
    with ServerThread(lm, config) as srv:
        lm.generate(PROMPTS[0], method=args.method, max_new_tokens=4, **kw)  # warm up
        if args.duration > 0:
            s = sustained(srv.url, args.concurrency, args.duration, args.max_tokens)
            print(f"sustained: {args.concurrency} clients x {s['wall_s']:.1f} s, max_tokens {args.max_tokens}: "
                  f"{s['ok']}/{s['requests']} ok (statuses {s['statuses']}), {s['requests_per_min']:.1f} requests/min, "
                  f"{s['tokens_per_s']:.1f} completion tokens/s")
        if args.latency_rounds > 0:
            lat = added_latency(srv.url, _Bound(lm, kw), args.method, args.latency_rounds, args.max_tokens)
            print(f"latency ({args.latency_rounds} greedy requests, max_tokens {args.max_tokens}, medians): "
                  f"HTTP {lat['http_ms']:.1f} ms, lm.generate {lat['direct_ms']:.1f} ms, "
                  f"difference {lat['added_ms']:.1f} ms; HTTP latency minus the engine's own time for the same "
                  f"request {lat['overhead_ms']:.1f} ms")
        if args.memory_requests > 0:
            rss = memory(srv.url, args.memory_warmup, args.memory_requests, args.memory_max_tokens)
            (a, ra), (b, rb) = sorted(rss.items())
            print(f"memory: RSS {ra:.1f} MiB after {a} requests, {rb:.1f} MiB after {b} "
                  f"(max_tokens {args.memory_max_tokens}; {rb - ra:+.1f} MiB)")
    return 0


class _Bound:
    """lm.generate with fixed extra keyword arguments (the static skip set)."""

    def __init__(self, lm, kw: dict) -> None:
        self.lm, self.kw = lm, kw

    def generate(self, prompt, **kw):
        return self.lm.generate(prompt, **kw, **self.kw)


if __name__ == "__main__":
    raise SystemExit(main())
