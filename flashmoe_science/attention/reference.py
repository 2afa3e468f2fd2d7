"""Plain PyTorch attention with the library's exact semantics, for tests and readers.

`attention_reference` is the definition the kernels are checked against: run it on float64
copies of the inputs for a reference, or in the input dtype to measure PyTorch's own rounding.
"""
from __future__ import annotations

import math

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Bottom-right aligned causal mask (True = visible): query i sees keys j <= i + Sk - Sq."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def attention_reference(q, k, v, causal=False, softmax_scale=None, upcast=True):
    """Returns (out, lse): q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D), lse (B, Hq, Sq) natural log.

    Rows that see no key give out = 0 and lse = -inf. With `upcast`, the math runs in float64.
    """
    out_dtype = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = torch.logsumexp(scores.float() if not upcast else scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None].to(scores.dtype))
    out = torch.matmul(weights.to(v.dtype), v)
    return out.to(out_dtype), lse.float()
