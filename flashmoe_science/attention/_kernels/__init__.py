"""Triton and Gluon kernels of attention. Private: `forward.py` and `backward.py` one level up
hold the plans and launches (their docstrings say which kernel runs for which call on which
GPU); these files hold the algorithms.

- `forward.py`: the forward for every GPU and the interpreter (`attention_forward_kernel`):
  FlashAttention-2's online softmax in base 2 over the band of keys a query block sees, dense or
  packed variable-length (VARLEN), causal, windowed, softcapped; and the helpers the other
  forwards share (the band, the masks, `tanh`, `finish`).
- `forward_hopper.py`: the same algorithm with TMA-descriptor tiles (sm90, Triton).
- `forward_gluon.py`: the sm90 forward in Gluon, warp-specialised (a TMA producer warp, two or
  three consumer warpgroups, the softmax overlapping the P V product), persistent or one program
  per tile.
- `backward.py`: the backward for every GPU (`attention_backward_dq_kernel`, then
  `attention_backward_dkdv_kernel`; `attention_backward_preprocess_kernel` where lse has a
  gradient of its own), with pointer or TMA-descriptor tiles.
- `backward_gluon.py`: the sm90 backward in Gluon (dQ kernel, then dK/dV kernel) with
  asynchronous wgmma.
- `decode.py`: attention against a KV cache, contiguous or paged: split-KV partials with the
  query heads of a KV head packed into one tile, their combine, and the cache append.
- `lengths.py`: the device-side check of packed cumulative lengths (`varlen.poison_if_malformed`).
- `tiles.py`: masked tile loads shared by the Triton kernels.
- `value_tiles.py`: the FP8 forward's copy of V, keys-last in P's register order.
"""
