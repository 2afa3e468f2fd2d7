"""Triton (and, for Hopper's prefill down, FP8 and backward GEMMs, Gluon) kernels of the fused MoE forward
and backward.
Private: the public modules one level up hold the contract (argument checks, allocation,
configuration, launch); these files hold the algorithm.

- `offsets.py`: 64-bit address arithmetic shared by every kernel.
- `dispatch.py`: top-k routing, its backward (d router logits), and the block-aligned,
  expert-sorted layout of token-expert pairs.
- `grouped_gemm.py`: the two expert GEMMs over that layout (gate/up with the gated activation,
  then down with the routing weight).
- `fp8.py`: the same two GEMMs with FP8 (e4m3) operands and fp32 scales, the per-row,
  128-column quantisation of the tokens (inference), and their copy into layout order.
- `fp8_gluon.py`: the FP8 GEMMs for Hopper prefill in Gluon (warp-specialised, persistent, each
  step's product scaled while the next one runs), reading that copy.
- `combine.py`: the deterministic sum of each token's k weighted expert outputs (and, in the
  backward, of each token's k input gradients); `gather_sum_kernel`, the same sum over rows an
  index names (expert parallelism's rows that come back from the experts' ranks).
- `backward.py`: the backward GEMMs over the same layout (activation gradient, input gradient,
  and the per-expert weight gradients), and the copy of x into layout order that dW1 reads
  where its configuration asks (`gather_rows_kernel`).
- `forward_gluon.py`: the down GEMM for Hopper prefill in Gluon (warp-specialised, persistent,
  both operands by TMA, two consumer warpgroups sharing each 128 x 256 tile).
- `backward_gluon.py`: d [gate, up] and the weight gradients for Hopper prefill in Gluon
  (warp-specialised, persistent, token rows gathered by copy warps, two consumer warpgroups
  sharing each 128 x 256 tile; d [gate, up]'s epilogue operands loaded ahead of their use, every
  output stored by TMA under the next products).
"""
