"""Routing plan: (token, slot) pairs sorted by local expert, tiles that never straddle two experts; the Triton
plan (interpreter on CPU) bit-identical to the torch one."""
import pytest
import torch

from mini.kernels.moe_route import max_rows, plan_routes, plan_routes_torch

FIELDS = ("token", "weight", "slot_row", "expert_offset", "tile_expert", "tile_start", "tile_end")


def _check_plan(ids, weights, experts, block_m):
    T, k = ids.shape
    p = plan_routes(ids, weights, experts, block_m)
    bare = plan_routes(ids, weights, experts, block_m, tiles=False)  # the same rows, no tiles
    for name in ("token", "weight", "slot_row", "expert_offset"):
        assert torch.equal(getattr(bare, name), getattr(p, name)), name
    assert bare.tile_expert.numel() == bare.tile_start.numel() == bare.tile_end.numel() == 0
    ids, weights = ids.cpu(), weights.cpu()
    token, weight, slot_row = p.token.cpu().long(), p.weight.cpu(), p.slot_row.cpu().long()
    te, ts, tend = p.tile_expert.cpu().long(), p.tile_start.cpu().long(), p.tile_end.cpu().long()
    assert p.n_rows == max_rows(T, k, len(experts)) == token.numel() == weight.numel()

    # slot_row is a permutation of the flat (token, slot) pairs; local pairs come first, by expert, then by pair
    assert torch.equal(slot_row.flatten().sort().values, torch.arange(T * k))
    local = (ids >= experts.start) & (ids < experts.stop)
    n_local = int(local.sum())
    assert (slot_row[local] < n_local).all() and (slot_row[~local] >= n_local).all()
    expected = sorted((int(ids[t, j]), t * k + j) for t in range(T) for j in range(k) if local[t, j])
    for r, (e, flat) in enumerate(expected):
        t, j = divmod(flat, k)
        assert slot_row[t, j] == r and token[r] == t and weight[r] == weights[t, j]

    row_expert = torch.tensor([e - experts.start for e, _ in expected], dtype=torch.int64)
    # expert_offset: the rows of local expert i are expert_offset[i]..expert_offset[i+1]
    off = p.expert_offset.cpu().long()
    counts = torch.bincount(row_expert, minlength=len(experts)) if n_local else torch.zeros(len(experts))
    assert off.numel() == len(experts) + 1 and off[0] == 0 and torch.equal(off.diff(), counts.long())

    # tiles: every local row in exactly one tile of its own expert, at most block_m rows, empty tiles marked -1
    covered = torch.zeros(n_local, dtype=torch.int64)
    for i in range(te.numel()):
        if te[i] < 0:
            continue
        rows = torch.arange(ts[i], min(ts[i] + block_m, tend[i]))
        assert rows.numel() > 0 and (row_expert[rows] == te[i]).all()
        covered[rows] += 1
    assert (covered == 1).all()
    assert te.numel() >= (covered.numel() + block_m - 1) // block_m


@pytest.mark.parametrize("T,k,n_experts,experts,block_m", [
    (1, 1, 4, range(0, 4), 16), (5, 6, 16, range(4, 10), 2), (37, 4, 16, range(0, 16), 8),
    (37, 4, 16, range(15, 16), 4), (9, 3, 12, range(12, 12), 4), (64, 6, 24, range(6, 12), 16)])
def test_plan_groups_pairs_by_local_expert(T, k, n_experts, experts, block_m):
    ids = torch.stack([torch.randperm(n_experts)[:k] for _ in range(T)])
    weights = torch.rand(T, k)
    _check_plan(ids, weights, experts, block_m)


def _random_ids(T, k, n_experts, distinct=True):
    """Each token's k experts: distinct (what a top-k gives), or drawn with repeats (hash tables may repeat)."""
    if not distinct:
        return torch.randint(0, n_experts, (T, k))
    return torch.rand(T, n_experts).argsort(dim=1)[:, :k]


def _assert_same_plan(ids, weights, experts, block_m, block=1024):
    for tiles in (True, False):
        new = plan_routes(ids, weights, experts, block_m, tiles, block)
        old = plan_routes_torch(ids, weights, experts, block_m, tiles)
        assert (new.block_m, new.n_rows) == (old.block_m, old.n_rows)
        for f in FIELDS:
            a, b = getattr(new, f), getattr(old, f)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (f, tiles)


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty fills with NaN / -7: an element the kernels fail to write differs from the torch plan."""
    real = torch.empty

    def empty(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else -7)
    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("T", [1, 5, 300, 4096])
@pytest.mark.parametrize("experts", [range(0, 1), range(200, 207), range(96, 192)])
@pytest.mark.parametrize("k", [1, 6])
def test_triton_plan_equals_torch_plan_interpreter(interpreter, poisoned, T, experts, k):
    ids = _random_ids(T, k, 384)
    _assert_same_plan(ids, torch.randn(T, k), experts, 64)


@pytest.mark.parametrize("T,k,n_experts,experts,distinct", [
    (0, 6, 384, range(96, 192), True),  # an idle rank
    (33, 4, 12, range(12, 12), True),  # no local experts: every pair elsewhere
    (333, 6, 384, range(0, 384), True),  # every expert local (512 buckets)
    (777, 6, 40, range(8, 20), False)])  # repeated experts within a token, several blocks of pairs
def test_triton_plan_edge_cases_interpreter(interpreter, poisoned, T, k, n_experts, experts, distinct):
    ids = _random_ids(T, k, n_experts, distinct)
    for block in (1024, 256, 16, None):  # pairs per program: one to many blocks, one to several steps per block;
        # None: pick_block's (about four blocks an SM)
        _assert_same_plan(ids.to(torch.int32), torch.rand(T, k, dtype=torch.float64), experts, 16, block)
    _check_plan(ids, torch.rand(T, k), experts, 16)


@pytest.mark.gpu
def test_plan_on_gpu_matches_invariants():
    T, k, n_experts = 300, 6, 384
    ids = torch.stack([torch.randperm(n_experts)[:k] for _ in range(T)]).cuda()
    _check_plan(ids, torch.rand(T, k, device="cuda"), range(96, 192), 64)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 300, 4096, 16384])
@pytest.mark.parametrize("experts", [range(0, 1), range(200, 207), range(96, 192)])
@pytest.mark.parametrize("k", [1, 6])
def test_triton_plan_equals_torch_plan_gpu(T, experts, k):
    ids = _random_ids(T, k, 384).cuda()
    _assert_same_plan(ids, torch.randn(T, k, device="cuda"), experts, 128)
    if T == 16384:
        _assert_same_plan(ids, torch.randn(T, k, device="cuda"), experts, 128, block=256)


@pytest.mark.parametrize("N", [1, 3, 6, 17, 96, 1000, 1030])
@pytest.mark.parametrize("one_program", [True, False])
def test_one_program_plan_equals_torch_plan_interpreter(interpreter, poisoned, N, one_program):
    """Decode-sized steps (N pairs = T x 6 where N allows, else T x 1): the one-program plan and the three kernels
    (forced either way, blocks of 16 pairs for the three, so several blocks even at small N) give the torch
    plan's rows exactly, with NaN / -7 poisoned outputs; 96 local experts of 384 as at EP4, all local, none."""
    k = 6 if N % 6 == 0 else 1
    T = N // k
    ids = _random_ids(T, k, 384)
    weights = torch.randn(T, k)
    for experts in (range(96, 192), range(0, 384), range(384, 384)):
        for tiles in (True, False):
            new = plan_routes(ids, weights, experts, 16, tiles, block=1024 if one_program else 16,
                              one_program=one_program)
            old = plan_routes_torch(ids, weights, experts, 16, tiles)
            for f in FIELDS:
                a, b = getattr(new, f), getattr(old, f)
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (f, tiles, experts)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 3, 16, 42, 43, 64, 170, 171, 256, 1024])
@pytest.mark.parametrize("one_program", [None, True, False])
def test_decode_plan_equals_torch_plan_gpu(T, one_program):
    """Decode steps at V4.1's EP4 shape (k = 6, 96 of 384 experts local): T = 42 is the last one-program step by
    default (252 pairs), 43 the first of three kernels over pick_block's blocks (64 pairs: 5 programs), 1,024 tokens
    (rank4 decode's B = 256: 6,144 pairs) 96 programs; forced either way, the same plan."""
    ids = _random_ids(T, 6, 384).cuda()
    weights = torch.randn(T, 6, device="cuda")
    for tiles in (True, False):
        new = plan_routes(ids, weights, range(96, 192), 128, tiles, one_program=one_program)
        old = plan_routes_torch(ids, weights, range(96, 192), 128, tiles)
        for f in FIELDS:
            assert torch.equal(getattr(new, f), getattr(old, f)), (f, tiles)


def _check_one_program_step(T, step, dev):
    ids = _random_ids(T, 6, 384).to(dev)
    weights = torch.randn(T, 6, device=dev)
    for tiles in (True, False):
        new = plan_routes(ids, weights, range(96, 192), 128, tiles, one_program=True, one_program_step=step)
        old = plan_routes_torch(ids.cpu(), weights.cpu(), range(96, 192), 128, tiles)
        for f in FIELDS:
            assert torch.equal(getattr(new, f).cpu(), getattr(old, f)), (f, tiles, step)


@pytest.mark.parametrize("step", [(128, 8), (256, 16)])
@pytest.mark.parametrize("T", [1, 24])
def test_one_program_steps_equal_torch_plan_interpreter(interpreter, poisoned, T, step):
    """The one-program plan's wider steps (the bench's candidates: 128 or 256 pairs a step, 8 or 16 warps; a
    B = 1 verify step's 144 pairs in one step instead of three) give the torch plan's rows, poisoned outputs."""
    _check_one_program_step(T, step, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("step", [(128, 8), (256, 8), (256, 16)])
@pytest.mark.parametrize("T", [1, 16, 24, 42])
def test_one_program_steps_equal_torch_plan_gpu(T, step):
    """The wider steps compiled, at every decode size the one program takes by default (T <= 42)."""
    _check_one_program_step(T, step, "cuda")


def test_pick_block_gives_a_few_short_programs_per_sm():
    """About PLAN_PROGRAMS_PER_SM (4) programs an SM, each at least one SUB step and at most BLOCK pairs."""
    from mini.kernels.moe_route import pick_block
    assert pick_block(1536, 64, 132) == 64  # rank4 decode B = 64: 24 programs of one step each
    assert pick_block(6144, 64, 132) == 64  # B = 256: 96 programs
    assert pick_block(64 * 6 * 8 * 6, 64, 132) == 64  # a B = 64 x 6 verify step at EP8: 288 one-step programs
    assert pick_block(20000, 64, 132) == 64
    assert pick_block(4096 * 4 * 6, 64, 132) == 256  # rank4 prefill: 384 programs of 4 steps
    assert pick_block(10 ** 7, 64, 132) == 1024  # BLOCK at most
    assert pick_block(1, 16, 132) == 16
