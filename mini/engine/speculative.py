"""Speculative decoding's step (docs/engine.md, "DSpark speculative decoding"): verify each decoding sequence's
draft in one eager forward, accept the longest prefix that the target itself would have produced, commit it to the
cache and the outputs, and let the drafter propose the next draft.

A decoding sequence with frontier f (tokens ..f cached) has its last sampled token b at f + 1 and a draft d1..dk
(`Sequence.draft`); its verify chunk is [b, d1..dk] (`ScheduledChunk.drafts` = k), whose 1 + k logit rows are the
target's distributions at output indices n..n+k. Row i is sampled exactly as plain decode would sample output index
n + i after d1..di: penalties, logit bias and min_tokens' hold read the history with those drafts appended, a
seeded draw uses the counter n + i (`_Row`). Acceptance, by request:
* greedy and seeded requests: d(i+1) is taken while it equals row i's token t_i; the step commits t_0..t_a (a
  drafts accepted, t_a the new last token): the very tokens plain decode draws, so speculation never changes
  their outputs; it only saves steps where the drafter guessed the target's token.
* unseeded sampling requests (`rejects`): rejection sampling (mini.engine.acceptance.verify_proposals, the drafts
  as deterministic proposals, q one-hot): d(i+1) is accepted with probability p_i(d(i+1)), so a draft the target
  finds likely is taken even where the target's own draw would have differed. The output is a draw from the same
  distribution as plain decode's, not the same draw. Logprobs stay the target's (of the committed tokens).

Then: the cache keeps the accepted drafts (`StepCache.commit_drafts`), the stop checks run over the committed
tokens in order (a stop inside them truncates), the drafter takes the committed rows and proposes drafts anchored
on each sequence's new last token (before prefix-cache snapshots: its state is in the slots they copy), each at
most as long as the load rule allows (`load_cap`: the next step's verify rows within a budget) and as the
sequence's past acceptance pays (`acceptance_cap`: none where its drafts keep failing, but a probe now and then),
and the outputs go out. A sequence with a grammar gets each row's mask from its matcher advanced over the drafts
before the row, then rolled back (`_grammar_masks`); the committed tokens advance it for good, as plain decode's do.

Forced drafts. Where a sequence's grammar forces its next tokens (DSML tool-call markup, a JSON key: `force`,
llguidance's fast-forward tokens), those tokens are its draft, certain ones: the drafter's draft, if any, is
dropped for them (it guessed the same positions). They are verified as any draft, so the grammar's mask, which at
their rows allows only them, makes the target's own token equal them (greedy, seeded; p(d) = 1 for rejection
sampling): a forced run costs one step instead of one per token, and outputs and logprobs stay plain decode's.
Without speculation the engine keeps a `Speculation` with no drafter for them (`LLMEngine.verify`): a step whose
chunks carry forced drafts verifies them (eagerly: the decode graphs have width 1), every other step is plain.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import torch

from mini.engine.acceptance import target_probs, verify_proposals
from mini.engine.sampler import SamplingBatch, sample
from mini.engine.scheduler import StepPlan
from mini.engine.sequence import Sequence, TokenLogprobs
from mini.step import Commit, Drafter

# without speculation, the longest forced run verified in one step (16 rows a sequence)
FORCED_DRAFT = 15

# The acceptance rule's cost model (docs/engine.md, "The draft length"), in units of the plain decode step it
# replaces: a step in which every one of B sequences drafts k tokens costs 1 + draft(B) + row(B) * k and commits,
# per sequence, 1 + α + α² + ... + α^k tokens on average (α: the chance that a draft token is accepted after the
# ones before it). MEASURED at V4.1-Flash width, 4K context, CUDA graphs, every verify row its own token (`mini
# bench spec-decode --no-proxy`, docs/perf/040; `tools/step_costs_fit.py`), on an H100 at one emulated EP8 rank
# (no H200 for EP4 since docs/perf/029, whose figures at B = 1 / 16 / 64 were 0.155 / 0.177 / 0.199 and 0.084 /
# 0.120 / 0.188, the latter two with draft rows that repeated the next sequences' tokens): decode steps of 9.65 /
# 16.81 / 25.26 / 41.60 ms at B = 1 / 16 / 64 / 256, the draft step (DSpark's ring write and proposal) 1.78 /
# 3.22 / 5.84 / 12.70 ms, a verify step of B x 6 rows 1.48x / 1.70x / 1.95x / 3.30x a decode step. ASSUMED: linear
# in B between those B (the load rule stops drafting past 192 sequences at its 384 rows); linear in k; the same
# for every sequence of a batch (a graph step takes its longest draft's width, and the draft step costs about as
# much for one sequence as for all); an EP4 rank on the H200 in the same proportions.
STEP_COSTS = ((1, 0.185, 0.096), (16, 0.191, 0.14), (64, 0.231, 0.19), (256, 0.305, 0.46))  # (B, draft, row)
PRIOR_WEIGHT = 1.0  # a sequence's own evidence is read beside one draft token at the engine's acceptance (`alpha`)
# (two, with the costs above, kept a never-right drafter's sequences drafting after three misses: docs/perf/029)
RESTART_HITS = 4.0  # a probe taken whole restarts its sequence's evidence at 4 hits: α >= 4/5, long drafts again
DECAY = 0.9  # each verify step keeps 0.9 of the evidence before it (about the last 10 steps count)
PROBE_EVERY = 32  # a sequence whose drafts do not pay drafts a probe every 32 steps, all of them in the same step
PROBE_DRAFT = 2  # a probe's tokens: two, not one, so a drafter right by chance (p) restarts a sequence only where
# both are taken (p², not p: at tiny-v4.1-dspark's p = 0.04, 0.2% of sequences a probe)

@dataclass
class SpecStats:
    """Speculation's counters (LLMEngine.stats.spec): drafted and accepted tokens, how many verify chunks accepted
    each length 0..max_draft, and the steps that ran as plain decode (`Speculation.plain_step`)."""
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # [a] = verify chunks that accepted a drafts
    plain_steps: int = 0

    def count(self, drafted: int, accepted: int, max_draft: int) -> None:
        if len(self.accept_lengths) <= max_draft:
            self.accept_lengths += [0] * (max_draft + 1 - len(self.accept_lengths))
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.accept_lengths[accepted] += 1


def step_costs(decoding: int) -> tuple[float, float]:
    """(the draft step's, a verify row's) cost in decode steps when `decoding` sequences decode (STEP_COSTS)."""
    for (b0, *c0), (b1, *c1) in zip(STEP_COSTS, STEP_COSTS[1:]):
        if decoding <= b1:
            at = (max(decoding, b0) - b0) / (b1 - b0)
            return c0[0] + (c1[0] - c0[0]) * at, c0[1] + (c1[1] - c0[1]) * at
    return STEP_COSTS[-1][1], STEP_COSTS[-1][2]


def paying_draft(alpha: float, longest: int, decoding: int) -> int:
    """The draft length, 0..`longest`, that commits the most tokens per unit of step time under the cost model above
    at acceptance `alpha` among `decoding` sequences; 0 where no draft beats plain decode (one token per step).
    Alone: none below α = 0.26, then 1 token, 2 from 0.29, 3 from 0.47, 4 from 0.60, 5 from 0.68 (a step of full
    drafts costs 1.58 decode steps); among 16: none below 0.34, then 1, 2 from 0.39, 3 from 0.57, 4 from 0.69, 5
    from 0.76 (1.91); among 64: none below 0.44, then 1, 2 from 0.46, 3 from 0.64, 4 from 0.74, 5 from 0.81
    (2.25); among 128 (2 drafts at most: the load rule) none below 0.55. One token pays only in a narrow band
    where drafting starts."""
    (draft, row), gain, best, best_k = step_costs(decoding), 0.0, 1.0, 0
    for k in range(1, longest + 1):
        gain += alpha ** k
        speed = (1 + gain) / (1 + draft + row * k)
        if speed > best:
            best, best_k = speed, k
    return best_k


@functools.lru_cache(maxsize=1024)
def least_paying_alpha(longest: int, decoding: int) -> float:
    """The least α at which `paying_draft` drafts among `decoding` sequences (it is monotone in α), bisected to
    1e-12; inf where none pays even at α = 1. Lets the engine foresee each step's drafts in one compare a sequence."""
    if paying_draft(1.0, longest, decoding) == 0:
        return math.inf
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-12:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if paying_draft(mid, longest, decoding) > 0 else (mid, hi)
    return hi


@dataclass
class DraftRecord:
    """How often a drafter has been right: accepted draft tokens (`hits`) and verify chunks that rejected one
    (`misses`: the accept length stopped short of the draft), each decayed by DECAY per verify step; hits / (hits +
    misses) estimates α (the maximum-likelihood estimate for accept lengths that stop at the first rejected token,
    whatever the draft lengths). A sequence's own (`Sequence.draft_record`), read beside the engine's (`alpha`).
    Forced drafts are not recorded (they say nothing of the drafter). `probing`: the draft in flight is a probe
    (`Speculation.acceptance_cap`)."""
    hits: float = 0.0
    misses: float = 0.0
    probing: bool = False

    def alpha(self, prior: float) -> float:
        """α from this evidence beside PRIOR_WEIGHT draft tokens at `prior` (the engine's α: `Speculation.pool`)."""
        return (self.hits + PRIOR_WEIGHT * prior) / (self.hits + self.misses + PRIOR_WEIGHT)

    def record(self, drafted: int, accepted: int) -> None:
        """A verify chunk accepted `accepted` of `drafted` draft tokens. A probe accepted whole restarts the record
        at RESTART_HITS (the drafter may have turned good: long drafts again, cut within a few steps if it was luck)."""
        if self.probing and accepted == drafted:
            self.hits, self.misses = RESTART_HITS, 0.0
        else:
            self.add(accepted, int(accepted < drafted))
        self.probing = False

    def add(self, hits: float, misses: float) -> None:
        """One verify step's outcomes (of one sequence, or summed over the engine's: `Speculation.pool`)."""
        self.hits = DECAY * self.hits + hits
        self.misses = DECAY * self.misses + misses


class _Row:
    """A verify row as the sampler reads a sequence: its history with the drafts before the row appended."""

    def __init__(self, seq: Sequence, drafts: list[int]):
        self.seq, self.drafts = seq, drafts
        self.params, self.seed, self.eos_token_id = seq.params, seq.seed, seq.eos_token_id

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.drafts

    @property
    def tokens(self) -> list[int]:
        return self.seq.tokens + self.drafts

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafts)


def rejects(c) -> bool:
    """Whether chunk `c`'s drafts go through rejection sampling: an unseeded sampling request's (its output is a
    draw from the target's distribution, not one fixed sequence of draws); greedy and seeded requests accept a
    draft only where it equals the target's own token, which keeps their outputs plain decode's bit for bit."""
    return c.drafts > 0 and c.seq.params.temperature > 0 and c.seq.params.seed is None


def accept(draft: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the target's own tokens (targets[i]: row i's, drawn after draft[:i])."""
    a = 0
    while a < len(draft) and draft[a] == targets[a]:
        a += 1
    return a


class Speculation:
    """The verify step of an LLMEngine: speculation's (`engine.spec`), or forced drafts' alone (`drafter` None)."""

    def __init__(self, engine, drafter: Drafter | None, max_draft: int, max_rows: int | None = None,
                 forced: bool = True, adaptive: bool = True):
        """`max_rows`: the load rule's row budget (`load_cap`; None: none); `forced`: grammars' forced tokens are
        drafts (`force`); `adaptive`: each sequence's drafts are as long as its acceptance pays (`acceptance_cap`)."""
        if not 0 < max_draft <= (drafter.max_draft if drafter is not None else max_draft):
            raise ValueError(f"spec tokens must be in [1, {drafter.max_draft}] for this drafter, got {max_draft}")
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"spec max rows must be at least 1, got {max_rows}")
        self.engine, self.drafter, self.max_draft, self.max_rows = engine, drafter, max_draft, max_rows
        self.forced, self.adaptive = forced, adaptive
        # every sequence's verify outcomes, a step at a time: the engine's α, beside which each sequence's own
        # evidence is read (none yet: 1, full drafts); the serving warm-up's drafts count as any (docs/engine.md)
        self.pool = DraftRecord()
        self.steps = 0  # steps run, verify steps and plain ones (`plain_step`): the probes' clock

    def load_cap(self, decoding: int) -> int:
        """The load rule: the longest draft each of `decoding` sequences may verify in one step, so that the
        step's verify rows, (1 + k) per sequence, stay within `max_rows` (docs/engine.md: past that budget a verify
        row costs more than the tokens it is expected to win; the budget comes from the issue's proxy figures until
        measured). 0 where the sequences alone fill the budget: plain decode."""
        if self.max_rows is None or decoding == 0:
            return self.max_draft
        return max(0, min(self.max_draft, self.max_rows // decoding - 1))

    @property
    def engine_alpha(self) -> float:
        """The engine's α from every sequence's recent verify steps (1 before any: full drafts)."""
        return self.pool.alpha(1.0) if self.pool.hits + self.pool.misses else 1.0

    def alpha(self, seq: Sequence) -> float:
        """`seq`'s α: its own evidence beside PRIOR_WEIGHT tokens at the engine's α, so that a sequence with little
        evidence of its own drafts as the others' drafts fare (where the drafter keeps failing a new request drafts
        nothing from its first step, and the first requests stop after one verify step, not three), and one with
        much follows its own."""
        record = seq.draft_record if seq.draft_record is not None else DraftRecord()
        return record.alpha(self.engine_alpha)

    def acceptance_cap(self, seq: Sequence, decoding: int) -> int:
        """The acceptance rule: the longest draft the drafter may propose for `seq` next, from its past verify
        steps alone (`DraftRecord`; never this step's random streams, so rejection sampling stays exact): the
        length that pays at its α (`alpha`) among `decoding` sequences (`paying_draft`), or where none pays, a
        PROBE_DRAFT-token probe every PROBE_EVERY steps (the same steps for every sequence: one draft step and one
        3-row verify per PROBE_EVERY steps, about 2% of plain decode's time by the cost model) so that a drafter
        that turns good is seen. Forced drafts are not cut by it (`force`)."""
        if not self.adaptive:
            return self.max_draft
        if seq.draft_record is None:
            seq.draft_record = DraftRecord()
        k = paying_draft(self.alpha(seq), self.max_draft, decoding)
        seq.draft_record.probing = k == 0 and self.steps % PROBE_EVERY == 0
        return PROBE_DRAFT if seq.draft_record.probing else k

    def draft_room(self, seq: Sequence) -> int:
        """The longest draft `seq` may take next: its verify (1 + k tokens) stays within max_tokens and the context."""
        if seq.is_finished:
            return 0
        room = seq.max_total_tokens - seq.num_tokens - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(self.max_draft, room))

    def force(self, seqs: list[Sequence]) -> None:
        """Before a step is planned: each of the decoding `seqs` whose grammar forces its next tokens drafts them
        (at most what the load rule and `draft_room` allow); without a drafter every other one drafts nothing. A
        sequence whose token is still in flight (overlapped steps) has no tokens to draft after yet."""
        if not self.forced:
            return
        cap = self.load_cap(len(seqs))
        for s in seqs:
            if s.matcher is None:
                continue
            forced = [] if s.num_inflight else self.engine.grammars.forced(s.matcher, min(cap, self.draft_room(s)))
            if forced or self.drafter is None:
                s.draft, s.draft_forced = forced, bool(forced)

    def forcing(self, seqs: list[Sequence]) -> bool:
        """Whether the step in flight holding `seqs` must be read back before the next plan: a grammar forces at
        least two tokens after a sequence's last one read back, the one in flight and a draft after it."""
        return self.forced and any(s.matcher is not None and not s.is_finished
                                   and len(self.engine.grammars.forced(s.matcher, 2)) == 2 for s in seqs)

    def _next_draft(self, seq: Sequence, cap: int, decoding: int, anchored: bool) -> int:
        """The longest draft `seq` may take next: the load rule's `cap`, its room and, where the drafter drafts
        for it (`anchored`: it sampled), its acceptance rule."""
        k = min(cap, self.draft_room(seq))
        if k and anchored and self.drafter is not None:
            k = min(k, self.acceptance_cap(seq, decoding))
        return k

    def _grammar_masks(self, sampling: list, device):
        """The bitmask of every verify row (None: no sequence has a grammar): row i of a sequence with a matcher
        takes its mask after the matcher consumed the drafts before the row; the matcher is rolled back after. A
        draft the grammar refuses ends that: the rows after it keep its mask (their drafts cannot be accepted, the
        target never draws a refused token)."""
        if not any(c.seq.matcher is not None for c in sampling):
            return None
        grammars, masks = self.engine.grammars, []
        for c in sampling:
            m = c.seq.matcher
            if m is None:
                masks += [None] * (1 + c.drafts)
                continue
            consumed, mask = 0, None
            for i in range(1 + c.drafts):
                if i == consumed:  # every draft before row i was consumed
                    mask = grammars.bitmask([m], "cpu")
                    if i < c.drafts and not m.is_stopped():
                        consumed += m.try_consume_tokens([c.seq.draft[i]])
                masks.append(mask)
            if consumed:
                m.rollback(consumed)
        words = next(x for x in masks if x is not None).shape[1]
        full = torch.full((len(masks), words), -1, dtype=torch.int32)
        for i, x in enumerate(masks):
            if x is not None:
                full[i] = x[0]
        return full.to(device)

    @staticmethod
    def _rejection_verdicts(sampling: list, logits: torch.Tensor, batch: SamplingBatch) -> dict:
        """Rejection sampling (`rejects`) for every row that has a draft token after it, all at once: row ->
        (accepted, the residual's token). Rows are those of `sample`'s batch: its seeds and counters (n + i)."""
        at, proposals, row = [], [], 0
        for c in sampling:
            if rejects(c):
                at += range(row, row + c.drafts)
                proposals += c.seq.draft[:c.drafts]
            row += 1 + c.drafts
        if not at:
            return {}
        r = torch.tensor(at, device=logits.device)
        ok, residual = verify_proposals(target_probs(logits, batch)[r], torch.tensor(proposals, device=r.device),
                                        batch.seeds[r], batch.counters[r])
        return dict(zip(at, zip(ok.tolist(), residual.tolist())))

    def verifies(self, plan: StepPlan) -> bool:
        """Whether the planned step is a verify step (`step`): a chunk carries drafts, or a sequence that samples in
        it will want a draft after it (the draft is anchored on the step's token, which must be on the host before
        the next plan). Otherwise the step is plain decode's, overlapped where it may be, and `plain_step` follows
        its launch. The next draft's length is foreseen as `step` will set it (the load rule over the sequences that
        decode after the step, the acceptance rule at the next step's clock); only the draft room is taken before
        the step's token (one more than after it: at worst a verify step where none was needed)."""
        if any(c.drafts for c in plan.chunks):
            return True
        if self.drafter is None:
            return False
        sampling = [c for c in plan.chunks if c.samples]
        decoding = (sum(1 for s in self.engine.scheduler.running if not s.in_prefill)
                    + sum(1 for c in sampling if not c.is_decode))
        if self.load_cap(decoding) == 0:
            return False
        if self.adaptive and (self.steps + 1) % PROBE_EVERY:  # (a probe step: everyone drafts, at least a probe)
            least = least_paying_alpha(self.max_draft, decoding)  # `acceptance_cap`, per sequence
            sampling = [c for c in sampling if self.alpha(c.seq) >= least]
        return any(self.draft_room(c.seq) > 0 for c in sampling)

    def plain_step(self, plan: StepPlan) -> None:
        """After the launch of a step that `verifies` left to plain decode (it may still be in flight): the probes'
        clock moves, and the drafter takes the step's rows into its state (DSpark's rings, before prefix-cache
        snapshots copy them) without drafting; after a decode step on graphs that write was part of the step's own
        graph, and nothing runs here."""
        self.steps += 1
        self.engine.stats.spec.plain_steps += 1
        self._forget_drafts(plan.preempted)
        if self.drafter is not None:
            self.engine.runner.draft(self.drafter, [
                Commit(rows=c.end - c.start, length=c.length, slot=c.seq.slot, end=c.end, anchor=None, max_draft=0,
                       history=lambda s=c.seq: s.tokens) for c in plan.chunks])

    @staticmethod
    def _forget_drafts(preempted: list[Sequence]) -> None:
        for seq in preempted:  # recomputed as a prompt; a new draft follows its first token
            seq.draft, seq.draft_forced = [], False

    def step(self, plan: StepPlan) -> list:
        e = self.engine
        self.steps += 1
        self._forget_drafts(plan.preempted)
        chunks = plan.chunks
        logits = e.runner.run(chunks)
        sampling = [c for c in chunks if c.samples]  # (read before the histories grow below)
        samples = {id(c) for c in sampling}
        rows = [_Row(c.seq, c.seq.draft[:i]) for c in sampling for i in range(1 + c.drafts)]
        if logits.shape[0] != len(rows):
            raise RuntimeError(f"{logits.shape[0]} logit rows for {len(rows)} verify rows")
        out = None
        if rows:
            batch = SamplingBatch.from_seqs(rows, logits.shape[-1], logits.device)
            batch.allowed = self._grammar_masks(sampling, logits.device)
            out = sample(logits, batch)
        ids = out.token_ids.tolist() if out is not None else []
        lp = out.logprobs.tolist() if out is not None and out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out is not None and out.top_ids is not None else None
        top_lp = out.top_logprobs.tolist() if out is not None and out.top_logprobs is not None else None

        # acceptance, then the cache at the committed frontier
        verdicts = self._rejection_verdicts(sampling, logits, batch) if rows else {}
        accepted, new_tokens, relogged, row, outcomes = [], {}, [], 0, [0, 0]
        for c in chunks:
            a = 0
            if id(c) in samples:
                draft = c.seq.draft[:c.drafts]
                if rejects(c):
                    while a < c.drafts and verdicts[row + a][0]:
                        a += 1
                    tokens = draft[:a] + [verdicts[row + a][1] if a < c.drafts else ids[row + a]]
                    relogged += [(row + i, t) for i, t in enumerate(tokens) if t != ids[row + i]]
                else:
                    a = accept(draft, ids[row:row + 1 + c.drafts])
                    tokens = ids[row:row + a + 1]
                new_tokens[id(c)] = (row, tokens)
                row += 1 + c.drafts
                if c.drafts:
                    e.stats.spec.count(c.drafts, a, self.max_draft)
                    if c.seq.draft_record is not None and not c.seq.draft_forced:
                        c.seq.draft_record.record(c.drafts, a)
                        outcomes[0] += a
                        outcomes[1] += a < c.drafts
            accepted.append(a)
            if c.is_decode:
                e.stats.decode_tokens += 1 + a
            else:
                e.stats.prefill_tokens += c.length
        if outcomes != [0, 0]:
            self.pool.add(*outcomes)
        if lp is not None and relogged:  # logprobs are the target's (raw rows, as `sample`'s) of the committed tokens
            at = torch.tensor(relogged, device=logits.device)
            fixed = torch.log_softmax(logits[at[:, 0]], dim=-1).gather(1, at[:, 1:])[:, 0].tolist()
            for (r, _), value in zip(relogged, fixed):
                lp[r] = value
        e.runner.cache.commit_drafts(accepted)
        for c, a in zip(chunks, accepted):
            c.seq.num_computed = c.end - c.drafts + a

        # the committed tokens, in order, through the stop checks (a stop inside them drops the rest)
        now, emitted = time.monotonic(), {}
        for c in sampling:
            seq, (first, tokens) = c.seq, new_tokens[id(c)]
            if seq.first_token_time is None:
                seq.first_token_time = now
            kept = []
            for i, token in enumerate(tokens):
                seq.output_token_ids.append(token)
                kept.append(token)
                if seq.matcher is not None:
                    e.grammars.advance([(seq.matcher, token)])
                if lp is not None and seq.params.logprobs is not None:
                    k = seq.params.logprobs
                    top = dict(zip(top_ids[first + i][:k], top_lp[first + i][:k]))
                    seq.output_logprobs.append(TokenLogprobs(token, lp[first + i], top))
                e._check_stop(seq, token)
                if seq.is_finished:
                    break
            emitted[id(c)] = kept

        # the load rule over the sequences that decode next (a draft kept from an earlier step is cut to it too)
        decoding = [s for s in e.scheduler.running if not s.is_finished and not s.in_prefill]
        cap = self.load_cap(len(decoding))
        for s in decoding:
            del s.draft[cap:]
        # the drafter takes the committed rows (its state in the slots) and proposes, each draft within the load
        # rule and its sequence's acceptance rule; then snapshots
        commits = [Commit(rows=c.end - c.drafts + a - c.start, length=c.length, slot=c.seq.slot,
                          end=c.seq.num_computed, anchor=c.seq.output_token_ids[-1] if id(c) in samples else None,
                          max_draft=self._next_draft(c.seq, cap, len(decoding), id(c) in samples),
                          history=lambda s=c.seq: s.tokens)
                   for c, a in zip(chunks, accepted)]
        drafts = e.runner.draft(self.drafter, commits) if self.drafter is not None else [[]] * len(chunks)
        for c, draft in zip(chunks, drafts):  # (a grammar's forced tokens replace them: `force`, next plan)
            c.seq.draft, c.seq.draft_forced = (list(draft) if id(c) in samples else []), False
        live = [c for c in chunks if not c.seq.is_finished]
        e.runner.copy_slots([s for s in (e.blocks.commit(c.seq) for c in live) if s is not None])

        results = []
        for c in sampling:
            seq = c.seq
            if seq.is_finished:
                e._remove(seq)
                e.requests.pop(seq.request_id, None)
            results.append(e._output(seq, emitted[id(c)]))
        return results
