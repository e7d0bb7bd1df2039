"""Windows that cover the map as dense attention per dilation group (``ops.dense_window``): exact against the
dense-mask oracle, forward and backward (RPB included), on every rank, with dilation, stride and GQA; the fused
backend's dispatch to it (``ops.fused.DENSE_WINDOW``) and the problems it must leave to the kernels."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first import of triton code
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ops  # noqa: E402
from ops import dense_window  # noqa: E402
from ops.functional import make_params  # noqa: E402
from tests.oracle import oracle_attention  # noqa: E402

COVERED = [  # spatial, kernel, dilation, stride, heads q / kv
    ((7, 7), (7, 7), (1, 1), (1, 1), (2, 2)),  # NAT's last stage
    ((14, 14), (7, 7), (2, 2), (1, 1), (4, 2)),  # DiNAT's dilated third stage, GQA
    ((12, 10), (4, 5), (3, 2), (2, 3), (2, 1)),  # stride changes nothing where the window is the group
    ((8,), (4,), (2,), (1,), (2, 2)),
    ((4, 6, 3), (2, 3, 3), (2, 2, 1), (1, 1, 1), (2, 2)),
]


@pytest.mark.parametrize("spatial, kernel, dilation, stride, heads", COVERED)
def test_matches_the_oracle_forward_and_backward(spatial, kernel, dilation, stride, heads):
    params = make_params(spatial, kernel, stride, dilation, False)
    assert dense_window.covers(params)
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    q, k, v = mk(2, *spatial, heads[0], 3), mk(2, *spatial, heads[1], 3), mk(2, *spatial, heads[1], 2)
    rpb = mk(heads[0], *(2 * x - 1 for x in kernel))
    out = dense_window.attention(q, k, v, params, rpb, 0.7)
    ref, _ = oracle_attention(q, k, v, spatial, kernel, stride, dilation, (False,) * len(spatial), rpb=rpb, scale=0.7)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    weights = torch.randn(out.shape, generator=g, dtype=out.dtype)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v, rpb))
    want = torch.autograd.grad((ref * weights).sum(), (q, k, v, rpb))
    for a, b in zip(got, want):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("spatial, kernel, dilation, causal", [
    ((8, 8), (7, 7), (1, 1), (False, False)),  # a window smaller than the map
    ((7, 7), (7, 7), (1, 1), (True, False)),  # causal: a query does not see its whole group
    ((14, 14), (7, 7), (1, 2), (False, False)),  # one axis not covered
    ((15,), (5,), (3,), (False,)),  # covered, the only one here
])
def test_covers_only_whole_groups(spatial, kernel, dilation, causal):
    params = make_params(spatial, kernel, 1, dilation, causal)
    assert dense_window.covers(params) == (spatial == (15,))
    if spatial != (15,):
        with pytest.raises(ValueError, match="^params: the window does not cover the map"):
            dense_window.attention(*(torch.zeros(1, *spatial, 1, 2),) * 3, params, None, 1.0)


@pytest.mark.skipif(not (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()),
                    reason="the fused backend needs CUDA or the Triton interpreter")
def test_fused_backend_dispatches_covered_windows_when_enabled(monkeypatch):
    """With ``DENSE_WINDOW`` on, a covered call without lse runs dense (no fused kernel), one that asks for the lse
    runs the kernels, and both equal the oracle; with it off the kernels run."""
    import ops.fused as fused
    import ops.fused.op as fused_op

    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls = []
    kernel_attention = fused_op.attention
    monkeypatch.setattr(fused_op, "attention", lambda *a, **kw: calls.append(1) or kernel_attention(*a, **kw))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 6, 6, 2, 4, generator=g).to(device) for _ in range(3))
    rpb = torch.randn(2, 5, 5, generator=g).to(device)
    ref, _ = oracle_attention(q.cpu(), k.cpu(), v.cpu(), (6, 6), (3, 3), (1, 1), (2, 2), (False, False),
                              rpb=rpb.cpu())
    for enabled, return_lse, kernels in ((True, False, 0), (True, True, 1), (False, False, 1)):
        monkeypatch.setattr(fused, "DENSE_WINDOW", enabled)
        calls.clear()
        result = ops.na2d(q, k, v, 3, dilation=2, rpb=rpb, return_lse=return_lse, backend="fused")
        out = result[0] if return_lse else result
        assert len(calls) == kernels
        torch.testing.assert_close(out.double().cpu(), ref, rtol=2e-4, atol=2e-4)
