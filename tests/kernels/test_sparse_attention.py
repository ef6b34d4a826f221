"""Parity of the sparse MLA attention kernel against a float64 gather-and-softmax oracle (fresh random data, odd
sizes, NaN-poisoned outputs). The CPU test runs the kernel under Triton's interpreter (conftest.py) in fp32,
since the interpreter's bf16 dot is unreliable."""
import pytest
import torch


pytestmark = pytest.mark.usefixtures("reference_ops")

def oracle(q, kv_new, window, comp, sink, b, comp_idx, ratio, scale):
    """Builds each query's key list explicitly and runs one softmax with the sink in the denominator."""
    T, H, D = q.shape
    W = window.shape[1]
    rpb = comp.shape[1] if comp is not None else 1
    out = torch.empty(T, H, D, dtype=torch.float64)
    for t in range(T):
        p, s = int(b.positions[t]), int(b.seq_of[t])
        start, slot = int(b.start_pos[s]), int(b.slots[s])
        keys = []
        for k in range(max(0, p - W + 1), p + 1):
            keys.append(kv_new[t - (p - k)] if k >= start else window[slot, k % W])
        if comp_idx is not None:
            for g in comp_idx[t].tolist():
                if g >= 0:
                    blk = int(b.block_table[s, g // rpb])
                    keys.append(comp[blk, g % rpb])
        K = torch.stack(keys).double()
        logits = q[t].double() @ K.T * scale  # [H, n]
        mx = logits.amax(-1, keepdim=True)
        e = torch.exp(logits - mx)
        denom = e.sum(-1, keepdim=True) + torch.exp(sink.double()[:, None] - mx)
        out[t] = (e / denom) @ K
    return out


def make_case(random_flat_batch, device, dtype, T_lens, starts, H, D, W, ratio, rpb, topk):
    b = random_flat_batch(T_lens, starts, block_tokens=rpb * ratio, device=device)
    T = b.positions.numel()
    q = torch.randn(T, H, D, device=device).to(dtype)
    kv_new = torch.randn(T, D, device=device).to(dtype)
    window = torch.randn(int(b.slots.max()) + 2, W, D, device=device).to(dtype)
    comp = torch.randn(b.n_blocks, rpb, D, device=device).to(dtype)
    sink = torch.randn(H, device=device)
    visible = (b.positions + 1) // ratio  # groups visible to each query
    comp_idx = torch.full((T, topk), -1, dtype=torch.int32, device=device)
    for t in range(T):
        n = int(visible[t])
        pick = torch.randperm(n)[: min(n, topk)]
        comp_idx[t, : pick.numel()] = pick.to(device=device, dtype=torch.int32)
        comp_idx[t] = comp_idx[t][torch.randperm(topk, device=device)]  # -1s anywhere in the row
    return b, q, kv_new, window, comp, sink, comp_idx


def rope_for(positions, rope_dim):
    from mini.ops.rope import rope_frequencies, rope_table
    return rope_table(positions, rope_frequencies(rope_dim, 160000.0, 256, 4.0).to(positions.device))


def rotated_oracle(q, kv_new, window, comp, sink, b, comp_idx, ratio, scale, rope):
    """The op's contract with a rope_out table: attend, then rotate the output back (fp32 rotation)."""
    from mini.ops.rope import apply_rope
    out = oracle(q, kv_new, window, comp, sink, b, comp_idx, ratio, scale)
    return out if rope is None else apply_rope(out.float(), rope, inverse=True).double()


@pytest.mark.parametrize("d_split", [1, 2])
@pytest.mark.parametrize("with_comp,rope_dim", [(True, 0), (False, 0), (True, 8), (False, 32), (True, 24)])
@pytest.mark.parametrize("W,block_n", [(8, 4), (6, 4), (16, 64)])  # windows that are not whole key tiles too
def test_sparse_attention_interpreter(with_comp, rope_dim, W, block_n, d_split, interpreter, flat_batch):
    from mini.kernels.sparse_attention import sparse_mla_attention
    H, D, ratio, rpb, topk = 5, 32, 2, 4, 7
    b, q, kv_new, window, comp, sink, comp_idx = make_case(flat_batch, "cpu", torch.float32, [7, 1, 3], [0, 19, 5],
                                                           H, D, W, ratio, rpb, topk)
    if not with_comp:
        comp_idx = None
    rope = rope_for(b.positions * 97, rope_dim) if rope_dim else None  # large angles
    scale = D ** -0.5
    out = torch.full_like(q, float("nan"))
    out.copy_(sparse_mla_attention(q, kv_new, window, sink, b.positions, b.seq_of, b.slots, b.start_pos, scale,
                                   comp=comp, block_table=b.block_table, comp_idx=comp_idx, ratio=ratio,
                                   rope_out=rope,
                                   block_h=8, block_n=block_n, num_warps=1, d_split=d_split))
    ref = rotated_oracle(q, kv_new, window, comp, sink, b, comp_idx, ratio, scale, rope)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    if rope is not None:  # the rotation matters: without it the result is far off
        plain = oracle(q, kv_new, window, comp, sink, b, comp_idx, ratio, scale)
        assert (plain - ref).abs().max() > 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("H,block_h,D,W", [(64, 64, 512, 128), (64, 32, 512, 128), (13, 16, 512, 128),
                                           (8, 64, 128, 16)])  # the last: the official fixtures' shape
def test_sparse_attention_gpu(H, block_h, D, W, flat_batch):
    from mini.kernels.sparse_attention import sparse_mla_attention
    ratio, rpb, topk = 2, 32, 61
    b, q, kv_new, window, comp, sink, comp_idx = make_case(flat_batch, "cuda", torch.bfloat16, [300, 1, 77, 1],
                                                           [0, 1000, 150, 3], H, D, W, ratio, rpb, topk)
    scale = D ** -0.5
    out = torch.full_like(q, float("nan"))
    out.copy_(sparse_mla_attention(q, kv_new, window, sink, b.positions, b.seq_of, b.slots, b.start_pos, scale,
                                   comp=comp, block_table=b.block_table, comp_idx=comp_idx, ratio=ratio,
                                   block_h=block_h))
    ref = oracle(q.cpu(), kv_new.cpu(), window.cpu(), comp.cpu(), sink.cpu(), b.to("cpu"), comp_idx.cpu(), ratio,
                 scale)
    err = (out.double().cpu() - ref).norm() / ref.norm()
    assert torch.isfinite(out).all() and err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("rope_dim", [0, 64])
def test_sparse_attention_matches_reference_op(rope_dim, flat_batch):
    """Real V4.1 shape against mini.ops.attention.sparse_attention (same signature): bf16, P rounded to bf16; with
    a RoPE table the op rotates the output back."""
    from mini.kernels.sparse_attention import sparse_mla_attention
    from mini.ops.attention import sparse_attention
    H, D, W, ratio, rpb, topk = 64, 512, 128, 1, 64, 512
    b, q, kv_new, window, comp, sink, comp_idx = make_case(flat_batch, "cuda", torch.bfloat16, [601, 1, 1],
                                                           [700, 3000, 5], H, D, W, ratio, rpb, topk)
    args = (q, kv_new, window, sink, b.positions, b.seq_of, b.slots, b.start_pos, D ** -0.5)
    kw = dict(comp=comp, block_table=b.block_table, comp_idx=comp_idx, ratio=ratio,
              rope_out=rope_for(b.positions, rope_dim) if rope_dim else None)
    out = torch.full_like(q, float("nan"))
    out.copy_(sparse_mla_attention(*args, **kw))
    ref = sparse_attention(*args, **kw)
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    assert torch.isfinite(out).all() and err < 5e-3, err


def _poisoned_call(fn):
    """Runs fn with the allocator's free blocks filled with NaN first, so that an output element the kernel does
    not write reads NaN (the wrapper allocates its output with empty_like)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0]
        junk = torch.full((min(free // 8, 1 << 28),), float("nan"), device="cuda", dtype=torch.bfloat16)
        del junk  # back to the caching allocator, NaN-filled
    return fn()


def test_sparse_attention_d_split_interpreter(interpreter, flat_batch):
    """d_split=2 (the default) against d_split=1 under the interpreter, bf16 as on the GPU, RoPE across both
    halves. A tolerance, not bits: the interpreter rounds each tl.dot once (float64 sum), so the split's two QK dots
    round twice where d_split=1 rounds once; on the GPU both are one chain of k16 MMAs and the gpu test below asks
    for the same bits."""
    from mini.kernels.sparse_attention import sparse_mla_attention
    H, D, W, ratio, rpb, topk = 5, 64, 6, 2, 4, 9
    b, q, kv_new, window, comp, sink, comp_idx = make_case(flat_batch, "cpu", torch.bfloat16, [9, 1, 2], [0, 23, 4],
                                                           H, D, W, ratio, rpb, topk)
    args = (q, kv_new, window, sink, b.positions, b.seq_of, b.slots, b.start_pos, D ** -0.5)
    kw = dict(comp=comp, block_table=b.block_table, comp_idx=comp_idx, ratio=ratio, rope_out=rope_for(b.positions,
              48), block_h=8, block_n=4, num_warps=1)
    base = sparse_mla_attention(*args, **kw, d_split=1)
    split = sparse_mla_attention(*args, **kw)
    assert torch.equal(split, sparse_mla_attention(*args, **kw, d_split=2))  # the default is the split build
    assert torch.isfinite(split).all()
    torch.testing.assert_close(split.float(), base.float(), rtol=2e-2, atol=2e-3)  # a bf16 ulp or two
    with pytest.raises(ValueError, match="d_split"):
        sparse_mla_attention(*args, **kw, d_split=3)


@pytest.mark.gpu
@pytest.mark.parametrize("H,D,W,ratio,rpb,topk,lens,starts,rope_dim,prefill_lists,block_h", [
    (64, 512, 128, 4, 64, 512, [1] * 37, [40000 + 997 * i for i in range(37)], 64, True, 64),  # V4.1 decode
    (64, 512, 128, 4, 64, 512, [1] * 9, [3, 50, 127, 128, 129, 700, 5000, 20000, 32767], 64, False, 64),
    (64, 512, 128, 4, 64, 512, [600, 1, 130], [0, 9000, 200], 64, True, 64),  # prefill chunks + a decode token
    (64, 512, 128, 128, 64, 509, [1] * 5 + [90], [4100, 70000, 9, 131071, 640, 3000], 0, True, 64),
    (13, 512, 100, 2, 32, 61, [300, 1, 77, 1], [0, 1000, 150, 3], 64, True, 16),  # odd heads, window, top-k
    (40, 512, 77, 4, 16, 33, [1, 1, 201], [88, 5, 0], 0, True, 32),
    (8, 128, 16, 2, 32, 61, [300, 1, 77], [0, 1000, 150], 64, True, 64),  # the official fixtures' width
])
def test_sparse_attention_d_split_same_bits_gpu(H, D, W, ratio, rpb, topk, lens, starts, rope_dim, prefill_lists,
                                                block_h, flat_batch):
    """d_split=2 (the default) == d_split=1 bit for bit on the H200 (the same sums: two QK dots chained through
    one accumulator are one chain of k16 MMAs; PV per output column is unchanged), and near the reference op."""
    from mini.kernels.sparse_attention import sparse_mla_attention
    from mini.ops.attention import sparse_attention
    torch.manual_seed(H * 7 + W)
    b, q, kv_new, window, comp, sink, comp_idx = make_case(flat_batch, "cuda", torch.bfloat16, lens, starts,
                                                           H, D, W, ratio, rpb, topk)
    args = (q, kv_new, window, sink, b.positions, b.seq_of, b.slots, b.start_pos, D ** -0.5)
    kw = dict(comp=comp, block_table=b.block_table, comp_idx=comp_idx, ratio=ratio,
              rope_out=rope_for(b.positions, rope_dim) if rope_dim else None)
    # k_split=1 both times: a decode step's default split-K count follows the grid, which d_split changes
    base = _poisoned_call(lambda: sparse_mla_attention(*args, **kw, prefill_lists=prefill_lists, block_h=block_h,
                                                       d_split=1, k_split=1))
    split = _poisoned_call(lambda: sparse_mla_attention(*args, **kw, prefill_lists=prefill_lists, block_h=block_h,
                                                        k_split=1))
    assert torch.isfinite(base).all() and torch.isfinite(split).all()
    differ = (split.view(torch.int16) != base.view(torch.int16)).sum().item()
    assert differ == 0, f"{differ} of {base.numel()} elements differ from the d_split=1 build"
    if prefill_lists:  # the reference op lists windows as the prefill does
        ref = sparse_attention(*args, **kw)
        err = (split.float() - ref.float()).norm() / ref.float().norm()
        assert err < 5e-3, err
