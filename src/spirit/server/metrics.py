"""The server's Prometheus metrics, written in the text exposition format (version 0.0.4).

Kept by hand rather than with prometheus_client: a handful of series, one lock. The
generation figures reuse the definitions of `spirit.stats` (tokens/s includes the prefill;
acceptance rate = accepted / drafted tokens, from the two counters).

Every series is a total over all requests, for the operator. None is the figure of one
request (no "last request's acceptance") or of the shared draft state (no current skip
ratio): any API client can read this route, and such a figure would show it something of
what other users' requests did and taught the shared policy (docs/server.md).

    spirit_http_requests_total{route,status}        requests answered, by HTTP status
    spirit_http_request_duration_seconds{route}     histogram, until the last byte (streams too)
    spirit_queue_depth / spirit_queue_capacity      jobs waiting behind the running ones / the bound
    spirit_requests_running                         jobs decoding now (at most --max-batch)
    spirit_generated_tokens_total, spirit_prompt_tokens_total, spirit_generation_seconds_total
    spirit_drafted_tokens_total, spirit_accepted_tokens_total
    spirit_generations_total{method,finish_reason}
    spirit_tokens_per_second                        generated tokens / generation seconds, overall
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

from spirit.api import GenerationResult

# seconds; from a few tokens on a tiny model to a long generation on a CPU
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.latency_counts: dict[str, list[int]] = {}  # route -> count per bucket (+Inf last)
        self.latency_sum: dict[str, float] = defaultdict(float)
        self.generations: dict[tuple[str, str], int] = defaultdict(int)
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.generation_seconds = 0.0
        self.drafted = 0
        self.accepted = 0

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(route, status)] += 1
            counts = self.latency_counts.setdefault(route, [0] * (len(LATENCY_BUCKETS) + 1))
            counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            self.latency_sum[route] += seconds

    def observe_generation(self, result: GenerationResult) -> None:
        s = result.stats
        with self._lock:
            self.generations[(result.method, result.finish_reason)] += 1
            self.generated_tokens += s.new_tokens
            self.prompt_tokens += s.prompt_tokens
            self.generation_seconds += s.wall_time_s
            self.drafted += s.counters.drafted
            self.accepted += s.counters.accepted

    def render(self, queue_depth: int, queue_capacity: int, running: int) -> str:
        out: list[str] = []

        def family(name: str, kind: str, help_: str) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")

        with self._lock:
            family("spirit_http_requests_total", "counter", "HTTP requests answered, by route and status.")
            for (route, status), n in sorted(self.requests.items()):
                out.append(f'spirit_http_requests_total{{route="{route}",status="{status}"}} {n}')
            family("spirit_http_request_duration_seconds", "histogram", "Time from request to last byte sent.")
            for route, counts in sorted(self.latency_counts.items()):
                cumulative = 0
                for bound, n in zip((*LATENCY_BUCKETS, float("inf")), counts):
                    cumulative += n
                    le = "+Inf" if bound == float("inf") else repr(bound)
                    out.append(f'spirit_http_request_duration_seconds_bucket{{route="{route}",le="{le}"}} {cumulative}')
                out.append(f'spirit_http_request_duration_seconds_sum{{route="{route}"}} {self.latency_sum[route]:.6f}')
                out.append(f'spirit_http_request_duration_seconds_count{{route="{route}"}} {cumulative}')
            family("spirit_generations_total", "counter", "Generations finished, by method and finish reason.")
            for (method, finish), n in sorted(self.generations.items()):
                out.append(f'spirit_generations_total{{method="{method}",finish_reason="{finish}"}} {n}')
            for name, kind, help_, value in (
                ("spirit_queue_depth", "gauge", "Requests waiting for the engine.", queue_depth),
                ("spirit_queue_capacity", "gauge", "Most requests that may wait (--max-queue).", queue_capacity),
                ("spirit_requests_running", "gauge", "Requests being generated (at most --max-batch).", int(running)),
                ("spirit_generated_tokens_total", "counter", "New tokens generated.", self.generated_tokens),
                ("spirit_prompt_tokens_total", "counter", "Prompt tokens processed.", self.prompt_tokens),
                ("spirit_generation_seconds_total", "counter", "Engine wall time, prefill included.",
                 round(self.generation_seconds, 6)),
                ("spirit_drafted_tokens_total", "counter", "Draft tokens proposed.", self.drafted),
                ("spirit_accepted_tokens_total", "counter", "Draft tokens accepted.", self.accepted),
                ("spirit_tokens_per_second", "gauge", "New tokens / engine wall time, over all generations.",
                 round(self.generated_tokens / self.generation_seconds, 3) if self.generation_seconds else 0.0),
            ):
                family(name, kind, help_)
                out.append(f"{name} {value}")
        return "\n".join(out) + "\n"
