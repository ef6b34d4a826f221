"""Batch.build flattens chunks; StepLayout's index tensors say where every key and partial group lives."""
import pytest
import torch

from mini.config import preset
from mini.model import Batch, SeqChunk

CFG = preset("tiny-v4")  # no Engram: no hasher needed


def _batch():
    # sequence 0: decode at position 9 (slot 2, blocks 3, 1, 5); sequence 1: prefill chunk 5..7 (slot 0, blocks 4, 0)
    return Batch.build([SeqChunk(list(range(10, 20)), 9, 2, [3, 1, 5]), SeqChunk(list(range(8)), 5, 0, [4, 0])],
                       CFG, "cpu")


def test_build_flattens_the_chunks():
    b = _batch()
    assert b.input_ids.tolist() == [19, 5, 6, 7]
    assert b.positions.tolist() == [9, 5, 6, 7]
    assert b.seq_of.tolist() == [0, 1, 1, 1]
    assert b.slots.tolist() == [2, 0] and b.start_pos.tolist() == [9, 5] and b.lens.tolist() == [1, 3]
    assert b.block_table.tolist() == [[3, 1, 5], [4, 0, -1]] and b.block_table.dtype == torch.int32
    assert b.logit_rows.tolist() == [0, 3]
    assert b.engram is None


def test_build_needs_a_hasher_for_engram_models():
    with pytest.raises(ValueError, match="Engram"):
        Batch.build([SeqChunk([1, 2], 0, 0, [0])], preset("tiny-v4.1"), "cpu")


def test_layout_rejects_too_few_blocks():
    b = Batch.build([SeqChunk(list(range(9)), 0, 0, [0, 1])], CFG, "cpu")
    with pytest.raises(ValueError, match="blocks"):
        b.layout(block_tokens=4, window=4)


def test_ring_writes_are_the_last_window_positions_of_each_chunk():
    lay = Batch.build([SeqChunk(list(range(12)), 3, 1, [0, 1, 2])], CFG, "cpu").layout(block_tokens=4, window=4)
    assert lay.ring_write_row.tolist() == [5, 6, 7, 8]  # positions 8..11
    assert lay.ring_write_dst.tolist() == [4 + 0, 4 + 1, 4 + 2, 4 + 3]  # slot 1 * W + pos % W


def test_groups_without_overlap():
    lay = _batch().layout(block_tokens=4, window=4)
    g = lay.groups(2, overlap=False)
    # seq 0 completes group 4 (positions 8, 9); seq 1 completes groups 2 (4, 5) and 3 (6, 7)
    assert g.seq.tolist() == [0, 1, 1] and g.group.tolist() == [4, 2, 3] and g.pos.tolist() == [8, 4, 6]
    assert g.pool_row.tolist() == [5 * 2 + 0, 0 * 2 + 0, 0 * 2 + 1]  # block_table[j // 2] * 2 + j % 2
    assert g.member_row.tolist() == [[-1, 0], [-1, 1], [2, 3]]
    assert g.member_state.tolist() == [[2 * 2 + 0, -1], [0 * 2 + 0, -1], [-1, -1]]  # slot * 2 + pos % 2
    assert g.write_row.numel() == 0  # no group is left open


def test_groups_with_overlap_keep_the_last_complete_group():
    lay = _batch().layout(block_tokens=4, window=4)
    o = lay.groups(4, overlap=True)  # M = 8 members: the previous group's 4 tokens, then the group's own
    assert o.group.tolist() == [1] and o.seq.tolist() == [1]  # only seq 1 completes a group: 1 (positions 4..7)
    assert o.member_row.tolist() == [[-1] * 5 + [1, 2, 3]]
    assert o.member_state.tolist() == [[0, 1, 2, 3, 4, -1, -1, -1]]  # slot 0 * 8 + pos % 8
    # kept: seq 0's position 9 (open group 2; group 1 was kept by earlier steps), seq 1's group 1 (4..7)
    assert o.write_row.tolist() == [0, 1, 2, 3]
    assert o.write_state.tolist() == [2 * 8 + 1, 5, 6, 7]


def test_seq_rows_and_visibility():
    lay = _batch().layout(block_tokens=4, window=4)
    assert lay.seq_rows(2).tolist() == [[6, 7, 2, 3, 10], [8, 9, 0, 1, -1]]
    assert lay.n_visible(2).tolist() == [5, 3, 3, 4]
    assert lay.seq_rows(128).shape == (2, 0)
