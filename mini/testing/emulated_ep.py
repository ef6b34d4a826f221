"""One EP rank's MoE emulated on one device, as the rank4 family of suites, `mini check fastpath` and the tests run
it: `EmulatedEP` is a `Model(moe_exchange=...)` that routes the rank's own tokens, adds (ep - 1) x as many
synthetic remote tokens (the own rows in fixed random orders, with their routing: the same distribution), runs the
local experts over every pair routed to them and keeps the own rows plus the shared expert, as the real exchange
(mini.parallel.exchange) would return them. Communication is not run (measured on 2 GPUs: `mini bench ep-exchange`).

Routing: "uniform" keeps the gate's choice (random weights spread the pairs evenly); "skewed" replaces the expert ids
after the gate by draws from `RoutingSkew` (hot experts at 2.5x the mean load, this rank holding more than its even
share of them), so the experts see the load shape of a trained router.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mini.config import ModelConfig

ROUTINGS = ("uniform", "skewed")  # the gate's expert ids, or RoutingSkew's


@dataclass(frozen=True)
class RoutingSkew:
    """The expert loads of `--routing skewed`, fixed and the same on every run: a two-level mixture. Per MoE layer,
    an eighth of the experts (48 of 384) are hot, each drawing `hot_load` (2.5) x the mean load per expert; the
    others share the rest evenly (0.786 x the mean at 384 experts). This rank holds `local_hot(ep)` of the hot ones
    (16 of 48 at EP4, its even share being 12: a little above the expected busiest of 4 ranks under a random
    placement, 12 +- 2.8 each, max of 4 ~ 15), so it gets (16 x 2.5 + 80 x 0.786) / 96 = 1.071 x the mean rank's
    pairs. Which experts are hot changes per layer (a generator seeded by (seed, layer)). Each row takes k distinct
    experts drawn with these probabilities (Gumbel top-k), so a hot expert's load is a little under 2.5 x the mean
    (2.46-2.51 per layer at V4.1-Flash's k = 6 of 384). At rank4's shape (16,384 rows x 6 pairs, mean 256 pairs
    per expert), seed 0, the realized max / mean per layer is 2.64-2.77 over the 40 layers (the hot experts'
    binomial spread), this rank's pairs per local expert min 154 / median 205 / mean 274 / max 709;
    tests/testing/test_emulated_ep.py checks the shape (max / mean in [2.4, 3.0], hot mean / mean in [2.3, 2.6], this
    rank's share 1.04-1.10 x even)."""
    hot_fraction: float = 1 / 8
    hot_load: float = 2.5  # a hot expert's expected load / the mean load per expert

    def n_hot(self, n_experts: int) -> int:
        return max(1, round(n_experts * self.hot_fraction))

    def local_hot(self, n_experts: int, n_local: int, ep: int) -> int:
        """Hot experts among this rank's: 4/3 of an even share (at least one, at most all of either)."""
        return max(1, min(n_local, self.n_hot(n_experts), round(self.n_hot(n_experts) / ep * 4 / 3)))

    def probabilities(self, n_experts: int, local: range, ep: int, seed: int, layer: int) -> torch.Tensor:
        """fp64 [n_experts]: the probability that a pair goes to each expert, in one layer."""
        n_hot, n_local_hot = self.n_hot(n_experts), self.local_hot(n_experts, len(local), ep)
        g = torch.Generator().manual_seed(seed * 1_000_003 + layer)
        mine = torch.tensor(list(local))
        others = torch.tensor([e for e in range(n_experts) if e not in local], dtype=torch.int64)
        hot = torch.cat([mine[torch.randperm(len(mine), generator=g)[:n_local_hot]],
                         others[torch.randperm(len(others), generator=g)[:n_hot - n_local_hot]]])
        cold_load = (n_experts - self.hot_load * n_hot) / (n_experts - n_hot)
        load = torch.full((n_experts,), cold_load, dtype=torch.float64)
        load[hot] = self.hot_load
        return load / n_experts

    def draw(self, rows: int, k: int, n_experts: int, local: range, ep: int, seed: int, layer: int) -> torch.Tensor:
        """int64 [rows, k]: k distinct experts per row, each row's draw independent (Gumbel top-k)."""
        p = self.probabilities(n_experts, local, ep, seed, layer)
        g = torch.Generator().manual_seed(seed * 1_000_003 + layer + 500_009)
        u = torch.rand(rows, n_experts, generator=g, dtype=torch.float64).clamp_min(1e-300)
        return (p.log() - (-u.log()).log()).topk(k, dim=-1).indices


SKEW = RoutingSkew()


class EmulatedEP:
    """`Model(moe_exchange=...)` for one EP rank on one device: the gate over the rank's own tokens, then the local
    experts over the tokens an all-gather would bring (own + synthetic remote, with their routing), then the own
    rows (what the reduce-scatter would return) plus the shared expert. `routing` "skewed" replaces the gate's
    expert ids by `SKEW`'s draws (fixed per layer and row count; the gate's weights are kept). While `recording`,
    each layer's pairs per local expert are kept in `pairs` (layer -> int64 [E_local], on the device)."""

    def __init__(self, ep: int, seed: int, routing: str = "uniform", experts: range | None = None):
        if routing not in ROUTINGS:
            raise ValueError(f"routing {routing!r}: choose one of {', '.join(ROUTINGS)}")
        self.ep, self.seed, self.routing, self.experts = ep, seed, routing, experts
        self._orders: dict[tuple, torch.Tensor] = {}
        self._skewed: dict[tuple, torch.Tensor] = {}
        self.recording = False
        self.pairs: dict[int, torch.Tensor] = {}

    def record(self, step, suite: str) -> dict[int, list[int]]:
        """Run `step()` with recording on: layer -> pairs per local expert. Refuses (SuiteError) when no MoE layer
        went through the emulation (the step would not be an EP rank's, whatever routing was asked)."""
        from mini.testing.suites import SuiteError
        self.recording, self.pairs = True, {}
        try:
            step()
        finally:
            self.recording = False
        pairs = {k: v.tolist() for k, v in sorted(self.pairs.items())}
        if not pairs:
            raise SuiteError(f"{suite}: no MoE layer ran through the EP emulation; the step is not an EP rank's")
        return pairs

    def rows_seen(self, n: int, device) -> torch.Tensor:
        """Row indices of every token the local experts see: the own n rows, then the synthetic remote ones, (ep - 1)
        fixed random orders of the own rows (one gather per tensor builds them)."""
        key = (n, str(device))
        if key not in self._orders:
            g = torch.Generator().manual_seed(self.seed)
            orders = [torch.randperm(n, generator=g) for _ in range(self.ep - 1)]
            self._orders[key] = torch.cat([torch.arange(n), *orders]).to(device)
        return self._orders[key]

    def skewed_ids(self, rows: int, w, cfg: ModelConfig, layer: int, device) -> torch.Tensor:
        """The skewed routing's ids of `rows` rows in `layer` (drawn once, on the CPU)."""
        key = (rows, layer, str(device))
        if key not in self._skewed:
            local = w.experts if self.experts is None else self.experts
            self._skewed[key] = SKEW.draw(rows, cfg.n_activated_experts, cfg.n_routed_experts, local, self.ep,
                                          self.seed, layer).to(device)
        return self._skewed[key]

    def route(self, x: torch.Tensor, w, cfg: ModelConfig, plan, input_ids: torch.Tensor,
              image_mask: torch.Tensor | None = None):
        """(x, weights, ids) of every row the local experts see: own rows first, then the remote ones."""
        from mini.ops.moe import gate
        rows = self.rows_seen(x.shape[0], x.device)
        weights, ids = gate(x, w, cfg, plan, input_ids, image_mask)
        if self.routing == "skewed":
            ids_all = self.skewed_ids(rows.shape[0], w, cfg, plan.layer, x.device)
        else:
            ids_all = ids[rows]
        return x[rows], weights[rows], ids_all

    def __call__(self, x: torch.Tensor, w, cfg: ModelConfig, plan, input_ids: torch.Tensor,
                 image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The exchange's contract (mini.parallel.exchange.MoEExchange): image rows gate with `bias_vl`."""
        from mini.ops.moe import experts_and_shared
        x_all, weights, ids = self.route(x, w, cfg, plan, input_ids, image_mask)
        if self.recording:
            self.pairs[plan.layer] = local_pairs(ids, w.experts, cfg.n_routed_experts)
        return experts_and_shared(x_all, x.shape[0], w, cfg, weights, ids)


def local_pairs(ids: torch.Tensor, experts: range, n_experts: int) -> torch.Tensor:
    """int64 [len(experts)]: the (row, slot) pairs of `ids` routed to each of `experts`, the local ones."""
    return torch.bincount(ids.flatten(), minlength=n_experts)[experts.start:experts.stop]


def record_moe_calls(step) -> dict[str, list[int]]:
    """Run `step()` (eagerly: the counts are read back to the host), keeping each MoE call's rows per local expert
    in call order ("0", "1", ... -> counts [experts]): the routing of MoE layers that do not go through
    `EmulatedEP` (DSpark's draft stages), for the same studies as `EmulatedEP.record`'s
    (tools/humming_decode_study.py --step-routing)."""
    from unittest import mock

    from mini.ops import moe as moe_op
    seen, inner = [], moe_op.experts_and_shared

    def recording(x, own, w, cfg, weights, ids, step=None):
        seen.append(local_pairs(ids, w.experts, cfg.n_routed_experts).tolist())
        return inner(x, own, w, cfg, weights, ids, step)
    with mock.patch.object(moe_op, "experts_and_shared", recording):
        step()
    return {str(i): counts for i, counts in enumerate(seen)}
