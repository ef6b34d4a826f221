"""The EP exchange split into micro-batches (communication overlapped with the experts, MINI_EP_OVERLAP) against
the same exchange in one piece and against one device holding every expert, on gloo ranks (spawned CPU
processes): the fast path's kernels under the Triton interpreter (bitwise) and the CPU reference."""
import pytest
import torch

from mini.checkpoint import expert_range, random_state
from mini.config import TINY_V41
from mini.parallel import exchange as exchange_mod
from mini.parallel.exchange import MoEExchange, micro_batches, overlap_choice
from mini.parallel.groups import DistContext
from mini.parallel.launch import spawn
from mini.ops.moe import MoEWeights, moe
from test_exchange import inputs, one_rank_layer  # tests/parallel is on sys.path (pytest's rootdir-relative import)


# ------------------------------------------------------------------------------------------------- the split
@pytest.mark.parametrize("counts, n", [([7, 0, 3], 2), ([5, 5], 3), ([1, 1], 4), ([0, 0], 2), ([13, 2, 9, 1], 4)])
def test_micro_batches_cover_every_token_once_in_order(counts, n):
    parts = micro_batches(counts, n)
    assert 1 <= len(parts) <= n
    for rank, t in enumerate(counts):
        rows = [i for p in parts for i in range(t)[p.rows(rank)]]
        assert rows == list(range(t))  # contiguous, in order, each token once
        sizes = [p.counts[rank] for p in parts]
        assert max(sizes) - min(sizes) <= 1 or sum(counts) == 0 or len(parts) < n  # near-equal where not dropped
    if sum(counts):
        assert all(any(p.counts) for p in parts)  # no part in which every rank is idle
    assert len(micro_batches([1, 1], 4)) == 1  # one token per rank: one exchange, not four


def test_small_steps_are_split_into_fewer_parts(monkeypatch):
    assert len(micro_batches([300, 10], 4, min_rows=256)) == 1  # e.g. decode: one piece
    assert len(micro_batches([600, 0], 4, min_rows=256)) == 2
    assert len(micro_batches([1024, 5], 4, min_rows=256)) == 4
    assert [p.counts for p in micro_batches([1024, 5], 4, min_rows=256)] == [(256, 1), (256, 1), (256, 1), (256, 2)]
    monkeypatch.delenv("MINI_EP_OVERLAP_MIN_TOKENS", raising=False)
    assert MoEExchange(DistContext(0, 1, torch.device("cpu"), None)).min_part_tokens == 256
    monkeypatch.setenv("MINI_EP_OVERLAP_MIN_TOKENS", "1")
    assert MoEExchange(DistContext(0, 1, torch.device("cpu"), None)).min_part_tokens == 1
    monkeypatch.setenv("MINI_EP_OVERLAP_MIN_TOKENS", "many")
    with pytest.raises(ValueError, match="MINI_EP_OVERLAP_MIN_TOKENS"):
        MoEExchange(DistContext(0, 1, torch.device("cpu"), None))


def test_valid_rows_index_the_padded_layout():
    part = micro_batches([4, 1, 3], 1)[0]
    assert part.t_max == 4
    assert part.valid_rows("cpu").tolist() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert micro_batches([2, 2], 1)[0].valid_rows("cpu") is None


def test_overlap_choice(monkeypatch):
    monkeypatch.delenv("MINI_EP_OVERLAP", raising=False)
    assert overlap_choice() == 1 and overlap_choice(3) == 3
    for text, n in (("off", 1), ("on", 2), ("1", 1), ("4", 4), (" On ", 2)):
        monkeypatch.setenv("MINI_EP_OVERLAP", text)
        assert overlap_choice() == n
        assert MoEExchange(DistContext(0, 1, torch.device("cpu"), None)).micro_batches == n
    for bad in ("0", "-2", "yes", "1.5"):
        monkeypatch.setenv("MINI_EP_OVERLAP", bad)
        with pytest.raises(ValueError, match="MINI_EP_OVERLAP"):
            overlap_choice()
    with pytest.raises(ValueError, match="micro_batches"):
        overlap_choice(0)


# ------------------------------------------------------------------------- overlapped == plain == one device
def _counting(ctx):
    """Count this process's MoE all-gathers and reduce-scatters (so a path that silently runs one piece shows)."""
    calls = {"all_gather": 0, "reduce_scatter": 0}
    for name in calls:
        fn = getattr(exchange_mod, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            calls[_name] += 1
            return _fn(*a, **kw)
        setattr(exchange_mod, name, counted)
    return calls


def _rank_overlap(ctx: DistContext, layer, cases, seed, fast):
    """Each case (counts, glue, n): one MoE layer through the exchange in n micro-batches and in one piece, and this
    rank's tokens through one device holding every expert. `fast`: bf16 on the fast path's kernels (interpreted)."""
    import mini.ops
    if fast:
        mini.ops.set_backend("fast", interpret_on_cpu=True)
    dtype = torch.bfloat16 if fast else torch.float32
    cfg = TINY_V41
    mine = expert_range(cfg, ctx.rank, ctx.world)
    w = MoEWeights.from_state(random_state(cfg, seed=seed, experts=mine), f"layers.{layer}.ffn", cfg, layer,
                              experts=mine)
    every = MoEWeights.from_state(random_state(cfg, seed=seed), f"layers.{layer}.ffn", cfg, layer)
    plan, out = cfg.layers[layer], []
    calls = _counting(ctx)
    for counts, glue, n in cases:
        xs, ids = inputs(cfg, counts, seed)
        x = xs[ctx.rank].to(dtype)
        got = {}
        for m in (n, 1):
            ex = MoEExchange(ctx, glue=glue, micro_batches=m)
            ex.min_part_tokens = 1  # split these tiny steps too
            ex.begin_step(counts[ctx.rank])
            before = dict(calls)
            got[m] = ex(x, w, cfg, plan, input_ids=ids[ctx.rank])
            got[f"calls{m}"] = {k: calls[k] - before[k] for k in calls}
        got["one"] = moe(x, every, cfg, plan, input_ids=ids[ctx.rank])
        out.append(got)
    return out


def _check(got, cases, fast):
    for r in range(len(got)):
        for (counts, glue, n), o in zip(cases, got[r]):
            parts = len(micro_batches(counts, n))
            assert o[f"calls{n}"] == {"all_gather": parts, "reduce_scatter": parts}, (counts, glue, n)
            assert o["calls1"] == {"all_gather": 1, "reduce_scatter": 1}
            y = o[n]
            assert y.shape == (counts[r], TINY_V41.dim) and y.dtype == (torch.bfloat16 if fast else torch.float32)
            assert torch.isfinite(y).all()
            assert torch.equal(y, o[1]), f"rank {r} {counts} {glue} n={n}: {(y != o[1]).sum().item()} differ"
            if fast:  # bf16 expert outputs summed exactly in fp32 in any order (docs/parallel.md): one device's bits
                assert torch.equal(y, o["one"])
            else:  # the fp32 reference: only the cross-rank summation order differs from one device
                scale = o["one"].abs().max().item() if counts[r] else 0.0
                torch.testing.assert_close(y, o["one"], rtol=1e-5, atol=1e-6 * scale)


FAST_CASES = [([7, 3], "fused", 2),  # uneven: each part padded to its own largest count
              ([0, 5], "fused", 2),  # an idle rank takes part in every micro-batch
              ([6, 4], "fused", 3),
              ([1, 1], "fused", 2),  # one token each: a single part
              ([7, 3], "eager", 2)]  # the eager glue around the same kernels


def test_overlapped_exchange_equals_plain_and_one_device_bitwise_fast_path(monkeypatch):
    """On the fast path's kernels (interpreted: the GPU's per-row math), the exchange in micro-batches gives the
    one-piece exchange's and one device's bf16 outputs bit for bit, with one all-gather and one reduce-scatter per
    part."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by the spawned ranks when their kernels are decorated
    got = spawn(2, _rank_overlap, 3, FAST_CASES, 5, True, device="cpu")
    _check(got, FAST_CASES, fast=True)


FAST_CASES_4 = [([5, 0, 3, 7], "fused", 2), ([6, 6, 1, 2], "fused", 3)]


def test_overlapped_exchange_on_four_ranks_bitwise_fast_path(monkeypatch):
    """4 ranks: each token's partial sums come from up to 4 ranks, summed by the reduce-scatter in its own order
    per message; every expert output being a bf16 value (docs/parallel.md), the parts still give the one-piece
    and one-device bits."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = spawn(4, _rank_overlap, 3, FAST_CASES_4, 5, True, device="cpu")
    _check(got, FAST_CASES_4, fast=True)


REFERENCE_CASES = [([9, 4], "eager", 2), ([3, 0], "eager", 3), ([5, 5], "eager", 4)]


def test_overlapped_exchange_equals_plain_reference_path():
    """The CPU reference (fp32, the eager glue): the micro-batched exchange equals the one-piece one (bitwise on
    this machine; the reference's per-expert GEMMs make no row-invariance promise, see exchange.py) and one device
    within fp32 summation order."""
    got = spawn(2, _rank_overlap, 5, REFERENCE_CASES, 7, False, device="cpu")
    _check(got, REFERENCE_CASES, fast=False)


# ------------------------------------------------------------------------------ the whole EP forward, overlapped
def _prefill_args():
    import argparse

    from mini.bench import ep_prefill
    p = argparse.ArgumentParser()
    ep_prefill.add_args(p)
    return p.parse_args(["--preset", "tiny-v4.1", "--device", "cpu", "--dtype", "float32", "--engram-rows", "97",
                         "--block-tokens", "16"])


def _ep_logits(ctx: DistContext, args, tokens):
    from mini.bench import ep_prefill
    r = ep_prefill.build(ctx, ep_prefill.layer_config(args.preset, args.layers), args, tokens[ctx.rank])
    assert r.exchange.micro_batches == 2 and r.exchange.min_part_tokens == 4  # from the environment
    return r.step()


def test_overlapped_ep_forward_equals_one_process(monkeypatch):
    """The whole EP forward (8 layers, every kind) with MINI_EP_OVERLAP=2 against one process holding every
    expert, as the one-piece exchange is checked in test_ep_prefill.py."""
    from mini.bench import ep_prefill
    from mini.model import Model
    monkeypatch.setenv("MINI_EP_OVERLAP", "2")
    monkeypatch.setenv("MINI_EP_OVERLAP_MIN_TOKENS", "4")  # rank 0's 19 tokens in 2 parts, rank 1's 9 too
    tokens = [[[5 + (11 * i + 7 * j) % 500 for j in range(n)] for i, n in enumerate(lens)] for lens in ([13, 6], [9])]
    args = _prefill_args()
    logits = spawn(2, _ep_logits, args, tokens, device="cpu")
    cfg = ep_prefill.layer_config(args.preset, args.layers)
    full = Model(cfg, random_state(cfg, "cpu", args.seed, engram_rows=args.engram_rows), "cpu", torch.float32)
    for rank, got in enumerate(logits):
        r = ep_prefill.build(DistContext(0, 1, torch.device("cpu"), None), cfg, args, tokens[rank])
        want = full.forward(r.batch, r.cache)
        assert got.shape == want.shape and torch.isfinite(want).all()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # only the fp32 cross-rank sum order differs


# ------------------------------------------------------------------- one rank, the real kernels (GPU: Humming)
def _rank_wire_parts(ctx: DistContext, T, parts, seed, dim, inter, experts):
    """`exchange_wire` in `parts` micro-batches and in one piece on a one-rank group (the collectives copy), with
    the whole layer's pairs as the tile hint as `MoEExchange.__call__` passes it, against the one-device fast MoE."""
    from mini.ops.moe import gate, routed_wire, routed_wire_ok, shared
    dev = ctx.device
    cfg, w = one_rank_layer(ctx, seed, dim, inter, experts)
    plan = cfg.layers[0]
    x = (torch.randn(T, cfg.dim, device=dev) * torch.logspace(-2, 2, T, device=dev)[:, None]).bfloat16()
    weights, ids = gate(x, w, cfg, plan)
    assert routed_wire_ok(x, ids, w)
    out = {}
    for n in (parts, 1):
        ex = MoEExchange(ctx, micro_batches=n)
        ex.min_part_tokens = 1
        ex.set_counts([T])
        pairs = T * ids.shape[1]
        out[n] = ex.exchange_wire(x, weights, ids, cfg.fp8_block, local=lambda: shared(x, w, x.dtype),
                                  experts=lambda rows, wa, ia, add, at: routed_wire(rows, w, wa, ia, add, at,
                                                                                    layer_pairs=pairs)).cpu()
    return out[parts], out[1], moe(x, w, cfg, plan).cpu(), w.humming is not None


def _check_wire_parts(device, T, parts, dim, inter, experts):
    split, whole, one, humming = spawn(1, _rank_wire_parts, T, parts, 3, dim, inter, experts, device=device)[0]
    assert split.shape == (T, dim) and split.dtype == torch.bfloat16 and torch.isfinite(split).all()
    assert torch.equal(whole, one), f"humming={humming}: one piece vs one device: {(whole != one).sum().item()}"
    assert torch.equal(split, whole), f"humming={humming}: {parts} parts vs one piece: {(split != whole).sum().item()}"


def test_micro_batched_wire_exchange_equals_one_piece_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _check_wire_parts("cpu", 11, 3, 64, 32, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("parts", [2, 4])
def test_micro_batched_wire_exchange_equals_one_piece_gpu(parts):
    """On one GPU (Humming's GEMMs where they load): 4,096 tokens at 1,024 wide with 64 experts, in 2 and 4
    micro-batches, bit for bit the one-piece exchange and the one-device MoE (every part takes the whole layer's
    tile config: without the hint a part's smaller row bucket could pick another schedule)."""
    _check_wire_parts("cuda", 4096, parts, 1024, 512, 64)


def test_ep_exact_with_overlap_on_two_cpu_ranks(monkeypatch):
    """`ep-exact` (greedy prefill + decode, EP vs one rank) with every MoE exchange in 2 micro-batches, decode
    steps included (MINI_EP_OVERLAP_MIN_TOKENS=1): the tokens of one rank, its logits within fp32 order."""
    import argparse

    from mini.check import ep_exact
    from mini.testing.suites import check_result
    monkeypatch.setenv("MINI_EP_OVERLAP", "2")
    monkeypatch.setenv("MINI_EP_OVERLAP_MIN_TOKENS", "1")
    p = argparse.ArgumentParser()
    ep_exact.add_args(p)
    p.add_argument("--json", default=None)
    args = p.parse_args(["--nproc", "2", "--decode-steps", "3", "--device", "cpu", "--cases", "tiny-reference-fp32"])
    m = check_result("ep-exact", ep_exact.run(args))["metrics"]
    assert m["tiny-reference-fp32.tokens_identical"] == 1 and m["tiny-reference-fp32.logit_abs_max"] > 1
    assert m["tiny-reference-fp32.max_abs_logit_diff"] <= 1e-5
