"""`FlashMoELayer`: a mixture-of-experts feed-forward layer on the fused MoE kernels, with the
router's auxiliary losses, optional shared experts, and loading from Hugging Face blocks."""
from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..moe import configs, fused_experts, moe_route
from ..moe.reference import gated_activation_torch


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{name} must be {bounds}, got {value}")


def _check_coefficient(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and non-negative, got {value}")


class FlashMoELayer(nn.Module):
    """A sparse mixture-of-experts layer: router, top-k routing, gated experts, weighted sum.

    out = sum_j w_j * expert_{e_j}(x) (+ shared(x)), with (w, e) the top_k of
    softmax(router(x)) (renormalised over the k when `renormalize`) and
    expert_e(x) = w2[e] @ (act(w1[e, :I] @ x) * (w1[e, I:] @ x)), act = silu (SwiGLU) or gelu
    (GeGLU, tanh approximation). Routing, dispatch, the experts and the combine run in the
    fused kernels of `flashmoe_science.moe`, forward and backward; the router learns through
    the routing weights.

    Args:
        hidden_size: H, a multiple of 16.
        num_experts: E, 1 to 256.
        expert_dim: I, each expert's intermediate width, a multiple of 16.
        top_k: experts per token, 1 to min(E, 8).
        renormalize: divide the k chosen probabilities by their sum (Mixtral, Qwen3-MoE).
        activation: "silu", "gelu" or "swiglu_oai" (`fused_experts`).
        num_shared_experts: S >= 0. With S > 0 every token also goes through one dense gated
            MLP of width S * I (the same activation), added to the output. One MLP of width
            S * I computes exactly the sum of S experts of width I, so this is also "S shared
            experts" (DeepSeek-MoE's form: `shared_experts` of width S * I, ungated).
        router_aux_loss_coef: weight of the Switch-Transformer load-balancing loss.
        router_z_loss_coef: weight of the ST-MoE router z-loss.
        dtype, device: of the parameters.

    Parameters (the layout `fused_experts` reads):
        router.weight: (E, H), a bias-free Linear (the "gate" of Hugging Face blocks).
        w1: (E, 2I, H); rows [0, I) of w1[e] are expert e's gate projection, rows [I, 2I) its
            up projection (Mixtral's w1 and w3, or gate_proj and up_proj, stacked).
        w2: (E, H, I), the down projections (Mixtral's w2, or down_proj).
        shared_w1: (2 S I, H) and shared_w2: (H, S I) in the same layout, when S > 0.
    Initialised as E separate nn.Linear layers would be: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

    forward(x: (..., H)) -> (..., H), x's shape; x must have the parameters' dtype (under
    torch.autocast, tokens and expert weights are cast to the autocast dtype, as nn.Linear's
    inputs are, and so is the output). After each call:
        aux_loss: router_aux_loss_coef * E * sum_e f_e * P_e, with f_e the fraction of the
            T * k token-expert assignments that went to expert e and P_e the mean router
            probability of e (1 at perfect balance; Hugging Face's Mixtral loss is k times
            this). A differentiable fp32 scalar; a zero tensor when the coefficient is 0.
        z_loss: router_z_loss_coef * mean over tokens of logsumexp(router logits)^2, fp32 scalar.
        tokens_per_expert: (E,) int64, the token-expert assignments each expert received,
            counted on the device (no host synchronisation).
    Add them to the training loss: `loss = task_loss + layer.aux_loss + layer.z_loss`, or for a
    whole model `loss = task_loss + router_losses(model)`.
    """

    def __init__(self, hidden_size: int, num_experts: int, expert_dim: int, top_k: int = 2, *,
                 renormalize: bool = True, activation: str = "silu", num_shared_experts: int = 0,
                 router_aux_loss_coef: float = 0.0, router_z_loss_coef: float = 0.0, dtype=None, device=None):
        super().__init__()
        _check_int("hidden_size", hidden_size, 16)
        _check_int("num_experts", num_experts, 1, configs.MAX_EXPERTS)
        _check_int("expert_dim", expert_dim, 16)
        _check_int("top_k", top_k, 1, min(num_experts, configs.MAX_TOP_K))
        _check_int("num_shared_experts", num_shared_experts, 0)
        for name, size in (("hidden_size", hidden_size), ("expert_dim", expert_dim)):
            if size % 16:
                raise ValueError(f"{name} must be a multiple of 16, got {size}")
        if not isinstance(renormalize, bool):
            raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
        if activation not in configs.ACTIVATIONS:
            raise ValueError(f"activation must be one of {configs.ACTIVATIONS}, got {activation!r}")
        _check_coefficient("router_aux_loss_coef", router_aux_loss_coef)
        _check_coefficient("router_z_loss_coef", router_z_loss_coef)
        self.hidden_size, self.num_experts, self.expert_dim, self.top_k = hidden_size, num_experts, expert_dim, top_k
        self.renormalize, self.activation, self.num_shared_experts = renormalize, activation, num_shared_experts
        self.router_aux_loss_coef, self.router_z_loss_coef = float(router_aux_loss_coef), float(router_z_loss_coef)
        factory = dict(dtype=dtype, device=device)
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.w1 = nn.Parameter(torch.empty(num_experts, 2 * expert_dim, hidden_size, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, expert_dim, **factory))
        shared_dim = num_shared_experts * expert_dim
        self.shared_w1 = nn.Parameter(torch.empty(2 * shared_dim, hidden_size, **factory)) if shared_dim else None
        self.shared_w2 = nn.Parameter(torch.empty(hidden_size, shared_dim, **factory)) if shared_dim else None
        self.aux_loss = self.z_loss = self.tokens_per_expert = None
        # FP8 experts (to_fp8): the weights' scales, and their blocks (None: per output channel)
        self.register_buffer("w1_scale", None)
        self.register_buffer("w2_scale", None)
        self.fp8_block_shape, self.is_fp8 = None, False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.router.reset_parameters()
        for weight in (self.w1, self.w2, self.shared_w1, self.shared_w2):
            if weight is not None:
                bound = 1.0 / math.sqrt(weight.shape[-1])
                nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be (..., hidden_size = {self.hidden_size}), got shape {tuple(x.shape)}")
        tokens = x.reshape(-1, self.hidden_size)
        w1, w2 = self.w1, self.w2
        fp8 = {}
        if self.is_fp8:
            if torch.is_grad_enabled():
                raise RuntimeError("this FlashMoELayer holds FP8 expert weights (to_fp8), which run for inference "
                                   "only: call it under torch.no_grad() or torch.inference_mode()")
            fp8 = dict(w1_scale=self.w1_scale, w2_scale=self.w2_scale, block_shape=self.fp8_block_shape)
            if torch.is_autocast_enabled(x.device.type):
                tokens = tokens.to(torch.get_autocast_dtype(x.device.type))
        elif torch.is_autocast_enabled(x.device.type):
            compute_dtype = torch.get_autocast_dtype(x.device.type)
            tokens, w1, w2 = tokens.to(compute_dtype), w1.to(compute_dtype), w2.to(compute_dtype)
        elif x.dtype != w1.dtype:
            raise TypeError(f"x has dtype {x.dtype} but the layer's parameters are {w1.dtype}: convert one "
                            "(e.g. layer.to(x.dtype)) or run under torch.autocast")
        logits = self.router(tokens)
        weights, ids = moe_route(logits, self.top_k, renormalize=self.renormalize)
        out = fused_experts(tokens, w1, w2, weights, ids, activation=self.activation, **fp8)
        if self.shared_w1 is not None:
            gate, up = F.linear(tokens, self.shared_w1).chunk(2, dim=-1)
            out = out + F.linear(gated_activation_torch(gate, up, self.activation), self.shared_w2)
        self.tokens_per_expert, self.aux_loss, self.z_loss = router_statistics(
            logits, ids, self.num_experts, self.router_aux_loss_coef, self.router_z_loss_coef)
        return out.reshape(x.shape)

    def extra_repr(self) -> str:
        fp8 = f", fp8 block_shape={self.fp8_block_shape}" if self.is_fp8 else ""
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, expert_dim={self.expert_dim}, "
                f"top_k={self.top_k}, renormalize={self.renormalize}, activation={self.activation!r}, "
                f"num_shared_experts={self.num_shared_experts}{fp8}")

    @torch.no_grad()
    def to_fp8(self, block_shape=(128, 128)) -> "FlashMoELayer":
        """Quantises the expert weights to FP8 (e4m3) for inference, in place, and returns the
        layer: w1 and w2 become float8_e4m3fn buffers with float32 scales `w1_scale`, `w2_scale`
        per 128 x 128 block (block_shape=(128, 128), DeepSeek-V3's format) or per output channel
        (block_shape=None), as `quantize_fp8_blockwise` / `quantize_fp8_per_channel` make them;
        the router and shared experts keep their dtype. The layer then runs `fused_experts`' FP8
        path (compute capability 8.9 or newer; hidden_size and expert_dim multiples of 128),
        under torch.no_grad() or torch.inference_mode() only. An FP8 checkpoint in that layout
        loads with `load_state_dict` after this call."""
        from ..moe.fp8 import GROUP, quantize_fp8_blockwise, quantize_fp8_per_channel

        if self.is_fp8:
            raise RuntimeError("the layer's expert weights are FP8 already")
        if block_shape is not None and tuple(block_shape) != (GROUP, GROUP):
            raise ValueError(f"block_shape must be (128, 128) or None (per output channel), got {block_shape!r}")
        if self.hidden_size % GROUP or self.expert_dim % GROUP:
            raise ValueError(f"FP8 experts need hidden_size ({self.hidden_size}) and expert_dim ({self.expert_dim}) "
                             f"to be multiples of {GROUP}")
        quantize = quantize_fp8_blockwise if block_shape is not None else quantize_fp8_per_channel
        (w1, w1_scale), (w2, w2_scale) = quantize(self.w1), quantize(self.w2)
        del self.w1, self.w2
        for name, value in (("w1", w1), ("w2", w2), ("w1_scale", w1_scale), ("w2_scale", w2_scale)):
            self.register_buffer(name, value)
        self.fp8_block_shape = None if block_shape is None else tuple(block_shape)
        self.is_fp8 = True
        return self

    @torch.no_grad()
    def load_hf_experts(self, source) -> "FlashMoELayer":
        """Copies the weights of a Hugging Face sparse-MoE block (its per-expert Linear layout)
        into this layer; returns the layer.

        Args:
            source: the block (an nn.Module such as MixtralSparseMoeBlock or
                Qwen3MoeSparseMoeBlock) or its state dict, keys relative to the block:
                "gate.weight" (E, H) the router; per expert e either Mixtral's
                "experts.{e}.w1.weight" (gate, (I, H)), "experts.{e}.w3.weight" (up, (I, H)),
                "experts.{e}.w2.weight" (down, (H, I)), or Qwen-MoE's
                "experts.{e}.gate_proj.weight", "up_proj", "down_proj" with the same shapes;
                with num_shared_experts > 0, "shared_experts.gate_proj/up_proj/down_proj.weight"
                (DeepSeek-MoE's ungated shared experts, width S * I).

        Routing options are not in the weights: build the layer with the block's top_k and
        renormalize (Mixtral: renormalize=True; Qwen-MoE: its config's norm_topk_prob).
        A block whose shared expert has its own sigmoid gate (Qwen2-MoE's "shared_expert_gate")
        has no equivalent here and is refused.
        """
        if self.is_fp8:
            raise RuntimeError("load Hugging Face weights before to_fp8: the layer's expert weights are FP8")
        state = _state_dict_of(source)
        if any(key.startswith(("shared_expert.", "shared_expert_gate.")) for key in state):
            raise ValueError("source has a gated shared expert (Qwen2-MoE's shared_expert and shared_expert_gate), "
                             "which FlashMoELayer does not implement")
        naming = _expert_naming(state)
        E, I = self.num_experts, self.expert_dim
        self.router.weight.copy_(_weight(state, "gate.weight", (E, self.hidden_size)))
        gate_name, up_name, down_name = naming
        for e in range(E):
            self.w1[e, :I].copy_(_weight(state, f"experts.{e}.{gate_name}.weight", (I, self.hidden_size)))
            self.w1[e, I:].copy_(_weight(state, f"experts.{e}.{up_name}.weight", (I, self.hidden_size)))
            self.w2[e].copy_(_weight(state, f"experts.{e}.{down_name}.weight", (self.hidden_size, I)))
        if self.shared_w1 is not None:
            shared = self.num_shared_experts * I
            self.shared_w1[:shared].copy_(_weight(state, "shared_experts.gate_proj.weight", (shared, self.hidden_size)))
            self.shared_w1[shared:].copy_(_weight(state, "shared_experts.up_proj.weight", (shared, self.hidden_size)))
            self.shared_w2.copy_(_weight(state, "shared_experts.down_proj.weight", (self.hidden_size, shared)))
        elif any(key.startswith("shared_experts.") for key in state):
            raise ValueError("source has shared experts: build the layer with num_shared_experts > 0")
        return self

    @classmethod
    def from_hf_experts(cls, source, top_k: int, *, renormalize: bool = True, activation: str = "silu",
                        router_aux_loss_coef: float = 0.0, router_z_loss_coef: float = 0.0, dtype=None,
                        device=None) -> "FlashMoELayer":
        """A layer with the sizes and weights of a Hugging Face sparse-MoE block (see
        `load_hf_experts` for `source`). E, H and I come from the weights, the number of shared
        experts from the width of "shared_experts" (if present) over I. dtype and device
        default to those of the router weight."""
        state = _state_dict_of(source)
        router = state.get("gate.weight")
        if router is None:
            raise KeyError("source has no 'gate.weight' (the router); expected a Hugging Face sparse-MoE block")
        gate_name = _expert_naming(state)[0]
        num_experts, hidden_size = router.shape
        expert_dim = state[f"experts.0.{gate_name}.weight"].shape[0]
        shared = state.get("shared_experts.gate_proj.weight")
        num_shared = 0
        if shared is not None:
            if shared.shape[0] % expert_dim:
                raise ValueError(f"shared_experts width {shared.shape[0]} is not a multiple of expert_dim {expert_dim}")
            num_shared = shared.shape[0] // expert_dim
        layer = cls(hidden_size, num_experts, expert_dim, top_k, renormalize=renormalize, activation=activation,
                    num_shared_experts=num_shared, router_aux_loss_coef=router_aux_loss_coef,
                    router_z_loss_coef=router_z_loss_coef, dtype=dtype or router.dtype,
                    device=device or router.device)
        return layer.load_hf_experts(state)


# The two per-expert naming schemes: (gate, up, down) projection names.
_HF_NAMINGS = {"mixtral": ("w1", "w3", "w2"), "qwen": ("gate_proj", "up_proj", "down_proj")}


def _state_dict_of(source) -> Mapping:
    if isinstance(source, nn.Module):
        return source.state_dict()
    if isinstance(source, Mapping):
        return source
    raise TypeError(f"source must be an nn.Module or a state dict, got {type(source).__name__}")


def _expert_naming(state: Mapping) -> tuple:
    for naming in _HF_NAMINGS.values():
        if f"experts.0.{naming[0]}.weight" in state:
            return naming
    found = sorted(k for k in state if re.match(r"experts\.0\.", k))
    raise KeyError("source has neither Mixtral's 'experts.0.w1.weight' nor Qwen-MoE's 'experts.0.gate_proj.weight'"
                   f" (expert 0 keys: {found})")


def _weight(state: Mapping, key: str, shape: tuple) -> torch.Tensor:
    if key not in state:
        raise KeyError(f"source has no {key!r}")
    weight = state[key]
    if tuple(weight.shape) != shape:
        raise ValueError(f"{key} has shape {tuple(weight.shape)}, expected {shape}")
    return weight


def count_values(values: torch.Tensor, n: int) -> torch.Tensor:
    """How many of `values` (integers in [0, n)) equal each of 0..n-1, int64 (n,): a scatter-add
    on the device; unlike torch.bincount on a GPU, nothing is read back to the host."""
    values = values.long()
    return torch.zeros(n, dtype=torch.int64, device=values.device).scatter_add_(0, values, torch.ones_like(values))


def router_statistics(logits: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, aux_loss_coef: float,
                      z_loss_coef: float):
    """(tokens_per_expert, aux_loss, z_loss) of one routing call, as FlashMoELayer defines them.

    Args:
        logits: (T, E) router logits, any float dtype (the losses are formed in fp32).
        topk_ids: (T, k) the chosen experts.
        num_experts: E; aux_loss_coef, z_loss_coef: the losses' weights (0 skips a loss).

    Returns:
        tokens_per_expert (E,) int64, counted on the device (a scatter-add; no host
        synchronisation); aux_loss = aux_loss_coef * E * sum_e f_e * P_e, with f_e the fraction
        of the T * k assignments that went to e and P_e the mean softmax probability of e;
        z_loss = z_loss_coef * mean_t logsumexp(logits_t)^2. Both fp32 scalars, differentiable
        in logits, zero when their coefficient is 0 or T = 0.
    """
    counts = count_values(topk_ids.reshape(-1), num_experts)
    num_tokens, top_k = topk_ids.shape
    aux_loss = z_loss = logits.new_zeros((), dtype=torch.float32)
    if num_tokens == 0:
        return counts, aux_loss, z_loss
    logits = logits.float()
    if aux_loss_coef > 0:
        mean_probability = torch.softmax(logits, dim=-1).mean(dim=0)
        assigned_fraction = counts.float() / (num_tokens * top_k)
        aux_loss = aux_loss_coef * num_experts * (assigned_fraction * mean_probability).sum()
    if z_loss_coef > 0:
        z_loss = z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean()
    return counts, aux_loss, z_loss


def router_losses(model: nn.Module) -> torch.Tensor:
    """aux_loss + z_loss of every FlashMoELayer in `model`, from its last forward call (add it
    to the training loss); a zero tensor when no layer has run."""
    losses = [loss for layer in model.modules() if isinstance(layer, FlashMoELayer)
              for loss in (layer.aux_loss, layer.z_loss) if loss is not None]
    if not losses:
        parameter = next(model.parameters(), None)
        return torch.zeros((), device=None if parameter is None else parameter.device)
    return torch.stack(losses).sum()
