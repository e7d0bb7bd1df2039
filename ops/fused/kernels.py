"""Triton kernels of the fused NA backend: forward, dQ, dK/dV, the RPB bias tiles and dRPB.

Conventions shared by every kernel (see ``ops/fused/launch.py`` for the host side):

* Every problem is run as 3-D: a 1-D or 2-D problem gets leading axes of length 1 (kernel 1,
  stride 1, dilation 1).  ``ACT0`` / ``ACT1`` say whether axes 0 / 1 are real, so a 1-D problem
  pays no mask arithmetic for its dummy axes.  Axis 2 is always real.
* Tensors are heads-last ``[B, N, H, D]`` with a unit last stride; a token's offset is
  ``flat_index * stride_token`` computed in int64 (offsets past 2**31 elements are fine).
* Tiles are N-D boxes in *dilation-group* coordinates: a program owns one dilation group per axis
  (``i = i' * d + g``), so a dilated problem has exactly the work of an undilated one of the same
  size.  A query tile has shape ``(T0, T1, T2)``, a key/value tile ``(U0, U1, U2)``; each side is a
  power of two and the flattened tile is row-major.
* Window start and stop are monotone in the query index (inside a group), so the keys a query
  tile needs are the box ``[start(first), stop(last))`` per axis, and the keys every query of the
  tile needs are ``[start(last), stop(first))``.  The loops visit only the KV tiles covering the
  first box; a tile inside the second box needs no mask (the common case for large windows).
* Softmax runs in base 2: logits are multiplied by ``scale * log2(e)`` (RPB by ``log2(e)``);
  ``lse`` is stored in natural log.
* dK/dV computes its score tile as [queries, keys] (``QUERY_ROWS``) where the query tile has >= 64 rows,
  with k/v as the B operands (fewer registers); smaller query tiles use [keys, queries] (wgmma's tiles
  are 64 rows tall).
* ``TMA`` (constexpr): the tiles a loop visits (K/V, or Q/dO in dK/dV, plus dK/dV's own K/V tile)
  come from device-side TMA descriptors, one per dilation group (``_group_descriptor``), instead of
  pointer tensors; the host sets it only where the GPU and the tensors allow it (``decide.tma_eligible``).
* ``BIAS_TILES`` (constexpr): the RPB and the window mask of every box come precomputed, one [rows, cols] tile per
  (head, program, box) shared by the whole batch (``na_bias_tiles_kernel`` / ``na_bias_tiles_inverse_kernel``, run
  once per call), and start the score matmul; else the kernels gather the bias per element (``_rpb_index``) and
  build the mask from per-axis compares.
* ``PREC`` (constexpr): every ``tl.dot``'s input precision, which matters for float32 inputs only; the host
  follows torch's float32 matmul setting (``decide.dot_precision``: 3xTF32 at "highest", TF32 below).
* Non-finite inputs stay in the windows that hold them.  A matmul over a box multiplies every (row, key)
  pair, and a zero weight outside a row's window times a NaN (or an infinity) is NaN, so one bad key or
  value reaches every row of the tiles that load it; no select on the weights can prevent that (the
  product itself is NaN), and cleaning the operands on every box would cost the loops.  So the loops stay
  as they are; after its loop a program checks its result (``_holds_nonfinite``, one sum) and only where
  that holds a NaN or an infinity computes its rows again, one window offset at a time (``*_by_offset``:
  each row gathers its own key per offset, so nothing outside a window enters a row).  Slow, but only for
  the programs that meet bad values.
"""
import triton
import triton.language as tl

from .window_jit import first_query_reaching, group_length, last_query_reaching, window_start, window_stop

LOG2E = 1.4426950408889634  # host side: scales are passed premultiplied
LN2 = 0.6931471805599453
# the same constants inside kernels (Triton reads module globals only as constexprs)
LOG2E_C = tl.constexpr(LOG2E)
LN2_C = tl.constexpr(LN2)


@triton.jit
def _split_group(p, NT, D):
    """(group, tile) of an axis' program coordinate; without dilation (``D`` == 1, which Triton's
    launcher passes as a constant) no division is needed."""
    if D == 1:
        g = 0
        tile = p
    else:
        g = p // NT
        tile = p % NT
    return g, tile


@triton.jit
def _decode_program(pid, NT0, NT1, NT2, D0, D1, D2, ACT0: tl.constexpr, ACT1: tl.constexpr):
    """Program index -> (group, tile index) per axis.  Tiles of one group are adjacent (L2 reuse).
    Dummy axes of 1-D / 2-D problems and undilated axes skip their divisions, which a small program notices
    (docs/fused.md, "Tiling")."""
    if ACT1:
        c2 = NT2 * D2
        p2 = pid % c2
        rest = pid // c2
        if ACT0:
            c1 = NT1 * D1
            p1 = rest % c1
            p0 = rest // c1
        else:
            p1 = rest
            p0 = 0
    else:
        p2 = pid
        p1 = 0
        p0 = 0
    g0, tile0 = _split_group(p0, NT0, D0)
    g1, tile1 = _split_group(p1, NT1, D1)
    g2, tile2 = _split_group(p2, NT2, D2)
    return g0, tile0, g1, tile1, g2, tile2


@triton.jit
def _next_tile(i0, i1, i2, n1, n2, ACT0: tl.constexpr, ACT1: tl.constexpr):
    """The next tile of a row-major loop over ``n0 x n1 x n2`` tiles, as a counter with carries.  Decoding the
    flat loop index instead (``t % n2``, ``t // n2`` ...) costs two integer divisions by runtime values per
    iteration, a noticeable share of a step (docs/fused.md, "Tiling")."""
    i2 += 1
    if ACT1:
        wrap = i2 == n2
        i2 = tl.where(wrap, 0, i2)
        i1 = tl.where(wrap, i1 + 1, i1)
        if ACT0:
            wrap = i1 == n1
            i1 = tl.where(wrap, 0, i1)
            i0 = tl.where(wrap, i0 + 1, i0)
    return i0, i1, i2


@triton.jit
def _tile_coords(T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr):
    """Per-axis coordinates of the rows of a row-major (T0, T1, T2) tile."""
    r = tl.arange(0, T0 * T1 * T2)
    return r // (T1 * T2), (r // T2) % T1, r % T2


@triton.jit
def _axis_rows(first, r, Lg, K, s, CAUSAL: tl.constexpr):
    """Window of each row of a tile on one axis: (valid, clamped coord, start, stop).

    Rows past the group end are clamped to its last query so their windows stay in bounds; the
    callers mask their results out.
    """
    qi = first + r
    qc = tl.minimum(qi, Lg - 1)
    start = window_start(qc, Lg, K, s, CAUSAL)
    stop = window_stop(qc, start, K, CAUSAL)
    return qi < Lg, qc, start, stop


@triton.jit
def _axis_span(first, T, Lg, K, s, CAUSAL: tl.constexpr):
    """Union ``[lo, hi)`` and intersection ``[in_lo, in_hi)`` of the windows of queries
    ``first .. min(first + T, Lg) - 1`` on one axis (an empty tile gets an empty union)."""
    last = tl.minimum(first + T, Lg) - 1
    a_first = window_start(first, Lg, K, s, CAUSAL)
    b_first = window_stop(first, a_first, K, CAUSAL)
    a_last = window_start(last, Lg, K, s, CAUSAL)
    b_last = window_stop(last, a_last, K, CAUSAL)
    hi = tl.where(last >= first, b_last, a_first)
    return a_first, hi, a_last, b_first


@triton.jit
def _flat_token(c0, c1, c2, g0, g1, g2, D0, D1, D2, L1, L2, IDX64: tl.constexpr):
    """Flat (row-major) token index of group coordinates (c0, c1, c2).

    int32 unless ``IDX64``: the host sets it when a token offset (index * token stride) of one
    batch element can pass 2**31; int64 vectors cost registers and cause spills (docs/fused.md, "Tiling").
    """
    if IDX64:
        c0 = c0.to(tl.int64)
    return ((c0 * D0 + g0) * L1 + (c1 * D1 + g1)) * L2 + (c2 * D2 + g2)


@triton.jit
def _axis_keep(kj, start, stop, TRANSPOSED: tl.constexpr):
    """[rows, cols] (or [cols, rows] when ``TRANSPOSED``): key ``kj`` inside the query's window on one axis."""
    if TRANSPOSED:  # one return: Triton types both branches' returns alike, even under a constexpr if
        keep = (kj[:, None] >= start[None, :]) & (kj[:, None] < stop[None, :])
    else:
        keep = (kj[None, :] >= start[:, None]) & (kj[None, :] < stop[:, None])
    return keep


@triton.jit
def _mask_outside(x, fill, k0, k1, k2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2,
                  start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2,
                  U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr, ACT0: tl.constexpr, ACT1: tl.constexpr,
                  TRANSPOSED: tl.constexpr):
    """``x`` with ``fill`` where the key lies outside the query's window.

    A KV box starting at (k0, k1, k2) that lies inside every query's window (``[in_lo, in_hi)`` on
    each axis) needs no mask.  In 3-D a partial box is usually partial on one axis only, so there the
    axes are tested one by one and the compares of the others skipped; in 1-D / 2-D one combined mask
    (docs/fused.md, "Softmax and masking").
    """
    part2 = (k2 < in_lo2) | (k2 + U2 > in_hi2)
    part1 = (k1 < in_lo1) | (k1 + U1 > in_hi1)
    if ACT0:
        if part2:
            x = tl.where(_axis_keep(kj2, start2, stop2, TRANSPOSED), x, fill)
        if part1:
            x = tl.where(_axis_keep(kj1, start1, stop1, TRANSPOSED), x, fill)
        if (k0 < in_lo0) | (k0 + U0 > in_hi0):
            x = tl.where(_axis_keep(kj0, start0, stop0, TRANSPOSED), x, fill)
    elif ACT1:
        if part2 | part1:
            keep = _axis_keep(kj2, start2, stop2, TRANSPOSED) & _axis_keep(kj1, start1, stop1, TRANSPOSED)
            x = tl.where(keep, x, fill)
    else:
        if part2:
            x = tl.where(_axis_keep(kj2, start2, stop2, TRANSPOSED), x, fill)
    return x


@triton.jit
def _window_bias(start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, ACT0: tl.constexpr, ACT1: tl.constexpr,
                 TRANSPOSED: tl.constexpr):
    """[rows, keys] (or [keys, rows] when ``TRANSPOSED``) float32: 0 where the key lies in the row's window on every
    active axis, else -inf: the initial value of a score matmul whose scale is positive (``MASK_IN_DOT``).  Each axis'
    term depends on one row and one key coordinate, so a thread's terms take few distinct values (ptxas shares their
    compares and the inner sums across its columns): the tile costs about one add per element and outer axis."""
    bias = tl.where(_axis_keep(kj2, start2, stop2, TRANSPOSED), 0.0, float("-inf"))
    if ACT1:
        bias = tl.where(_axis_keep(kj1, start1, stop1, TRANSPOSED), 0.0, float("-inf")) + bias
    if ACT0:
        bias = tl.where(_axis_keep(kj0, start0, stop0, TRANSPOSED), 0.0, float("-inf")) + bias
    return bias


@triton.jit
def _scores(a, b, start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, ACT0: tl.constexpr, ACT1: tl.constexpr,
            TRANSPOSED: tl.constexpr, MASK_IN_DOT: tl.constexpr, PREC: tl.constexpr):
    """The unscaled score tile ``a @ b^T`` ([queries, keys], or [keys, queries] when ``TRANSPOSED``), started from the
    window bias where ``MASK_IN_DOT``: then it is already -inf outside each query's window and the caller skips
    ``_mask_outside``."""
    if MASK_IN_DOT:
        s = tl.dot(a, tl.trans(b), _window_bias(start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, ACT0, ACT1,
                                                TRANSPOSED), input_precision=PREC)
    else:
        s = tl.dot(a, tl.trans(b), input_precision=PREC)
    return s


@triton.jit
def _group_descriptor(base, g0, g1, g2, D0, D1, D2, L1, L2, Lg0, Lg1, Lg2, stride_token, width, heads, stride_head,
                      U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr, BLOCK: tl.constexpr):
    """A TMA descriptor over one dilation group of ``heads`` consecutive heads of one batch element:
    a ``[heads, Lg0, Lg1, Lg2, width]`` array whose axis ``a`` steps ``D_a`` map positions.  A load of
    box ``(1, U0, U1, U2, BLOCK)`` is one bulk copy into shared memory; positions past the group (or
    ``width``) read as zeros, which is what the pointer loads' masks gave."""
    st = stride_token.to(tl.int64)
    origin = ((g0 * L1 + g1) * L2 + g2).to(tl.int64) * st
    return tl.make_tensor_descriptor(base + origin, shape=[heads, Lg0, Lg1, Lg2, width],
                                     strides=[stride_head.to(tl.int64), D0 * L1 * L2 * st, D1 * L2 * st, D2 * st, 1],
                                     block_shape=[1, U0, U1, U2, BLOCK])


@triton.jit
def _kv_sources(k_ptr, v_ptr, k_desc, v_desc, b, hk, g0, g1, g2, D0, D1, D2, L1, L2, Lg0, Lg1, Lg2, skt, svt, skh, svh,
                HEAD_DIM, VALUE_DIM, U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, TMA: tl.constexpr, HOST_DESC: tl.constexpr):
    """Where the loop's K/V tiles come from, and the coordinates of this batch element and head in them
    (``(lead, k_col, v_col)``, for ``_kv_tile``):

    * ``HOST_DESC``: ``k_desc`` / ``v_desc``, descriptors the host built over ``[B, L0, L1, L2, heads * D]`` (no
      dilation, power-of-two head dims): nothing to set up per program, where a device-side descriptor costs each
      program a write and a fence (why per-program descriptors lose on short loops);
    * ``TMA``: group descriptors built here (bulk copies, no address or mask arithmetic per element);
    * else the K/V pointers of this batch element and head (``k_desc`` / ``v_desc`` unused)."""
    if HOST_DESC:
        k_src = k_desc
        v_src = v_desc
        lead = b
        k_col = hk * BLOCK_D
        v_col = hk * BLOCK_DV
    else:
        if TMA:
            k_src = _group_descriptor(k_ptr, g0, g1, g2, D0, D1, D2, L1, L2, Lg0, Lg1, Lg2, skt, HEAD_DIM, 1, skh,
                                      U0, U1, U2, BLOCK_D)
            v_src = _group_descriptor(v_ptr, g0, g1, g2, D0, D1, D2, L1, L2, Lg0, Lg1, Lg2, svt, VALUE_DIM, 1, svh,
                                      U0, U1, U2, BLOCK_DV)
        else:
            k_src = k_ptr
            v_src = v_ptr
        lead = 0
        k_col = 0
        v_col = 0
    return k_src, v_src, lead, k_col, v_col


@triton.jit
def _kv_tile(k_src, v_src, lead, k_col, v_col, k0, k1, k2, kj0, kj1, kj2, Lg0, Lg1, Lg2, g0, g1, g2, D0, D1, D2, L1,
             L2, skt, svt, offs_d, offs_dv, d_ok, dv_ok, U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, IDX64: tl.constexpr, TMA: tl.constexpr):
    """The K and V tiles of the box at group coordinates (k0, k1, k2), flattened to [U0 * U1 * U2, BLOCK]
    rows (keys past the group read as zeros either way); ``lead`` / ``k_col`` / ``v_col`` place the box in a
    descriptor (``_kv_sources``)."""
    if TMA:
        k = k_src.load([lead, k0, k1, k2, k_col]).reshape([U0 * U1 * U2, BLOCK_D])
        v = v_src.load([lead, k0, k1, k2, v_col]).reshape([U0 * U1 * U2, BLOCK_DV])
    else:
        k_ok = (kj0 < Lg0) & (kj1 < Lg1) & (kj2 < Lg2)
        k_tok = _flat_token(kj0, kj1, kj2, g0, g1, g2, D0, D1, D2, L1, L2, IDX64)
        k = tl.load(k_src + k_tok[:, None] * skt + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_src + k_tok[:, None] * svt + offs_dv[None, :], mask=k_ok[:, None] & dv_ok[None, :], other=0.0)
    return k, v


@triton.jit
def _rpb_index(qc0, qc1, qc2, kj0, kj1, kj2, K0, K1, K2):
    """[rows, cols] flat index into rpb[h] of (query, key): the relative offset per axis is
    ``j' - i' + K - 1``; it splits into a row term and a column term.  Clamped so that pairs
    outside the window (masked afterwards) still read in bounds."""
    w1 = 2 * K1 - 1
    w2 = 2 * K2 - 1
    col = (kj0 * w1 + kj1) * w2 + kj2
    row = ((K0 - 1 - qc0) * w1 + (K1 - 1 - qc1)) * w2 + (K2 - 1 - qc2)
    idx = row[:, None] + col[None, :]
    # one unsigned min clamps both ends (a negative index wraps to a large one): a single instruction per element
    return tl.minimum(idx.to(tl.uint32, bitcast=True), ((2 * K0 - 1) * w1 * w2 - 1).to(tl.uint32))


@triton.jit
def _recomputed_probs(q, k, lse2, qk_scale, RPB, h, qc0, qc1, qc2, kj0, kj1, kj2, K0, K1, K2, k0, k1, k2,
                      in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, start0, stop0, start1, stop1, start2, stop2,
                      U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr, ACT0: tl.constexpr, ACT1: tl.constexpr,
                      HAS_RPB: tl.constexpr, MASK_IN_DOT: tl.constexpr, PREC: tl.constexpr):
    """The backward's [queries, keys] probabilities, recomputed from the forward's lse (base 2), zero
    outside each query's window (``MASK_IN_DOT``: through the score matmul's initial value, ``qk_scale`` > 0)."""
    s = _scores(q, k, start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, ACT0, ACT1, False,
                MASK_IN_DOT, PREC) * qk_scale
    if HAS_RPB:
        ridx = _rpb_index(qc0, qc1, qc2, kj0, kj1, kj2, K0, K1, K2)
        s += tl.load(RPB + h * ((2 * K0 - 1) * (2 * K1 - 1) * (2 * K2 - 1)) + ridx) * LOG2E_C
    p = tl.math.exp2(s - lse2[:, None])
    if not MASK_IN_DOT:
        p = _mask_outside(p, 0.0, k0, k1, k2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2,
                          start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, U0, U1, U2, ACT0, ACT1, False)
    return p


@triton.jit
def _store_window_ds(base, ds, q_ok, q_tok, stride_token, kj0, kj1, kj2, start0, stop0, start1, stop1, start2, stop2,
                     K1, K2, ATOMIC: tl.constexpr):
    """Stores the [queries, keys] tile ``ds`` at ``base + token * stride_token + slot`` for the pairs inside each
    query's window (slot: the key's row-major position in the window).  Every (query, slot) pair lies in exactly one
    key tile of the query's loop, so each is written once per batch element; ``ATOMIC`` adds it instead, into a
    buffer that every batch element shares (the batch sum done in L2, with no per-element buffer to write and
    read back)."""
    inside = q_ok[:, None] & _axis_keep(kj0, start0, stop0, False) & _axis_keep(kj1, start1, stop1, False)
    inside = inside & _axis_keep(kj2, start2, stop2, False)
    slot = ((kj0[None, :] - start0[:, None]) * K1 + (kj1[None, :] - start1[:, None])) * K2 + \
        (kj2[None, :] - start2[:, None])
    if ATOMIC:
        tl.atomic_add(base + q_tok[:, None] * stride_token + slot, ds, mask=inside, sem="relaxed")
    else:
        tl.store(base + q_tok[:, None] * stride_token + slot, ds, mask=inside)


# ---------------------------------------------------------------------------------------------
# Non-finite inputs: a program's rows again, one window offset at a time (see the top)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _holds_nonfinite(x):
    """Whether a [rows, cols] tile holds a NaN or an infinity: ``x * 0`` is 0 for a finite ``x`` and NaN otherwise, and
    a sum carries a NaN.  One pass over a program's result, against its loop's matmuls."""
    return tl.sum(tl.sum(x * 0.0, 1), 0) != 0.0


@triton.jit
def _offset_range(ok, qc, start, stop):
    """``(lo, n)``: the key - query offsets ``[lo, lo + n)`` spanned by the windows of the valid rows on one axis."""
    big = 1 << 30
    lo = tl.min(tl.where(ok, start - qc, big), 0)
    hi = tl.max(tl.where(ok, stop - qc, -big), 0)
    return lo, tl.maximum(hi - lo, 0)


@triton.jit
def _offset(t, lo0, lo1, lo2, n1, n2):
    """The ``t``-th offset (row-major) of ``[lo0, lo0 + n0) x [lo1, lo1 + n1) x [lo2, lo2 + n2)``."""
    return lo0 + t // (n2 * n1), lo1 + (t // n2) % n1, lo2 + t % n2


@triton.jit
def _relative_slot(o0, o1, o2, K0, K1, K2):
    """The flat index of the relative offset (o0, o1, o2) = key - query in a ``[2K0-1, 2K1-1, 2K2-1]`` RPB table."""
    return ((o0 + K0 - 1) * (2 * K1 - 1) + (o1 + K1 - 1)) * (2 * K2 - 1) + (o2 + K2 - 1)


@triton.jit
def _offset_bias(RPB, h, o0, o1, o2, K0, K1, K2):
    """rpb[h] (flat float32 table) at the relative offset (o0, o1, o2) = key - query, base-2 scaled; one scalar."""
    n_rel = (2 * K0 - 1) * (2 * K1 - 1) * (2 * K2 - 1)
    return tl.load(RPB + h * n_rel + _relative_slot(o0, o1, o2, K0, K1, K2)) * LOG2E_C


@triton.jit
def _sub_rows(first, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, SUB: tl.constexpr):
    """Per-axis coordinates of rows ``first .. first + SUB - 1`` of a row-major (T0, T1, T2) tile."""
    r = first + tl.arange(0, SUB)
    return r // (T1 * T2), (r // T2) % T1, r % T2


@triton.jit
def _query_rows(first0, first1, first2, r0, r1, r2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2,
                D0, D1, D2, CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr, CAUSAL2: tl.constexpr, IDX64: tl.constexpr):
    """Query rows at ``first + r`` per axis (group coordinates): whether each exists, its token, and its clamped
    coordinate and window per axis."""
    ok0, qc0, start0, stop0 = _axis_rows(first0, r0, Lg0, K0, S0, CAUSAL0)
    ok1, qc1, start1, stop1 = _axis_rows(first1, r1, Lg1, K1, S1, CAUSAL1)
    ok2, qc2, start2, stop2 = _axis_rows(first2, r2, Lg2, K2, S2, CAUSAL2)
    q_ok = ok0 & ok1 & ok2
    q_tok = _flat_token(qc0, qc1, qc2, g0, g1, g2, D0, D1, D2, L1, L2, IDX64)
    return q_ok, q_tok, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2


@triton.jit
def _row_windows(first, tile0, tile1, tile2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2,
                 CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr, CAUSAL2: tl.constexpr, T0: tl.constexpr,
                 T1: tl.constexpr, T2: tl.constexpr, SUB: tl.constexpr, IDX64: tl.constexpr):
    """Rows ``first .. first + SUB - 1`` of the program's query tile, for the pair-by-pair paths: whether each
    exists, its token, its clamped coordinate and window per axis, and the key - query offsets ``[lo, lo + n)`` per
    axis that the rows' windows span."""
    r0, r1, r2 = _sub_rows(first, T0, T1, T2, SUB)
    q_ok, q_tok, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2 = _query_rows(
        tile0 * T0, tile1 * T1, tile2 * T2, r0, r1, r2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2,
        D0, D1, D2, CAUSAL0, CAUSAL1, CAUSAL2, IDX64)
    lo0, n0 = _offset_range(q_ok, qc0, start0, stop0)
    lo1, n1 = _offset_range(q_ok, qc1, start1, stop1)
    lo2, n2 = _offset_range(q_ok, qc2, start2, stop2)
    return q_ok, q_tok, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2, lo0, n0, lo1, n1, lo2, n2


@triton.jit
def _gathered_pair(Kp, V, RPB, k_base, v_base, skt, svt, h, q, q_ok, t, lo0, lo1, lo2, n1, n2, qc0, qc1, qc2,
                   start0, stop0, start1, stop1, start2, stop2, g0, g1, g2, L1, L2, K0, K1, K2, D0, D1, D2,
                   offs_d, offs_dv, d_ok, dv_ok, qk_scale, HAS_RPB: tl.constexpr, IDX64: tl.constexpr):
    """The ``t``-th window offset of each row (``_row_windows``): whether the row's window holds that key, the key's
    and value's rows (zero where it does not), and the base-2 scaled score with its bias."""
    o0, o1, o2 = _offset(t, lo0, lo1, lo2, n1, n2)
    kj0 = qc0 + o0
    kj1 = qc1 + o1
    kj2 = qc2 + o2
    adm = q_ok & (kj0 >= start0) & (kj0 < stop0) & (kj1 >= start1) & (kj1 < stop1)
    adm = adm & (kj2 >= start2) & (kj2 < stop2)
    k_tok = _flat_token(kj0, kj1, kj2, g0, g1, g2, D0, D1, D2, L1, L2, IDX64)
    k = tl.load(Kp + k_base + k_tok[:, None] * skt + offs_d[None, :], mask=adm[:, None] & d_ok[None, :],
                other=0.0).to(tl.float32)
    v = tl.load(V + v_base + k_tok[:, None] * svt + offs_dv[None, :], mask=adm[:, None] & dv_ok[None, :],
                other=0.0).to(tl.float32)
    s = tl.sum(q * k, 1) * qk_scale
    if HAS_RPB:
        s += _offset_bias(RPB, h, o0, o1, o2, K0, K1, K2)
    return adm, k, v, s


@triton.jit
def _attend_by_offset(Q, Kp, V, RPB, O, LSE, q_base, k_base, v_base, o_base, l_base, sqt, skt, svt, sot, slt, h,
                      tile0, tile1, tile2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2,
                      HEAD_DIM, VALUE_DIM, qk_scale, CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr,
                      CAUSAL2: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, SUB: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_RPB: tl.constexpr, IDX64: tl.constexpr,
                      STORE_LSE: tl.constexpr):
    """The forward of the program's query tile, ``SUB`` rows at a time, stored to O (and LSE): each row's online
    softmax over its own window, one gathered key and value per row and offset (a key outside a row's window is
    never loaded for it)."""
    offs_d, offs_dv, d_ok, dv_ok = _head_dims(BLOCK_D, BLOCK_DV, HEAD_DIM, VALUE_DIM)
    for first in tl.range(0, T0 * T1 * T2, SUB, num_stages=1):
        q_ok, q_tok, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2, lo0, n0, lo1, n1, lo2, n2 = \
            _row_windows(first, tile0, tile1, tile2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1,
                         D2, CAUSAL0, CAUSAL1, CAUSAL2, T0, T1, T2, SUB, IDX64)
        q = tl.load(Q + q_base + q_tok[:, None] * sqt + offs_d[None, :], mask=q_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        m_i = tl.full([SUB], float("-inf"), tl.float32)
        l_i = tl.zeros([SUB], tl.float32)
        acc = tl.zeros([SUB, BLOCK_DV], tl.float32)
        for t in tl.range(0, n0 * n1 * n2, num_stages=1):
            adm, k, v, s = _gathered_pair(Kp, V, RPB, k_base, v_base, skt, svt, h, q, q_ok, t, lo0, lo1, lo2, n1, n2,
                                          qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2, g0, g1, g2, L1,
                                          L2, K0, K1, K2, D0, D1, D2, offs_d, offs_dv, d_ok, dv_ok, qk_scale, HAS_RPB,
                                          IDX64)
            s = tl.where(adm, s, float("-inf"))
            m_new = tl.maximum(m_i, s)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use)
            alpha = tl.math.exp2(m_i - m_use)
            acc = acc * alpha[:, None] + p[:, None] * v  # outside the window p = 0 and v = 0
            l_i = l_i * alpha + p
            m_i = m_new
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows past the group end (a NaN sum stays NaN)
        tl.store(O + o_base + q_tok[:, None] * sot + offs_dv[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty),
                 mask=q_ok[:, None] & dv_ok[None, :])
        if STORE_LSE:
            lse = (m_i + tl.math.log2(l_i)) * LN2_C
            tl.store(LSE + l_base + q_tok * slt + h, lse.to(LSE.dtype.element_ty), mask=q_ok)


@triton.jit
def _dq_by_offset(Q, Kp, V, RPB, DO, LSE, DELTA, DQ, q_base, k_base, v_base, do_base, l_base, g_base, sqt, skt, svt,
                  sdt, slt, sgt, h, tile0, tile1, tile2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2,
                  D0, D1, D2, HEAD_DIM, VALUE_DIM, qk_scale, scale, CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr,
                  CAUSAL2: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, SUB: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_RPB: tl.constexpr, IDX64: tl.constexpr):
    """dQ of the program's query tile, ``SUB`` rows at a time, stored to DQ: per row and window offset one gathered key
    and value (``_attend_by_offset``'s order)."""
    offs_d, offs_dv, d_ok, dv_ok = _head_dims(BLOCK_D, BLOCK_DV, HEAD_DIM, VALUE_DIM)
    for first in tl.range(0, T0 * T1 * T2, SUB, num_stages=1):
        q_ok, q_tok, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2, lo0, n0, lo1, n1, lo2, n2 = \
            _row_windows(first, tile0, tile1, tile2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1,
                         D2, CAUSAL0, CAUSAL1, CAUSAL2, T0, T1, T2, SUB, IDX64)
        q = tl.load(Q + q_base + q_tok[:, None] * sqt + offs_d[None, :], mask=q_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        do = tl.load(DO + do_base + q_tok[:, None] * sdt + offs_dv[None, :], mask=q_ok[:, None] & dv_ok[None, :],
                     other=0.0).to(tl.float32)
        lse2 = tl.load(LSE + l_base + q_tok * slt + h, mask=q_ok, other=0.0).to(tl.float32) * LOG2E_C
        delta = tl.load(DELTA + l_base + q_tok * slt + h, mask=q_ok, other=0.0).to(tl.float32)
        dq = tl.zeros([SUB, BLOCK_D], tl.float32)
        for t in tl.range(0, n0 * n1 * n2, num_stages=1):
            adm, k, v, s = _gathered_pair(Kp, V, RPB, k_base, v_base, skt, svt, h, q, q_ok, t, lo0, lo1, lo2, n1, n2,
                                          qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2, g0, g1, g2, L1,
                                          L2, K0, K1, K2, D0, D1, D2, offs_d, offs_dv, d_ok, dv_ok, qk_scale, HAS_RPB,
                                          IDX64)
            p = tl.math.exp2(s - lse2)
            ds = tl.where(adm, p * (tl.sum(do * v, 1) - delta), 0.0)
            dq += ds[:, None] * k  # outside the window ds = 0 and k = 0
        tl.store(DQ + g_base + q_tok[:, None] * sgt + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
                 mask=q_ok[:, None] & d_ok[None, :])


@triton.jit
def _axis_queries(kj, o, k_ok, Lg, K, s, CAUSAL: tl.constexpr):
    """On one axis, for keys ``kj`` and the offset ``o`` = key - query: the queries ``kj - o`` (clamped into the group)
    and whether each exists and holds its key in its window."""
    qi = kj - o
    qc = tl.minimum(tl.maximum(qi, 0), Lg - 1)
    start = window_start(qc, Lg, K, s, CAUSAL)
    holds = (qi >= 0) & (qi < Lg) & (kj >= start) & (kj < window_stop(qc, start, K, CAUSAL))
    return qc, k_ok & holds


@triton.jit
def _dkdv_by_offset(Q, Kp, V, RPB, DO, LSE, DELTA, DK, DV, b, hk, GROUP, sqb, sqt, sqh, skt, sdb, sdt, sdh, svt, slb,
                    slt, skgt, svgt, k_base, v_base, kg_base, vg_base, k0, k1, k2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2,
                    K0, K1, K2, S0, S1, S2, D0, D1, D2, HEAD_DIM, VALUE_DIM, qk_scale, scale,
                    CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr, CAUSAL2: tl.constexpr, U0: tl.constexpr,
                    U1: tl.constexpr, U2: tl.constexpr, SUB: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_DV: tl.constexpr, HAS_RPB: tl.constexpr, IDX64: tl.constexpr):
    """dK, dV of the program's key tile, ``SUB`` keys at a time, stored to DK / DV: per key, GQA head and offset
    (key - query, within ``(-K, K)`` on each axis) one gathered query, kept where the key lies in its window."""
    offs_d, offs_dv, d_ok, dv_ok = _head_dims(BLOCK_D, BLOCK_DV, HEAD_DIM, VALUE_DIM)
    for first in tl.range(0, U0 * U1 * U2, SUB, num_stages=1):
        c0, c1, c2 = _sub_rows(first, U0, U1, U2, SUB)
        kj0 = k0 + c0
        kj1 = k1 + c1
        kj2 = k2 + c2
        k_ok = (kj0 < Lg0) & (kj1 < Lg1) & (kj2 < Lg2)
        k_tok = _flat_token(kj0, kj1, kj2, g0, g1, g2, D0, D1, D2, L1, L2, IDX64)
        k = tl.load(Kp + k_base + k_tok[:, None] * skt + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        v = tl.load(V + v_base + k_tok[:, None] * svt + offs_dv[None, :], mask=k_ok[:, None] & dv_ok[None, :],
                    other=0.0).to(tl.float32)
        dk = tl.zeros([SUB, BLOCK_D], tl.float32)
        dv = tl.zeros([SUB, BLOCK_DV], tl.float32)
        for h in tl.range(hk * GROUP, hk * GROUP + GROUP, num_stages=1):
            for o0 in tl.range(1 - K0, K0, num_stages=1):
                qc0, adm0 = _axis_queries(kj0, o0, k_ok, Lg0, K0, S0, CAUSAL0)
                for o1 in tl.range(1 - K1, K1, num_stages=1):
                    qc1, adm1 = _axis_queries(kj1, o1, adm0, Lg1, K1, S1, CAUSAL1)
                    for o2 in tl.range(1 - K2, K2, num_stages=1):
                        qc2, adm = _axis_queries(kj2, o2, adm1, Lg2, K2, S2, CAUSAL2)
                        q_tok = _flat_token(qc0, qc1, qc2, g0, g1, g2, D0, D1, D2, L1, L2, IDX64)
                        q = tl.load(Q + b.to(tl.int64) * sqb + h * sqh + q_tok[:, None] * sqt + offs_d[None, :],
                                    mask=adm[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                        do = tl.load(DO + b.to(tl.int64) * sdb + h * sdh + q_tok[:, None] * sdt + offs_dv[None, :],
                                     mask=adm[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
                        l_off = b.to(tl.int64) * slb + q_tok * slt + h
                        lse2 = tl.load(LSE + l_off, mask=adm, other=0.0).to(tl.float32) * LOG2E_C
                        delta = tl.load(DELTA + l_off, mask=adm, other=0.0).to(tl.float32)
                        s = tl.sum(q * k, 1) * qk_scale
                        if HAS_RPB:
                            s += _offset_bias(RPB, h, o0, o1, o2, K0, K1, K2)
                        p = tl.where(adm, tl.math.exp2(s - lse2), 0.0)
                        dv += p[:, None] * do  # outside the window p = 0 and do = 0
                        ds = tl.where(adm, p * (tl.sum(do * v, 1) - delta), 0.0)
                        dk += ds[:, None] * q
        tl.store(DK + kg_base + k_tok[:, None] * skgt + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
                 mask=k_ok[:, None] & d_ok[None, :])
        tl.store(DV + vg_base + k_tok[:, None] * svgt + offs_dv[None, :], dv.to(DV.dtype.element_ty),
                 mask=k_ok[:, None] & dv_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Forward
@triton.jit
def _program_group(NT0, NT1, NT2, D0, D1, D2, L0, L1, L2, HEADS, ACT0: tl.constexpr, ACT1: tl.constexpr):
    """Every kernel's start: the dilation group and tile per axis this program owns (grid axis 0), its batch
    element and head (grid axis 1 is ``b * HEADS + head``), and the group's length per axis."""
    g0, tile0, g1, tile1, g2, tile2 = _decode_program(tl.program_id(0), NT0, NT1, NT2, D0, D1, D2, ACT0, ACT1)
    bh = tl.program_id(1)
    return (g0, tile0, g1, tile1, g2, tile2, bh // HEADS, bh % HEADS,
            group_length(L0, D0, g0), group_length(L1, D1, g1), group_length(L2, D2, g2))


@triton.jit
def _query_tile(tile0, tile1, tile2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2,
                CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr, CAUSAL2: tl.constexpr, T0: tl.constexpr,
                T1: tl.constexpr, T2: tl.constexpr, IDX64: tl.constexpr):
    """The rows of a query-tile program (forward, dQ; ``_query_rows``), and per axis the keys the rows' windows
    reach, ``[lo, hi)``, with the part every row's window holds, ``[in_lo, in_hi)``."""
    r0, r1, r2 = _tile_coords(T0, T1, T2)
    q_ok, q_tok, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2 = _query_rows(
        tile0 * T0, tile1 * T1, tile2 * T2, r0, r1, r2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2,
        D0, D1, D2, CAUSAL0, CAUSAL1, CAUSAL2, IDX64)
    lo0, hi0, in_lo0, in_hi0 = _axis_span(tile0 * T0, T0, Lg0, K0, S0, CAUSAL0)
    lo1, hi1, in_lo1, in_hi1 = _axis_span(tile1 * T1, T1, Lg1, K1, S1, CAUSAL1)
    lo2, hi2, in_lo2, in_hi2 = _axis_span(tile2 * T2, T2, Lg2, K2, S2, CAUSAL2)
    return (q_ok, q_tok, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2,
            lo0, hi0, in_lo0, in_hi0, lo1, hi1, in_lo1, in_hi1, lo2, hi2, in_lo2, in_hi2)


@triton.jit
def _head_dims(BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HEAD_DIM, VALUE_DIM):
    """Column offsets of the q/k and v rows, and which of them are inside the head dims."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    return offs_d, offs_dv, offs_d < HEAD_DIM, offs_dv < VALUE_DIM


@triton.jit
def _box_offsets(ROWS: tl.constexpr, COLS: tl.constexpr):
    """Row-major offsets of a [ROWS, COLS] tile."""
    return tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]


@triton.jit
def _program_tiles(BIAS, h, BOXES, BOX: tl.constexpr):
    """Where the bias tiles of this program (grid axis 0) and query head ``h`` start: ``BOXES`` tiles of ``BOX``
    elements per program and head."""
    return BIAS + (h * tl.num_programs(0) + tl.program_id(0)).to(tl.int64) * (BOXES * BOX)


@triton.jit
def _bias_tile(table, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, K0, K1, K2,
               ACT0: tl.constexpr, ACT1: tl.constexpr, TRANSPOSED: tl.constexpr):
    """[queries, keys] (or [keys, queries] when ``TRANSPOSED``): ``log2(e) * rpb`` at each pair's offset inside the
    query's window, -inf outside."""
    bias = tl.load(table + _rpb_index(qc0, qc1, qc2, kj0, kj1, kj2, K0, K1, K2)) * LOG2E_C
    if TRANSPOSED:
        bias = tl.trans(bias)
    return _window_bias(start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, ACT0, ACT1, TRANSPOSED) + bias


@triton.jit
def _tile_value(bias, inv_qk_scale, BIAS):
    """A bias tile as stored: divided by the score scale, in the table's dtype.  A 16-bit table is float16
    (``launch.bias_tiles_dtype``): finite values saturate at its range instead of turning into infinities."""
    bias = bias * inv_qk_scale
    if BIAS.dtype.element_ty == tl.float16:
        bias = tl.where(bias == float("-inf"), bias, tl.minimum(tl.maximum(bias, -65504.0), 65504.0))
    return bias.to(BIAS.dtype.element_ty)


@triton.jit
def na_bias_tiles_kernel(
    RPB, BIAS, ZEROED, HQ, inv_qk_scale,
    L0, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2, NT0, NT1, NT2, BOXES,
    CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr, CAUSAL2: tl.constexpr,
    ACT0: tl.constexpr, ACT1: tl.constexpr,
    T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
    U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr, OFFSETS: tl.constexpr, ZERO_TILES: tl.constexpr,
):
    """The score bias of every box a query-tile program visits, shared by the whole batch: ``BIAS[h, program, box]``
    is a [queries, keys] tile holding ``log2(e) * rpb`` at each pair's offset where the key lies in the query's window
    and -inf elsewhere, divided by the score scale (the kernels add it to the unscaled scores).  Grid: the query-tile
    programs of the kernel that reads it (axis 0) by heads (axis 1); ``BOXES`` tiles per program, the most any visits.
    Precomputing it turns the per-element gather and window compares of every batch element into one contiguous load
    of a table that stays in L2.

    ``OFFSETS``: instead, the int32 flat RPB offset of each (query, key) pair inside the query's window, -1 elsewhere
    and on rows past the group (one set of tiles, ``HQ`` = 1, ``RPB`` unused): where dQ's tile-layout dS belongs in
    dRPB (``rpb_grad.tile_gather_index``).

    ``ZERO_TILES``: also zero the float32 buffer ``ZEROED`` of the same layout at every box the program visits (dQ's
    tile-layout dS, which dQ then adds to by atomics): a fill kernel less per backward."""
    g0, tile0, g1, tile1, g2, tile2, b, h, Lg0, Lg1, Lg2 = _program_group(NT0, NT1, NT2, D0, D1, D2, L0, L1, L2, HQ,
                                                                         ACT0, ACT1)
    (q_ok, q_tok, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2,
     lo0, hi0, in_lo0, in_hi0, lo1, hi1, in_lo1, in_hi1, lo2, hi2, in_lo2, in_hi2) = _query_tile(
        tile0, tile1, tile2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2,
        CAUSAL0, CAUSAL1, CAUSAL2, T0, T1, T2, False)
    c0, c1, c2 = _tile_coords(U0, U1, U2)
    box = T0 * T1 * T2 * U0 * U1 * U2
    out = _program_tiles(BIAS, h, BOXES, box)
    zeroed = _program_tiles(ZEROED, h, BOXES, box)
    offs = _box_offsets(T0 * T1 * T2, U0 * U1 * U2)
    table = RPB + h * ((2 * K0 - 1) * (2 * K1 - 1) * (2 * K2 - 1))
    n0 = tl.cdiv(hi0 - lo0, U0)
    n1 = tl.cdiv(hi1 - lo1, U1)
    n2 = tl.cdiv(hi2 - lo2, U2)
    i0 = 0
    i1 = 0
    i2 = 0
    for t in range(0, n0 * n1 * n2):
        kj0 = lo0 + i0 * U0 + c0
        kj1 = lo1 + i1 * U1 + c1
        kj2 = lo2 + i2 * U2 + c2
        i0, i1, i2 = _next_tile(i0, i1, i2, n1, n2, ACT0, ACT1)
        if OFFSETS:
            inside = _window_bias(start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, ACT0, ACT1, False) == 0.0
            rel = _rpb_index(qc0, qc1, qc2, kj0, kj1, kj2, K0, K1, K2).to(tl.int32)
            tl.store(out + t * box + offs, tl.where(inside & q_ok[:, None], rel, -1))
        else:
            bias = _bias_tile(table, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, K0,
                              K1, K2, ACT0, ACT1, False)
            tl.store(out + t * box + offs, _tile_value(bias, inv_qk_scale, BIAS))
            if ZERO_TILES:
                tl.store(zeroed + t * box + offs, tl.zeros((T0 * T1 * T2, U0 * U1 * U2), tl.float32))


@triton.jit
def na_bias_tiles_inverse_kernel(
    RPB, BIAS, HQ, inv_qk_scale,
    L0, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2, NU0, NU1, NU2, BOXES,
    CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr, CAUSAL2: tl.constexpr,
    ACT0: tl.constexpr, ACT1: tl.constexpr,
    T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
    U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr, BISECT: tl.constexpr, QUERY_ROWS: tl.constexpr,
):
    """``na_bias_tiles_kernel`` for dK/dV's loops: a key-tile program (axis 0) visits the query tiles whose windows
    reach it; its tiles are [keys, queries] ([queries, keys] where ``QUERY_ROWS``), one set per query head (axis 1)."""
    g0, tile0, g1, tile1, g2, tile2, b, h, Lg0, Lg1, Lg2 = _program_group(NU0, NU1, NU2, D0, D1, D2, L0, L1, L2, HQ,
                                                                         ACT0, ACT1)
    c0, c1, c2 = _tile_coords(U0, U1, U2)
    k0 = tile0 * U0
    k1 = tile1 * U1
    k2 = tile2 * U2
    n0, n1, n2, ql0, ql1, ql2 = _reaching_tiles(k0, k1, k2, Lg0, Lg1, Lg2, K0, K1, K2, S0, S1, S2, CAUSAL0, CAUSAL1,
                                                CAUSAL2, T0, T1, T2, U0, U1, U2, BISECT)
    r0, r1, r2 = _tile_coords(T0, T1, T2)
    box = T0 * T1 * T2 * U0 * U1 * U2
    out = _program_tiles(BIAS, h, BOXES, box)
    if QUERY_ROWS:
        offs = _box_offsets(T0 * T1 * T2, U0 * U1 * U2)
    else:
        offs = _box_offsets(U0 * U1 * U2, T0 * T1 * T2)
    table = RPB + h * ((2 * K0 - 1) * (2 * K1 - 1) * (2 * K2 - 1))
    i0 = 0
    i1 = 0
    i2 = 0
    for t in range(0, n0 * n1 * n2):
        q0 = ql0 + i0 * T0
        q1 = ql1 + i1 * T1
        q2 = ql2 + i2 * T2
        i0, i1, i2 = _next_tile(i0, i1, i2, n1, n2, ACT0, ACT1)
        q_ok, q_tok, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2 = _query_rows(
            q0, q1, q2, r0, r1, r2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2,
            CAUSAL0, CAUSAL1, CAUSAL2, False)
        bias = _bias_tile(table, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2, k0 + c0, k1 + c1,
                          k2 + c2, K0, K1, K2, ACT0, ACT1, not QUERY_ROWS)
        tl.store(out + t * box + offs, _tile_value(bias, inv_qk_scale, BIAS))


@triton.jit
def _reaching_tiles(k0, k1, k2, Lg0, Lg1, Lg2, K0, K1, K2, S0, S1, S2, CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr,
                    CAUSAL2: tl.constexpr, T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr, U0: tl.constexpr,
                    U1: tl.constexpr, U2: tl.constexpr, BISECT: tl.constexpr):
    """Inverse neighborhood of the key tile at (k0, k1, k2): per axis the query tiles whose windows reach any of its
    keys, as a count and a first query."""
    ql0 = first_query_reaching(k0, Lg0, K0, S0, CAUSAL0, BISECT)
    qh0 = last_query_reaching(tl.minimum(k0 + U0, Lg0) - 1, Lg0, K0, S0, CAUSAL0, BISECT) + 1
    ql1 = first_query_reaching(k1, Lg1, K1, S1, CAUSAL1, BISECT)
    qh1 = last_query_reaching(tl.minimum(k1 + U1, Lg1) - 1, Lg1, K1, S1, CAUSAL1, BISECT) + 1
    ql2 = first_query_reaching(k2, Lg2, K2, S2, CAUSAL2, BISECT)
    qh2 = last_query_reaching(tl.minimum(k2 + U2, Lg2) - 1, Lg2, K2, S2, CAUSAL2, BISECT) + 1
    n0 = tl.cdiv(tl.maximum(qh0 - ql0, 0), T0)
    n1 = tl.cdiv(tl.maximum(qh1 - ql1, 0), T1)
    n2 = tl.cdiv(tl.maximum(qh2 - ql2, 0), T2)
    return n0, n1, n2, ql0, ql1, ql2


# ---------------------------------------------------------------------------------------------
@triton.jit
def na_fwd_kernel(
    Q, Kp, V, RPB, O, LSE, K_DESC, V_DESC, BIAS,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, slb, slt,
    HQ, GROUP, HEAD_DIM, VALUE_DIM, qk_scale,
    L0, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2, NT0, NT1, NT2, BOXES,
    CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr, CAUSAL2: tl.constexpr,
    ACT0: tl.constexpr, ACT1: tl.constexpr,
    T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
    U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_RPB: tl.constexpr, IDX64: tl.constexpr,
    FOLD_SCALE: tl.constexpr, TMA: tl.constexpr, HOST_DESC: tl.constexpr, STORE_LSE: tl.constexpr,
    MASK_IN_DOT: tl.constexpr, PREC: tl.constexpr, GATHER_ROWS: tl.constexpr, BIAS_TILES: tl.constexpr,
):
    # K_DESC / V_DESC: K/V descriptors built on the host where ``HOST_DESC`` (see ``_kv_sources``), else unused.
    # BIAS_TILES: each box's RPB and window mask come ready from BIAS (``na_bias_tiles_kernel``, ``BOXES`` boxes per
    # program), the score matmul's initial value; else BIAS is unused.
    # GATHER_ROWS: rows per step of ``_attend_by_offset`` (programs whose result holds a NaN / inf; see the top).
    g0, tile0, g1, tile1, g2, tile2, b, h, Lg0, Lg1, Lg2 = _program_group(NT0, NT1, NT2, D0, D1, D2, L0, L1, L2, HQ,
                                                                         ACT0, ACT1)
    hk = h // GROUP
    (q_ok, q_tok, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2,
     lo0, hi0, in_lo0, in_hi0, lo1, hi1, in_lo1, in_hi1, lo2, hi2, in_lo2, in_hi2) = _query_tile(
        tile0, tile1, tile2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2,
        CAUSAL0, CAUSAL1, CAUSAL2, T0, T1, T2, IDX64)
    offs_d, offs_dv, d_ok, dv_ok = _head_dims(BLOCK_D, BLOCK_DV, HEAD_DIM, VALUE_DIM)
    q_base = b.to(tl.int64) * sqb + h * sqh
    q = tl.load(Q + q_base + q_tok[:, None] * sqt + offs_d[None, :], mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = b.to(tl.int64) * skb + hk * skh
    v_base = b.to(tl.int64) * svb + hk * svh
    c0, c1, c2 = _tile_coords(U0, U1, U2)
    k_src, v_src, lead, k_col, v_col = _kv_sources(Kp + k_base, V + v_base, K_DESC, V_DESC, b, hk, g0, g1, g2, D0, D1,
                                                   D2, L1, L2, Lg0, Lg1, Lg2, skt, svt, skh, svh, HEAD_DIM, VALUE_DIM,
                                                   U0, U1, U2, BLOCK_D, BLOCK_DV, TMA, HOST_DESC)

    m_i = tl.full([T0 * T1 * T2], float("-inf"), tl.float32)
    l_i = tl.zeros([T0 * T1 * T2], tl.float32)
    acc = tl.zeros([T0 * T1 * T2, BLOCK_DV], tl.float32)
    if BIAS_TILES:
        bias_ptr = _program_tiles(BIAS, h, BOXES, T0 * T1 * T2 * U0 * U1 * U2)
        bias_offs = _box_offsets(T0 * T1 * T2, U0 * U1 * U2)

    n0 = tl.cdiv(hi0 - lo0, U0)
    n1 = tl.cdiv(hi1 - lo1, U1)
    n2 = tl.cdiv(hi2 - lo2, U2)
    i0 = 0
    i1 = 0
    i2 = 0
    for t in range(0, n0 * n1 * n2):
        k0 = lo0 + i0 * U0
        k1 = lo1 + i1 * U1
        k2 = lo2 + i2 * U2
        i0, i1, i2 = _next_tile(i0, i1, i2, n1, n2, ACT0, ACT1)
        kj0 = k0 + c0
        kj1 = k1 + c1
        kj2 = k2 + c2
        k, v = _kv_tile(k_src, v_src, lead, k_col, v_col, k0, k1, k2, kj0, kj1, kj2, Lg0, Lg1, Lg2, g0, g1, g2, D0, D1,
                        D2, L1, L2, skt, svt, offs_d, offs_dv, d_ok, dv_ok, U0, U1, U2, BLOCK_D, BLOCK_DV, IDX64, TMA)
        if BIAS_TILES:
            bias = tl.load(bias_ptr + t * (T0 * T1 * T2 * U0 * U1 * U2) + bias_offs).to(tl.float32)
            s = tl.dot(q, tl.trans(k), bias, input_precision=PREC)
        else:
            # MASK_IN_DOT: the window mask is the score matmul's initial value, on every box (see launch.py)
            s = _scores(q, k, start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, ACT0, ACT1, False,
                        MASK_IN_DOT, PREC)
        if FOLD_SCALE:  # scale > 0, no bias: max of the raw logits, the scale folded into exp2's FMA
            s_scale = qk_scale
        else:
            s = s * qk_scale
            if HAS_RPB:
                ridx = _rpb_index(qc0, qc1, qc2, kj0, kj1, kj2, K0, K1, K2)
                s += tl.load(RPB + h * ((2 * K0 - 1) * (2 * K1 - 1) * (2 * K2 - 1)) + ridx) * LOG2E_C
            s_scale = 1.0
        if not MASK_IN_DOT:
            s = _mask_outside(s, float("-inf"), k0, k1, k2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2,
                              start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, U0, U1, U2, ACT0, ACT1, False)
        m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing admitted yet
        p = tl.math.exp2(s * s_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        # rescale, then accumulate in the matmul itself (no second accumulator and add)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new

    # Every query sees at least one key, so l_i > 0 on every row that is stored; rows of a program past the end of
    # a short dilation group see none (l_i = 0) and would compute 0 * inf and log2(0), which are never stored but
    # make numpy warn under the interpreter: one select per row keeps them finite.
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc * (1.0 / l_i)[:, None]  # one reciprocal per row, not a division per element
    o_base = b.to(tl.int64) * sob + h * soh
    if _holds_nonfinite(out):  # a NaN / inf reached the tile: its rows again, kept inside their windows (rare)
        _attend_by_offset(Q, Kp, V, RPB, O, LSE, q_base, k_base, v_base, o_base, b.to(tl.int64) * slb, sqt, skt, svt,
                          sot, slt, h, tile0, tile1, tile2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2,
                          D0, D1, D2, HEAD_DIM, VALUE_DIM, qk_scale, CAUSAL0, CAUSAL1, CAUSAL2, T0, T1, T2,
                          GATHER_ROWS, BLOCK_D, BLOCK_DV, HAS_RPB, IDX64, STORE_LSE)
    else:
        tl.store(O + o_base + q_tok[:, None] * sot + offs_dv[None, :], out.to(O.dtype.element_ty),
                 mask=q_ok[:, None] & dv_ok[None, :])
        if STORE_LSE:  # skipped where nobody reads it (inference): 4 scattered bytes per query and head
            lse = (m_i + tl.math.log2(l_i)) * LN2_C
            tl.store(LSE + b.to(tl.int64) * slb + q_tok * slt + h, lse.to(LSE.dtype.element_ty), mask=q_ok)


# ---------------------------------------------------------------------------------------------
# Backward: dQ (loops over KV tiles like the forward)
# ---------------------------------------------------------------------------------------------
@triton.jit
def na_bwd_dq_kernel(
    Q, Kp, V, RPB, DO, LSE, DELTA, DQ, K_DESC, V_DESC, DSW, BIAS, O, DLSE,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdb, sdt, sdh, slb, slt, sgb, sgt, sgh, swb, swt, swh, sob, sot, soh,
    HQ, GROUP, HEAD_DIM, VALUE_DIM, qk_scale, scale,
    L0, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2, NT0, NT1, NT2, BOXES,
    CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr, CAUSAL2: tl.constexpr,
    ACT0: tl.constexpr, ACT1: tl.constexpr,
    T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
    U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_RPB: tl.constexpr, IDX64: tl.constexpr,
    TMA: tl.constexpr, HOST_DESC: tl.constexpr, STORE_DS: tl.constexpr, DS_ATOMIC: tl.constexpr,
    MASK_IN_DOT: tl.constexpr, PREC: tl.constexpr, GATHER_ROWS: tl.constexpr, BIAS_TILES: tl.constexpr,
    DS_BOXES: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    # lse, delta and dlse share strides (slb, slt); dQ has its own (sgb, sgt, sgh): q may be a strided view.
    # DELTA is written here: each program computes delta = rowsum(dO * O) - dlse (the lse gradient enters only there)
    # for its own query rows, which no other program owns, and the dK/dV kernel, launched after this one, reads it.
    # BIAS_TILES: the boxes' RPB and window mask come from BIAS (``na_bias_tiles_kernel``), else it is unused.
    # DS_BOXES (with BIAS_TILES): dS is added over the batch into DSW in the bias tiles' layout (whole tiles: contiguous
    # atomics, no index arithmetic; ``rpb_grad.reduce_tile_ds`` sums it by offset), instead of STORE_DS's layout.
    # K_DESC / V_DESC: K/V descriptors built on the host where ``HOST_DESC`` (as in the forward), else unused.
    # ``STORE_DS``: also writes dS in window layout, DSW[b, token, h, slot] (float32, strides swb, swt, swh; slot =
    # row-major position of the key in the query's window), from which the host sums the RPB gradient by offset
    # (``ops/fused/rpb_grad.py``); else DSW is unused.  ``DS_ATOMIC``: DSW is one [token, h, slot] buffer for the
    # whole batch (swb = 0) that every program adds into.
    g0, tile0, g1, tile1, g2, tile2, b, h, Lg0, Lg1, Lg2 = _program_group(NT0, NT1, NT2, D0, D1, D2, L0, L1, L2, HQ,
                                                                         ACT0, ACT1)
    hk = h // GROUP
    (q_ok, q_tok, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2,
     lo0, hi0, in_lo0, in_hi0, lo1, hi1, in_lo1, in_hi1, lo2, hi2, in_lo2, in_hi2) = _query_tile(
        tile0, tile1, tile2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2,
        CAUSAL0, CAUSAL1, CAUSAL2, T0, T1, T2, IDX64)
    offs_d, offs_dv, d_ok, dv_ok = _head_dims(BLOCK_D, BLOCK_DV, HEAD_DIM, VALUE_DIM)
    q_base = b.to(tl.int64) * sqb + h * sqh
    q = tl.load(Q + q_base + q_tok[:, None] * sqt + offs_d[None, :], mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    do_base = b.to(tl.int64) * sdb + h * sdh
    do = tl.load(DO + do_base + q_tok[:, None] * sdt + offs_dv[None, :], mask=q_ok[:, None] & dv_ok[None, :],
                 other=0.0)
    l_off = b.to(tl.int64) * slb + q_tok * slt + h
    lse2 = tl.load(LSE + l_off, mask=q_ok, other=0.0).to(tl.float32) * LOG2E_C
    o = tl.load(O + b.to(tl.int64) * sob + h * soh + q_tok[:, None] * sot + offs_dv[None, :],
                mask=q_ok[:, None] & dv_ok[None, :], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + l_off, mask=q_ok, other=0.0).to(tl.float32)
    tl.store(DELTA + l_off, delta, mask=q_ok)
    k_base = b.to(tl.int64) * skb + hk * skh
    v_base = b.to(tl.int64) * svb + hk * svh
    c0, c1, c2 = _tile_coords(U0, U1, U2)
    k_src, v_src, lead, k_col, v_col = _kv_sources(Kp + k_base, V + v_base, K_DESC, V_DESC, b, hk, g0, g1, g2, D0, D1,
                                                   D2, L1, L2, Lg0, Lg1, Lg2, skt, svt, skh, svh, HEAD_DIM, VALUE_DIM,
                                                   U0, U1, U2, BLOCK_D, BLOCK_DV, TMA, HOST_DESC)
    dq = tl.zeros([T0 * T1 * T2, BLOCK_D], tl.float32)
    if BIAS_TILES:
        bias_ptr = _program_tiles(BIAS, h, BOXES, T0 * T1 * T2 * U0 * U1 * U2)
        bias_offs = _box_offsets(T0 * T1 * T2, U0 * U1 * U2)
        if DS_BOXES:  # the dS tiles have the bias tiles' layout
            ds_ptr = _program_tiles(DSW, h, BOXES, T0 * T1 * T2 * U0 * U1 * U2)

    n0 = tl.cdiv(hi0 - lo0, U0)
    n1 = tl.cdiv(hi1 - lo1, U1)
    n2 = tl.cdiv(hi2 - lo2, U2)
    i0 = 0
    i1 = 0
    i2 = 0
    for t in range(0, n0 * n1 * n2):
        k0 = lo0 + i0 * U0
        k1 = lo1 + i1 * U1
        k2 = lo2 + i2 * U2
        i0, i1, i2 = _next_tile(i0, i1, i2, n1, n2, ACT0, ACT1)
        kj0 = k0 + c0
        kj1 = k1 + c1
        kj2 = k2 + c2
        k, v = _kv_tile(k_src, v_src, lead, k_col, v_col, k0, k1, k2, kj0, kj1, kj2, Lg0, Lg1, Lg2, g0, g1, g2, D0, D1,
                        D2, L1, L2, skt, svt, offs_d, offs_dv, d_ok, dv_ok, U0, U1, U2, BLOCK_D, BLOCK_DV, IDX64, TMA)
        if BIAS_TILES:
            bias = tl.load(bias_ptr + t * (T0 * T1 * T2 * U0 * U1 * U2) + bias_offs).to(tl.float32)
            p = tl.math.exp2(tl.dot(q, tl.trans(k), bias, input_precision=PREC) * qk_scale - lse2[:, None])
        else:
            p = _recomputed_probs(q, k, lse2, qk_scale, RPB, h, qc0, qc1, qc2, kj0, kj1, kj2, K0, K1, K2, k0, k1, k2,
                                  in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, start0, stop0, start1, stop1, start2,
                                  stop2, U0, U1, U2, ACT0, ACT1, HAS_RPB, MASK_IN_DOT, PREC)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        if DS_BOXES:  # zero outside the windows already (p = 0); rows past the group are dropped here
            tl.atomic_add(ds_ptr + t * (T0 * T1 * T2 * U0 * U1 * U2) + bias_offs, tl.where(q_ok[:, None], ds, 0.0),
                          sem="relaxed")
        if STORE_DS:
            _store_window_ds(DSW + b.to(tl.int64) * swb + h * swh, ds, q_ok, q_tok, swt, kj0, kj1, kj2,
                             start0, stop0, start1, stop1, start2, stop2, K1, K2, DS_ATOMIC)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)

    dq = dq * scale
    g_base = b.to(tl.int64) * sgb + h * sgh
    if _holds_nonfinite(dq):  # a NaN / inf reached the tile: its rows again, kept inside their windows (rare)
        tl.debug_barrier()  # the rows' delta, stored above by other threads of this program, read back from memory
        _dq_by_offset(Q, Kp, V, RPB, DO, LSE, DELTA, DQ, q_base, k_base, v_base, do_base, b.to(tl.int64) * slb, g_base,
                      sqt, skt, svt, sdt, slt, sgt, h, tile0, tile1, tile2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1,
                      K2, S0, S1, S2, D0, D1, D2, HEAD_DIM, VALUE_DIM, qk_scale, scale, CAUSAL0, CAUSAL1, CAUSAL2, T0,
                      T1, T2, GATHER_ROWS, BLOCK_D, BLOCK_DV, HAS_RPB, IDX64)
    else:
        tl.store(DQ + g_base + q_tok[:, None] * sgt + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=q_ok[:, None] & d_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Backward: dK, dV (each KV tile loops over the query tiles whose windows reach it)
# ---------------------------------------------------------------------------------------------
@triton.jit
def na_bwd_dkdv_kernel(
    Q, Kp, V, RPB, DO, LSE, DELTA, DK, DV, K_DESC, V_DESC, Q_DESC, DO_DESC, BIAS,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdb, sdt, sdh, slb, slt,
    skgb, skgt, skgh, svgb, svgt, svgh,
    HKV, GROUP, HEAD_DIM, VALUE_DIM, qk_scale, scale,
    L0, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2, NU0, NU1, NU2, BOXES,
    CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr, CAUSAL2: tl.constexpr,
    ACT0: tl.constexpr, ACT1: tl.constexpr,
    T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
    U0: tl.constexpr, U1: tl.constexpr, U2: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_RPB: tl.constexpr, IDX64: tl.constexpr,
    BISECT: tl.constexpr, TMA: tl.constexpr, QUERY_ROWS: tl.constexpr, HOST_DESC: tl.constexpr,
    MASK_IN_DOT: tl.constexpr, PREC: tl.constexpr, GATHER_ROWS: tl.constexpr, BIAS_TILES: tl.constexpr,
):
    # The program tile is a KV tile (U0, U1, U2); the inner loop runs over query tiles (T0, T1, T2).
    # BIAS_TILES: the boxes' RPB and window mask come from BIAS (``na_bias_tiles_inverse_kernel``), else it is unused.
    # dK/dV have their own strides (k/v may be strided views).  GQA: the query heads of this kv head are
    # summed in the same loop.  ``HOST_DESC``: K/V (box U) and Q/dO (box T) descriptors built on the host over
    # ``[B, L0, L1, L2, heads * D]``, as the forward's (else the four are unused).
    g0, tile0, g1, tile1, g2, tile2, b, hk, Lg0, Lg1, Lg2 = _program_group(NU0, NU1, NU2, D0, D1, D2, L0, L1, L2,
                                                                          HKV, ACT0, ACT1)
    c0, c1, c2 = _tile_coords(U0, U1, U2)
    k0 = tile0 * U0
    k1 = tile1 * U1
    k2 = tile2 * U2
    kj0 = k0 + c0
    kj1 = k1 + c1
    kj2 = k2 + c2
    k_ok = (kj0 < Lg0) & (kj1 < Lg1) & (kj2 < Lg2)
    k_tok = _flat_token(kj0, kj1, kj2, g0, g1, g2, D0, D1, D2, L1, L2, IDX64)

    offs_d, offs_dv, d_ok, dv_ok = _head_dims(BLOCK_D, BLOCK_DV, HEAD_DIM, VALUE_DIM)
    k_base = b.to(tl.int64) * skb + hk * skh
    v_base = b.to(tl.int64) * svb + hk * svh
    if QUERY_ROWS:  # k/v are B operands: TMA copies them into the shared memory the matmuls read them from
        k_src, v_src, lead, k_col, v_col = _kv_sources(Kp + k_base, V + v_base, K_DESC, V_DESC, b, hk, g0, g1, g2, D0,
                                                       D1, D2, L1, L2, Lg0, Lg1, Lg2, skt, svt, skh, svh, HEAD_DIM,
                                                       VALUE_DIM, U0, U1, U2, BLOCK_D, BLOCK_DV, TMA, HOST_DESC)
        k, v = _kv_tile(k_src, v_src, lead, k_col, v_col, k0, k1, k2, kj0, kj1, kj2, Lg0, Lg1, Lg2, g0, g1, g2, D0, D1,
                        D2, L1, L2, skt, svt, offs_d, offs_dv, d_ok, dv_ok, U0, U1, U2, BLOCK_D, BLOCK_DV, IDX64, TMA)
    else:  # k/v are A operands: an N-D TMA box would pass through registers ("TMA and host descriptors", docs/fused.md)
        k, v = _kv_tile(Kp + k_base, V + v_base, 0, 0, 0, k0, k1, k2, kj0, kj1, kj2, Lg0, Lg1, Lg2, g0, g1, g2, D0, D1,
                        D2, L1, L2, skt, svt, offs_d, offs_dv, d_ok, dv_ok, U0, U1, U2, BLOCK_D, BLOCK_DV, IDX64, False)

    # Inverse neighborhood: queries whose windows reach any key of this tile, per axis.
    n0, n1, n2, ql0, ql1, ql2 = _reaching_tiles(k0, k1, k2, Lg0, Lg1, Lg2, K0, K1, K2, S0, S1, S2, CAUSAL0, CAUSAL1,
                                                CAUSAL2, T0, T1, T2, U0, U1, U2, BISECT)
    n_tiles = n0 * n1 * n2
    if BIAS_TILES:  # this program's tiles of query head h start at bias_ptr + (h - hk * GROUP) * stride
        bias_ptr = _program_tiles(BIAS, hk * GROUP, BOXES, T0 * T1 * T2 * U0 * U1 * U2)
        bias_head = tl.num_programs(0).to(tl.int64) * (BOXES * T0 * T1 * T2 * U0 * U1 * U2)
        if QUERY_ROWS:
            bias_offs = _box_offsets(T0 * T1 * T2, U0 * U1 * U2)
        else:
            bias_offs = _box_offsets(U0 * U1 * U2, T0 * T1 * T2)

    r0, r1, r2 = _tile_coords(T0, T1, T2)
    if TMA and not HOST_DESC:  # the GROUP query heads of this kv head are the leading axis of the Q / dO descriptors
        q_desc = _group_descriptor(Q + b.to(tl.int64) * sqb + hk * GROUP * sqh, g0, g1, g2, D0, D1, D2, L1, L2,
                                   Lg0, Lg1, Lg2, sqt, HEAD_DIM, GROUP, sqh, T0, T1, T2, BLOCK_D)
        do_desc = _group_descriptor(DO + b.to(tl.int64) * sdb + hk * GROUP * sdh, g0, g1, g2, D0, D1, D2, L1, L2,
                                    Lg0, Lg1, Lg2, sdt, VALUE_DIM, GROUP, sdh, T0, T1, T2, BLOCK_DV)
    dk = tl.zeros([U0 * U1 * U2, BLOCK_D], tl.float32)
    dv = tl.zeros([U0 * U1 * U2, BLOCK_DV], tl.float32)
    i0 = 0
    i1 = 0
    i2 = 0
    h_next = hk * GROUP
    for t in range(0, GROUP * n_tiles):
        h = h_next
        q0 = ql0 + i0 * T0
        q1 = ql1 + i1 * T1
        q2 = ql2 + i2 * T2
        i0, i1, i2 = _next_tile(i0, i1, i2, n1, n2, ACT0, ACT1)
        # the GQA heads of this kv head, one after the other: i0 wraps past n0 (i1 and i2 have already
        # wrapped; in 1-D / 2-D the highest real axis plays i0's part)
        if ACT0:
            wrap = i0 == n0
            i0 = tl.where(wrap, 0, i0)
        elif ACT1:
            wrap = i1 == n1
            i1 = tl.where(wrap, 0, i1)
        else:
            wrap = i2 == n2
            i2 = tl.where(wrap, 0, i2)
        h_next = tl.where(wrap, h_next + 1, h_next)
        q_ok, q_tok, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2 = _query_rows(
            q0, q1, q2, r0, r1, r2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2,
            CAUSAL0, CAUSAL1, CAUSAL2, IDX64)
        if HOST_DESC:
            q = Q_DESC.load([b, q0, q1, q2, h * BLOCK_D]).reshape([T0 * T1 * T2, BLOCK_D])
            do = DO_DESC.load([b, q0, q1, q2, h * BLOCK_DV]).reshape([T0 * T1 * T2, BLOCK_DV])
        elif TMA:
            q = q_desc.load([h - hk * GROUP, q0, q1, q2, 0]).reshape([T0 * T1 * T2, BLOCK_D])
            do = do_desc.load([h - hk * GROUP, q0, q1, q2, 0]).reshape([T0 * T1 * T2, BLOCK_DV])
        else:
            q = tl.load(Q + b.to(tl.int64) * sqb + h * sqh + q_tok[:, None] * sqt + offs_d[None, :],
                        mask=q_ok[:, None] & d_ok[None, :], other=0.0)
            do = tl.load(DO + b.to(tl.int64) * sdb + h * sdh + q_tok[:, None] * sdt + offs_dv[None, :],
                         mask=q_ok[:, None] & dv_ok[None, :], other=0.0)
        l_off = b.to(tl.int64) * slb + q_tok * slt + h
        # Rows past the group end get lse = +inf: probability 0, so they add nothing to dK/dV.
        lse2 = tl.load(LSE + l_off, mask=q_ok, other=float("inf")).to(tl.float32) * LOG2E_C
        delta = tl.load(DELTA + l_off, mask=q_ok, other=0.0).to(tl.float32)

        _, _, in_lo0, in_hi0 = _axis_span(q0, T0, Lg0, K0, S0, CAUSAL0)
        _, _, in_lo1, in_hi1 = _axis_span(q1, T1, Lg1, K1, S1, CAUSAL1)
        _, _, in_lo2, in_hi2 = _axis_span(q2, T2, Lg2, K2, S2, CAUSAL2)
        if BIAS_TILES:
            bias = tl.load(bias_ptr + (h - hk * GROUP) * bias_head + (t - (h - hk * GROUP) * n_tiles) * (
                T0 * T1 * T2 * U0 * U1 * U2) + bias_offs).to(tl.float32)
        if QUERY_ROWS:
            # [queries, keys]: k and v are the B operands of the two score matmuls, so they stay in shared
            # memory for the whole loop; p and ds go to the dV / dK matmuls transposed.
            if BIAS_TILES:
                p = tl.math.exp2(tl.dot(q, tl.trans(k), bias, input_precision=PREC) * qk_scale - lse2[:, None])
            else:
                p = _recomputed_probs(q, k, lse2, qk_scale, RPB, h, qc0, qc1, qc2, kj0, kj1, kj2, K0, K1, K2, k0, k1,
                                      k2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2, start0, stop0, start1, stop1,
                                      start2, stop2, U0, U1, U2, ACT0, ACT1, HAS_RPB, MASK_IN_DOT, PREC)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
        else:
            # [keys, queries]: k and v are A operands (read from shared memory), p and ds stay in registers as
            # the A operands of the dV / dK matmuls; a query tile of fewer than 64 rows still fills wgmma's
            # 64-row minimum here, because the keys are the rows.
            if BIAS_TILES:
                st = tl.dot(k, tl.trans(q), bias, input_precision=PREC) * qk_scale
            else:
                st = _scores(k, q, start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, ACT0, ACT1, True,
                             MASK_IN_DOT, PREC) * qk_scale
                if HAS_RPB:
                    ridx = _rpb_index(qc0, qc1, qc2, kj0, kj1, kj2, K0, K1, K2)
                    bias = tl.load(RPB + h * ((2 * K0 - 1) * (2 * K1 - 1) * (2 * K2 - 1)) + ridx)
                    st += tl.trans(bias) * LOG2E_C
            pt = tl.math.exp2(st - lse2[None, :])
            if not MASK_IN_DOT:
                pt = _mask_outside(pt, 0.0, k0, k1, k2, in_lo0, in_hi0, in_lo1, in_hi1, in_lo2, in_hi2,
                                   start0, stop0, start1, stop1, start2, stop2, kj0, kj1, kj2, U0, U1, U2, ACT0, ACT1,
                                   True)
            dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC)
            dpt = tl.dot(v, tl.trans(do), input_precision=PREC)
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(q.dtype), q, input_precision=PREC)

    dk = dk * scale
    kg_base = b.to(tl.int64) * skgb + hk * skgh
    vg_base = b.to(tl.int64) * svgb + hk * svgh
    if _holds_nonfinite(dk) | _holds_nonfinite(dv):  # a NaN / inf reached the tile: again, inside the windows (rare)
        _dkdv_by_offset(Q, Kp, V, RPB, DO, LSE, DELTA, DK, DV, b, hk, GROUP, sqb, sqt, sqh, skt, sdb, sdt, sdh, svt,
                        slb, slt, skgt, svgt, k_base, v_base, kg_base, vg_base, k0, k1, k2, g0, g1, g2, Lg0, Lg1, Lg2,
                        L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2, HEAD_DIM, VALUE_DIM, qk_scale, scale, CAUSAL0,
                        CAUSAL1, CAUSAL2, U0, U1, U2, GATHER_ROWS, BLOCK_D, BLOCK_DV, HAS_RPB, IDX64)
    else:
        tl.store(DK + kg_base + k_tok[:, None] * skgt + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=k_ok[:, None] & d_ok[None, :])
        tl.store(DV + vg_base + k_tok[:, None] * svgt + offs_dv[None, :], dv.to(DV.dtype.element_ty),
                 mask=k_ok[:, None] & dv_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Backward: dRPB (one pass over relative offsets; per-program partial sums or atomics)
# ---------------------------------------------------------------------------------------------
@triton.jit
def na_bwd_drpb_kernel(
    Q, Kp, V, RPB, DO, LSE, DELTA, DRPB,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdb, sdt, sdh, slb, slt,
    HQ, GROUP, HEAD_DIM, VALUE_DIM, qk_scale,
    L0, L1, L2, K0, K1, K2, S0, S1, S2, D0, D1, D2, NT0, NT1, NT2,
    CAUSAL0: tl.constexpr, CAUSAL1: tl.constexpr, CAUSAL2: tl.constexpr,
    T0: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ATOMIC: tl.constexpr, IDX64: tl.constexpr,
):
    """dRPB[h, r] = sum over (b, query i) of dS(i, i + r) for every offset r in i's window.

    For a fixed offset each query meets at most one key, so the pass walks the offsets the tile's
    windows span and gathers one key row per query (row-wise dot products, no matrix unit).  With
    ``ATOMIC`` the per-program sums are added into ``DRPB[h]``; otherwise each program writes its
    own row ``DRPB[(b * HQ + h) * programs + pid]`` and the host sums them (deterministic).
    """
    pid = tl.program_id(0)
    g0, tile0, g1, tile1, g2, tile2, b, h, Lg0, Lg1, Lg2 = _program_group(NT0, NT1, NT2, D0, D1, D2, L0, L1, L2, HQ,
                                                                         True, True)
    bh = tl.program_id(1)
    hk = h // GROUP
    r0, r1, r2 = _tile_coords(T0, T1, T2)
    q_ok, q_tok, qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2 = _query_rows(
        tile0 * T0, tile1 * T1, tile2 * T2, r0, r1, r2, g0, g1, g2, Lg0, Lg1, Lg2, L1, L2, K0, K1, K2, S0, S1, S2,
        D0, D1, D2, CAUSAL0, CAUSAL1, CAUSAL2, IDX64)
    offs_d, offs_dv, d_ok, dv_ok = _head_dims(BLOCK_D, BLOCK_DV, HEAD_DIM, VALUE_DIM)
    q = tl.load(Q + b.to(tl.int64) * sqb + h * sqh + q_tok[:, None] * sqt + offs_d[None, :],
                mask=q_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    do = tl.load(DO + b.to(tl.int64) * sdb + h * sdh + q_tok[:, None] * sdt + offs_dv[None, :],
                 mask=q_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
    l_off = b.to(tl.int64) * slb + q_tok * slt + h
    lse2 = tl.load(LSE + l_off, mask=q_ok, other=0.0).to(tl.float32) * LOG2E_C
    delta = tl.load(DELTA + l_off, mask=q_ok, other=0.0).to(tl.float32)
    k_base = b.to(tl.int64) * skb + hk * skh
    v_base = b.to(tl.int64) * svb + hk * svh

    # Offsets (key - query, group coordinates) spanned by the tile's windows, per axis.
    o_lo0, n0 = _offset_range(q_ok, qc0, start0, stop0)
    o_lo1, n1 = _offset_range(q_ok, qc1, start1, stop1)
    o_lo2, n2 = _offset_range(q_ok, qc2, start2, stop2)
    n_rel = (2 * K0 - 1) * (2 * K1 - 1) * (2 * K2 - 1)
    if ATOMIC:
        out_base = h.to(tl.int64) * n_rel
    else:
        out_base = (bh.to(tl.int64) * tl.num_programs(0) + pid) * n_rel
    for t in range(0, n0 * n1 * n2):
        adm, k, v, s = _gathered_pair(Kp, V, RPB, k_base, v_base, skt, svt, h, q, q_ok, t, o_lo0, o_lo1, o_lo2, n1, n2,
                                      qc0, qc1, qc2, start0, stop0, start1, stop1, start2, stop2, g0, g1, g2, L1, L2,
                                      K0, K1, K2, D0, D1, D2, offs_d, offs_dv, d_ok, dv_ok, qk_scale, True, IDX64)
        p = tl.math.exp2(s - lse2)
        ds = tl.sum(tl.where(adm, p * (tl.sum(do * v, 1) - delta), 0.0), 0)
        o0, o1, o2 = _offset(t, o_lo0, o_lo1, o_lo2, n1, n2)
        rel = _relative_slot(o0, o1, o2, K0, K1, K2)
        if ATOMIC:
            tl.atomic_add(DRPB + out_base + rel, ds)
        else:
            tl.store(DRPB + out_base + rel, ds)


# ---------------------------------------------------------------------------------------------
# dRPB from dQ's window-layout dS (``rpb_grad``): one program per (relative offset, head)
# ---------------------------------------------------------------------------------------------
@triton.jit
def na_drpb_window_kernel(DS, SLOTS, DRPB, N, H, S, L1, L2, W0, W1, W2, K1, K2, SLOTS1, SLOTS2,
                          BLOCK_N: tl.constexpr):
    """``DRPB[h, r] = sum_n DS[n, h, slot(n, r)]`` (``DS``: ``[N, H, S]`` with ``S = K0 * K1 * K2`` slots per token,
    ``DRPB``: ``[H, W0 * W1 * W2]``, float32) over the tokens whose window holds the key at relative offset ``r``.
    Per axis, ``SLOTS`` maps (position, offset index) to the window slot holding that offset, or -1: ``[L_a, W_a]``
    int32 tables at element offsets 0, ``SLOTS1``, ``SLOTS2``; a token's slot is the row-major combination of its
    axes' slots.  Each (token, slot) has exactly one offset, so the buffer is read once, in a fixed order."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    r2 = r % W2
    r1 = (r // W2) % W1
    r0 = r // (W2 * W1)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for first in range(0, N, BLOCK_N):
        n = first + tl.arange(0, BLOCK_N)
        ok = n < N
        p2 = n % L2
        p1 = (n // L2) % L1
        p0 = n // (L2 * L1)
        s0 = tl.load(SLOTS + p0 * W0 + r0, mask=ok, other=-1)
        s1 = tl.load(SLOTS + SLOTS1 + p1 * W1 + r1, mask=ok, other=-1)
        s2 = tl.load(SLOTS + SLOTS2 + p2 * W2 + r2, mask=ok, other=-1)
        held = ok & (s0 >= 0) & (s1 >= 0) & (s2 >= 0)
        slot = (s0 * K1 + s1) * K2 + s2
        acc += tl.load(DS + (n.to(tl.int64) * H + h) * S + slot, mask=held, other=0.0)
    tl.store(DRPB + h * (W0 * W1 * W2) + r, tl.sum(acc, 0))


@triton.jit
def na_drpb_tiles_kernel(DS, INDEX, DRPB, E, M, R, BLOCK: tl.constexpr):
    """``DRPB[h, r] = sum_m DS[h * E + INDEX[r, m]]`` over the valid (>= 0) entries of row ``r`` of ``INDEX``
    (``[R, M]``, ``rpb_grad.tile_gather_index``): dQ's tile-layout dS (``E`` elements per head) summed by relative
    offset.  One program per (offset, head)."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    acc = tl.zeros([BLOCK], tl.float32)
    for m in range(0, M, BLOCK):
        offs = m + tl.arange(0, BLOCK)
        idx = tl.load(INDEX + r.to(tl.int64) * M + offs, mask=offs < M, other=-1)
        acc += tl.load(DS + h.to(tl.int64) * E + idx, mask=idx >= 0, other=0.0)
    tl.store(DRPB + h * R + r, tl.sum(acc, 0))


def interpreted() -> bool:
    """True when the kernels were built for Triton's interpreter (``TRITON_INTERPRET=1`` when this module was
    imported: Triton decides at decoration time)."""
    return type(na_fwd_kernel).__name__ == "InterpretedFunction"
