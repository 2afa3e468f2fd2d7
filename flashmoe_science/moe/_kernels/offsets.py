"""64-bit address arithmetic.

Triton computes `index * stride` in 32 bits when both are 32-bit values, and silently wraps.
In an MoE layer several such products pass 2**31 elements long before any single tensor
dimension does: expert e's weights start at e * (2*I*H) (Mixtral's w1 at e = 7 sits at
822M elements; 256 DeepSeek-sized experts pass 2**31), and row t of the activations at t * H
(one million tokens at H = 4096). Every kernel forms such offsets through `wide_offset`.
"""
import triton
import triton.language as tl


@triton.jit
def wide_offset(index, stride):
    """index * stride computed in int64 (index: a scalar or tensor of int32 or int64)."""
    return index.to(tl.int64) * stride
