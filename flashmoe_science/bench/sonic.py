"""SonicMoE (the `sonic-moe` package, CuTe DSL kernels on QuACK's grouped GEMMs) as a side of
`bench moe`: the same call as `fused_moe(x, w1, w2, router_logits, top_k)` on the same weights.

SonicMoE's own layer computes the router logits from its router weight; the benchmark hands every
implementation the same logits, so this enters SonicMoE after that product, at its top-k router
(softmax over all experts, the k largest, renormalised: `moe_route`'s formula), its routing
metadata and its up and down projections, as its `moe_TC_softmax_topk_layer` calls them. The
weights are ours, read in place through views: w1 (E, 2I, H) with gate rows before up rows is
SonicMoE's (2I, H, E) `concat_layout`, w2 (E, H, I) its (H, I, E); the gradients flow back to
them. SonicMoE compiles each kernel on first use (JIT): time it only after a warm call.

Nothing here is imported unless a benchmark asks for SonicMoE; `unavailable` says why it cannot
run on a machine (not installed, no Hopper or Blackwell GPU, a failed first call)."""
from __future__ import annotations

import importlib

import torch


# SonicMoE's GEMMs are QuACK's, each autotuned on its first call at a shape over every sm90
# candidate (tile, ping-pong or cooperative, cluster: 11-22 for its varlen GEMMs), each compiled
# first: more than ten minutes on a 16-core machine before the first layer has run. "subset"
# narrows the sm90 candidates to these (tile_m, tile_n, pingpong, cluster_m, cluster_n): QuACK's
# default configuration (128 x 192 ping-pong, cluster 2 x 1) and the largest tiles of each kind.
AUTOTUNE_SUBSET = ((128, 192, True, 2, 1), (128, 128, True, 2, 1), (256, 128, False, 2, 1), (128, 256, False, 1, 2))
AUTOTUNE_CHOICES = ("all", "subset")


def autotuning_description(choice: str) -> str:
    """What the results' meta records for `narrow_autotuning`'s choice."""
    if choice == "all":
        return "QuACK's sm90 candidates, all"
    return f"QuACK's sm90 candidates narrowed to (tile_m, tile_n, pingpong, cluster_m, cluster_n) in {AUTOTUNE_SUBSET}"


def narrow_autotuning(choice: str) -> str:
    """Restricts QuACK's sm90 GEMM autotuning to AUTOTUNE_SUBSET ("subset"; "all": as shipped);
    returns `autotuning_description(choice)`."""
    if choice not in AUTOTUNE_CHOICES:
        raise ValueError(f"SonicMoE autotuning must be one of {AUTOTUNE_CHOICES}, got {choice!r}")
    if choice == "all":
        return autotuning_description(choice)
    from quack import gemm_interface

    def kept(candidate):
        c = candidate.kwargs["config"]
        return c.device_capacity != 9 or (c.tile_m, c.tile_n, c.pingpong, c.cluster_m, c.cluster_n) in AUTOTUNE_SUBSET

    for tuner in vars(gemm_interface).values():
        if hasattr(tuner, "configs") and hasattr(tuner, "prune_configs"):
            tuner.configs = [c for c in tuner.configs if kept(c)] or tuner.configs
    return autotuning_description(choice)


def unavailable(device: torch.device, dtype: torch.dtype, autotune: str = "all") -> str | None:
    """None when SonicMoE runs here on a tiny layer (forward and backward), else why not;
    `autotune`: `narrow_autotuning`'s choice, applied first."""
    if device.type != "cuda":
        return "SonicMoE needs a CUDA GPU"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "SonicMoE needs sm90 or newer"
    try:
        importlib.import_module("sonicmoe")
    except Exception as exc:  # recorded in the results instead of failing the run
        return f"sonic-moe does not import: {type(exc).__name__}: {exc}"[:300]
    try:
        narrow_autotuning(autotune)
    except Exception as exc:
        return f"QuACK's autotuning could not be narrowed: {type(exc).__name__}: {exc}"[:300]
    try:
        generator = torch.Generator(device=device).manual_seed(0)
        E, H, I, T = 8, 256, 128, 64
        inputs = [torch.randn(T, H, device=device, dtype=dtype, generator=generator),
                  torch.randn(E, 2 * I, H, device=device, dtype=dtype, generator=generator) * H**-0.5,
                  torch.randn(E, H, I, device=device, dtype=dtype, generator=generator) * I**-0.5,
                  torch.randn(T, E, device=device, dtype=dtype, generator=generator)]
        for t in inputs:
            t.requires_grad_()
        out = fused_moe_sonic(*inputs, 2)
        torch.autograd.grad(out, inputs, torch.randn_like(out))
        torch.cuda.synchronize(device)
    except Exception as exc:  # recorded in the results instead of failing the run
        return f"SonicMoE failed on a tiny layer: {type(exc).__name__}: {exc}"[:300]
    return None


def versions() -> str:
    """The installed versions of SonicMoE and the QuACK kernels it runs, for the results' meta."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package):
        try:
            return version(package)
        except PackageNotFoundError:
            return "unknown"

    return f"sonic-moe {of('sonic-moe')}, quack-kernels {of('quack-kernels')}"


def fused_moe_sonic(x, w1, w2, router_logits, top_k):
    """out (T, H): SonicMoE's SwiGLU experts on softmax top-k routing of `router_logits`,
    renormalised, with w1 (E, 2I, H) [gate; up] and w2 (E, H, I) read in place."""
    from sonicmoe.enums import ActivationType
    from sonicmoe.functional import (TC_Softmax_Topk_Router_Function, TC_topk_router_metadata_triton,
                                     _DownProjection, _UpProjection)

    T, E = router_logits.shape
    scores, ids = TC_Softmax_Topk_Router_Function.apply(router_logits, E, top_k, False, True)
    TK, device = T * top_k, x.device
    s_scatter_idx = torch.empty(TK, dtype=torch.int32, device=device)
    s_reverse_scatter_idx = torch.empty(TK, dtype=torch.int32, device=device)
    expert_frequency = torch.empty(E, dtype=torch.int32, device=device)
    expert_frequency_offset = torch.empty(E + 1, dtype=torch.int32, device=device)
    x_gather_idx = torch.empty(TK, dtype=torch.int32, device=device)
    TC_topk_router_metadata_triton(ids, E, expert_frequency, expert_frequency_offset, x_gather_idx,
                                   s_scatter_idx, s_reverse_scatter_idx)
    inference = not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, w1, w2, router_logits)))
    a, h = _UpProjection.apply(x, w1.permute(1, 2, 0), None, expert_frequency_offset, TK, top_k, x_gather_idx,
                               s_scatter_idx, s_reverse_scatter_idx, None, False, ActivationType.SWIGLU,
                               inference, True)
    return _DownProjection.apply(a, h, w2.permute(1, 2, 0), None, scores, expert_frequency_offset, T, top_k,
                                 x_gather_idx, s_scatter_idx, s_reverse_scatter_idx, None, False,
                                 ActivationType.SWIGLU)
