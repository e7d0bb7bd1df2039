"""Channels-last LayerNorm as Triton kernels: forward and backward over a ``[rows, C]`` view.

The vision models normalise token rows (``[B, *spatial, C]``, C = 64..1024) many times per step, and
torch's kernels for short rows run far below memory bandwidth.  Here one program normalises a tile of
``BLOCK_ROWS x BLOCK_C`` elements (many rows per program when C is small, so loads stay wide and
coalesced), statistics in float32.  The backward recomputes the normalised input from the saved per-row
mean and 1/std; the weight and bias gradients are float32 partial sums per program, added up with torch
afterwards (deterministic, no atomics).

Under autocast the Triton path writes the autocast dtype directly (see :class:`LayerNorm`).  Every
case the kernels do not cover (CPU tensors unless forced, torch.compile, normalisation over several
dims, very wide rows, float64) goes to ``torch.nn.functional.layer_norm``.

Host cost: a call is a Python ``autograd.Function`` with one Triton launch each way (plus a torch sum
of the partials), a few times torch's own per-call CPU time; it pays where the GPU bounds the step.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .devices import multiprocessors

try:
    import triton
    import triton.language as tl

    from .fused.launch import PlannedLaunch, remember_plan
except ImportError:  # torch builds without Triton: every call takes the torch path
    triton = None

__all__ = ["MAX_COLUMNS", "LayerNorm", "LayerNormFunction", "layer_norm", "layer_norm_forward",
           "layer_norm_backward", "triton_path_applies"]

MAX_COLUMNS = 8192  # widest row (C) the kernels take; a row is held whole in registers
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Elements per program tile, chosen by timing rows of C = 64..1024 (NAT's widths; the kernels' times are in
# docs/performance.md, "LayerNorm").  Each forward program normalises one
# tile; each backward program walks several tiles (BACKWARD_PROGRAMS_PER_SM programs per multiprocessor
# in all), so that the weight / bias partial sums stay few.
FORWARD_TILE = 4096
BACKWARD_TILE = 1024
BACKWARD_PROGRAMS_PER_SM = 8


if triton is not None:

    @triton.jit
    def _layer_norm_forward_kernel(x_ptr, y_ptr, weight_ptr, bias_ptr, stats_ptr, add_ptr, scale_ptr, gamma_ptr,
                                   sum_ptr, n_rows, rows_per_scale,
                                   N_COLS: tl.constexpr, EPS: tl.constexpr,
                                   HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr,
                                   HAS_SCALE: tl.constexpr, HAS_GAMMA: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                                   BLOCK_C: tl.constexpr):
        """Rows ``pid * BLOCK_ROWS ...`` of ``y = (x - mean) * rstd * weight + bias``; ``stats`` is
        ``[2, n_rows]``: the mean, then 1/std.  ``HAS_ADD``: x is first replaced by ``x + add`` (``HAS_SCALE``:
        ``add`` times ``scale[row // rows_per_scale]``, a residual branch with per-sample stochastic depth;
        ``HAS_GAMMA``: times ``gamma[col]``, a per-channel layer scale), in float32, which is also stored to
        ``sum``."""
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_C)
        row_ok = rows < n_rows
        col_ok = cols < N_COLS
        mask = row_ok[:, None] & col_ok[None, :]
        offsets = rows.to(tl.int64)[:, None] * N_COLS + cols[None, :]

        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_ADD:
            branch = tl.load(add_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            if HAS_SCALE:
                branch = branch * tl.load(scale_ptr + rows // rows_per_scale, mask=row_ok, other=0.0)[:, None]
            if HAS_GAMMA:
                branch = branch * tl.load(gamma_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            x = x + branch
            tl.store(sum_ptr + offsets, x.to(sum_ptr.dtype.element_ty), mask=mask)
        mean = tl.sum(x, axis=1) / N_COLS
        # padded columns must not enter the variance
        centred = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / N_COLS + EPS)
        y = centred * rstd[:, None]
        if HAS_WEIGHT:
            y = y * tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]

        tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(stats_ptr + rows, mean, mask=row_ok)
        tl.store(stats_ptr + n_rows + rows, rstd, mask=row_ok)

    @triton.jit
    def _layer_norm_backward_kernel(x_ptr, dy_ptr, dx_ptr, weight_ptr, stats_ptr, partial_ptr, residual_ptr,
                                    copy_ptr, scale_ptr, gamma_ptr, branch_ptr, n_rows, blocks_per_program,
                                    rows_per_scale, N_COLS: tl.constexpr,
                                    HAS_WEIGHT: tl.constexpr, COMPUTE_DX: tl.constexpr,
                                    COMPUTE_DWEIGHT: tl.constexpr, COMPUTE_DBIAS: tl.constexpr,
                                    HAS_RESIDUAL: tl.constexpr, HAS_COPY: tl.constexpr, HAS_SCALE: tl.constexpr,
                                    HAS_GAMMA: tl.constexpr, COMPUTE_DGAMMA: tl.constexpr,
                                    BLOCK_ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
        """Program ``p`` handles row blocks ``p * blocks_per_program ...`` (the last ones may be empty)
        and writes row ``p`` of the partial sums ``partial [n_sums, programs, C]``: the weight gradient
        at index 0 when computed, then the bias gradient.  ``HAS_RESIDUAL``: dx also gets ``residual`` (a pre-norm
        block's skip-connection gradient) added; it may be dx itself (each element is read before it is written).
        ``HAS_COPY``: dx is also stored to ``copy`` in its dtype (``HAS_SCALE``: times
        ``scale[row // rows_per_scale]``; ``HAS_GAMMA``: times ``gamma[col]``), the gradient that reaches a residual
        branch under per-sample stochastic depth and layer scale.  ``COMPUTE_DGAMMA``: the next partial-sum slot gets
        gamma's gradient, ``dx * scale[row] * branch`` summed over rows (``branch``: the forward's ``add``)."""
        program = tl.program_id(0)
        cols = tl.arange(0, BLOCK_C)
        col_ok = cols < N_COLS
        if HAS_WEIGHT:
            weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        # summed over rows once at the end: one cross-row reduction per program, not per block
        dweight_acc = tl.zeros((BLOCK_ROWS, BLOCK_C), dtype=tl.float32)
        dbias_acc = tl.zeros((BLOCK_ROWS, BLOCK_C), dtype=tl.float32)
        dgamma_acc = tl.zeros((BLOCK_ROWS, BLOCK_C), dtype=tl.float32)
        if HAS_GAMMA:
            gamma = tl.load(gamma_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)

        for block in range(0, blocks_per_program):
            rows = (program * blocks_per_program + block) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_ok = rows < n_rows
            mask = row_ok[:, None] & col_ok[None, :]
            offsets = rows.to(tl.int64)[:, None] * N_COLS + cols[None, :]

            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(stats_ptr + rows, mask=row_ok, other=0.0)
            rstd = tl.load(stats_ptr + n_rows + rows, mask=row_ok, other=0.0)
            x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)

            if COMPUTE_DX:
                if HAS_WEIGHT:
                    dx_hat = dy * weight[None, :]
                else:
                    dx_hat = dy
                # dx = rstd * (dx_hat - mean(dx_hat) - x_hat * mean(dx_hat * x_hat)), means over the row
                mean_dx_hat = tl.sum(dx_hat, axis=1) / N_COLS
                mean_dx_hat_x_hat = tl.sum(dx_hat * x_hat, axis=1) / N_COLS
                dx = (dx_hat - mean_dx_hat[:, None] - x_hat * mean_dx_hat_x_hat[:, None]) * rstd[:, None]
                if HAS_RESIDUAL:
                    dx += tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                if HAS_COPY:
                    if HAS_SCALE:
                        dx = dx * tl.load(scale_ptr + rows // rows_per_scale, mask=row_ok, other=0.0)[:, None]
                    if COMPUTE_DGAMMA:
                        dgamma_acc += dx * tl.load(branch_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
                    if HAS_GAMMA:
                        dx = dx * gamma[None, :]
                    tl.store(copy_ptr + offsets, dx.to(copy_ptr.dtype.element_ty), mask=mask)
            if COMPUTE_DWEIGHT:
                dweight_acc += dy * x_hat
            if COMPUTE_DBIAS:
                dbias_acc += dy

        partial_row = partial_ptr + program * N_COLS + cols
        if COMPUTE_DWEIGHT:
            tl.store(partial_row, tl.sum(dweight_acc, axis=0), mask=col_ok)
            partial_row += tl.num_programs(0) * N_COLS
        if COMPUTE_DBIAS:
            tl.store(partial_row, tl.sum(dbias_acc, axis=0), mask=col_ok)
            partial_row += tl.num_programs(0) * N_COLS
        if COMPUTE_DGAMMA:
            tl.store(partial_row, tl.sum(dgamma_acc, axis=0), mask=col_ok)


def _block_shape(n_cols: int, tile_elements: int, block_rows: int | None = None) -> tuple[int, int, int]:
    """``(BLOCK_ROWS, BLOCK_C, num_warps)`` for rows of ``n_cols``: a whole row per tile, as many rows
    as fill ``tile_elements`` unless ``block_rows`` is given."""
    block_c = triton.next_power_of_2(n_cols)
    block_rows = block_rows or max(1, tile_elements // block_c)
    return block_rows, block_c, _num_warps(block_rows * block_c, block_c)


def _num_warps(tile_elements: int, block_c: int) -> int:
    # one warp per 1024 tile elements, and wide rows spread over more warps (chosen by timing, as the tile
    # sizes above: more warps per tile were slower for short rows)
    return min(8, max(2, tile_elements // 1024, block_c // 512))


def _backward_programs(n_blocks: int, device: torch.device, max_programs: int | None) -> tuple[int, int]:
    """``(programs, blocks_per_program)``: enough programs to fill the GPU, few enough that the partial
    sums stay small next to the rows."""
    if max_programs is None:
        if device.type == "cuda":
            max_programs = BACKWARD_PROGRAMS_PER_SM * multiprocessors(device)
        else:
            max_programs = 8
    blocks_per_program = triton.cdiv(n_blocks, max(1, min(n_blocks, max_programs)))
    return triton.cdiv(n_blocks, blocks_per_program), blocks_per_program


def _launch_device(device: torch.device):
    """Triton launches on the current CUDA device: switch to the tensors' one where it differs."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# Launches per problem (shapes, dtypes, flags, device), decided once: eager models call the same few LayerNorms
# every step, and a kept launch of the compiled kernel skips Triton's per-call argument binding, most of a
# launch's host time.
_FORWARD_LAUNCHES: dict[tuple, object] = {}
_BACKWARD_LAUNCHES: dict[tuple, object] = {}


def layer_norm_forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                       out_dtype: torch.dtype, *, add: torch.Tensor | None = None,
                       add_scale: torch.Tensor | None = None, add_gamma: torch.Tensor | None = None,
                       block_rows: int | None = None):
    """Normalise the rows of contiguous ``x [rows, C]``; returns ``(y [rows, C] in out_dtype, stats)``,
    ``stats`` float32 ``[2, rows]``: each row's mean, then 1/std.  ``add``: a contiguous ``[rows, C]`` tensor added
    to x first, in float32 (``add_scale``: a float32 ``[groups]`` vector, row r's addend scaled by
    ``add_scale[r // (rows / groups)]``: a residual branch under per-sample stochastic depth; ``add_gamma``: a ``[C]``
    vector scaling the addend's columns, a layer scale); the sum, in x's dtype, is then returned third.
    ``block_rows`` overrides the rows per program (tests)."""
    n_rows, n_cols = x.shape
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    stats = torch.empty((2, n_rows), dtype=torch.float32, device=x.device)
    total = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device) if add is not None else None
    if n_rows:
        key = (n_rows, n_cols, eps, x.dtype, out_dtype, _dtype(weight), _dtype(bias), x.device, block_rows,
               _dtype(add), None if add_scale is None else (add_scale.shape[0], add_scale.dtype), _dtype(add_gamma))
        launch = _FORWARD_LAUNCHES.get(key)
        if launch is None:
            rows, block_c, num_warps = _block_shape(n_cols, FORWARD_TILE, block_rows)
            launch = remember_plan(_FORWARD_LAUNCHES, key, PlannedLaunch(
                _layer_norm_forward_kernel, (triton.cdiv(n_rows, rows), 1),
                (n_rows, _rows_per_scale(n_rows, add_scale)), dict(
                    N_COLS=n_cols, EPS=eps, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                    HAS_ADD=add is not None, HAS_SCALE=add_scale is not None, HAS_GAMMA=add_gamma is not None,
                    BLOCK_ROWS=rows, BLOCK_C=block_c, num_warps=num_warps)))
        with _launch_device(x.device):
            launch((x, y, x if weight is None else weight, x if bias is None else bias, stats,
                    x if add is None else add, stats if add_scale is None else add_scale,
                    x if add_gamma is None else add_gamma, x if total is None else total))
    return (y, stats) if add is None else (y, stats, total)


def _rows_per_scale(n_rows: int, scale: torch.Tensor | None) -> int:
    """Rows sharing one entry of a per-sample scale vector (1 without one)."""
    if scale is None:
        return 1
    if scale.dim() != 1 or scale.dtype != torch.float32 or n_rows % scale.shape[0]:
        raise ValueError(f"scale: expected a float32 vector whose length divides the {n_rows} rows, got "
                         f"{scale.dtype} {tuple(scale.shape)}")
    return n_rows // scale.shape[0]


def _dtype(t):
    return None if t is None else t.dtype


def _backward_launch(n_rows: int, n_cols: int, x, dy, weight, compute_dx: bool, compute_dweight: bool,
                     compute_dbias: bool, has_residual: bool, copy_scale, has_copy: bool, has_gamma: bool,
                     compute_dgamma: bool, block_rows: int | None, max_programs: int | None):
    """``(launch or None, programs, n_sums)`` of a backward problem, every launch parameter decided once; ``n_sums``:
    how many of dweight / dbias / dgamma the programs write partial rows of."""
    block_rows, block_c, num_warps = _block_shape(n_cols, BACKWARD_TILE, block_rows)
    n_blocks = triton.cdiv(n_rows, block_rows)
    programs, blocks_per_program = _backward_programs(n_blocks, x.device, max_programs) if n_blocks else (0, 1)
    n_sums = int(compute_dweight) + int(compute_dbias) + int(compute_dgamma)
    launch = None
    if programs and (compute_dx or n_sums):
        launch = PlannedLaunch(_layer_norm_backward_kernel, (programs, 1),
                               (n_rows, blocks_per_program, _rows_per_scale(n_rows, copy_scale)), dict(
            N_COLS=n_cols, HAS_WEIGHT=weight is not None, COMPUTE_DX=compute_dx, COMPUTE_DWEIGHT=compute_dweight,
            COMPUTE_DBIAS=compute_dbias, HAS_RESIDUAL=has_residual, HAS_COPY=has_copy,
            HAS_SCALE=copy_scale is not None, HAS_GAMMA=has_gamma, COMPUTE_DGAMMA=compute_dgamma,
            BLOCK_ROWS=block_rows, BLOCK_C=block_c, num_warps=num_warps))
    return launch, programs, n_sums


def layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, stats: torch.Tensor, *,
                        compute_dx: bool = True, compute_dweight: bool = True, compute_dbias: bool = True,
                        residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                        copy_dtype: torch.dtype | None = None, copy_scale: torch.Tensor | None = None,
                        copy_gamma: torch.Tensor | None = None, gamma_input: torch.Tensor | None = None,
                        block_rows: int | None = None, max_programs: int | None = None):
    """Gradients of :func:`layer_norm_forward` for contiguous ``dy`` and ``x`` ``[rows, C]``: returns
    ``(dx in x.dtype, dweight, dbias)``, the last two float32 ``[C]``; None where not asked for (and
    dweight also where there is no weight).  ``residual``: a contiguous ``[rows, C]`` gradient added to dx in the same
    kernel (a pre-norm block's skip connection); ``out``: the tensor dx is written to (contiguous, x's shape and
    dtype; it may be ``residual``).  ``copy_dtype``: dx is also returned fourth in that dtype (``copy_scale``: a
    float32 ``[groups]`` vector scaling its rows as in :func:`layer_norm_forward`'s ``add_scale``), the gradient of
    the residual branch added before the norm; ``copy_gamma``: a ``[C]`` vector also scaling its columns (the forward's
    ``add_gamma``), and then the gradient of that vector is returned fifth, float32, where ``gamma_input`` (the
    forward's ``add``) is given, else None.  ``block_rows`` / ``max_programs`` override the launch shape (tests)."""
    n_rows, n_cols = x.shape
    compute_dweight = compute_dweight and weight is not None
    has_residual = residual is not None and compute_dx
    has_copy = copy_dtype is not None and compute_dx
    has_gamma = copy_gamma is not None and has_copy
    compute_dgamma = has_gamma and gamma_input is not None
    key = (n_rows, n_cols, x.dtype, dy.dtype, _dtype(weight), x.device, compute_dx, compute_dweight, compute_dbias,
           _dtype(residual) if has_residual else None, copy_dtype if has_copy else None,
           None if copy_scale is None else (copy_scale.shape[0], copy_scale.dtype),
           _dtype(copy_gamma) if has_gamma else None, _dtype(gamma_input) if compute_dgamma else None, block_rows,
           max_programs)
    entry = _BACKWARD_LAUNCHES.get(key)
    if entry is None:
        entry = remember_plan(_BACKWARD_LAUNCHES, key, _backward_launch(
            n_rows, n_cols, x, dy, weight, compute_dx, compute_dweight, compute_dbias, has_residual,
            copy_scale if has_copy else None, has_copy, has_gamma, compute_dgamma, block_rows, max_programs))
    launch, programs, n_sums = entry
    dx = (out if out is not None else torch.empty_like(x)) if compute_dx else None
    copy = torch.empty((n_rows, n_cols), dtype=copy_dtype, device=x.device) if has_copy else None
    # every program writes its row of each partial sum, so no zero-fill is needed (and none over zero rows)
    partial = (torch.empty((n_sums, programs, n_cols), dtype=torch.float32, device=x.device) if programs
               else torch.zeros((n_sums, 1, n_cols), dtype=torch.float32, device=x.device))
    if launch is not None:
        with _launch_device(x.device):
            launch((x, dy, x if dx is None else dx, x if weight is None else weight, stats, partial,
                    residual if has_residual else x, x if copy is None else copy,
                    stats if copy_scale is None or not has_copy else copy_scale,
                    copy_gamma if has_gamma else x, gamma_input if compute_dgamma else x))
    sums = partial.sum(1) if n_sums else None
    dweight = sums[0] if compute_dweight else None
    dbias = sums[int(compute_dweight)] if compute_dbias else None
    if copy_dtype is None:
        return dx, dweight, dbias
    if copy_gamma is None:
        return dx, dweight, dbias, copy
    return dx, dweight, dbias, copy, sums[n_sums - 1] if compute_dgamma else None


class LayerNormFunction(torch.autograd.Function):
    """LayerNorm over the last dim of ``x`` by the Triton kernels, output in ``out_dtype``.

    ``apply(x, weight, bias, eps, out_dtype)``; weight / bias may be None.  Gradients: x in x's dtype,
    weight / bias in theirs.  Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps, out_dtype):
        x_shape = x.shape
        rows = x.reshape(-1, x_shape[-1]).contiguous()
        y, stats = layer_norm_forward(rows, weight, bias, eps, out_dtype)
        ctx.save_for_backward(rows, weight, stats)
        ctx.x_shape = x_shape
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.view(x_shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        rows, weight, stats = ctx.saved_tensors
        need_dx, need_dweight, need_dbias = ctx.needs_input_grad[:3]
        dx, dweight, dbias = layer_norm_backward(
            dy.reshape(rows.shape).contiguous(), rows, weight, stats,
            compute_dx=need_dx, compute_dweight=need_dweight, compute_dbias=need_dbias)
        if dx is not None:
            dx = dx.view(ctx.x_shape)
        if dweight is not None:
            dweight = dweight.to(weight.dtype)
        if dbias is not None:
            dbias = dbias.to(ctx.bias_dtype)
        return dx, dweight, dbias, None, None


def _affine_ok(param: torch.Tensor | None, x: torch.Tensor) -> bool:
    return param is None or (param.shape == x.shape[-1:] and param.device == x.device
                             and param.dtype in SUPPORTED_DTYPES)


def triton_path_applies(x: torch.Tensor, normalized_shape: Sequence[int], weight: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None, *, force_triton: bool = False) -> bool:
    """Whether :func:`layer_norm` runs the Triton kernels for these arguments (else torch's layer_norm).

    ``force_triton`` admits non-CUDA tensors (the kernels then need ``TRITON_INTERPRET=1``); nothing
    admits torch.compile tracing, where inductor generates and fuses its own LayerNorm."""
    if triton is None or torch.compiler.is_compiling():
        return False
    if not (x.is_cuda or force_triton):
        return False
    return (x.dim() >= 1 and tuple(normalized_shape) == tuple(x.shape[-1:])
            and 1 <= x.shape[-1] <= MAX_COLUMNS and x.dtype in SUPPORTED_DTYPES
            and _affine_ok(weight, x) and _affine_ok(bias, x))


def layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int], weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, out_dtype: torch.dtype | None = None,
               *, force_triton: bool = False) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` with the Triton kernels where they apply (see
    :func:`triton_path_applies`).

    Output dtype: ``out_dtype`` when given (either path).  Otherwise, on the Triton path, the autocast
    dtype when autocast is on for x's device, else x's dtype; on the torch path, whatever torch returns
    (float32 under autocast).
    """
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    if not isinstance(eps, (int, float)) or not eps >= 0 or eps == float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise ValueError(f"out_dtype must be a floating-point torch.dtype or None, got {out_dtype!r}")

    if not triton_path_applies(x, normalized_shape, weight, bias, force_triton=force_triton):
        y = F.layer_norm(x, tuple(normalized_shape), weight, bias, eps)
        return y if out_dtype is None else y.to(out_dtype)

    if out_dtype is None:
        device_type = x.device.type
        autocasting = torch.is_autocast_enabled(device_type)
        out_dtype = torch.get_autocast_dtype(device_type) if autocasting else x.dtype
    return LayerNormFunction.apply(x, weight, bias, float(eps), out_dtype)


class LayerNorm(torch.nn.LayerNorm):
    """Drop-in ``torch.nn.LayerNorm`` (same parameters, state_dict keys and repr) running the Triton
    kernels for CUDA inputs normalised over their last dim (C <= ``MAX_COLUMNS``); every other case,
    and torch.compile tracing, uses ``torch.nn.functional.layer_norm``.

    Output dtype under autocast: the Triton path returns the autocast dtype (e.g. bfloat16) where torch
    returns float32.  The values are torch's output cast to that dtype (up to float32 rounding in the
    statistics, which can move an output by one bfloat16 step): a LayerNorm is normally read
    by an ``nn.Linear``, which under autocast casts its input to that dtype anyway, so the float32
    tensor and the separate cast (forward and backward) are saved.  Without autocast the output has
    x's dtype, as in torch.  Gradients reach x in x's dtype and weight / bias in theirs.

    ``force_triton=True`` takes the Triton path for non-CUDA tensors too (CPU tests under
    ``TRITON_INTERPRET=1``).
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, force_triton: bool = False):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         device=device, dtype=dtype)
        self.force_triton = force_triton

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps,
                          force_triton=self.force_triton)
