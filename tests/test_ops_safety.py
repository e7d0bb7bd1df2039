"""Safety of the NA operators across backends: float32 matmul precision, non-finite values kept inside the windows
that hold them, 64-bit index math and chunked grids, and the flex CPU path under several threads.

* precision: the Triton kernels (``fused``, ``gemm``) take their float32 matmul precision from torch's setting
  (``torch.set_float32_matmul_precision``) on every call; on CPU the interpreter computes in float32 whatever the
  setting, so these tests check the launches' choice; the ``gpu`` test checks the numbers on CUDA;
* non-finite values: one NaN / inf in a key or value token of a 16x16 map with K = 3 must reach exactly the outputs
  (and gradients) whose windows hold it, as a per-query gather computes them (``_window_reference``), in every
  backend that runs on CPU (the Triton kernels through the interpreter);
* limits: index products widened to int64 before they can pass 2**31, grids split where B * H passes CUDA's
  grid-y limit (checked with a small limit against the results of one launch);
* flex on CPU: concurrent calls leave torch's flex debug flag and the warning filters as they found them.
"""
import os
import threading
import warnings

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels must be created in interpreter mode: before triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import ops  # noqa: E402
from ops.fused import autotune, decide, launch  # noqa: E402
from ops.fused.autotune import Config  # noqa: E402
from ops.gemm import operators, triton_kernels  # noqa: E402
from tests.oracle import RandomProblem, dense_mask_and_bias_index, oracle_attention  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
# index helpers of the kernels, called from the probe kernels below
_token_row = getattr(triton_kernels, "_token_row", None)


@pytest.fixture(autouse=True)
def fresh_fused_plans():
    """Every test plans its problems afresh (plans built under what the test patched)."""
    decide._PLANS.clear()
    yield
    decide._PLANS.clear()


@pytest.fixture
def matmul_precision():
    """Sets torch's float32 matmul precision for one test and puts the previous one back."""
    previous = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(previous)


# ------------------------------------------------------------------------------------------------------------------
# Non-finite values stay in their windows
# ------------------------------------------------------------------------------------------------------------------
SPATIAL = (16, 16)
KERNEL = (3, 3)
BAD_TOKEN = (5, 7)  # an interior token: 9 queries hold it in their 3x3 windows
BAD_CHANNEL = 3


def _window_reference(q, k, v, spatial, kernel_size, causal):
    """NA as a gather per query (float64, autograd-able): each query's softmax and weighted sum see only the keys of
    its window, so a non-finite key or value reaches exactly the outputs and gradients that depend on it."""
    rank = len(spatial)
    mask, _ = dense_mask_and_bias_index(spatial, kernel_size, (1,) * rank, (1,) * rank, causal)
    b, h, d = q.shape[0], q.shape[-2], q.shape[-1]
    hkv, dv = k.shape[-2], v.shape[-1]
    n = mask.shape[0]
    qf = q.reshape(b, n, h, d)
    kf = k.reshape(b, n, hkv, d).repeat_interleave(h // hkv, dim=2)
    vf = v.reshape(b, n, hkv, dv).repeat_interleave(h // hkv, dim=2)
    rows, lse = [], []
    for i in range(n):
        keys = mask[i].nonzero().squeeze(1)
        logits = torch.einsum("bhd,bwhd->bhw", qf[:, i], kf[:, keys]) * d ** -0.5
        rows.append(torch.einsum("bhw,bwhd->bhd", torch.softmax(logits, dim=-1), vf[:, keys]))
        lse.append(torch.logsumexp(logits, dim=-1))
    return torch.stack(rows, dim=1).reshape(b, *spatial, h, dv), torch.stack(lse, dim=1).reshape(b, *spatial, h)


def _inputs(bad_tensor, bad_value, heads=2, heads_kv=2, dim=8, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, *SPATIAL, heads, dim, generator=gen, dtype=dtype)
    k = torch.randn(1, *SPATIAL, heads_kv, dim, generator=gen, dtype=dtype)
    v = torch.randn(1, *SPATIAL, heads_kv, dim, generator=gen, dtype=dtype)
    target = {"query": q, "key": k, "value": v}[bad_tensor]
    target[(0, *BAD_TOKEN, 0, BAD_CHANNEL)] = bad_value
    return q, k, v


def _check_contained(backend, bad_tensor, bad_value, grads, causal=(False, False), heads=2, heads_kv=2, dim=8,
                     device=DEVICE):
    """The non-finite entries of the outputs (and of dq, dk, dv) of ``backend`` are exactly the reference's.

    Gradients are compared for NaN only: with an infinite logit, which of a row's probabilities come out NaN (all of
    them through softmax, one through exp(s - lse)) is the implementation's choice, inside that row's window."""
    grads = grads and bad_value != bad_value
    q, k, v = _inputs(bad_tensor, bad_value, heads, heads_kv, dim)
    inputs = [t.to(device).requires_grad_(grads) for t in (q, k, v)]
    out, lse = ops.na2d(*inputs, KERNEL, is_causal=causal, backend=backend, return_lse=True)
    ref_inputs = [t.double().requires_grad_(grads) for t in (q, k, v)]
    ref, ref_lse = _window_reference(*ref_inputs, SPATIAL, KERNEL, causal)
    reached = (~torch.isfinite(ref)).any(-1).sum().item()
    assert 0 < reached < 20, "the reference itself should keep the bad value in a few windows"
    _same_pattern("out", out, ref)
    _same_pattern("lse", lse[..., None], ref_lse[..., None])
    if not grads:
        return
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((out * d_out.to(device)).sum(), inputs)
    want = torch.autograd.grad((ref * d_out.double()).sum(), ref_inputs)
    for name, g, r in zip(("dq", "dk", "dv"), got, want):
        _same_pattern(name, g, r)


def _same_pattern(name, got, ref):
    bad_got, bad_ref = ~torch.isfinite(got.detach().cpu()), ~torch.isfinite(ref.detach())
    assert torch.equal(bad_got, bad_ref), (
        f"{name}: {int(bad_got.any(-1).sum())} rows with non-finite values, expected {int(bad_ref.any(-1).sum())} "
        f"({int((bad_got & ~bad_ref).sum())} extra elements, {int((bad_ref & ~bad_got).sum())} missing)")


BAD_CASES = [("value", float("nan")), ("key", float("nan")), ("value", float("inf")), ("key", float("inf")),
             ("key", float("-inf"))]
BAD_IDS = [f"{t}-{v}" for t, v in BAD_CASES]


@pytest.mark.parametrize("bad_tensor, bad_value", BAD_CASES, ids=BAD_IDS)
def test_non_finite_stays_in_its_windows_naive(bad_tensor, bad_value):
    _check_contained("naive", bad_tensor, bad_value, grads=True)


@pytest.mark.parametrize("bad_tensor", ["query", "key", "value"])
def test_non_finite_stays_in_its_windows_naive_causal(bad_tensor):
    """Causal windows leave slots empty; their gathered keys must not carry a NaN to the query."""
    _check_contained("naive", bad_tensor, float("nan"), grads=True, causal=(True, False))


@pytest.mark.parametrize("bad_tensor, bad_value", BAD_CASES, ids=BAD_IDS)
def test_non_finite_stays_in_its_windows_gemm_torch(bad_tensor, bad_value, monkeypatch):
    monkeypatch.setattr(operators, "IMPL", "torch")
    _check_contained("gemm", bad_tensor, bad_value, grads=True)


@pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs CUDA or the interpreter")
@pytest.mark.parametrize("bad_tensor, bad_value", BAD_CASES[:3], ids=BAD_IDS[:3])
def test_non_finite_stays_in_its_windows_gemm_triton(bad_tensor, bad_value, monkeypatch):
    monkeypatch.setattr(operators, "IMPL", "triton")
    _check_contained("gemm", bad_tensor, bad_value, grads=True)


@pytest.mark.parametrize("bad_tensor, bad_value", BAD_CASES, ids=BAD_IDS)
def test_non_finite_stays_in_its_windows_flex_cpu(bad_tensor, bad_value):
    _check_contained("flex", bad_tensor, bad_value, grads=False, device="cpu")  # CPU flex has no backward


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["fused", "gemm", "flex"])
@pytest.mark.parametrize("bad_tensor, bad_value", BAD_CASES, ids=BAD_IDS)
def test_gpu_non_finite_stays_in_its_windows(backend, bad_tensor, bad_value):
    """The compiled kernels (head dim 16: flex's minimum) on CUDA; flex's compiled backward is torch's own, so flex is
    checked forward only."""
    _check_contained(backend, bad_tensor, bad_value, grads=backend != "flex", heads=2, heads_kv=1, dim=16,
                     device="cuda")


# The fused kernels' ways of masking a key box and of orienting dK/dV, each with the default tiles of this problem
# and with 16 x 16 tiles on four warps: (MASK_IN_DOT_FROM, DKDV_QUERY_ROWS_FROM, configuration or None).
FUSED_PATHS = {
    "defaults": (decide.MASK_IN_DOT_FROM, decide.DKDV_QUERY_ROWS_FROM, None),
    "mask-in-dot-key-rows": (0.0, 1 << 30, Config(16, 16, 4, 1)),
    "selects-query-rows": (float("inf"), 1, Config(16, 16, 4, 1, True)),
}


@pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs CUDA or the interpreter")
@pytest.mark.parametrize("path", sorted(FUSED_PATHS))
@pytest.mark.parametrize("bad_tensor, bad_value", BAD_CASES[:3], ids=BAD_IDS[:3])
def test_non_finite_stays_in_its_windows_fused(bad_tensor, bad_value, path, monkeypatch):
    mask_from, rows_from, config = FUSED_PATHS[path]
    monkeypatch.setattr(decide, "MASK_IN_DOT_FROM", mask_from)
    monkeypatch.setattr(decide, "DKDV_QUERY_ROWS_FROM", rows_from)
    forced = {} if config is None else dict(fwd=config, dq=config, dkdv=config)
    with autotune.forced(**forced):
        _check_contained("fused", bad_tensor, bad_value, grads=True, heads=2, heads_kv=1)


@pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs CUDA or the interpreter")
def test_fused_contains_non_finite_values_on_a_repeated_call():
    """The launch plans (second call of a problem) run the same kernels: clean inputs after bad ones and bad
    inputs after clean ones give the reference's patterns."""
    for bad_value in (0.5, float("nan"), 0.25):
        _check_contained_or_finite("fused", bad_value)


def _check_contained_or_finite(backend, bad_value):
    q, k, v = _inputs("value", bad_value)
    out = ops.na2d(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), KERNEL, backend=backend)
    ref, _ = _window_reference(q.double(), k.double(), v.double(), SPATIAL, KERNEL, (False, False))
    _same_pattern("out", out, ref)
    finite = torch.isfinite(ref)
    torch.testing.assert_close(out.cpu().double()[finite], ref[finite], rtol=1e-4, atol=1e-5)


# The pair-by-pair paths that programs meeting a NaN / inf take, run by every program (``_holds_nonfinite`` patched to
# answer yes) on finite inputs, against the oracle: every window rule, GQA and RPB, forward and gradients.
RERUN_PROBLEMS = [
    RandomProblem((40,), (9,), (2,), (2,), (True,), 1, 2, 1, 16, 8, False),
    RandomProblem((7, 9), (5, 3), (1, 2), (1, 2), (False, False), 1, 2, 2, 8, 16, True),
    pytest.param(RandomProblem((4, 6, 5), (3, 3, 3), (2, 1, 1), (1, 2, 1), (True, False, False), 1, 2, 1, 8, 8, False),
                 marks=pytest.mark.slow),  # minutes under the interpreter
]


@triton.jit
def _always_rerun(x):
    return tl.sum(tl.sum(x * 0.0, 1), 0) == 0.0  # True wherever the real check says False


def _check_against_oracle(problem, backend, tol):
    gen = torch.Generator().manual_seed(4)
    q, k, v, rpb = problem.tensors(dtype=torch.float32, generator=gen, requires_grad=True)
    inputs = [t for t in (q, k, v, rpb) if t is not None]
    out, lse = ops.neighborhood_attention(len(problem.spatial), *[t.to(DEVICE) for t in (q, k, v)],
                                          **problem.kwargs(), rpb=None if rpb is None else rpb.to(DEVICE),
                                          return_lse=True, backend=backend)
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    ref, ref_lse = oracle_attention(*ref_in[:3], problem.spatial, problem.kernel_size, problem.stride,
                                    problem.dilation, problem.causal, rpb=ref_in[3] if rpb is not None else None)
    d_out = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad((out * d_out.to(DEVICE)).sum() + lse.sum(), inputs)
    want = torch.autograd.grad((ref * d_out.double()).sum() + ref_lse.sum(), ref_in)
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv", "drpb"), (out, lse, *got), (ref, ref_lse, *want)):
        err = ((g.detach().cpu().double() - r).abs().max() / r.abs().max()).item()
        assert err < tol, f"{name}: relative error {err:.2e}"


@pytest.mark.skipif(not INTERPRETED, reason="patches a kernel helper, which the interpreter looks up per call")
@pytest.mark.parametrize("problem", RERUN_PROBLEMS, ids=["1d-causal", "2d-rpb", "3d-gqa"])
def test_fused_pair_by_pair_path_matches_the_oracle(problem, monkeypatch):
    monkeypatch.setattr(launch.kernels, "_holds_nonfinite", _always_rerun)
    small = Config(16, 16, 4, 1)
    with autotune.forced(fwd=small, dq=small, dkdv=small):
        _check_against_oracle(problem, "fused", 1e-5)


@pytest.mark.skipif(not INTERPRETED, reason="patches a kernel helper, which the interpreter looks up per call")
@pytest.mark.parametrize("problem", RERUN_PROBLEMS, ids=["1d-causal", "2d-rpb", "3d-gqa"])
def test_gemm_pair_by_pair_path_matches_the_oracle(problem, monkeypatch):
    monkeypatch.setattr(operators, "IMPL", "triton")
    monkeypatch.setattr(triton_kernels, "_holds_nonfinite", _always_rerun)
    _check_against_oracle(problem, "gemm", 1e-5)


# ------------------------------------------------------------------------------------------------------------------
# float32 matmul precision
# ------------------------------------------------------------------------------------------------------------------
def _fused_plan_precisions(q, grads=False):
    """Runs the fused backend once; the ``PREC`` of every cached forward (or backward) plan."""
    out = ops.na2d(q, q, q, 3, backend="fused")
    if not grads:
        return [plan.launch.meta["PREC"] for plan in decide.plans("forward")]
    out.backward(torch.randn_like(out))  # a dense gradient, as in training
    return [(plan.dq.meta["PREC"], plan.dkdv.meta["PREC"]) for plan in decide.plans("backward")]


@pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs CUDA or the interpreter")
def test_fused_float32_precision_follows_torch_setting(matmul_precision):
    """float32 matmuls: 3xTF32 (float32-level error) at torch's default "highest", TF32 at "high" / "medium"; the
    next call of the same problem follows a changed setting (the launch plans are keyed by it); 16-bit inputs keep
    Triton's default."""
    q = torch.randn(1, 8, 8, 2, 16, device=DEVICE)
    matmul_precision("highest")
    assert _fused_plan_precisions(q) == ["tf32x3"]
    matmul_precision("high")
    assert _fused_plan_precisions(q) == ["tf32x3", "tf32"]
    matmul_precision("medium")
    assert _fused_plan_precisions(q) == ["tf32x3", "tf32"]  # the same matmuls as "high": the same plan
    matmul_precision("highest")
    assert _fused_plan_precisions(q) == ["tf32x3", "tf32"]
    decide._PLANS.clear()
    assert _fused_plan_precisions(q.half()) == ["tf32"]


@pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs CUDA or the interpreter")
def test_fused_backward_precision_follows_torch_setting(matmul_precision):
    q = torch.randn(1, 8, 8, 2, 16, device=DEVICE, requires_grad=True)
    matmul_precision("highest")
    assert _fused_plan_precisions(q, grads=True) == [("tf32x3", "tf32x3")]
    matmul_precision("high")
    assert _fused_plan_precisions(q, grads=True) == [("tf32x3", "tf32x3"), ("tf32", "tf32")]


def test_autotune_keys_carry_the_float32_precision(matmul_precision):
    """A tuned float32 entry belongs to the precision it was timed with (3xTF32 runs three matmuls per product)."""
    from ops.functional import make_params

    q = torch.randn(1, 8, 8, 2, 16)
    params = make_params((8, 8), 3, 1, 1, False)
    matmul_precision("highest")
    key_highest = autotune.problem_key("fwd", q, q, q, params, False)
    matmul_precision("high")
    assert autotune.problem_key("fwd", q, q, q, params, False) != key_highest
    assert autotune.problem_key("fwd", q.half(), q.half(), q.half(), params, False).count("tf32") == 0


def test_precision_under_torch_new_fp32_api():
    """torch >= 2.9 has a second API for the same setting (``torch.backends.cuda.matmul.fp32_precision``); once it is
    used, torch's legacy getters raise.  The kernels' choice still follows it."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision API")
    previous = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        assert decide.dot_precision(torch.float32) == "tf32"
        assert triton_kernels._precision(torch.float32) == "tf32"
        matmul.fp32_precision = "ieee"
        assert decide.dot_precision(torch.float32) == "tf32x3"
        assert triton_kernels._precision(torch.float32) == "tf32x3"
    finally:
        matmul.fp32_precision = previous


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["fused", "gemm"])
def test_gpu_float32_precision_against_float64(backend, matmul_precision):
    """On the GPU: float32 within 1e-5 (relative, Frobenius) of float64 at "highest", forward and gradients within
    1e-4; within TF32's tolerance (2e-3) at "high"."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 24, 24, 4, 64, device="cuda", generator=gen) for _ in range(3))
    d_out = torch.randn(q.shape, device="cuda", generator=gen)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = ops.na2d(*ref_in, 7, backend="naive")
    ref_grads = torch.autograd.grad((ref * d_out.double()).sum(), ref_in)
    for setting, tol, grad_tol in (("highest", 1e-5, 1e-4), ("high", 2e-3, 2e-2)):
        matmul_precision(setting)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ops.na2d(*inputs, 7, backend=backend)
        grads = torch.autograd.grad((out * d_out).sum(), inputs)
        err = _rel_norm_err(out, ref)
        assert err < tol, f"{setting}: forward relative error {err:.2e}"
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
            err = _rel_norm_err(g, r)
            assert err < grad_tol, f"{setting}: {name} relative error {err:.2e}"


def _rel_norm_err(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


# ------------------------------------------------------------------------------------------------------------------
# 64-bit index math and chunked grids
# ------------------------------------------------------------------------------------------------------------------
@triton.jit
def _gemm_row_probe(out_ptr, bi, n, token, heads, h):
    tl.store(out_ptr, _token_row(bi, n, token, heads, h))


@pytest.mark.skipif(not INTERPRETED, reason="runs the index helpers through the interpreter")
def test_gemm_row_index_is_widened_before_it_can_pass_int32():
    """(batch * N + token) * heads + head with batch * N past 2**31: what int32 math before the widening wrapped."""
    out = torch.zeros(1, dtype=torch.int64)
    bi, n, token, heads, h = 3, 2**30 - 5, 1234, 4, 1
    _gemm_row_probe[(1,)](out, bi, n, token, heads, h)
    assert out.item() == (bi * n + token) * heads + h


def test_batch_chunks_fit_the_grid_limit():
    """One helper splits the batch for every Triton launcher (fused and gemm): each chunk's B * H within the limit,
    chunks covering the batch in order."""
    from ops.fused.decide import MAX_GRID_Y, batch_chunks

    for batch, heads in ((1, 1), (3, 2), (70000, 1), (40000, 2), (5, 65535), (2, 70000)):
        chunks = batch_chunks(batch, heads)
        assert chunks[0][0] == 0 and chunks[-1][1] == batch
        assert all(hi > lo and (hi - lo) * heads <= max(MAX_GRID_Y, heads) for lo, hi in chunks)
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert len(batch_chunks(70000, 1)) == 2


@pytest.mark.skipif(not INTERPRETED, reason="the gemm Triton kernels on CPU need the interpreter")
def test_gemm_triton_grids_split_by_batch(monkeypatch):
    """B * H above the grid limit (made small here): the PN / NN / IN kernels run in batch chunks, forward and
    backward equal to one launch, and every launch's grid stays within the limit."""
    monkeypatch.setattr(operators, "IMPL", "triton")
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 6, 7, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 6, 7, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 6, 7, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    rpb = torch.randn(4, 5, 5, generator=gen, dtype=torch.float64)

    def run():
        out = ops.na2d(q, k, v, 3, rpb=rpb, backend="gemm")
        return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))

    whole = run()
    grids = []
    for name in ("_pn_kernel", "_nn_kernel", "_in_kernel"):
        kernel = getattr(triton_kernels, name)
        monkeypatch.setattr(triton_kernels, name, _GridRecorder(kernel, grids))
    monkeypatch.setattr(decide, "MAX_GRID_Y", 5)  # 4 query heads: one batch element per launch
    chunked = run()
    assert grids and max(g[1] for g in grids) <= 5 and len(grids) >= 3 * 3
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    out, *_ = chunked
    ref, _ = oracle_attention(q.detach(), k.detach(), v.detach(), (6, 7), (3, 3), (1, 1), (1, 1), (False, False),
                              rpb=rpb)
    torch.testing.assert_close(out.detach(), ref, rtol=0, atol=1e-9)


class _GridRecorder:
    """Stands in for a Triton kernel: records each launch's grid, then launches the real kernel."""

    def __init__(self, kernel, grids):
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


# ------------------------------------------------------------------------------------------------------------------
# flex on CPU from several threads
# ------------------------------------------------------------------------------------------------------------------
def test_flex_cpu_leaves_global_state_alone_under_threads():
    """The CPU path switches flex to its eager reference through a torch module flag; concurrent calls must leave that
    flag, and the process' warning filters, as they were (and compute the right thing)."""
    import torch.nn.attention.flex_attention as flex_module

    flag_before = flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    filters_before = list(warnings.filters)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 10, 10, 2, 8, generator=gen) for _ in range(3))
    want = ops.na2d(q, k, v, 3, backend="naive")
    start = threading.Barrier(8)
    failures = []

    def worker():
        start.wait()
        for _ in range(15):
            with torch.no_grad():
                got = ops.na2d(q, k, v, 3, backend="flex")
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                failures.append("wrong result")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    assert flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG == flag_before
    assert list(warnings.filters) == filters_before
