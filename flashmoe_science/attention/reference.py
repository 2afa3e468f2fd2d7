"""Plain PyTorch attention with the library's exact semantics, for tests and readers.

`attention_reference` is the definition the kernels are checked against: run it on float64
copies of the inputs for a reference, or in the input dtype to measure PyTorch's own rounding.
`varlen_attention_reference` is the same for packed variable-length batches: it runs each
sequence on its own, so it shares no indexing with the kernels.
"""
from __future__ import annotations

import math

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Bottom-right aligned causal mask (True = visible): query i sees keys j <= i + Sk - Sq."""
    return band_mask(seqlen_q, seqlen_k, causal=True, device=device)


def band_mask(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(-1, -1), device=None) -> torch.Tensor:
    """(Sq, Sk) bool mask, True where query i sees key j. With c = i + Sk - Sq (bottom-right
    alignment), query i sees keys c - left <= j <= c + right for window_size = (left, right);
    -1 leaves that side unbounded, and causal sets right = 0."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    c = i + (seqlen_k - seqlen_q)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= j <= c + right
    if left >= 0:
        visible &= j >= c - left
    return visible


def attention_reference(q, k, v, causal=False, softmax_scale=None, upcast=True, *, window_size=(-1, -1), softcap=0.0):
    """Returns (out, lse): q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, D_v), out (B, Hq, Sq, D_v),
    lse (B, Hq, Sq) natural log.

    Scores are softmax_scale * q.k, then softcap * tanh(scores / softcap) when softcap > 0, then
    masked to `band_mask(causal, window_size)`. Rows that see no key give out = 0 and
    lse = -inf. With `upcast`, the math runs in float64.
    """
    out_dtype = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if causal or window_size != (-1, -1):
        mask = band_mask(q.shape[2], k.shape[2], causal, window_size, q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores.float() if not upcast else scores, dim=-1)
    weights = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None].to(scores.dtype))
    out = torch.matmul(weights.to(v.dtype), v)
    return out.to(out_dtype), lse.float()


def varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=False, softmax_scale=None, upcast=True,
                               *, window_size=(-1, -1), softcap=0.0):
    """Returns (out, lse) of a packed batch: q (total_q, Hq, D), k (total_k, Hkv, D) and v
    (total_k, Hkv, D_v), cu_seqlens_* (batch + 1,) cumulative lengths; out (total_q, Hq, D_v),
    lse (Hq, total_q).

    Sequence b is queries cu_seqlens_q[b]:cu_seqlens_q[b + 1] against keys
    cu_seqlens_k[b]:cu_seqlens_k[b + 1], through `attention_reference` on its own.
    """
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(starts_q) - 1):
        q_b = q[starts_q[b]:starts_q[b + 1]].transpose(0, 1)[None]
        k_b = k[starts_k[b]:starts_k[b + 1]].transpose(0, 1)[None]
        v_b = v[starts_k[b]:starts_k[b + 1]].transpose(0, 1)[None]
        out, lse = attention_reference(q_b, k_b, v_b, causal, softmax_scale, upcast, window_size=window_size,
                                       softcap=softcap)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    if not outs:
        return q.new_empty((*q.shape[:-1], v.shape[-1])), torch.empty(q.shape[1], 0, dtype=torch.float32,
                                                                     device=q.device)
    return torch.cat(outs), torch.cat(lses, dim=1)
