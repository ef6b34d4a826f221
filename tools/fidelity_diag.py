"""Where two runs of an official-reference fixture first part (issue 12): every op output of a prefill, recorded in
call order, then compared run against run, with the discrete decisions (indexer top-k ids, candidate blocks, MoE
expert ids, the FP8 act-quant scales of each FP8/FP4 GEMM's input) called out.

    python3 tools/fidelity_diag.py record --fixture f1 --backend reference --device cpu --out a.pt
    MKL_CBWR=AVX2,STRICT python3 tools/fidelity_diag.py record --fixture f1 --out b.pt
    python3 tools/fidelity_diag.py compare a.pt b.pt [--row 3]

`record` also writes the run's logits against the fixture's (prefill rel-MAE / top-1, as
tests/parity/official_fixture.py measures them). Flags of `record`: `--no-reduced-precision` turns off cuBLAS's
reduced-precision (split-K) reductions for bf16 and fp16 GEMMs; `--index-ties newer` makes the reference backend
rank the indexer's equal scores as the fast path does.

    python3 tools/fidelity_diag.py same --fixture f1,f2 --device cuda

`same` runs the reference backend's prefill and, at every recorded op, the fast backend on the same input: per op,
how many calls are bitwise equal, the share of elements that differ and that differ by more than one unit in the
last place, and for ids the rows whose sets differ. On a CPU the fast kernels run under Triton's interpreter
(TRITON_INTERPRET=1; minutes).

    MKL_CBWR=AVX2,STRICT python3 tools/fidelity_diag.py decode-search --fixture f2 --step 6 [--sites topk,token]

`decode-search` runs a fixture's forced decode up to one step and reruns that step with one discrete decision changed
(an index source's top-k id, a layer's expert set, the token fed, a token the step's n-grams hash), printing the
candidates closest to the reference's decode step and any that reproduce it (docs/fidelity.md, f2 steps 6-7).

`compare` lists, in call order, each recorded op whose output differs: its largest |diff|, the rows that differ,
and for an op whose inputs agreed on a row while its output does not, "ORIGIN" (the op itself computes that row
differently, rather than passing on a difference from below). Integer outputs (ids) are compared as sets per row:
a row whose set differs is a DISCRETE flip, as is a row whose act-quant scale differs (a power of two).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "parity"))

# (module, function name) of the ops recorded; each is looked up through its module at call time
_ATTN = ["linear", "linears", "rms_norm", "apply_rope", "_window_kv", "compress", "_index", "index_scores",
         "select_candidates", "top_groups_ordered", "norm_rope_quant", "sparse_attention", "grouped_linear"]
_MODEL = ["attention", "engram", "moe"]
_MHC = ["pre_norm", "expand", "collapse"]
_MOE = ["gate", "routed", "shared", "_shared", "_routed_fast"]


class Recorder:
    def __init__(self):
        self.records: list[tuple[str, object]] = []
        self.layer, self.active = -1, True
        self.sites = 0  # pre_norm calls so far: two per block (attention, FFN)
        self.same: SameInput | None = None  # set: each op also runs on the fast path on the reference's input
        self.in_fast = False

    def add(self, name: str, value) -> None:
        if self.active:
            self.records.append((f"L{self.layer}.{name}", _cpu(value)))

    def wrap(self, module, fname: str):
        fn = getattr(module, fname, None)
        if fn is None:
            return
        rec = self

        def run(*args, **kwargs):
            if fname == "attention":
                rec.layer = args[2].layer
            elif fname in ("engram", "pre_norm") and rec.active:  # engram starts a block, then its two sites
                rec.layer = rec.sites // 2
                rec.sites += fname == "pre_norm"
            # linear, and linears (projections of one input, one GEMM on the fast path): each weight's own records
            weights = (args[1],) if fname == "linear" else tuple(args[1]) if fname == "linears" else ()
            labels = [f"linear[{w.out_features}x{w.in_features}]" for w in weights] or [fname]
            if weights and rec.active:
                x = args[0]
                for w, label in zip(weights, labels):
                    if w.kind != "bf16":
                        from mini.formats.quant import quant_fp8
                        rec.add(f"{label}.in_scale", quant_fp8(x.reshape(-1, x.shape[-1]), w.block)[1])
                    rec.add(f"{label}.in", x)
            if rec.same is None or not rec.active or rec.in_fast:
                out = fn(*args, **kwargs)
            else:  # the fast path on the same input first (its cache writes are then overwritten by the reference's)
                from mini.ops import using_backend
                rec.in_fast = True
                try:
                    with using_backend("fast"):
                        fast = fn(*_clone(args), **_clone(kwargs))
                finally:
                    rec.in_fast = False
                out = fn(*args, **kwargs)
                rec.same._layer = f"L{rec.layer}"
                for label, o, f in zip(labels, out if fname == "linears" else (out,),
                                       fast if fname == "linears" else (fast,)):
                    rec.same.add(label, o, f)
            for label, o in zip(labels, out if fname == "linears" else (out,)):
                rec.add(label, o)
            return out

        setattr(module, fname, run)


def _clone(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, tuple):
        return tuple(_clone(x) for x in v)
    if isinstance(v, list):
        return [_clone(x) for x in v]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: _clone(x) for k, x in v.items()}
    return v  # weights, configs, caches, the forward's StepShared: the same objects


def _ulps(ref: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """|d| in units of the last place of `ref`'s dtype at each element (bf16: 8 significant bits, fp32: 24)."""
    bits = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}.get(ref.dtype, 24)
    r = ref.double().abs().clamp_min(torch.finfo(ref.dtype).tiny)
    return d.double().abs() / torch.exp2(torch.floor(torch.log2(r)) - (bits - 1))


class SameInput:
    """Per op: the fast path vs the reference on the reference's own input, over every call of a prefill."""

    def __init__(self):
        self.stats: dict[str, dict] = {}

    def add(self, label: str, ref, fast) -> None:
        refs = ref if isinstance(ref, tuple) else (ref,)
        fasts = fast if isinstance(fast, tuple) else (fast,)
        for j, (r, f) in enumerate(zip(refs, fasts)):
            if not isinstance(r, torch.Tensor) or not isinstance(f, torch.Tensor):
                continue
            st = self.stats.setdefault(f"{label}[{j}]", dict(
                calls=0, bitwise=0, elems=0, differ=0, over_1ulp=0, max_ulps=0.0, max_rel=0.0, rows_differ=0,
                dtype=str(r.dtype).replace("torch.", ""), shape_mismatch=0, not_bitwise_in=[]))
            st["calls"] += 1
            bitwise_before = st["bitwise"]
            if r.shape != f.shape:
                st["shape_mismatch"] += 1
                continue
            r, f = r.detach().cpu(), f.detach().cpu().to(r.dtype)
            if torch.equal(r, f) or (r.is_floating_point() and torch.equal(r.isnan(), f.isnan())
                                     and torch.equal(r.nan_to_num(), f.nan_to_num())):
                st["bitwise"] += 1
            if st["bitwise"] == bitwise_before and self._layer not in st["not_bitwise_in"]:
                st["not_bitwise_in"].append(self._layer)
            if not r.is_floating_point():
                rows = r.reshape(r.shape[0], -1) if r.dim() else r.reshape(1, 1)
                frows = f.reshape(rows.shape)
                st["rows_differ"] += int((rows.sort(-1).values != frows.sort(-1).values).any(-1).sum())
                continue
            ok = r.isfinite() & f.isfinite()
            d = (f.double() - r.double()).where(ok, torch.zeros((), dtype=torch.float64))
            u = _ulps(r, d)
            st["elems"] += r.numel()
            st["differ"] += int((d != 0).sum())
            st["over_1ulp"] += int((u > 1.0001).sum())
            st["max_ulps"] = max(st["max_ulps"], float(u.max()) if u.numel() else 0.0)
            den = float(r.double().where(ok, torch.zeros((), dtype=torch.float64)).norm())
            if den > 0:
                st["max_rel"] = max(st["max_rel"], float(d.norm()) / den)

    _layer = "L?"

    def report(self) -> list[dict]:
        return [{"op": k, **v} for k, v in self.stats.items()]


def _cpu(v):
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().clone() if not v.is_floating_point() else v.detach().float().cpu().clone()
    if isinstance(v, (tuple, list)):
        return tuple(_cpu(x) for x in v)
    return None


def install() -> Recorder:
    import mini.model.attn_layer as attn_layer
    import mini.model.model as model
    import mini.ops.mhc as mhc
    import mini.ops.moe as moe
    rec = Recorder()
    for name in _ATTN:
        rec.wrap(attn_layer, name)
    for name in _MODEL:
        rec.wrap(model, name)
    for name in _MHC:
        rec.wrap(mhc, name)
    for name in _MOE:
        rec.wrap(moe, name)
    # the FFN's layer: Model._ffn gets the block
    ffn = model.Model._ffn

    def _ffn(self, x, blk, ids, image_mask=None, step=None):
        rec.layer = blk.plan.layer
        return ffn(self, x, blk, ids, image_mask, step)
    model.Model._ffn = _ffn
    return rec


def record(args) -> int:
    import official_fixture as of
    from mini import ops
    if args.no_reduced_precision:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.set_num_threads(1)
    ops.set_backend(args.backend)
    if args.index_ties == "newer":  # the reference backend ranks the indexer's ties as the fast path does
        from mini.ops import indexer
        indexer.RANK_AS_OFFICIAL = False
    rec = install()
    for fixture in args.fixture.split(","):
        rec.records, rec.active, rec.layer, rec.sites = [], True, -1, 0
        _record_one(args, of, rec, fixture)
    return 0


def same_input(args) -> int:
    """Each recorded op of the reference backend's prefill also run by the fast backend on the same input."""
    import official_fixture as of
    from mini import ops
    if args.no_reduced_precision:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.set_num_threads(1)
    if args.device == "cpu":  # the fast kernels under Triton's interpreter (TRITON_INTERPRET=1)
        ops.set_backend("fast", interpret_on_cpu=True)
    ops.set_backend("reference")
    rec = install()
    rows = []
    for fixture in args.fixture.split(","):
        rec.records, rec.active, rec.layer, rec.sites = [], True, -1, 0
        rec.same = SameInput()
        args.out = "/dev/null"
        _record_one(args, of, rec, fixture, save=False)
        print(f"{fixture}: the fast path on the reference's input, per op over the prefill's calls "
              "(bitwise calls; share of elements that differ, over 1 ulp; max ulps; max ||d||/||ref||):")
        for st in rec.same.report():
            st["fixture"] = fixture
            rows.append(st)
            if st["rows_differ"] or not st["elems"]:
                what = f"rows differ {st['rows_differ']}"
            else:
                what = (f"differ {st['differ'] / st['elems']:.2e} >1ulp {st['over_1ulp'] / st['elems']:.2e} "
                        f"max {st['max_ulps']:.3g} ulp rel {st['max_rel']:.2e}")
            print(f"  {st['op']:<34} {st['dtype']:<9} bitwise {st['bitwise']}/{st['calls']}  {what}"
                  f"  {'' if st['bitwise'] == st['calls'] else 'not bitwise in ' + ','.join(st['not_bitwise_in'][:6])}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def order_ensemble(args) -> int:
    """The official algorithm (the reference backend) with the summation order of its order-dependent fp32 sums
    (`--sites`) drawn at random, one draw per seed: the inputs of each sum permuted along the reduced dimension
    (within each 32-wide K block for the FP8/FP4 GEMMs, whose block order the official kernels fix). Exact sums
    stay exact; inexact ones round as another machine's or kernel's order would. What an implementation that sums
    in another order lands at on these chaotic models: the platform noise of the official algorithm itself."""
    import official_fixture as of
    import mini.ops.linear as linear_mod
    import mini.ops.mhc as mhc_mod
    import mini.ops.moe as moe_mod
    from mini.formats.quant import quant_fp8
    from mini import ops
    torch.set_num_threads(1)
    # on a CPU the fast kernels run under Triton's interpreter (TRITON_INTERPRET=1; ~2 min a fixture)
    ops.set_backend(args.backend, **({"interpret_on_cpu": True} if args.backend == "fast" and args.device == "cpu"
                                     else {}))
    if args.backend == "fast" and set(args.sites.split(",")) - {"mixes_ulp", "mixes_copy"}:
        raise ValueError("--backend fast: only the mixes_ulp (and mixes_copy) sites reach the fast path's fused "
                         "kernels")
    gen = torch.Generator().manual_seed(0)

    def perm(n: int) -> torch.Tensor:
        return torch.randperm(n, generator=gen)

    projected = mhc_mod._projected

    def mhc_permuted(h, fn, norm_eps):
        p = perm(h.shape[-2] * h.shape[-1]).to(h.device)
        return projected(h.flatten(-2)[..., p].view(h.shape), fn[:, p], norm_eps)

    def gemm_permuted(x, w):
        values, scales, k_block = w.blocks()
        a, a_s = quant_fp8(x.reshape(-1, x.shape[-1]), w.block)
        a_s = a_s.repeat_interleave(w.block // k_block, dim=1) if w.block > k_block else a_s
        acc = torch.zeros(a.shape[0], values.shape[0], dtype=torch.float32, device=x.device)
        for k in range(values.shape[1] // k_block):
            cols = (k * k_block + perm(k_block)).to(x.device)
            acc += (a[:, cols] @ values[:, cols].T) * a_s[:, k:k + 1] * scales[:, k].unsqueeze(0)
        return acc.view(*x.shape[:-1], values.shape[0])

    def gate_permuted(x, weight):
        p = perm(x.shape[-1]).to(x.device)
        return x.float()[..., p] @ weight.float()[:, p].t()

    pre_norm = mhc_mod.pre_norm

    def pre_norm_ulp(*a, **kw):
        """Every mix (pre, post, comb) one fp32 ulp up or down or kept, at random: the smallest difference another
        summation order of the mixes' projection can make (the fast path's differs from cuBLAS's by up to 44 ulp),
        on either backend (the fast one sums inside its fused kernel, out of reach of a permutation)."""
        x, *mixes = pre_norm(*a, **kw)
        out = []
        for m in mixes:
            step = torch.randint(-1, 2, m.shape, generator=gen).to(m.device)
            up, down = torch.nextafter(m, torch.full_like(m, float("inf"))), torch.nextafter(m, torch.full_like(
                m, float("-inf")))
            out.append(torch.where(step > 0, up, torch.where(step < 0, down, m)))
        return (x, *out)

    def pre_norm_copy(*a, **kw):
        """The control of mixes_ulp: the mixes copied, not moved (the wrapper alone must change nothing)."""
        x, *mixes = pre_norm(*a, **kw)
        return (x, *[m.clone() for m in mixes])

    if args.index_ties == "newer":
        from mini.ops import indexer
        indexer.RANK_AS_OFFICIAL = False
    sites = {"mhc": (mhc_mod, "_projected", mhc_permuted), "gemm": (linear_mod, "blockwise_gemm", gemm_permuted),
             "gate": (moe_mod, "_gate_logits", gate_permuted), "mixes_ulp": (mhc_mod, "pre_norm", pre_norm_ulp),
             "mixes_copy": (mhc_mod, "pre_norm", pre_norm_copy)}
    for site in args.sites.split(","):
        mod, fname, fn = sites[site]
        setattr(mod, fname, fn)
    rows = []
    for fixture in args.fixture.split(","):
        model = of.load(fixture, args.device)
        for seed in range(args.seeds):
            gen.manual_seed(seed)
            r = of.measure(fixture, args.device, model=model)
            rows.append({"fixture": fixture, "seed": seed, "prefill": r.prefill.row(), "decode": r.decode.row()})
            print(json.dumps(rows[-1]))
        got = sorted(x["prefill"]["rel_mae"] for x in rows if x["fixture"] == fixture)
        bound = 2 * of.own_noise(fixture).rel_mae
        top1 = sorted(x["prefill"]["top1"] for x in rows if x["fixture"] == fixture)
        noise = of.own_noise(fixture)
        meets = sum(x["prefill"]["rel_mae"] <= bound and x["prefill"]["top1"] >= noise.top1
                    for x in rows if x["fixture"] == fixture)
        print(f"{fixture} {args.backend} on {args.device}, sites {args.sites}, ties {args.index_ties}: prefill "
              f"rel-MAE over {len(got)} seeds min {got[0]:.4f} median {got[len(got) // 2]:.4f} max {got[-1]:.4f}; "
              f"{sum(g > bound for g in got)} of {len(got)} above 2x the reference's own noise ({bound:.4f}); top-1 "
              f"median {top1[len(top1) // 2]:.3f} (its own {noise.top1:.3f}); {meets} of {len(got)} meet both")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def _record_one(args, of, rec: Recorder, fixture: str, save: bool = True) -> None:
    ref = of.reference(fixture)
    model, cfg = of.load(fixture, args.device)
    ids = [int(t) for t in ref["prompt_ids"]]
    forced = [int(t) for t in ref["greedy_ids"][:of.DECODE_STEPS]]
    # record the prefill only (rows = prompt positions); the decode steps run unrecorded for the logits
    import mini.model.model as mm
    fwd = getattr(mm.Model.forward, "unrecorded", mm.Model.forward)

    def forward(self, batch, cache):
        try:
            return fwd(self, batch, cache)
        finally:
            rec.active = False
    forward.unrecorded = fwd
    mm.Model.forward = forward
    prefill, decode = of.run_logits(model, cfg, ids, forced, args.device)
    scale = of.scale_of(fixture)
    summary = {"run": Path(args.out.replace("{fixture}", fixture)).stem, "fixture": fixture,
               "backend": args.backend, "device": args.device, "mhc_dot": os.environ.get("MINI_MHC_DOT", "pieces"),
               "no_reduced_precision": args.no_reduced_precision, "index_ties": getattr(args, "index_ties", None),
               "prefill": of.compare(prefill, ref["prefill_logits"], scale).row(),
               "decode": of.compare(decode, ref["replay_logits"], scale).row(),
               "noise": of.own_noise(fixture).row(),
               "first_rows": [float(f"{x:.3g}") for x in np.abs(prefill - ref["prefill_logits"]).max(-1)[:12]]}
    print(json.dumps(summary))
    if not save:
        return
    out = args.out.replace("{fixture}", fixture)
    torch.save({"records": rec.records, "logits": torch.from_numpy(prefill), "summary": summary}, out)


def _rows(a: torch.Tensor, b: torch.Tensor, n_rows: int) -> torch.Tensor | None:
    """Per-row 'differs' measure: max |a - b| over each row (float), or 1/0 set mismatch (int); None if the shapes
    do not have rows."""
    if a.shape != b.shape:
        return None
    if a.dim() == 0 or a.shape[0] != n_rows:
        return None
    if not a.is_floating_point():
        sa, sb = a.reshape(n_rows, -1).sort(-1).values, b.reshape(n_rows, -1).sort(-1).values
        return (sa != sb).any(-1).float()
    return (a - b).abs().reshape(n_rows, -1).amax(-1)


def compare(args) -> int:
    a, b = torch.load(args.a, weights_only=False), torch.load(args.b, weights_only=False)
    ra, rb = a["records"], b["records"]
    n_rows = a["logits"].shape[0]
    print("A:", json.dumps(a["summary"]))
    print("B:", json.dumps(b["summary"]))
    names_a, names_b = [n for n, _ in ra], [n for n, _ in rb]
    if names_a != names_b:  # the backends call different internals (e.g. the fast MoE): compare common names
        print(f"call sequences differ ({len(names_a)} vs {len(names_b)} records): matching by name and occurrence")
    index_b: dict = {}
    for n, v in rb:
        index_b.setdefault(n, []).append(v)
    seen: dict = {}
    row_clean = torch.ones(n_rows, dtype=torch.bool)  # rows whose inputs agreed so far (bitwise)
    first_row_origin: dict[int, str] = {}
    lines, discrete_lines = [], []
    for name, va in ra:
        k = seen.get(name, 0)
        seen[name] = k + 1
        vbs = index_b.get(name, [])
        if k >= len(vbs):
            continue
        vb = vbs[k]
        pairs = list(zip(va, vb)) if isinstance(va, tuple) and isinstance(vb, tuple) else [(va, vb)]
        for j, (x, y) in enumerate(pairs):
            if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
                continue
            d = _rows(x, y, n_rows)
            if d is None:
                continue
            differ = d > 0
            if not differ.any():
                continue
            discrete = (not x.is_floating_point()) or name.endswith(".in_scale")
            origin = differ & row_clean
            for r in origin.nonzero().flatten().tolist():
                first_row_origin.setdefault(r, f"{name}[{j}]")
            rows = differ.nonzero().flatten().tolist()
            shown = f"rows {rows[:10]}{'...' if len(rows) > 10 else ''}"
            if discrete:
                discrete_lines.append(f"{name}[{j}] {len(rows)} rows differ: {shown}")
            if args.row is None or differ[args.row] or origin.any():
                tag = ("DISCRETE " if discrete else "") + (f"ORIGIN rows {origin.nonzero().flatten().tolist()[:8]}"
                                                           if origin.any() else "")
                at = f" row{args.row}={float(d[args.row]):.3g}" if args.row is not None else ""
                lines.append(f"{name}[{j}] max|d| {float(d.max()):.3g}{at} {shown} {tag}")
            if not name.endswith(".in"):  # an op's output that differs makes its rows unclean for later ops
                row_clean &= ~differ
    print(f"discrete decisions that differ (ids as sets per row; act-quant scales), first {args.max_lines}:")
    for line in discrete_lines[:args.max_lines]:
        print("  " + line)
    print(f"ops whose output differs{'' if args.row is None else f' on row {args.row}'}, first {args.max_lines}:")
    for line in lines[:args.max_lines]:
        print("  " + line)
    print("first op at which each row departs (its inputs agreeing):")
    for r in sorted(first_row_origin)[:args.max_rows]:
        print(f"  row {r}: {first_row_origin[r]}")
    d = (a["logits"] - b["logits"]).abs().amax(-1)
    print("logits max|d| per row (first 16):", [float(f"{x:.3g}") for x in d[:16]])
    return 0


def decode_search(args) -> int:
    """One forced decode step of a fixture, then every single change of one discrete decision of that step: is any
    of them the reference's decode step? Sites: `topk` (one id of an index source's top-k replaced by another
    visible group or by none), `experts` (a layer's routed expert set replaced by any other), `token` (the token fed
    at the step), `history` (one of the earlier tokens the step's n-gram hashes read, the fed embedding kept). Each
    candidate reruns the step from a copy of the caches the steps before it left."""
    import copy
    import itertools
    import torch.nn.functional as F

    import official_fixture as of
    import mini.model.attn_layer as al
    import mini.ops.moe as mo
    from mini.model import Batch, KVCache, SeqChunk
    ref = of.reference(args.fixture)
    model, cfg = of.load(args.fixture)
    ids = [int(t) for t in ref["prompt_ids"]]
    forced = [int(t) for t in ref["greedy_ids"][:of.DECODE_STEPS]]
    target = ref["decode_logits"][args.step]
    override: dict = {}
    seen: dict = {}
    index, gate = al._index, mo.gate_unfused

    def index_hook(x, qr, w, plan, cfg_, lay, cache, table, shared):
        ids_, n_valid = index(x, qr, w, plan, cfg_, lay, cache, table, shared)  # valid ids first, their count
        seen[("topk", plan.layer)] = ids_[-1].tolist()
        if ("topk", plan.layer) not in override:
            return ids_, n_valid
        chosen = override[("topk", plan.layer)]  # valid ids first, as _index orders them
        return chosen, (chosen >= 0).sum(-1, dtype=torch.int32)

    def gate_hook(x, w, cfg_, plan, input_ids=None, image_mask=None):
        weights, experts = gate(x, w, cfg_, plan, input_ids, image_mask)
        seen[("experts", plan.layer)] = experts[-1].tolist()
        if ("experts", plan.layer) not in override:
            return weights, experts
        experts = override[("experts", plan.layer)]  # the official gate's weights for that set (model.py Gate)
        scores = F.softplus(mo._gate_logits(x, w.gate) / cfg_.gate_temp).sqrt().gather(1, experts)
        return scores / (scores.sum(-1, keepdim=True) + 1e-20) * cfg_.route_scale, experts

    al._index, mo.gate_unfused = index_hook, gate_hook
    cache = KVCache(cfg, n_slots=1, n_blocks=(len(ids) + len(forced) + 127) // 128, block_tokens=128)
    blocks = list(range(cache.n_blocks))

    def forward(c, history):
        batch = Batch.build([SeqChunk(tokens=history, start=len(history) - 1, slot=0, blocks=blocks)], cfg, "cpu",
                            hasher=model.hasher)
        return model.forward(batch, c)

    with torch.inference_mode():
        batch = Batch.build([SeqChunk(tokens=ids, start=0, slot=0, blocks=blocks)], cfg, "cpu", hasher=model.hasher)
        model.forward(batch, cache)
        history = list(ids)
        for tok in forced[:args.step]:
            history.append(tok)
            forward(cache, history)
        step = history + [forced[args.step]]

        def diff(history_=step) -> float:
            return float(np.abs(forward(copy.deepcopy(cache), history_)[-1].float().numpy() - target).max())

        base = diff()
        decisions = dict(seen)
        print(json.dumps({"fixture": args.fixture, "step": args.step, "position": len(step) - 1, "max_abs": base,
                          "decisions": {f"{k[0]}.L{k[1]}": v for k, v in sorted(decisions.items())}}))
        sites, results = args.sites.split(","), []
        for (kind, layer), chosen in sorted(decisions.items()):
            if kind not in sites:
                continue
            if kind == "topk":
                visible = len(step) // cfg.layers[layer].ratio
                options = [sorted(set(chosen) - {old} | {new}) for old in chosen if old >= 0
                           for new in [-1, *range(visible)] if new not in chosen]
                options = [[i for i in o if i >= 0] + [-1] * (len(chosen) - len([i for i in o if i >= 0]))
                           for o in options]
            else:
                options = [list(c) for c in itertools.combinations(range(cfg.n_routed_experts), len(chosen))
                           if sorted(c) != sorted(chosen)]
            for option in options:
                override.clear()
                override[(kind, layer)] = torch.tensor([option])
                results.append((diff(), f"{kind}.L{layer}", option))
            override.clear()
        for site, positions in (("token", [len(step) - 1]), ("history", range(len(step) - cfg.engram_max_ngram_size,
                                                                                len(step) - 1))):
            if site not in sites:
                continue
            for pos in positions:
                for tok in range(cfg.vocab_size):
                    if tok != step[pos]:
                        changed = list(step)
                        changed[pos] = tok
                        if site == "token":
                            results.append((diff(changed), f"token@{pos}", tok))
                        else:  # the hash reads the history; the caches already hold its other effects
                            results.append((diff(changed), f"history@{pos}", tok))
    results.sort(key=lambda r: r[0])
    for d, site, option in results[:args.top]:
        print(json.dumps({"max_abs": d, "site": site, "option": option}))
    print(json.dumps({"candidates": len(results), "reproduced": [r[1:] for r in results if r[0] <= 1e-5][:10],
                      "best": results[0][0] if results else None, "base": base}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--fixture", default="f1", help="one fixture or a comma-separated list")
    r.add_argument("--backend", default="reference", choices=["reference", "fast"])
    r.add_argument("--device", default="cpu")
    r.add_argument("--no-reduced-precision", action="store_true")
    r.add_argument("--index-ties", choices=["official", "newer"], default="official",
                   help="reference backend: rank the indexer's equal scores as the official code (torch.topk at each "
                        "sequence's width) or as the fast path (the newer group)")
    r.add_argument("--out", required=True, help="file to write; {fixture} in it is replaced by the fixture's name")
    si = sub.add_parser("same", help="the fast path on the reference's input, op by op (CPU: TRITON_INTERPRET=1)")
    si.add_argument("--fixture", default="f1,f2")
    si.add_argument("--device", default="cuda")
    si.add_argument("--no-reduced-precision", action="store_true")
    si.add_argument("--backend", default="reference", help=argparse.SUPPRESS)
    si.add_argument("--json", default=None)
    e = sub.add_parser("order-ensemble", help="the reference with its fp32 sums in a random order, one per seed")
    e.add_argument("--fixture", default="f1,f2")
    e.add_argument("--sites", default="mhc,gemm,gate", help="comma-separated of mhc, gemm, gate, mixes_ulp, "
                   "mixes_copy (the control of mixes_ulp: copies only)")
    e.add_argument("--backend", default="reference", choices=["reference", "fast"],
                   help="fast: only with --sites mixes_ulp or mixes_copy")
    e.add_argument("--device", default="cpu")
    e.add_argument("--index-ties", choices=["official", "newer"], default="official")
    e.add_argument("--seeds", type=int, default=8)
    e.add_argument("--json", default=None)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--row", type=int, default=None, help="list only ops where this row differs (and origins)")
    c.add_argument("--max-lines", type=int, default=60)
    c.add_argument("--max-rows", type=int, default=16)
    d = sub.add_parser("decode-search", help="is the reference's decode step one discrete decision away from ours?")
    d.add_argument("--fixture", default="f2")
    d.add_argument("--step", type=int, default=6)
    d.add_argument("--sites", default="topk,experts,token,history", help="comma-separated of topk, experts, token, "
                   "history")
    d.add_argument("--top", type=int, default=8, help="print the closest this many candidates")
    args = p.parse_args(argv)
    return {"record": record, "same": same_input, "compare": compare, "order-ensemble": order_ensemble,
            "decode-search": decode_search}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
