"""The combine: out[t] = sum over j of y[t * top_k + j], in fp32, in the fixed order j = 0..k-1
(and, where the down GEMM splits K, over its splits' partial rows after each j).
(`gather_sum_kernel` sums rows named by an index instead: expert parallelism's rows that come
back from the experts' ranks.)

The down GEMM leaves each token's k weighted expert outputs in adjacent rows of y, so this
pass reads y once, contiguously, and the result does not depend on which program finished
first (no atomics). Pairs whose id lies outside [0, E) were never computed and are skipped.
"""
import triton
import triton.language as tl

from ...dependent_launch import chain_start
from .offsets import wide_offset


@triton.jit(do_not_specialize=["top_k"])
def combine_kernel(y_ptr, ids_ptr, out_ptr, T, E, H, top_k, SPLITS: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """y: (SPLITS, T * top_k, H) contiguous, each pair's row in SPLITS parts (a down GEMM whose K
    is split) added in the order s = 0, 1, ... after j; ids: (T * top_k,) int32 or int64; out:
    (T, H) contiguous. PDL: launched as a programmatic dependent (`dependent_launch`)."""
    chain_start(PDL)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = tokens < T
    ok = t_ok[:, None] & (cols < H)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in range(top_k):
        pairs = tokens * top_k + j
        e = tl.load(ids_ptr + pairs, mask=t_ok, other=-1)
        routed = (e >= 0) & (e < E)
        for s in tl.static_range(SPLITS):
            rows = pairs + s * T * top_k if s > 0 else pairs
            acc += tl.load(y_ptr + wide_offset(rows, H)[:, None] + cols[None, :],
                           mask=ok & routed[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + wide_offset(tokens, H)[:, None] + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=ok)


@triton.jit(do_not_specialize=["T", "N", "stride_rows", "stride_index_t", "stride_index_j", "num_sources"])
def gather_sum_kernel(rows_ptr, index_ptr, out_ptr, T, N, H, stride_rows, stride_index_t, stride_index_j, num_sources,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum over j < num_sources of rows[index[t, j]], in fp32, in the fixed order
    j = 0, 1, ...; an index outside [0, N) adds nothing. rows: (N, H), unit stride along H;
    index: (T, num_sources) int64, any strides; out: (T, H) contiguous."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = tokens < T
    ok = t_ok[:, None] & (cols < H)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    index_ptrs = index_ptr + wide_offset(tokens, stride_index_t)
    for _ in range(num_sources):
        row = tl.load(index_ptrs, mask=t_ok, other=-1)
        index_ptrs += stride_index_j
        present = (row >= 0) & (row < N)
        acc += tl.load(rows_ptr + wide_offset(row, stride_rows)[:, None] + cols[None, :],
                       mask=ok & present[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + wide_offset(tokens, H)[:, None] + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)
