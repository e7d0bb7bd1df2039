"""The window-layout dRPB reduction (ops/fused/rpb_grad.py) against a direct sum over the oracle's slot tables."""
import pytest
import torch

from ops.fused import rpb_grad
from ops.functional import make_params
from ops.window import neighbor_table


def _direct_sum(ds: torch.Tensor, params) -> torch.Tensor:
    """dRPB[h, r] = sum over batch, query and slot of ds where the slot's relative-offset index is r."""
    _, _, rel = neighbor_table(params)  # [N, W] flat offset index of every (query, slot)
    heads = ds.shape[2]
    out = torch.zeros(heads, rpb_grad_size(params), dtype=torch.float64)
    per_head = ds.double().sum(0).permute(1, 0, 2).reshape(heads, -1)  # [H, N * W]
    return out.index_add_(1, rel.reshape(-1), per_head)


def rpb_grad_size(params) -> int:
    size = 1
    for k in params.kernel_size:
        size *= 2 * k - 1
    return size


@pytest.mark.parametrize("spatial,kernel,stride,dilation", [
    ((11,), (5,), (1,), (1,)),
    ((9, 10), (3, 5), (1, 2), (2, 1)),
    ((5, 6, 7), (3, 3, 5), (2, 1, 1), (1, 2, 1)),
], ids=["1d", "2d-stride-dilation", "3d"])
@pytest.mark.parametrize("batch", [1, 2], ids=["batch-summed", "per-element"])
def test_window_reduction_matches_direct_sum(spatial, kernel, stride, dilation, batch):
    params = make_params(spatial, kernel, stride, dilation, (False,) * len(spatial))
    gen = torch.Generator().manual_seed(0)
    ds = torch.randn(rpb_grad.buffer_shape(batch, 3, params), generator=gen)
    # the summing kernel runs on the GPU, or on CPU tensors through Triton's interpreter (set by conftest)
    got = rpb_grad.reduce_window_ds(ds.to("cuda" if torch.cuda.is_available() else "cpu"), params).cpu()
    assert got.shape == (3, rpb_grad_size(params)) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _direct_sum(ds, params), rtol=1e-5, atol=1e-4)


def test_window_path_limits(monkeypatch):
    """Causal axes never take the window path (no RPB there, and their short windows would leave slots unwritten);
    the buffer bound is WINDOW_BUFFER_BYTES."""
    small = make_params((8, 8), (3, 3), (1, 1), (1, 1), (False, False))
    assert rpb_grad.window_path_ok(2, 2, small)
    assert not rpb_grad.window_path_ok(2, 2, make_params((8, 8), (3, 3), (1, 1), (1, 1), (True, False)))
    bytes_needed = 4 * 2 * 64 * 2 * 9  # float32 [B, N, H, prod(K)]
    monkeypatch.setattr(rpb_grad, "WINDOW_BUFFER_BYTES", bytes_needed - 1)
    assert not rpb_grad.window_path_ok(2, 2, small)
    monkeypatch.setattr(rpb_grad, "WINDOW_BUFFER_BYTES", bytes_needed)
    assert rpb_grad.window_path_ok(2, 2, small)


@pytest.mark.parametrize("heads", [1, 3])
def test_tile_reduction_matches_direct_sum(heads):
    """dQ's tile-layout dS summed by relative offset through the gather index (``tile_gather_index``, rows padded
    with -1; elements outside every window marked -1 are left out) equals a direct index_add over the offsets."""
    gen = torch.Generator().manual_seed(1)
    n_rel, elements = 25, 1000
    offsets = torch.randint(-1, n_rel, (elements,), generator=gen, dtype=torch.int32)
    offsets[offsets == 7] = -1  # an offset no element holds: its sum is zero
    ds = torch.randn(heads * elements, generator=gen)
    index = rpb_grad.tile_gather_index(offsets, n_rel)
    assert index.dtype == torch.int32 and index.shape[0] == n_rel
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got = rpb_grad.reduce_tile_ds(ds.to(device), index.to(device), heads).cpu()
    valid = offsets >= 0
    want = torch.zeros(heads, n_rel, dtype=torch.float64)
    want.index_add_(1, offsets[valid].long(), ds.view(heads, elements)[:, valid].double())
    assert got.shape == (heads, n_rel) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[:, 7], torch.zeros(heads))
