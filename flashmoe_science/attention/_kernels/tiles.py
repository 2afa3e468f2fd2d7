"""Tile loads shared by the attention kernels."""
import triton
import triton.language as tl


@triton.jit
def load_tile(ptrs, rows, num_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    """Load a [len(rows), BLOCK_D] tile of rows of a (rows, head dim) matrix at `ptrs`.

    With MASKED, rows at or past `num_rows` read as zeros; columns past HEAD_DIM (the head dim
    padded to a power of two) always do. Without MASKED the caller guarantees every row exists,
    and a head dim that needs no padding loads with no mask at all.
    """
    if MASKED:
        mask = (rows < num_rows)[:, None]
        if BLOCK_D != HEAD_DIM:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        tile = tl.load(ptrs, mask=mask, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile
