"""The device-side check of a packed batch's cumulative lengths, run after every variable-length
forward and backward launch.

The host reads each cu_seqlens tensor once and remembers it (`varlen._CheckedLengths`), which a
change made behind the version counter (through `.data` or a numpy view) or CUDA graph replay with
new values would get past. The kernels clamp the bounds they read into the tensors
(`forward.sequence_bounds`), so such values can never move a read or write outside them; this
kernel makes their results loud as well: every program re-checks both tensors (start at 0,
lengths >= 0 and at most max_seqlen, end at the token count) and, where they are malformed,
fills its share of the outputs with NaN. On well-formed lengths each program reads 2 (B + 1)
int32 values and returns.
"""
import triton
import triton.language as tl


@triton.jit
def _malformed(CU, batch, total, max_seqlen, BLOCK_B: tl.constexpr):
    bad = tl.load(CU) != 0
    for b0 in range(0, batch, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        inside = b < batch
        start = tl.load(CU + b, mask=inside, other=0)
        end = tl.load(CU + b + 1, mask=inside, other=0)
        length = end - start
        bad = bad | (tl.max(((length < 0) | (length > max_seqlen)) & inside, 0) != 0)
    return bad | (tl.load(CU + batch) != total)


@triton.jit
def _fill_nan(OUT, numel, first, step, BLOCK: tl.constexpr):
    for start in range(first * BLOCK, numel, step * BLOCK):
        offs = start + tl.arange(0, BLOCK).to(tl.int64)
        tl.store(OUT + offs, tl.full([BLOCK], float("nan"), OUT.dtype.element_ty), mask=offs < numel)


@triton.jit
def malformed_lengths_poison_kernel(CU_SEQLENS_Q, CU_SEQLENS_K, batch, total_q, total_k, max_seqlen_q, max_seqlen_k,
                                    OUT_A, numel_a, OUT_B, numel_b, OUT_C, numel_c,
                                    BLOCK_B: tl.constexpr, BLOCK: tl.constexpr):
    """OUT_A, OUT_B, OUT_C: the call's outputs as flat dense buffers of numel_* elements (0 for an
    unused one); the grid's programs split each between them, BLOCK elements at a time."""
    bad = _malformed(CU_SEQLENS_Q, batch, total_q, max_seqlen_q, BLOCK_B)
    bad = bad | _malformed(CU_SEQLENS_K, batch, total_k, max_seqlen_k, BLOCK_B)
    if bad:
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        _fill_nan(OUT_A, numel_a, pid, step, BLOCK)
        _fill_nan(OUT_B, numel_b, pid, step, BLOCK)
        _fill_nan(OUT_C, numel_c, pid, step, BLOCK)
