"""The launch order of the Hopper kernels' tiles (``ops.fused.launch_order``), checked without a GPU."""
import itertools

import pytest
import torch

from ops.fused import hopper, launch_order
from ops.window import NAParams

pytestmark = pytest.mark.usefixtures("h100_sms_without_a_gpu")


def _params(spatial, kernel, stride):
    rank = len(spatial)
    return NAParams(tuple(spatial), tuple(kernel), tuple(stride), (1,) * rank, (False,) * rank)


def test_blocked_visits_blocks_then_tiles_in_row_major_order():
    # a 4 x 3 grid (leading dummy axis) in blocks of 2 x 2: the blocks' tiles row by row, blocks cut at the edge
    order = launch_order.blocked((1, 4, 3), (1, 2, 2)).tolist()
    assert order == [0, 1, 3, 4, 2, 5, 6, 7, 9, 10, 8, 11]
    assert launch_order.blocked((2, 3, 5), (2, 3, 5)).tolist() == list(range(30))


@pytest.mark.parametrize("counts, block", [((3, 5, 7), (2, 4, 2)), ((15, 6, 10), (8, 2, 4)), ((1, 1, 9), (1, 1, 4))])
def test_blocked_is_a_permutation(counts, block):
    order = launch_order.blocked(counts, block)
    assert sorted(order.tolist()) == list(range(counts[0] * counts[1] * counts[2]))


def test_run_volume_is_the_summed_bounding_box_of_each_run():
    gen = torch.Generator().manual_seed(0)
    counts, at_once = (3, 4, 5), 7
    lo = torch.randint(0, 20, (3, 8), generator=gen)
    spans = torch.stack([lo, lo + torch.randint(1, 9, (3, 8), generator=gen)], -1)
    order = torch.randperm(60, generator=gen)
    expect = 0
    for run in order.split(at_once):
        coords = [(int(t) // 20, int(t) // 5 % 4, int(t) % 5) for t in run]
        volume = 1
        for axis in range(3):
            volume *= max(spans[axis, c[axis], 1] for c in coords) - min(spans[axis, c[axis], 0] for c in coords)
        expect += int(volume)
    assert launch_order.run_volume(order, counts, spans, at_once) == expect


def _tables(spatial, kernel, stride):
    params = _params(spatial, kernel, stride)
    q_tile, _, _, _, counts, (_, spans, _), _ = hopper.query_boxes(params, torch.device("cpu"))
    return q_tile, counts, spans


def test_block_order_keeps_a_stride_groups_tiles_together():
    """3d-hunyuan-s16x8x8's query tiles of one stride group share one window; in row-major order the 132 tiles in
    flight at once span whole frames of keys, in block order well under two thirds of that."""
    q_tile, counts, spans = _tables((30, 48, 80), (18, 24, 24), (16, 8, 8))
    order = launch_order.block_order(counts, spans, 132)
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(counts[0] * counts[1] * counts[2]))
    row_major = launch_order.blocked(counts, counts)
    ordered = launch_order.run_volume(order.long(), counts, spans[..., :2], 132)
    assert ordered < 0.65 * launch_order.run_volume(row_major, counts, spans[..., :2], 132)
    # no block shape does better (the search is exhaustive over its candidates)
    sides = [launch_order._candidates(n) for n in counts]
    assert all(ordered <= launch_order.run_volume(launch_order.blocked(counts, block), counts, spans[..., :2], 132)
               for block in itertools.product(*sides))


def test_block_order_leaves_1d_in_row_major_order():
    _, counts, spans = _tables((32768,), (2048,), (1,))
    assert launch_order.block_order(counts, spans, 132).tolist() == list(range(counts[2]))


def test_plans_carry_the_order_and_ordered_off_is_row_major(monkeypatch):
    params = _params((30, 48, 80), (18, 24, 24), (1, 1, 1))
    q4 = torch.zeros(1, params.num_tokens, 2, 128, dtype=torch.bfloat16)
    fw = hopper.build_launches(q4, q4, q4, params, 0.1, False)
    tiles = fw.grid[0]
    assert fw.order.dtype == torch.int32 and sorted(fw.order.tolist()) == list(range(tiles))
    assert fw.order.tolist() != list(range(tiles))
    monkeypatch.setattr(hopper, "ORDERED", False)
    assert hopper.build_launches(q4, q4, q4, params, 0.1, False).order.tolist() == list(range(tiles))
