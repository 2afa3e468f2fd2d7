"""The FP8 forward's copy of V (`fp8.fp8_value_tiles`): keys-last, in the order P's registers
hold them, so that the sm90 kernel's FP8 P V product reads both operands K-major and converts
P inside each thread (`forward_gluon._p_operand`)."""
import triton
import triton.language as tl

# Keys of V whose order the copy changes together (`fp8.VALUE_KEY_GROUP`).
KEY_GROUP = tl.constexpr(16)


@triton.jit
def fp8_value_tiles_kernel(V, OUT, stride_vb, stride_vh, stride_vs, stride_vd, heads, seqlen, padded,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """OUT (batch, heads, HEAD_DIM, padded), contiguous, from V (batch, heads, seqlen, HEAD_DIM),
    one byte an element, any strides: OUT[b, h, d, 16 g + 4 c + 2 r + e] = V[b, h, 16 g + 8 r +
    2 c + e, d], zero for keys past seqlen. One program per (batch, head) and BLOCK_S keys."""
    bh = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_S
    keys = first + tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    source = (V + (bh // heads).to(tl.int64) * stride_vb + (bh % heads).to(tl.int64) * stride_vh
              + keys.to(tl.int64)[:, None] * stride_vs + dims[None, :] * stride_vd)
    tile = tl.load(source, mask=(keys[:, None] < seqlen) & (dims[None, :] < HEAD_DIM), other=0)
    # key 16 g + 8 r + 2 c + e as (g, r, c, e), to position 16 g + 4 c + 2 r + e as (g, c, r, e)
    tile = tl.reshape(tile, [BLOCK_S // KEY_GROUP, 2, 4, 2, BLOCK_D])
    tile = tl.reshape(tl.permute(tile, (4, 0, 2, 1, 3)), [BLOCK_D, BLOCK_S])
    target = OUT + bh.to(tl.int64) * HEAD_DIM * padded + dims.to(tl.int64)[:, None] * padded + keys[None, :]
    tl.store(target, tile, mask=(dims[:, None] < HEAD_DIM) & (keys[None, :] < padded))
