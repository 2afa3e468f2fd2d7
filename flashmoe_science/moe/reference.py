"""Plain PyTorch references of the MoE forward: the formula of the issue, step by step.

They run in whatever dtype they are given (tests upcast to float64 for the reference and keep
the input precision to measure PyTorch's own rounding error), and loop over experts the way
most model code does, so the benchmark also uses `fused_experts_torch` as its "naive" path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_route_torch(router_logits, top_k, *, renormalize=True, scoring="softmax"):
    """(topk_weights (T, k), topk_ids (T, k) int64): softmax or sigmoid of the logits in at least
    fp32 (float64 stays float64), the k largest, optionally divided by their sum."""
    logits = router_logits if router_logits.dtype == torch.float64 else router_logits.float()
    scores = torch.sigmoid(logits) if scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def gated_activation_torch(gate, up, activation="silu"):
    """silu(gate) * up (SwiGLU) or gelu_tanh(gate) * up (GeGLU)."""
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up


def fused_experts_torch(hidden_states, w1, w2, topk_weights, topk_ids, *, activation="silu"):
    """out[t] = sum_j w[t, j] * w2[e] @ (act(w1[e, :I] @ x_t) * (w1[e, I:] @ x_t)), e = ids[t, j],
    computed per expert in hidden_states' dtype (ids outside [0, E) contribute nothing)."""
    inter = w1.shape[1] // 2
    out = torch.zeros_like(hidden_states)
    weights = topk_weights.to(hidden_states.dtype)
    for e in range(w1.shape[0]):
        tokens, slots = torch.where(topk_ids == e)
        if tokens.numel() == 0:
            continue
        x = hidden_states[tokens]
        h = gated_activation_torch(x @ w1[e, :inter].T, x @ w1[e, inter:].T, activation)
        out.index_add_(0, tokens, (h @ w2[e].T) * weights[tokens, slots, None])
    return out


def fused_moe_torch(hidden_states, w1, w2, router_logits, top_k, *, renormalize=True, activation="silu",
                    scoring="softmax"):
    """Routing by `moe_route_torch`, then `fused_experts_torch`."""
    weights, ids = moe_route_torch(router_logits, top_k, renormalize=renormalize, scoring=scoring)
    return fused_experts_torch(hidden_states, w1, w2, weights, ids, activation=activation)


def fused_moe_grouped_mm(x, w1, w2, router_logits, top_k):
    """`fused_moe_torch` the way torchtitan and transformers' grouped_mm experts compute it: sort
    the token-expert pairs by expert, then torch._grouped_mm for both expert matmuls (SiLU)."""
    E, two_i, _ = w1.shape
    weights, ids = moe_route_torch(router_logits, top_k)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    ends = torch.searchsorted(flat[order], torch.arange(E, device=x.device), right=True).to(torch.int32)
    tokens = order // top_k
    h = torch._grouped_mm(x[tokens], w1.transpose(1, 2), offs=ends)
    a = gated_activation_torch(h[:, : two_i // 2], h[:, two_i // 2:])
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=ends) * weights.flatten()[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, y)
