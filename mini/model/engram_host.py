"""Engram rows from tables in host memory, looked up ahead of the forward (issue 13).

V4.1-Flash's Engram tables hold 384M rows per layer (~203 GB in all): they live on the host, not the GPU. A step's
rows depend only on its token ids, so `EngramPrefetcher.start(hash_ids)` begins the lookup when the step is
scheduled, before its forward: a pool of threads gathers the raw row bytes (fp8 values, E8M0 scales: the checkpoint's
layout) with `torch.index_select` over chunks of the ids into pinned staging buffers, and a side stream copies them
to the GPU. The forward meets the returned `PendingEngramRows` at its first Engram layer (`EngramInput` "pending"):
the host waits for the gather to have been queued, the compute stream waits on the copy's event (no host sync), and
the rows are dequantized there exactly as `EngramWeights.lookup` does, so the output is bitwise the same as looking
up the same tables in place.

Why threads over chunks: `index_select` releases the GIL and, on rows of 256 bytes, one call is bound by per-row
overhead, not bandwidth; the pool's threads each run single-threaded calls (OpenMP fan-out inside each would
oversubscribe the cores). Why two staging slots: step N + 1's rows can be gathered while step N's are still being
copied; a slot is refilled only after its last copy has finished (its event).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from mini.ops.engram import EngramWeights, dequantize_rows

GATHER_CHUNK_ROWS = 16384  # ids per index_select call: large enough that the per-call overhead vanishes


def pin(t: torch.Tensor, threads: int = 8, chunk_bytes: int = 1 << 30) -> bool:
    """Page-lock `t`'s memory in place (cudaHostRegister over 1 GiB spans, on `threads` threads: pinning faults the
    pages in, which one thread does at a few GB/s). Exact size, where torch.empty(pin_memory=True) would round a large
    tensor up to a power of two. False when CUDA is not there or the driver refused a span (the tables then stay (in
    part) pageable: the gather works the same; only the staging buffers need pinned memory for the copy). The spans are
    registered on fresh threads so that a refusal's CUDA error stays there: in the caller's thread it would surface at
    the next kernel launch check."""
    if not torch.cuda.is_available() or t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return False
    cudart = torch.cuda.cudart()
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    # span ends at absolute multiples of chunk_bytes (page multiples): two spans never share a page (a large CPU
    # tensor starts 64-byte aligned, not page aligned)
    cuts = [start, *range((start // chunk_bytes + 1) * chunk_bytes, end, chunk_bytes), end]

    def register(span: tuple[int, int]) -> bool:
        return int(cudart.cudaHostRegister(span[0], span[1] - span[0], 0)) == 0

    with ThreadPoolExecutor(threads, thread_name_prefix="engram-pin") as pool:
        return all(pool.map(register, zip(cuts[:-1], cuts[1:])))


def _one_thread():
    torch.set_num_threads(1)  # this worker's own calls: no OpenMP team inside each gather


class _Staging:
    """One pinned staging buffer for a step's raw rows, and the event of its last copy to the device."""

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.copied: torch.cuda.Event | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's rows have left this buffer
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = torch.full((nbytes,), 255, dtype=torch.uint8, pin_memory=True)  # 255: NaN in fp8 and E8M0
        return self.buf[:nbytes]


class EngramPrefetcher:
    """Looks up Engram rows in host tables ahead of the forward. `tables`: the model's EngramWeights of its Engram
    layers in order (embed / embed_scale on the host), `device`: the model's. On a CPU device the rows are gathered
    the same way into fresh tensors (no staging, no stream): the tests' path."""

    def __init__(self, tables: list[EngramWeights], device, threads: int = 8, chunk_rows: int = GATHER_CHUNK_ROWS,
                 slots: int = 2):
        if not tables:
            raise ValueError("no Engram tables to look up")
        for i, w in enumerate(tables):
            if w.embed.device.type != "cpu" or w.embed_scale.device.type != "cpu":
                raise ValueError(f"Engram table {i} is on {w.embed.device}: the prefetcher reads host tables")
        if threads < 1 or chunk_rows < 1 or slots < 1:
            raise ValueError(f"threads {threads}, chunk_rows {chunk_rows}, slots {slots}: each must be >= 1")
        self.tables, self.device = tables, torch.device(device)
        self.head_dim, self.scale_cols = tables[0].embed.shape[-1], tables[0].embed_scale.shape[-1]
        self.chunk_rows = chunk_rows
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._slots = [_Staging() for _ in range(slots)] if self.cuda else []
        self._next_slot = 0
        self._gather = ThreadPoolExecutor(threads, thread_name_prefix="engram-gather", initializer=_one_thread)
        self._steps = ThreadPoolExecutor(1, thread_name_prefix="engram-step")  # steps in the order they start

    def start(self, hash_ids: torch.Tensor) -> "PendingEngramRows":
        """Begin looking up the rows of one step: hash_ids [T, n_tables, n_hash_cols] int64 on the host (table
        rows, already within each table). Returns at once."""
        if hash_ids.device.type != "cpu" or hash_ids.dtype != torch.int64 or hash_ids.dim() != 3 \
                or hash_ids.shape[1] != len(self.tables):
            raise ValueError(f"hash ids {tuple(hash_ids.shape)} {hash_ids.dtype} on {hash_ids.device}: want int64 "
                             f"[tokens, {len(self.tables)} tables, hash columns] on the host")
        hash_ids = hash_ids.contiguous()
        return PendingEngramRows(self._steps.submit(self._fetch, hash_ids), hash_ids.shape)

    def _fetch(self, hash_ids: torch.Tensor):
        """(values uint8 [L, T * cols, head_dim], scales uint8 [L, T * cols, head_dim / 32] on the device, the
        copy's event or None, gather ms)."""
        n_tables, n = len(self.tables), hash_ids.shape[0] * hash_ids.shape[2]
        n_vals, n_scales = n_tables * n * self.head_dim, n_tables * n * self.scale_cols
        if self.cuda:
            slot = self._slots[self._next_slot]
            self._next_slot = (self._next_slot + 1) % len(self._slots)
            buf = slot.take(n_vals + n_scales)
        else:
            buf = torch.full((n_vals + n_scales,), 255, dtype=torch.uint8)
        vals = buf[:n_vals].view(n_tables, n, self.head_dim)
        scales = buf[n_vals:].view(n_tables, n, self.scale_cols)
        t0 = time.perf_counter()
        jobs = []
        for i, w in enumerate(self.tables):
            ids = hash_ids[:, i].reshape(-1)
            for src, dst in ((w.embed.view(torch.uint8), vals[i]), (w.embed_scale.view(torch.uint8), scales[i])):
                for a in range(0, n, self.chunk_rows):
                    b = min(n, a + self.chunk_rows)
                    jobs.append(self._gather.submit(torch.index_select, src, 0, ids[a:b], out=dst[a:b]))
        for j in jobs:
            j.result()
        gather_ms = 1e3 * (time.perf_counter() - t0)
        if not self.cuda:
            return vals, scales, None, gather_ms
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            dev_buf = torch.empty_like(buf, device=self.device)
            dev_buf.copy_(buf, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        slot.copied = copied
        return (dev_buf[:n_vals].view(n_tables, n, self.head_dim),
                dev_buf[n_vals:].view(n_tables, n, self.scale_cols), copied, gather_ms)

    def close(self) -> None:
        self._steps.shutdown(wait=True)
        self._gather.shutdown(wait=True)


class PendingEngramRows:
    """One step's Engram rows on their way (`EngramInput("pending", ...)`): `rows(i, dtype)` gives table i's rows
    [T, n_hash_cols, head_dim] on the device, waiting for them the first time. After the step, `host_wait_ms` is how
    long the forward's thread waited for the gather to be queued, `gather_ms` the gather's own time, and
    `gpu_wait_ms()` how long the compute stream stalled for the copy (CUDA events; call after the step's sync)."""

    def __init__(self, future: Future, shape: torch.Size):
        self._future, self.n_tokens, self.n_cols = future, shape[0], shape[2]
        self._rows = None
        self._stall: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self.host_wait_ms = self.gather_ms = None

    def _arrive(self):
        t0 = time.perf_counter()
        vals, scales, copied, self.gather_ms = self._future.result()
        self.host_wait_ms = 1e3 * (time.perf_counter() - t0)
        if copied is not None:
            stream = torch.cuda.current_stream(vals.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(stream)
            stream.wait_event(copied)
            after.record(stream)
            vals.record_stream(stream)  # made on the copy stream, read on this one
            self._stall = (before, after)
        self._rows = (vals, scales)

    def rows(self, table: int, dtype: torch.dtype) -> torch.Tensor:
        if self._rows is None:
            self._arrive()
        vals, scales = self._rows
        return dequantize_rows(vals[table], scales[table], dtype).unflatten(0, (self.n_tokens, self.n_cols))

    def gpu_wait_ms(self) -> float | None:
        return None if self._stall is None else self._stall[0].elapsed_time(self._stall[1])
