"""What a server still pays for after its warm-up: a trace of Triton JIT compiles, CUDA-graph captures, engine
steps, request arrivals, allocator growth and long garbage collections, one JSON line per event, and its summary per burst of a benchmark.

Off unless MINI_WARMUP_TRACE names a file (the `cold_diag` GPU phase sets it): mini.engine.warmup then attaches a
WarmupTrace to the engine before it warms up, and it stays attached while the server runs. Lines are written as
they happen (line-buffered), so a server stopped by a signal leaves a complete trace. `mini bench tiny-goodput`
started with the variable set reads the trace back and adds `summarize(...)` of its bursts to its JSON.

A compile is what Triton's `jit_cache_hook` reports: a kernel launched with a specialization (constexprs, integer
arguments equal to 1 or divisible by 16, pointer alignment, dtypes) this process has not compiled yet; its
seconds run from that hook to `jit_post_compile_hook`. Steps are `LLMEngine.step` calls that scheduled something;
their seconds are host wall time (an overlapped step's include the wait for the step before it).
"""
from __future__ import annotations

import json
import statistics
import threading
import time

TRACE_ENV = "MINI_WARMUP_TRACE"


class WarmupTrace:
    """Appends events to `path`; `attach(engine)` wraps that engine's step, add_request, schedule and graph
    capture (on the instance: nothing else changes), `phase` labels what runs now ("warmup:<part>", "serve")."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)
        self._lock = threading.Lock()
        self._local = threading.local()  # compiles in progress on this thread (a stack: start times)
        self.phase = "start"
        self.compiles = 0
        self.compile_s = 0.0
        self._triton = False
        self._gc = None

    def emit(self, ev: str, **fields) -> None:
        line = json.dumps({"ev": ev, "t": time.time(), "phase": self.phase, **fields}, default=str)
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")

    # ------------------------------------------------------------------ Triton compiles
    def install_triton(self) -> bool:
        """Chain onto Triton's JIT hooks (keeping any already set). False where Triton has no such knobs."""
        if self._triton:
            return True
        try:
            import triton
            rt = triton.knobs.runtime
            before, after = rt.jit_cache_hook, rt.jit_post_compile_hook
        except (ImportError, AttributeError):
            return False

        def on_miss(*args, **kw):
            self._stack().append(time.perf_counter())
            return before(*args, **kw) if before is not None else None  # truthy would skip the compile

        def on_compiled(*args, **kw):
            stack = self._stack()
            seconds = time.perf_counter() - stack.pop() if stack else 0.0
            self.compiles += 1
            self.compile_s += seconds
            fn = kw.get("fn")
            self.emit("compile", kernel=getattr(fn, "name", "?"), s=round(seconds, 4),
                      key=str(kw.get("repr", ""))[:800])
            return after(*args, **kw) if after is not None else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = on_miss, on_compiled
        self._triton = (before, after)
        return True

    # ------------------------------------------------------------------ Python's garbage collector
    def install_gc(self) -> None:
        """Note every collection of the oldest generation and any other over 5 ms (a full collection walks every
        object the process made at start: a pause for every request in flight)."""
        import gc
        started = {}

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                started["t"] = time.perf_counter()
                return
            seconds = time.perf_counter() - started.pop("t", time.perf_counter())
            if info.get("generation") == 2 or seconds > 0.005:
                self.emit("gc", generation=info.get("generation"), s=round(seconds, 4),
                          collected=info.get("collected"))
        gc.callbacks.append(on_gc)
        self._gc = on_gc

    def close(self) -> None:
        """Give Triton its hooks back and close the file (the engine's wrappers stay, writing nothing after)."""
        gc_hook = getattr(self, "_gc", None)
        if gc_hook is not None:
            import gc
            gc.callbacks.remove(gc_hook)
            self._gc = None
        if self._triton:
            import triton
            triton.knobs.runtime.jit_cache_hook, triton.knobs.runtime.jit_post_compile_hook = self._triton
            self._triton = False
        with self._lock:
            self._file.close()

    def _stack(self) -> list[float]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    # ------------------------------------------------------------------ the engine
    def attach(self, engine) -> None:
        step, add, schedule = engine.step, engine.add_request, engine.scheduler.schedule
        runner = engine.runner
        cuda = runner.device.type == "cuda"
        last = {"plan": None, "reserved": _reserved(runner.device) if cuda else 0}

        def scheduled(*a, **kw):
            plan = schedule(*a, **kw)
            last["plan"] = plan
            return plan

        def added(request_id, prompt, params, images=None):  # add_request's signature: a wrapper must take it all
            seq = add(request_id, prompt, params, images)
            self.emit("add", prompt=len(seq.prompt_token_ids), max_tokens=params.max_tokens)
            return seq

        def stepped(*a, **kw):
            last["plan"] = None
            n0, s0 = self.compiles, self.compile_s
            t0 = time.perf_counter()
            out = step(*a, **kw)
            seconds = time.perf_counter() - t0
            plan = last["plan"]
            if plan is None or not plan.chunks:
                return out
            chunks = plan.chunks
            now = time.monotonic()
            firsts = [now - o.arrival_time for o in out if o.new_token_ids and len(o.token_ids) == 1]
            prefill = [c.length for c in chunks if not c.is_decode]
            fields = dict(
                s=round(seconds, 5), seqs=len(chunks), decode=len(chunks) - len(prefill), tokens=plan.num_tokens,
                prefills=len(prefill), max_chunk=max(prefill, default=0),
                max_blocks=max(len(c.seq.blocks) for c in chunks),
                graph=runner.graphs is not None and runner.graphs.fits(chunks),
                compiles=self.compiles - n0, compile_s=round(self.compile_s - s0, 4),
                first_tokens=len(firsts), engine_ttft_s=[round(x, 4) for x in firsts])
            if cuda:
                reserved = _reserved(runner.device)
                if reserved != last["reserved"]:
                    fields["reserved_growth"] = reserved - last["reserved"]
                    fields["allocator"] = _allocator_stats(runner.device)
                    last["reserved"] = reserved
            self.emit("step", **fields)
            return out

        engine.scheduler.schedule, engine.add_request, engine.step = scheduled, added, stepped
        graphs = runner.graphs
        if graphs is not None:
            capture = graphs._capture

            def captured(n):
                t0 = time.perf_counter()
                capture(n)
                self.emit("capture", bucket=n, s=round(time.perf_counter() - t0, 4))
            graphs._capture = captured


def _reserved(device) -> int:
    import torch
    return torch.cuda.memory_reserved(device)


def _allocator_stats(device) -> dict:
    import torch
    s = torch.cuda.memory_stats(device)
    keys = ("reserved_bytes.all.current", "segment.all.current", "num_alloc_retries", "num_device_alloc",
            "num_ooms")
    return {k: s[k] for k in keys if k in s}


def from_env(engine) -> WarmupTrace | None:
    """The trace MINI_WARMUP_TRACE asks for, attached to `engine` with Triton's hooks installed (None: not asked)."""
    from mini import switches
    path = switches.current().warmup_trace
    if not path:
        return None
    trace = WarmupTrace(path)
    trace.install_triton()
    trace.install_gc()
    trace.attach(engine)
    return trace


# ---------------------------------------------------------------------- reading it back
def read(path: str) -> list[dict]:
    events = []
    with open(path) as f:
        for line in f:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by the process's end
                pass
    return events


def _part(events: list[dict], top_kernels: int = 12) -> dict:
    steps = [e for e in events if e["ev"] == "step"]
    compiles = [e for e in events if e["ev"] == "compile"]
    ttfts = [x for e in steps for x in e.get("engine_ttft_s", [])]
    kernels: dict[str, list] = {}
    for c in compiles:
        k = kernels.setdefault(c["kernel"], [0, 0.0])
        k[0] += 1
        k[1] += c["s"]
    return {
        "steps": len(steps), "step_s": round(sum(e["s"] for e in steps), 4),
        "max_step_s": max((e["s"] for e in steps), default=0.0),
        "eager_steps": sum(not e["graph"] for e in steps), "graph_steps": sum(e["graph"] for e in steps),
        "compiles": len(compiles), "compile_s": round(sum(c["s"] for c in compiles), 4),
        "compiled_kernels": {k: [n, round(s, 3)] for k, (n, s) in
                             sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top_kernels]},
        "compile_keys": [c["key"] for c in compiles[:top_kernels]],
        "captures": sum(e["ev"] == "capture" for e in events),
        "gc_full": sum(e["ev"] == "gc" and e.get("generation") == 2 for e in events),
        "gc_s": round(sum(e["s"] for e in events if e["ev"] == "gc"), 4),
        "reserved_growth": sum(e.get("reserved_growth", 0) for e in steps),
        "allocator_last": next((e["allocator"] for e in reversed(steps) if "allocator" in e), None),
        "adds": sum(e["ev"] == "add" for e in events),
        "engine_ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        # the slowest steps with their shapes: what a compile or a first use hit
        "slowest_steps": [{k: e[k] for k in ("s", "seqs", "decode", "tokens", "prefills", "max_chunk", "max_blocks",
                                             "graph", "compiles", "compile_s")}
                          for e in sorted(steps, key=lambda e: -e["s"])[:5]],
    }


def summarize(events: list[dict], bursts: list[tuple[float, float]]) -> dict:
    """Per part of the trace: the warm-up (and each of its labelled parts), each burst (events between its
    start and end, wall clock), and the rest of serving outside the bursts."""
    warm = [e for e in events if str(e.get("phase", "")).startswith("warmup")]
    parts = sorted({e["phase"] for e in warm})
    out = {"warmup": _part(warm), "warmup_parts": {p: _part([e for e in warm if e["phase"] == p]) for p in parts},
           "before_warmup": _part([e for e in events if e.get("phase") == "start"])}
    serving = [e for e in events if e.get("phase") == "serve"]
    out["bursts"] = []
    for i, (t0, t1) in enumerate(bursts):
        inside = [e for e in serving if t0 <= e["t"] <= t1]
        part = _part(inside)
        adds = [e["t"] for e in inside if e["ev"] == "add"]
        part["first_add_after_s"] = round(adds[0] - t0, 4) if adds else None
        part["last_add_after_s"] = round(adds[-1] - t0, 4) if adds else None
        part["burst"] = i
        out["bursts"].append(part)
    out["outside_bursts"] = _part([e for e in serving if not any(t0 <= e["t"] <= t1 for t0, t1 in bursts)])
    return out
