"""Sparse MQA attention with a sink (spec §2.4.6), reading its keys by index from the cache pools (design.md step 4).

A query at position p of sequence b attends to
* its window, positions max(0, p-W+1)..p: rows of the chunk's fresh `kv_new` for positions at or after the chunk
  start, otherwise ring row `pos % W` of the sequence's slot in `window`;
* compressed groups `comp_idx` (absolute group ids, -1 = none) of the paged pool `comp`: group g lives in row
  `block_table[b, g // rows_per_block] * rows_per_block + g % rows_per_block`.
K = V (one latent). o[t,h] = Σ_n softmax_n(q[t,h]·k_n · scale) k_n, the denominator also holding exp(sink[h]).
With a RoPE table `rope_out`, o's tail is rotated back by its conjugate (V = K carries the keys' rotation): the
kernel does it in its epilogue instead of one more pass over [T, H, D].
Logits and softmax statistics are fp32; the probabilities are rounded to the activation dtype before P·V, as in
the reference kernel.

On the GPU (bf16) the op runs one of two kernels, chosen once per process by MINI_SPARSE_ATTN (mini.ops.backends):
our Triton kernel (`mini.kernels.sparse_attention`, same signature), or for prefill-sized steps FlashMLA's SM90
sparse prefill kernel (`mini.kernels.flashmla_attention`), which reads keys by row from ONE tensor: `scratch_keys`
lays the step's keys out as such a tensor plus each query's row list (the plain definition); the adapter's
`StepRows` (one per step, held by the step's layout: `step_rows`) gives the same bits, building what a step's
layers share once per step. `core_kernel` is the one dispatch: which kernel runs for a step, and why; what FlashMLA
needs beside its kernel (the scratch, the first-call check, the deterministic mode's split) is in its adapter.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from mini import switches
from mini.kernels import flashmla_attention as flashmla
from mini.kernels.attention_input import AttentionInput, KeyStore
from mini.kernels.flashmla_attention import StepRows
from mini.ops import backends, deterministic, use_fast
from mini.ops.rope import apply_rope
from mini.ops.stages import staged

if TYPE_CHECKING:
    from mini.ops.step_plan import StepPlan

GATHER_ELEMENTS = 1 << 25  # the reference gathers the keys of a block of queries at once: at most this many values


def window_rows(positions, seq_of, slots, start_pos, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, W] rows of kv_new and [T, W] flat rows of the rings holding each query's window (-1 = elsewhere/none)."""
    k = torch.arange(W, device=positions.device)
    key_pos = positions[:, None] - (W - 1) + k
    fresh = key_pos >= start_pos[seq_of][:, None]
    valid = key_pos >= 0
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None] - (W - 1) + k
    new = torch.where(valid & fresh, rows, -1)
    ring = torch.where(valid & ~fresh, slots[seq_of][:, None] * W + key_pos % W, -1)
    return new, ring


def group_rows(group_ids, seq, block_table, rows_per_block: int) -> torch.Tensor:
    """Flat pool rows of absolute group ids (any shape, -1 kept), seq broadcasting against them."""
    g = group_ids.clamp_min(0)
    rows = block_table[seq, g // rows_per_block].long() * rows_per_block + g % rows_per_block
    return torch.where(group_ids >= 0, rows, -1)


SOFTMAX_BLOCK = 64  # the official kernel's online softmax walks a query's key list in blocks of this many keys


def reference_window_rows(positions, seq_of, slots, start_pos, W: int
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query's window keys in the official reference's order, as ([T, n] rows of kv_new, [T, n] flat ring
    rows, [T] the query's list width), -1 = not from that source / no key; n is the step's widest list and a
    query's entries past its own width are -1. The order fixes the rounding (the online softmax's blocks and sums):
    oldest first; a chunk that starts its sequence lists `min(chunk, W)` positions max(0, p-W+1).. with the empty
    ones after them (the reference's prefill), any other chunk W positions p-W+1..p with those before the
    sequence's start first (the reference's decode ring, read oldest first)."""
    T, dev = positions.shape[0], positions.device
    from mini.kernels.sparse_attention import window_widths  # triton is optional on CPU: import on use
    starts_seq = start_pos[seq_of] == 0
    width = window_widths(seq_of, start_pos, W)[seq_of].long()
    k = torch.arange(W if T == 0 else int(width.max()), device=dev)
    key_pos = torch.where(starts_seq[:, None], (positions[:, None] - W + 1).clamp_min(0) + k,
                          positions[:, None] - W + 1 + k)
    valid = (key_pos >= 0) & (key_pos <= positions[:, None]) & (k < width[:, None])
    fresh = key_pos >= start_pos[seq_of][:, None]
    row = torch.arange(T, device=dev)[:, None] - (positions[:, None] - key_pos)
    new = torch.where(valid & fresh, row, -1)
    ring = torch.where(valid & ~fresh, slots[seq_of][:, None] * W + key_pos % W, -1)
    return new, ring, width


def layout_invariant_window_rows(positions, seq_of, slots, start_pos, W: int
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference_window_rows` with every query's list W wide, p-W+1..p (the official decode ring's order),
    whichever chunk the query is in: the deterministic mode's lists, so that where a chunk starts moves no softmax
    block (the official prefill lists are min(chunk, W) wide: a request's result would depend on the token budget)."""
    return (*window_rows(positions, seq_of, slots, start_pos, W), positions.new_full(positions.shape, W))


def _after_window(rows: torch.Tensor, width: torch.Tensor, n: int) -> torch.Tensor:
    """rows [T, n + K] = n window columns then K compressed ones -> each row's list with its compressed entries
    right after its own `width` window entries (where the official kernel's blocks put them), -1 padded."""
    j = torch.arange(rows.shape[1], device=rows.device)
    src = torch.where(j < width[:, None], j, j - width[:, None] + n)
    return torch.where(src < rows.shape[1], rows.gather(1, src.clamp(max=rows.shape[1] - 1)), -1)


def _valid_first(rows: torch.Tensor) -> torch.Tensor:
    """Valid rows first, in their order, then the -1s: the reference lists its top-k ids ascending with the
    unreachable ones (-1) last."""
    return rows.gather(-1, torch.sort((rows < 0).to(torch.int8), dim=-1, stable=True).indices)


def _attend(q, keys, valid, sink, scale):
    """The official sparse-attention kernel's arithmetic: an online softmax over blocks of SOFTMAX_BLOCK keys whose
    running maximum is over the logits alone (from -1e30, so a query with no key gets 0), the probabilities
    rounded to q.dtype before P·V, an fp32 denominator, and the sink only in the final denominator."""
    t, H = q.shape[0], q.shape[1]
    qf = q.float()
    acc = torch.zeros(t, H, q.shape[-1], dtype=torch.float32, device=q.device)
    denom = torch.zeros(t, H, dtype=torch.float32, device=q.device)
    peak = torch.full((t, H), -1e30, dtype=torch.float32, device=q.device)
    for lo in range(0, keys.shape[1], SOFTMAX_BLOCK):
        k_blk, v_blk = keys[:, lo:lo + SOFTMAX_BLOCK], valid[:, lo:lo + SOFTMAX_BLOCK]
        logits = torch.where(v_blk[:, None, :], torch.einsum("thd,tnd->thn", qf, k_blk), float("-inf")) * scale
        prev, peak = peak, torch.maximum(peak, logits.amax(-1))
        rescale = torch.exp(prev - peak)
        p = torch.exp(logits - peak[..., None])
        denom = denom * rescale + p.sum(-1)
        acc = acc * rescale[..., None] + torch.einsum("thn,tnd->thd", p.to(q.dtype).float(), k_blk)
    return acc / (denom + torch.exp(sink[None, :] - peak))[..., None]


@staged("attention.sparse_core")
def sparse_attention(q: torch.Tensor, kv_new: torch.Tensor, window: torch.Tensor, sink: torch.Tensor,
                     positions: torch.Tensor, seq_of: torch.Tensor, slots: torch.Tensor, start_pos: torch.Tensor,
                     scale: float, comp: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                     comp_idx: torch.Tensor | None = None, ratio: int = 1,
                     rope_out: torch.Tensor | None = None, key_rows: StepRows | None = None,
                     step: StepPlan | None = None, window_width: torch.Tensor | None = None,
                     comp_valid: torch.Tensor | None = None, rows_per_seq: int = 1,
                     key_store: KeyStore | None = None) -> torch.Tensor:
    """q [T, H, D], kv_new [T, D], window [n_slots, W, D], sink [H] fp32, positions/seq_of [T], slots/start_pos
    [B]; optional comp [n_blocks, rows_per_block, D] with block_table [B, nb] and comp_idx [T, K] group ids;
    optional rope_out table complex64 [T, rd/2] (apply_rope(inverse=True) of the output); optional `key_rows`,
    the step's `step_rows` (what the FlashMLA path's layers share; only it reads them); optional `step`, the step's
    plan (mini.ops.step_plan: `core_kernel` asked once per step and layer kind; None: asked for this call);
    optional `window_width`, the step's `window_widths(seq_of, start_pos, W)` for our Triton kernel (the same for
    all its layers: the layout builds it once per step; None: built for this call); optional `comp_valid` [T]
    int32 when comp_idx is already in mini.ops.indexer.ordered_ids' order: its count of valid ids; `rows_per_seq`:
    the rows each sequence holds in a static step (a verify step's 1 + k: the Triton kernel splits its key lists
    by the grid's size, as for decode; 1 otherwise); `key_store`: the cache's KeyStore when window and comp are
    its views (a decode-shaped step may then read them in place through FlashMLA). Returns [T, H, D] in q.dtype.
    (`ratio` only matters to kernels that address blocks by token position.)"""
    inp = AttentionInput(q, kv_new, window, sink, positions, seq_of, slots, start_pos, scale, comp, block_table,
                         comp_idx, ratio, rope_out, rows_per_seq, key_store)
    kernel = step.attention(inp) if step is not None else core_kernel(inp)
    if kernel != "reference":
        return _run(kernel, inp, key_rows, window_width, comp_valid)
    T, W, D = q.shape[0], window.shape[1], q.shape[-1]
    lists = layout_invariant_window_rows if deterministic() else reference_window_rows
    new_rows, ring_rows, width = lists(positions, seq_of, slots, start_pos, W)
    sources = [(kv_new, new_rows), (window.view(-1, D), ring_rows)]
    if comp_idx is not None and comp_idx.shape[-1]:  # the compressed keys follow each query's window entries
        none, n = new_rows.new_full((T, comp_idx.shape[-1]), -1), new_rows.shape[1]
        comp_rows = _valid_first(group_rows(comp_idx, seq_of[:, None], block_table, comp.shape[1]))
        sources = [(kv_new, torch.cat([new_rows, none], 1)), (window.view(-1, D), torch.cat([ring_rows, none], 1)),
                   (comp.view(-1, D), torch.cat([torch.full_like(new_rows, -1), comp_rows], 1))]
        sources = [(src, _after_window(rows, width, n)) for src, rows in sources]
    n = sources[0][1].shape[1]
    if deterministic() and n % SOFTMAX_BLOCK:
        # Lists padded to whole softmax blocks: their compressed part is min(index_topk, the chunk's groups) wide,
        # so a chunk's (or a verify chunk's) last block would be narrower than a decode step's, and on the CPU a
        # block's products and sums round by its width. Blocks of -1 only are no-ops in `_attend`.
        pad = SOFTMAX_BLOCK - n % SOFTMAX_BLOCK
        sources = [(src, torch.cat([rows, rows.new_full((T, pad), -1)], 1)) for src, rows in sources]
        n += pad
    out = torch.empty_like(q)
    step = max(1, GATHER_ELEMENTS // (n * D))
    for lo in range(0, T, step):
        hi = min(lo + step, T)
        keys = torch.zeros(hi - lo, n, D, dtype=torch.float32, device=q.device)
        for src, rows in sources:  # each list entry comes from one source at most; unread rows (NaN even) stay out
            keys = torch.where((rows[lo:hi] >= 0)[..., None], src[rows[lo:hi].clamp_min(0)].float(), keys)
        valid = torch.stack([rows[lo:hi] >= 0 for _, rows in sources]).any(0)
        out[lo:hi] = _attend(q[lo:hi], keys, valid, sink.float(), scale).to(q.dtype)
    return out if rope_out is None else apply_rope(out, rope_out, inverse=True)


def scratch_keys(kv_new: torch.Tensor, window: torch.Tensor, positions: torch.Tensor, seq_of: torch.Tensor,
                 slots: torch.Tensor, start_pos: torch.Tensor, comp: torch.Tensor | None = None,
                 block_table: torch.Tensor | None = None, comp_idx: torch.Tensor | None = None,
                 width_multiple: int = 1, valid_first: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys `sparse_attention` reads, as rows of one tensor: (kv [N, D], rows [T, n] int32, count [T] int32).

    kv holds kv_new's T rows, then the ring of each of the step's B sequences (W rows each, ring order), then with
    a pool the blocks of each block-table row (nb·rpb rows each, so group g of sequence b is row
    T + B·W + b·nb·rpb + g; entries -1 past a sequence's blocks gather block 0, which no query reads). Query t
    reads rows[t, :count[t]] (-1 = none; n = W + K rounded up to `width_multiple`, padded with -1); with
    `valid_first` its rows are sorted descending, so count[t] is its number of keys, else count = n. Every size
    comes from tensor shapes: no device sync."""
    T, D = kv_new.shape
    B, W = slots.shape[0], window.shape[1]
    new, ring = window_rows(positions, seq_of, torch.arange(B, device=slots.device), start_pos, W)
    parts, rows = [kv_new, window.index_select(0, slots).view(B * W, D)], [torch.where(ring >= 0, ring + T, new)]
    if comp_idx is not None and comp_idx.shape[-1]:
        nb, rpb = block_table.shape[1], comp.shape[1]
        parts.append(comp.index_select(0, block_table.flatten().long().clamp_min(0)).view(B * nb * rpb, D))
        rows.append(torch.where(comp_idx >= 0, T + B * W + seq_of[:, None] * (nb * rpb) + comp_idx, -1))
    rows = torch.cat(rows, dim=1)
    pad = -rows.shape[1] % width_multiple
    rows = torch.cat([rows, rows.new_full((T, pad), -1)], dim=1).to(torch.int32)
    if not valid_first:
        return torch.cat(parts), rows, torch.full((T,), rows.shape[1], dtype=torch.int32, device=rows.device)
    rows = rows.sort(dim=-1, descending=True).values
    return torch.cat(parts), rows, (rows >= 0).sum(-1, dtype=torch.int32)


def step_rows(positions: torch.Tensor, seq_of: torch.Tensor, slots: torch.Tensor, start_pos: torch.Tensor,
              verify: torch.Tensor | None = None) -> StepRows:
    """The FlashMLA row lists of one step, built on first use and shared by the step's layers (StepLayout.key_rows
    holds one per step): `scratch_keys(..., valid_first=True)` bit for bit; in the deterministic mode with the
    window keys in position order instead (`_deterministic_core`). `verify`: [B] bool, the sequences whose chunks
    are verify chunks (the mode computes them as decode steps)."""
    return StepRows(positions, seq_of, slots, start_pos, window_rows, position_order=deterministic(), verify=verify)


def flashmla_attention(q, kv_new, window, sink, positions, seq_of, slots, start_pos, scale, comp=None,
                       block_table=None, comp_idx=None, ratio: int = 1, rope_out=None,
                       key_rows: StepRows | None = None) -> torch.Tensor:
    """`sparse_attention` through FlashMLA's sparse prefill kernel, whatever `core_kernel` would choose, over the
    step's scratch keys (`key_rows`, the step's StepRows; None builds them for this call alone)."""
    if key_rows is None:
        key_rows = step_rows(positions, seq_of, slots, start_pos)
    return flashmla.attend(AttentionInput(q, kv_new, window, sink, positions, seq_of, slots, start_pos, scale, comp,
                                          block_table, comp_idx, ratio, rope_out), key_rows, _unrotate)


def _unrotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return apply_rope(x, table, inverse=True)


def _fast_supported(q: torch.Tensor) -> bool:
    """Whether the fast path's kernels take this head width (FlashMLA's narrower set is checked per call)."""
    from mini.kernels.sparse_attention import supported
    return supported(q.shape[-1])


# the deterministic mode's kernel for queries of multi-token chunks is MINI_DET_SPARSE_ATTN's (mini.switches):
# "flashmla" (the default; where FlashMLA takes the model's shapes: bitwise alone == among load == chunked on the
# H200 at 56388c4, phase det_final, and the mode then costs +13% on rank4 instead of +78%), or "triton": every
# query on our kernel. Tests and tools/det_profile.py override it here (None: the switch).
DET_SPARSE_ATTN: str | None = None


def det_sparse_attn() -> str:
    """The deterministic mode's kernel for queries of multi-token chunks: DET_SPARSE_ATTN, else the switch."""
    return DET_SPARSE_ATTN or switches.current().det_sparse_attn


# ------------------------------------------------------------------------------------------------- dispatch
# the kernels `core_kernel` chooses from, and when
KERNELS = {
    "reference": "plain PyTorch (sparse_attention's own code): the reference backend, a CPU tensor (unless the "
                 "fast path is interpreted there), fp32 activations, or a head width our kernel does not take",
    "triton": "our Triton kernel (mini/kernels/sparse_attention.py): steps FlashMLA does not serve (flashmla.serves: "
              "head count and width, T >= its MIN_TOKENS, a scratch in proportion, not during CUDA-graph capture; "
              "flashmla.serves_in_place: a decode-shaped step over a KeyStore, captured only once auto's check "
              "has run), or MINI_SPARSE_ATTN=triton / FlashMLA missing",
    "flashmla": "FlashMLA's sparse prefill over the step's scratch keys, where it serves the step",
    "flashmla-in-place": "FlashMLA's sparse prefill over the cache's KeyStore itself, no scratch: decode-shaped "
                         "steps (decode, static verify; CUDA graphs too) whose cache keeps its keys in one store "
                         "(flashmla.serves_in_place)",
    "flashmla-checked": "the same under MINI_SPARSE_ATTN=auto before its first call was checked against ours "
                        "(once per process)",
    # the deterministic mode: a query's kernel follows its own chunk, never the step's size (_deterministic_kernel)
    "triton-invariant": "deterministic mode: our kernel over W-wide lists in the decode ring's order, every query",
    "flashmla-by-chunk": "deterministic mode: FlashMLA for the queries of multi-token chunks, ours for one-token "
                         "chunks",
}


def core_kernel(inp: AttentionInput) -> str:
    """Which kernel computes this step's attention core, one of KERNELS (which says why): the op's one dispatch.
    A step's plan (mini.ops.step_plan) asks it once per layer kind."""
    q = inp.q
    if not (use_fast(q) and q.dtype == torch.bfloat16 and _fast_supported(q)):
        return "reference"
    if deterministic():  # FlashMLA serves only big steps here: a choice by T
        return _deterministic_kernel(inp)
    library = backends.sparse_attn()
    if library == "flashmla" and flashmla.serves_in_place(inp):
        return "flashmla-in-place"
    capturing = inp.q.is_cuda and torch.cuda.is_current_stream_capturing()
    if library == "auto-flashmla" and not capturing and flashmla.serves_in_place(inp):
        return "flashmla-checked"  # a decode-shaped step's first call checks the library over a scratch
    if library != "triton" and flashmla.serves(inp):
        return "flashmla" if library == "flashmla" else "flashmla-checked"
    return "triton"


def _deterministic_kernel(inp: AttentionInput) -> str:
    """The deterministic mode's kernel (docs/design.md, Determinism): by default (MINI_DET_SPARSE_ATTN flashmla,
    where FlashMLA takes the model's shapes and MINI_SPARSE_ATTN allows it) the queries of chunks of more than one
    token take FlashMLA's sparse prefill: one CTA per (token, 64 heads), nothing summed across tokens (bitwise on
    the H200: a query alone == among 4,096 == in a shuffled batch, tools/det_profile.py), over lists with the window
    keys in position order, so that neither the batch nor where a chunk starts moves a key; one-token chunks
    (decode steps, the CUDA-graph ones) stay on the Triton kernel. Without FlashMLA (or with
    MINI_DET_SPARSE_ATTN=triton) every query takes our Triton kernel over W-wide lists in the decode ring's order."""
    q = inp.q
    one_token_chunks = q.shape[0] == inp.slots.shape[0]  # every sequence of a step holds at least one token
    if (det_sparse_attn() != "flashmla" or backends.sparse_attn() == "triton"
            or one_token_chunks or (q.is_cuda and torch.cuda.is_current_stream_capturing())
            or not flashmla.takes_model(q, inp.keys())):
        return "triton-invariant"
    return "flashmla-by-chunk"


def _run(kernel: str, inp: AttentionInput, key_rows: StepRows | None, window_width: torch.Tensor | None = None,
         comp_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Run the fast kernel `core_kernel` chose (`window_width`, `comp_valid`: what the step's layers share, or
    None: `sparse_attention` says what they are)."""
    if kernel == "triton":
        from mini.kernels.sparse_attention import sparse_mla_attention
        return sparse_mla_attention(*inp.args(), width=window_width, comp_valid=comp_valid,
                                    rows_per_seq=inp.rows_per_seq)
    if kernel == "flashmla-in-place":
        return flashmla.attend_in_place(inp, _unrotate)
    if kernel == "triton-invariant":
        return _triton_invariant(inp)
    if kernel == "flashmla":
        return flashmla_attention(*inp.args(), key_rows=key_rows)
    if kernel == "flashmla-checked":
        settled = backends.sparse_attn()
        if settled != "auto-flashmla":  # an earlier layer of this step's plan made the check: its verdict holds
            in_place = settled == "flashmla" and flashmla.serves_in_place(inp)
            return _run("flashmla-in-place" if in_place else settled, inp, key_rows, window_width, comp_valid)
        return _first_flashmla_call(inp, key_rows)
    if kernel != "flashmla-by-chunk":
        raise ValueError(f"sparse attention kernel {kernel!r}")
    if key_rows is None or not key_rows.position_order:  # (a step's rows built before the mode was switched on)
        key_rows = StepRows(inp.positions, inp.seq_of, inp.slots, inp.start_pos, window_rows, position_order=True,
                            verify=None if key_rows is None else key_rows.verify)
    return flashmla.attend_by_chunk_kind(inp, key_rows, _triton_invariant, _unrotate)


def _deterministic_core(inp: AttentionInput, key_rows: StepRows | None = None) -> torch.Tensor:
    """The deterministic mode's core for any tensors (the tests': it skips the fast path's dtype and device gate)."""
    return _run(_deterministic_kernel(inp), inp, key_rows)


def _triton_invariant(inp: AttentionInput) -> torch.Tensor:
    """Our kernel with the deterministic mode's lists (W wide, the decode ring's order, whatever the chunk)."""
    from mini.kernels.sparse_attention import sparse_mla_attention
    return sparse_mla_attention(*inp.args(), prefill_lists=False)


def _first_flashmla_call(inp: AttentionInput, key_rows: StepRows | None = None) -> torch.Tensor:
    """MINI_SPARSE_ATTN=auto: run both kernels once (`flashmla.checked_first_call`) and keep FlashMLA for the process
    only if it ran and matched ours on every token. Returns the output of the kernel kept, so that this call gives
    what every later one would: returning ours here made a step's result depend on whether it held the process's
    first FlashMLA-sized call (issue 18: EP2 vs one rank in one process, 0.49 apart at V4.1 width). A decode-shaped
    step is checked on the path it will take (`flashmla.attend_in_place`)."""
    from mini.kernels.sparse_attention import sparse_mla_attention
    # a decode-shaped step is checked on its own path, with no scratch (a static step's scratch would copy its whole
    # block table's pool: GBs at B = 256 x 32K)
    in_place = flashmla.serves_in_place(inp)
    return settle_by_first_call(
        lambda: sparse_mla_attention(*inp.args(), rows_per_seq=inp.rows_per_seq),
        (lambda: flashmla.attend_in_place(inp, _unrotate)) if in_place
        else (lambda: flashmla_attention(*inp.args(), key_rows=key_rows)))


def settle_by_first_call(ours, theirs, where: str = "") -> torch.Tensor:
    """MINI_SPARSE_ATTN=auto's verdict from one call (`flashmla.checked_first_call`: our output `ours()`, the
    library's `theirs()`): warn if the library failed or differed (`where`: the call's op, for the message), settle
    the switch for the process, and return the output of the kernel kept."""
    out, problem = flashmla.checked_first_call(ours, theirs)
    if problem:
        warnings.warn(f"MINI_SPARSE_ATTN=auto: FlashMLA's sparse prefill {problem}{where}; using the Triton kernel")
    backends.settle_sparse_attn("triton" if problem else "flashmla")
    return out
