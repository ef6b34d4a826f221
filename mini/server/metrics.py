"""Prometheus text exposition for the server: request gauges, cache usage, token counters, latency histograms."""
from __future__ import annotations

import bisect
import threading

from mini.engine.llm import STEP_KINDS, LLMEngine, RequestOutput

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for b, c in zip(self.buckets, self.counts):
            total += c
            lines.append(f'{self.name}_bucket{{le="{b}"}} {total}')
        total += self.counts[-1]
        lines += [f'{self.name}_bucket{{le="+Inf"}} {total}', f"{self.name}_sum {self.sum}",
                  f"{self.name}_count {total}"]
        return lines


def _accept_histogram(counts: list[int], max_draft: int) -> list[str]:
    """Verify chunks by accepted draft length (0..max_draft) as a Prometheus histogram."""
    name = "mini_spec_acceptance_length"
    counts = counts + [0] * (max_draft + 1 - len(counts))
    lines = [f"# HELP {name} Drafts accepted per verified draft.", f"# TYPE {name} histogram"]
    total = 0
    for a, n in enumerate(counts):
        total += n
        lines.append(f'{name}_bucket{{le="{a}"}} {total}')
    lines += [f'{name}_bucket{{le="+Inf"}} {total}', f"{name}_sum {sum(a * n for a, n in enumerate(counts))}",
              f"{name}_count {total}"]
    return lines


def _by_kind(name: str, help_text: str, values: dict) -> list[str]:
    """A counter with one series per step kind (each of STEP_KINDS, 0 until it happens)."""
    return [f"# HELP {name} {help_text}", f"# TYPE {name} counter",
            *(f'{name}{{kind="{k}"}} {round(values.get(k, 0), 6)}' for k in STEP_KINDS)]


class ServerMetrics:
    """Latency histograms are fed from the engine thread (`observe`); gauges are read at scrape time."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self.ttft = Histogram("mini_time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.tpot = Histogram("mini_time_per_output_token_seconds",
                              "Per request: (finish - first token) / (output tokens - 1).", TPOT_BUCKETS)
        self.finished: dict[str, int] = {}

    def observe(self, out: RequestOutput) -> None:
        if not out.finished:
            return
        with self._lock:
            self.finished[out.finish_reason] = self.finished.get(out.finish_reason, 0) + 1
            if out.first_token_time is None:
                return
            self.ttft.observe(out.first_token_time - out.arrival_time)
            if len(out.token_ids) > 1 and out.finish_time is not None:
                self.tpot.observe((out.finish_time - out.first_token_time) / (len(out.token_ids) - 1))

    def render(self) -> str:
        eng = self.engine
        sched, blocks, stats = eng.scheduler, eng.blocks, eng.stats

        def metric(name, kind, help_text, value):
            return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]

        lines = []
        lines += metric("mini_num_requests_running", "gauge", "Requests in the running batch.", len(sched.running))
        lines += metric("mini_num_requests_waiting", "gauge", "Requests waiting to be scheduled.", len(sched.waiting))
        lines += metric("mini_cache_usage_ratio", "gauge", "Fraction of cache blocks held by running requests.",
                        round(blocks.usage, 6))
        lines += metric("mini_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
                        blocks.stats.queries)
        lines += metric("mini_prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache.",
                        blocks.stats.hits)
        lines += metric("mini_prefix_cache_hit_rate", "gauge", "Hits / queries of the prefix cache so far.",
                        round(blocks.stats.hit_rate, 6))
        lines += metric("mini_prefill_tokens_total", "counter", "Tokens computed in prefill chunks.",
                        stats.prefill_tokens)
        lines += metric("mini_decode_tokens_total", "counter", "Tokens computed in decode steps.", stats.decode_tokens)
        lines += metric("mini_preemptions_total", "counter", "Requests preempted (recomputed later).",
                        stats.preemptions)
        lines += metric("mini_overlapped_steps_total", "counter", "Steps launched before the previous one was read "
                        "back (overlapped scheduling).", stats.overlapped_steps)
        lines += _by_kind("mini_steps_total", "Steps that ran a forward, by kind (prefill: a prompt chunk in it; "
                          "verify: speculation's verify step).", stats.kind_steps)
        lines += _by_kind("mini_step_seconds_total", "Host seconds of those steps' step() calls, by kind (with "
                          "overlapped scheduling about one step's period each).", stats.kind_seconds)
        if eng.spec is not None:  # speculative decoding (docs/engine.md)
            spec = stats.spec
            lines += metric("mini_spec_draft_tokens_total", "counter", "Draft tokens verified.", spec.drafted_tokens)
            lines += metric("mini_spec_accepted_tokens_total", "counter", "Draft tokens accepted.",
                            spec.accepted_tokens)
            lines += metric("mini_spec_plain_steps_total", "counter", "Steps without drafts to verify or to make "
                            "after them (plain decode, overlapped where it may be).", spec.plain_steps)
            lines += _accept_histogram(spec.accept_lengths, eng.spec.max_draft)
        with self._lock:
            lines += ["# HELP mini_requests_finished_total Finished requests by reason.",
                      "# TYPE mini_requests_finished_total counter"]
            lines += [f'mini_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(self.finished.items())]
            lines += self.ttft.render() + self.tpot.render()
        return "\n".join(lines) + "\n"
