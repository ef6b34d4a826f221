"""DSpark as the engine's drafter (mini.step.Drafter; docs/engine.md, "DSpark speculative decoding").

After every forward the committed rows' target features (`Model.target_features`, taken by that forward) go into
the sequences' DSpark rings (`KVCache.draft`, per slot, so prefix-cache snapshots and restores carry them), then
each sequence that sampled gets a draft anchored on its new token: the f4 fixture's order (features of position p
written, then a draft anchored on the token at p + 1), so greedy speculation proposes what `mini logits --dspark`
records.

After a static decode or verify step (CUDA graphs) the same draft step runs over fixed buffers (`StaticDSparkDraft`,
mini.step.StaticDraft), which the engine captures beside the step's graphs: every row of the step is written, the
rows not committed (rejected drafts, padding) into the scratch slot's rings, from a device mask i <= a_b over the
accepted counts copied in, then all the bucket's sequences draft. A decode step (one row a sequence) commits every
row, so its write needs nothing from the host and runs inside the step's own graph (`write_decode`). Its rows equal
the eager drafter's under the deterministic mode (there a row's result does not depend on its step's rows); the
confidence cut and each sequence's draft room stay on the host.
"""
from __future__ import annotations

import torch

from mini.model.dspark import propose, write_ring_rows, write_rings
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
        want = [i for i, c in enumerate(commits) if wants_draft(c)]
        if want:
            draft = propose(m.dspark, cfg, m.embed, m.head, cache.draft, t([commits[i].anchor for i in want]),
                            t([commits[i].end - 1 for i in want]), t([commits[i].slot for i in want]))
            for i, ids in zip(want, self.cut(draft.ids, draft.confidence, [commits[i] for i in want])):
                out[i] = ids
        return out

    def cut(self, ids: torch.Tensor, confidence: torch.Tensor, commits: list[Commit]) -> list[list[int]]:
        """Row b's draft up to its first position whose sigmoid(confidence) is below `min_confidence`, at most
        commits[b].max_draft tokens (host lists)."""
        sure = torch.sigmoid(confidence) >= self.min_confidence  # [B, k]
        lengths = sure.int().cumprod(1).sum(1).tolist()  # up to the first position below the threshold
        return [d[:min(n, c.max_draft)] for d, n, c in zip(ids.tolist(), lengths, commits)]

    def static_draft(self, static, cache) -> StaticDSparkDraft:
        """`static`: this model's StaticDecodeInputs (Model.static_decode), whose buffers keep the target features
        of each static step's rows."""
        return StaticDSparkDraft(self, static.buffers, cache)


def wants_draft(c: Commit) -> bool:
    return c.anchor is not None and c.max_draft > 0


class StaticDSparkDraft:
    """DSpark's draft step over fixed buffers (mini.step.StaticDraft) after the static steps over `buffers` (a
    DecodeBuffers): per sequence its slot, the position of its step's first row, its accepted drafts (-1: no row
    committed, as for a padding sequence) and its anchor, in one [4, max_seqs] tensor copied from a pinned mirror
    (`fill`); the target features of the step's rows are those its forward kept in `buffers` (row b·width + i:
    sequence b's row i). `propose(n)` leaves each sequence's draft ids and confidence logits in `ids` and
    `confidence` (the graphs' outputs, shared by every bucket)."""

    def __init__(self, drafter: DSparkDrafter, buffers, cache):
        self.drafter, self.buffers, self.rings = drafter, buffers, cache.draft
        dev, n, k = buffers.ids.device, buffers.max_seqs, drafter.max_draft
        self.pad_slot = buffers.pad_slot
        self.host_seqs = torch.tensor([[self.pad_slot], [0], [-1], [0]]).repeat(1, n)
        if dev.type == "cuda":
            self.host_seqs = self.host_seqs.pin_memory()
        self.seqs = self.host_seqs.to(dev, copy=True)
        self.copied = torch.cuda.Event() if dev.type == "cuda" else None
        self.row_in_seq = torch.arange(buffers.max_rows, device=dev)
        self.ids = torch.zeros(n, k, dtype=torch.int64, device=dev)
        self.confidence = torch.zeros(n, k, dtype=torch.float32, device=dev)

    def fill(self, n: int, commits: list[Commit]) -> None:
        if not len(commits) <= n <= self.buffers.max_seqs:
            raise ValueError(f"{len(commits)} sequences in a bucket of {n} (buffers hold {self.buffers.max_seqs})")
        if self.copied is not None:
            self.copied.synchronize()  # the mirror's previous contents have reached the device
        host = self.host_seqs.numpy()
        for b, c in enumerate(commits):
            host[:, b] = c.slot, c.end - c.rows, c.rows - 1, c.anchor if c.anchor is not None else 0
        host[:, len(commits):n] = [[self.pad_slot], [0], [-1], [0]]
        self.seqs[:, :n].copy_(self.host_seqs[:, :n], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def write(self, n: int, width: int) -> None:
        """Every row of the step into the rings: sequence b's rows i <= accepted_b into its slot, the others into
        the scratch slot (pad_slot)."""
        slots, first, accepted = self.seqs[0, :n, None], self.seqs[1, :n, None], self.seqs[2, :n, None]
        i = self.row_in_seq[:width]
        row_slots = torch.where(i <= accepted, slots, self.pad_slot).flatten()
        self._write_rows(n * width, (first + i).flatten(), row_slots)

    def write_decode(self, n: int) -> None:
        """Every row of a decode step over the buffers (width 1) into the rings, at the position and slot the step's
        own inputs give it (a padding row: position 0 of the scratch slot, as `fill` pads). A decode step commits
        every row, so this needs no `fill`: the engine runs it inside the decode step's own forward (its graph),
        and it writes what `fill` + `write(n, 1)` would."""
        batch = self.buffers.batch(n)
        self._write_rows(n, batch.positions, batch.slots)

    def _write_rows(self, rows: int, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """The first `rows` rows' target features (kept by the step's forward) into the rings."""
        m = self.drafter.model
        features = self.buffers.kept.get("target_features")
        if features is None or features.shape[0] < rows:
            raise RuntimeError(f"the static buffers keep no target features of a step of {rows} rows")
        write_ring_rows(m.dspark, m.config, features[:rows], positions, slots, self.rings)

    def propose(self, n: int) -> None:
        """Drafts after each sequence's last committed position (a padding sequence's: -1, an empty ring)."""
        m = self.drafter.model
        slots, first, accepted, anchors = self.seqs[:, :n]
        draft = propose(m.dspark, m.config, m.embed, m.head, self.rings, anchors, first + accepted, slots)
        self.ids[:n].copy_(draft.ids)
        self.confidence[:n].copy_(draft.confidence)

    def drafts(self, commits: list[Commit]) -> list[list[int]]:
        cut = self.drafter.cut(self.ids[:len(commits)], self.confidence[:len(commits)], commits)
        return [d if wants_draft(c) else [] for d, c in zip(cut, commits)]
