"""DSpark as the engine's drafter (mini.step.Drafter; docs/engine.md, "DSpark speculative decoding").

After every forward the committed rows' target features (`Model.target_features`, taken by that forward) go into
the sequences' DSpark rings (`KVCache.draft`, per slot, so prefix-cache snapshots and restores carry them), then
each sequence that sampled gets a draft anchored on its new token: the f4 fixture's order (features of position p
written, then a draft anchored on the token at p + 1), so greedy speculation proposes what `mini logits --dspark`
records.
"""
from __future__ import annotations

import torch

from mini.model.dspark import propose, write_rings
from mini.step import Commit


class DSparkDrafter:
    def __init__(self, model):
        """`model`: a mini.model.Model with its DSpark weights (`model.dspark`)."""
        if model.dspark is None:
            raise ValueError("this model has no DSpark draft module (mtp.*)")
        self.model = model
        self.max_draft = model.config.dspark_block_size
        self.min_confidence = 0.0  # the adaptive draft length: cut at the first sigmoid(confidence) below it

    @torch.inference_mode()
    def propose(self, cache, commits: list[Commit]) -> list[list[int]]:
        m, cfg = self.model, self.model.config
        rows, positions, slots, offset = [], [], [], 0
        for c in commits:
            rows += range(offset, offset + c.rows)
            positions += range(c.end - c.rows, c.end)
            slots += [c.slot] * c.rows
            offset += c.length
        if m.target_features is None or m.target_features.shape[0] != offset:
            raise RuntimeError(f"the last forward's target features do not cover the step's {offset} rows")
        dev = m.target_features.device

        def t(v):
            return torch.tensor(v, dtype=torch.int64, device=dev)

        if rows:
            write_rings(m.dspark, cfg, m.target_features[t(rows)], t(positions), t(slots), cache.draft)
        out: list[list[int]] = [[] for _ in commits]
        want = [i for i, c in enumerate(commits) if c.anchor is not None and c.max_draft > 0]
        if want:
            draft = propose(m.dspark, cfg, m.embed, m.head, cache.draft, t([commits[i].anchor for i in want]),
                            t([commits[i].end - 1 for i in want]), t([commits[i].slot for i in want]))
            sure = torch.sigmoid(draft.confidence) >= self.min_confidence  # [B, k]
            lengths = sure.int().cumprod(1).sum(1).tolist()  # up to the first position below the threshold
            for i, ids, n in zip(want, draft.ids.tolist(), lengths):
                out[i] = ids[:min(n, commits[i].max_draft)]
        return out
