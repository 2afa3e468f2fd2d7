"""Hugging Face transformers on our kernels: `register()`, then

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fms", experts_implementation="fms")

(or `from_config`). The name "fms" is registered with transformers' `AttentionInterface`,
`AttentionMaskInterface` and `ExpertsInterface` (5.x). Not a name containing "flash": transformers
treats any such attention name as a flash-attn kernel to fetch from its hub.

- Attention (`fms_attention_forward`): query, key, value (B, H, S, D) as transformers passes
  them, GQA without repeating K and V; causal (bottom-right) and sliding windows without a dense
  mask; a padded batch (the 2-D padding mask `flash_attention_mask` leaves when some token is
  padding) through `flash_attention_varlen` on the unpadded tokens, as are rows that pack several
  sequences with no mask (padding-free training: position ids that start again, or flash-attn's
  `cu_seq_lens_q/k` arguments); decoding with the cache (one
  query against the cached keys) through the split-KV kernels that `flash_attention_science`
  picks for short queries, and for a left-padded batch or a static cache
  `flash_attention_with_kvcache` on the keys in place, each sequence from its first unpadded
  slot. Attention sinks (gpt-oss's, one logit per head) scale each row by sigmoid(lse - sink).
  Dropout in training and dense masks raise a clear error.
- Mask (`fms_attention_mask`): `flash_attention_mask`'s, except with a static cache: there the
  keys include unfilled slots, and the padding mask covers the tokens so far, one longer each
  step, or is absent (transformers 5.24, nothing padded); a mask whose shape changed every step, or
  from a tensor to None once the cache fills, would make torch.compile record new CUDA graphs.
  It becomes a (B, 2, cache length) bool tensor instead, [padding mask padded with False; which
  slots are filled], one shape for the whole generation (`static_cache_mask`).
- Experts (`fms_experts_forward`): `fused_experts` on the module's own `gate_up_proj` (E, 2I, H:
  gate rows then up rows) and `down_proj` (E, H, I), forward and backward, with the model's
  router (its top-k ids and weights). gpt-oss's experts (weights stored transposed, gate and up
  rows interleaved, biases, its clamped SwiGLU) run on the same kernels, forward and backward.
  Experts our kernels cannot express (no gate, another custom gate, a post-expert norm, an
  activation other than SiLU or tanh-GELU, top_k above 8, expert parallelism) run transformers'
  `grouped_mm` experts, with a warning naming the reason once per module class and reason.

Importing `flashmoe_science` never imports transformers; this module does (the `[hf]` extra).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from ..attention import flash_attention_science, flash_attention_varlen, flash_attention_with_kvcache
from ..attention.configs import DECODE_MAX_BLOCK_M
from ..moe import fused_experts
from ..tensor_facts import TensorFacts

NAME = "fms"
# transformers' activation names our gated kernels compute, by our name for them.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}
_WARNED: set = set()


def register() -> None:
    """Registers "fms" for attention, its mask and experts with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, fms_attention_forward)
    AttentionMaskInterface.register(NAME, fms_attention_mask)
    ExpertsInterface.register(NAME, fms_experts_forward)
    try:  # FP8 checkpoints (FineGrainedFP8 quantisation; transformers with FP8 experts)
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:
        return
    FP8ExpertsInterface.register(NAME, fms_fp8_experts_forward)


def fms_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                       attention_mask=None, **kwargs):
    """transformers' mask function for "fms": None or the 2-D padding mask, as for flash-attn, where
    every key slot holds a token; the fixed-shape `static_cache_mask` where a static cache hands
    the attention slots that may be unfilled. A static cache is seen from the sizes transformers
    passes: its layer's offset is a device tensor (`StaticLayer`, compiled steps read no host
    value), or the tokens so far (`q_offset + q_length`) fall short of its `kv_length`. Its mask is
    the padding mask if there is one (as long as the tokens so far), else every token so far; so
    one shape for the whole generation, full cache included, and no host read. A mask already in
    that form (transformers makes the mask before the compiled step, and the step asks again)
    comes back as it is."""
    from transformers.masking_utils import flash_attention_mask

    if attention_mask is not None and attention_mask.dim() == 3:
        return attention_mask
    if not isinstance(q_offset, torch.Tensor) and not (kv_offset == 0 and q_offset + q_length < kv_length):
        return flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                                    attention_mask, **kwargs)
    if attention_mask is not None:
        return static_cache_mask(attention_mask.to(torch.bool), kv_length)
    device = q_offset.device if isinstance(q_offset, torch.Tensor) else kwargs.get("device")
    filled = q_offset + q_length
    slots = torch.arange(kv_length, device=device) < filled
    return slots.expand(batch_size, 2, kv_length)


def static_cache_mask(mask: torch.Tensor, cache_length: int) -> torch.Tensor:
    """(B, 2, cache_length) bool: row 0 the padding mask of the B x filled tokens so far, False past
    them; row 1 which cache slots are filled (the first `filled`)."""
    batch, filled = mask.shape
    slots = torch.arange(cache_length, device=mask.device) < filled
    return torch.stack([F.pad(mask, (0, cache_length - filled), value=False), slots.expand(batch, -1)], 1)


def _split_mask(mask, seqlen_q: int, seqlen_k: int):
    """(key_mask (B, K), filled, q_mask (B, Sq)) of a padding mask in either form: which of the first
    K <= seqlen_k key slots hold unpadded tokens (slots past the filled ones: False), how many
    slots are filled (an int, or an int32 (B,) tensor for the static-cache form), and which
    queries are unpadded tokens (the queries are the last seqlen_q filled slots)."""
    if mask.dim() == 3:
        if mask.shape[2] != seqlen_k:
            raise ValueError(f"a static-cache mask of {mask.shape[2]} slots for {seqlen_k} cached keys")
        key_mask = mask[:, 0]
        filled = mask[:, 1].sum(1, dtype=torch.int32)
        positions = (filled[:, None] - seqlen_q + torch.arange(seqlen_q, device=mask.device)).clamp_min(0)
        return key_mask, filled, key_mask.gather(1, positions.long())
    mask = mask[:, -seqlen_k:]
    return mask, mask.shape[1], mask[:, -seqlen_q:]


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"attn_implementation='{NAME}' does not support {what}; use 'sdpa' or 'eager' "
                               "for this model")


def fms_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                          softcap=None, is_causal=None, **kwargs):
    """transformers' attention contract: query (B, Hq, Sq, D), key (B, Hkv, Sk, D) and value
    (B, Hkv, Sk, D_v) (D_v = D but in MLA models such as DeepSeek-V3); returns (output (B, Sq, Hq,
    D_v), None)."""
    if dropout and module.training:
        raise _unsupported(f"attention dropout in training (dropout={dropout})")
    sinks = kwargs.get("s_aux")
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise _unsupported(f"attention sinks of shape {tuple(sinks.shape)} (one per query head: ({query.shape[1]},))")
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    window = (sliding_window - 1, -1) if sliding_window else (-1, -1)
    options = dict(softmax_scale=scaling, window_size=window, softcap=float(softcap or 0.0), return_lse=sinks is not None)
    if attention_mask is None:
        sequences = _packed_sequences(query, key, kwargs)
        if sequences is not None:
            out = _sequences_attention(query, key, value, sequences, causal, options)
        else:
            out = flash_attention_science(query, key, value, causal, **options)
            out = tuple(t.transpose(1, 2) for t in out) if sinks is not None else out.transpose(1, 2)
            if torch.compiler.is_compiling():
                out = _poisoned_if_packed(out, query, key, kwargs)
    else:
        if attention_mask.dim() not in (2, 3) or attention_mask.dtype != torch.bool:
            raise _unsupported(f"a {attention_mask.dim()}-D {attention_mask.dtype} attention mask (only the padding "
                               f"masks of its '{NAME}' mask function)")
        out = _left_padded_short_queries(query, key, value, attention_mask, causal, options)
        if out is None:
            out = _padded_attention(query, key, value, attention_mask, causal, options)
    if sinks is not None:
        out, lse = out
        return _with_sinks(out, lse, sinks), None
    return out, None


def _packed_sequences(query, key, kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of several sequences packed into a
    row with no padding mask (padding-free training: transformers' DataCollatorWithFlattening),
    or None for one sequence a row. From flash-attn's `cu_seq_lens_q/k` and `max_length_q/k`
    where the caller passes them; else from `position_ids` without a cache (queries and keys the
    same tokens), a sequence starting wherever a position does not follow the one before, as
    transformers' own masks for eager and SDPA attention cut them. Found once per position_ids
    tensor (a host read, `_mask_facts`). Under torch.compile position ids are not read back: there
    a packed row's outputs come out NaN (`_poisoned_if_packed`), never attention across sequences."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        return (cu_q.to(torch.int32), cu_k.to(torch.int32), int(kwargs["max_length_q"]),
                int(kwargs["max_length_k"]))
    position_ids = _self_attention_positions(query, key, kwargs)
    if position_ids is None or torch.compiler.is_compiling():
        return None
    batch, seqlen = query.shape[0], query.shape[2]
    return _mask_facts(position_ids, "packed sequences", batch, seqlen,
                       lambda: _sequence_starts(position_ids.expand(batch, -1)))


def _self_attention_positions(query, key, kwargs):
    """The (B or 1, S) position ids of a call whose queries and keys are the same S > 1 tokens
    (no cache), or None."""
    position_ids = kwargs.get("position_ids")
    seqlen = query.shape[2]
    if (position_ids is None or seqlen <= 1 or key.shape[2] != seqlen or position_ids.dim() != 2
            or position_ids.shape[-1] != seqlen):
        return None
    return position_ids


def _sequence_starts(position_ids):
    """`_packed_sequences` from (B, S) position ids, read to the host in one copy (one sync, where
    finding the starts and the longest sequence on the device would take two): None if every row
    is one sequence."""
    batch, seqlen = position_ids.shape
    positions = position_ids.cpu()
    starts = torch.ones(batch, seqlen, dtype=torch.bool)
    starts[:, 1:] = positions.diff(dim=1) != 1
    first = starts.flatten().nonzero().squeeze(1)
    if first.numel() == batch:
        return None
    cu = torch.cat([first, first.new_tensor([batch * seqlen])]).to(torch.int32)
    longest = int(cu.diff().max())
    cu = cu.to(position_ids.device)
    return cu, cu, longest, longest


def _poisoned_if_packed(out, query, key, kwargs):
    """Under torch.compile, where `_packed_sequences` reads nothing back: `out` (B, S, Hq, D_v), or
    (out, lse), with NaN outputs where a row of position ids holds several sequences (positions
    that do not count up by one), which the dense call just made attended across."""
    position_ids = _self_attention_positions(query, key, kwargs)
    if position_ids is None:
        return out
    packed = (position_ids.diff(dim=-1) != 1).any(-1).expand(query.shape[0])[:, None, None, None]
    if isinstance(out, tuple):
        return torch.where(packed, float("nan"), out[0]), out[1]
    return torch.where(packed, float("nan"), out)


def _sequences_attention(query, key, value, sequences, causal, options):
    """Attention of packed rows (`_packed_sequences`): (B, S, Hq, D_v), and lse (B, S, Hq) when
    options ask for it."""
    cu_q, cu_k, max_q, max_k = sequences
    batch, heads_q, seqlen, dim = query.shape
    q, k, v = (t.transpose(1, 2).reshape(-1, *t.shape[1:2], t.shape[-1]) for t in (query, key, value))
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, **options)
    if not options.get("return_lse"):
        return out.view(batch, seqlen, heads_q, -1)
    out, lse = out
    return out.view(batch, seqlen, heads_q, -1), lse.transpose(0, 1).reshape(batch, seqlen, heads_q)


def _with_sinks(out, lse, sinks):
    """Attention with a learned sink logit per head (gpt-oss's): a softmax over the keys and the
    sink, which takes its share and adds nothing, is the keys' attention times
    exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink). out (B, Sq, Hq, D), lse (B, Sq, Hq);
    differentiable in out, lse (our kernels' lse is) and the sinks."""
    scale = torch.sigmoid(lse - sinks.float())
    return (out.float() * scale[..., None]).to(out.dtype)


def _left_padded_short_queries(query, key, value, mask, causal, options):
    """Decoding a left-padded batch (the padding transformers asks for in generation), or any batch
    with a static cache: the KV-cache kernels over the keys as they lie, each sequence from its
    first unpadded slot (`cache_leftpad`) to the last token, no gather of the valid tokens. Only
    for causal queries that fit one decode tile and need no gradient; None when the mask is not
    left padding (a hole in it: the caller packs the valid tokens instead). Under torch.compile
    the mask is checked on the device (no host read, one graph): a sequence whose mask has a
    hole comes out NaN."""
    batch, heads_q, seqlen_q, dim = query.shape
    seqlen_k = key.shape[2]
    if (not causal or seqlen_q * (heads_q // key.shape[1]) > DECODE_MAX_BLOCK_M[query.element_size()]
            or value.shape[-1] != dim  # the KV-cache kernels take one head dim
            or (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))):
        return None
    found = _mask_facts(mask, "left padding", seqlen_q, seqlen_k, lambda: _left_padding(mask, seqlen_q, seqlen_k))
    if found is None:
        return None
    filled, leftpad = found
    out = flash_attention_with_kvcache(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                       cache_seqlens=filled, cache_leftpad=leftpad, causal=True, **options)
    return (out[0], out[1].transpose(1, 2)) if options.get("return_lse") else out


def _left_padding(mask, seqlen_q: int, seqlen_k: int):
    """(filled, leftpad) of a left-padded mask (`_left_padded_short_queries`), or None (eager) if
    some sequence's mask has a hole. Under torch.compile nothing is read back: such a sequence gets
    a start out of range, which makes its outputs NaN (visible), never another sequence's attention."""
    mask, filled, _ = _split_mask(mask, seqlen_q, seqlen_k)  # a static cache: slots past `filled` are unfilled
    leftpad = filled - mask.sum(1, dtype=torch.int32)
    slots = torch.arange(mask.shape[1], device=mask.device)
    started = slots >= leftpad[:, None]
    if isinstance(filled, torch.Tensor):
        started = started & (slots < filled[:, None])
    left_padding = (mask == started).all(1)
    if torch.compiler.is_compiling():
        return filled, torch.where(left_padding, leftpad, -1)
    return (filled, leftpad) if bool(left_padding.all()) else None


# What a padding mask says about its batch (where each sequence starts; which tokens to pack),
# found once per mask tensor: transformers hands every layer of a forward the same mask, and
# finding it reads values back to the host (a sync), so it is read once a forward, not once a
# layer. Kept as `tensor_facts` says (gone with the mask, or when it is written in place); not
# under torch.compile, which traces the finding into its graph.
_MASK_FACTS = TensorFacts(max_entries=16)


def _mask_facts(mask, what: str, seqlen_q: int, seqlen_k: int, find):
    """`find()`, remembered for `mask` under (what, seqlen_q, seqlen_k)."""
    if torch.compiler.is_compiling():
        return find()
    known = _MASK_FACTS.get(mask) or {}
    key = (what, seqlen_q, seqlen_k)
    if key not in known:
        known = {**known, key: find()}
        _MASK_FACTS.remember(known, mask)
    return known[key]


def _padded_attention(query, key, value, mask, causal, options):
    """A padded batch as packed sequences: key b's valid tokens are the mask's (`_split_mask`: the
    last Sk entries of a 2-D mask, or the static-cache form's), query b's the last Sq filled slots;
    outputs of padding queries are 0. Keys past the filled slots (a static cache) are unfilled. A
    sliding window then counts tokens, as transformers' flash-attention path does: the cache slots
    its eager masks count are the same unless the mask has a hole inside a sequence."""
    batch, heads_q, seqlen_q, dim = query.shape
    seqlen_k, dim_v = key.shape[2], value.shape[-1]
    k_index, q_index, cu_k, cu_q = _mask_facts(mask, "packing", seqlen_q, seqlen_k,
                                               lambda: _packing(mask, seqlen_q, seqlen_k))
    q = query.transpose(1, 2).reshape(batch * seqlen_q, heads_q, dim)[q_index]
    k = key.transpose(1, 2).reshape(batch * seqlen_k, key.shape[1], dim)[k_index]
    v = value.transpose(1, 2).reshape(batch * seqlen_k, value.shape[1], dim_v)[k_index]
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, seqlen_q, seqlen_k, causal, **options)
    out, lse = out if options.get("return_lse") else (out, None)
    full = out.new_zeros(batch * seqlen_q, heads_q, dim_v)
    full = full.index_copy(0, q_index, out).view(batch, seqlen_q, heads_q, dim_v)
    if lse is None:
        return full
    full_lse = lse.new_full((batch * seqlen_q, heads_q), float("-inf")).index_copy(0, q_index, lse.transpose(0, 1))
    return full, full_lse.view(batch, seqlen_q, heads_q)


def _packing(mask, seqlen_q: int, seqlen_k: int):
    """(k_index, q_index, cu_seqlens_k, cu_seqlens_q) that pack a padded batch's tokens
    (`_padded_attention`)."""
    mask, _, q_mask = _split_mask(mask, seqlen_q, seqlen_k)
    if mask.shape[1] < seqlen_k:
        mask = F.pad(mask, (0, seqlen_k - mask.shape[1]), value=False)
    zero = torch.zeros(1, dtype=torch.int32, device=mask.device)
    cu = [torch.cat([zero, m.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32)]) for m in (mask, q_mask)]
    return mask.flatten().nonzero().squeeze(1), q_mask.flatten().nonzero().squeeze(1), *cu


def _gpt_oss_gate(module) -> str | None:
    """Whether the module gates as gpt-oss does (its `_apply_gate`): None if not, "swiglu_oai"
    at our constants (alpha 1.702, limit 7), else why not."""
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:
        return None
    if getattr(type(module), "_apply_gate", None) is not GptOssExperts._apply_gate:
        return None
    from ..moe.configs import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if (alpha, limit) != (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT):
        return f"gpt-oss's gate with alpha={alpha}, limit={limit} (ours: {SWIGLU_OAI_ALPHA}, {SWIGLU_OAI_LIMIT})"
    return "swiglu_oai"


def _experts_call(module, hidden_states, top_k: int):
    """(None, `fused_experts`' weights and options for this experts module), or (why our kernels
    cannot run it, None). Transposed weights are passed as views (read, and their gradients
    written, in place), interleaved gate/up rows and biases as `fused_experts`' options."""
    from transformers.integrations.moe import _default_apply_gate

    flags = {"has_gate": False, "has_post_expert_norm": True, "_is_expert_parallel": True}
    for flag, bad in flags.items():
        if getattr(module, flag, not bad) == bad:
            return f"{flag}={bad}", None
    transposed, interleaved = getattr(module, "is_transposed", False), not getattr(module, "is_concatenated", True)
    has_bias = getattr(module, "has_bias", False)
    if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        activation = _gpt_oss_gate(module)
        if activation != "swiglu_oai":
            return activation or "a custom _apply_gate", None
    else:
        activation = _ACTIVATIONS.get(getattr(module.config, "hidden_act", None))
        if activation is None:
            return f"activation {module.config.hidden_act!r} (ours: {', '.join(sorted(_ACTIVATIONS))})", None
    w1, w2 = module.gate_up_proj, module.down_proj
    if transposed:  # (E, H, 2I) and (E, I, H): our (E, 2I, H) and (E, H, I) as views
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    experts, inner2, hidden = w1.shape
    if hidden_states.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {hidden_states.dtype}", None
    if experts > 256 or hidden % 16 or (inner2 // 2) % 16:
        return f"E={experts}, H={hidden}, I={inner2 // 2} (ours: E <= 256, H and I multiples of 16)", None
    if top_k > 8:
        return f"top_k={top_k} (ours: up to 8)", None
    biases = (module.gate_up_proj_bias, module.down_proj_bias) if has_bias else (None, None)
    return None, dict(w1=w1, w2=w2, activation=activation, w1_bias=biases[0], w2_bias=biases[1],
                      gate_up_interleaved=interleaved)


def fms_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts contract: hidden_states (T, H), top_k_index (T, K) and top_k_weights
    (T, K) from the model's router; returns (T, H)."""
    reason, call = _experts_call(self, hidden_states, top_k_index.shape[1])
    if reason is not None:
        from transformers.integrations.moe import grouped_mm_experts_forward

        if (type(self), reason) not in _WARNED:
            _WARNED.add((type(self), reason))
            warnings.warn(f"experts_implementation='{NAME}': {type(self).__name__} runs transformers' grouped_mm "
                          f"experts ({reason} is not supported by the fused kernels)", stacklevel=2)
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return fused_experts(hidden_states, topk_weights=top_k_weights, topk_ids=top_k_index, **call)


def _fp8_fallback_reason(module, hidden_states, top_k: int) -> str | None:
    """Why our FP8 kernels cannot run this FP8 experts module (transformers' FP8Experts), or None."""
    from ..moe.fp8 import FP8_DTYPE, GROUP

    if torch.is_grad_enabled() and hidden_states.requires_grad:
        return "training (our FP8 experts are for inference)"
    if not getattr(module, "has_gate", True) or getattr(module, "has_bias", False):
        return "experts without a gate or with biases"
    if any(getattr(module, name, None) is not None for name in ("swiglu_alpha", "limit", "gate_softcap", "up_softcap")):
        return "a clamped or soft-capped gate"
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        return "static activation scales"
    block = getattr(module, "block_size", None)
    if block is None or tuple(block) != (GROUP, GROUP):
        return f"block_size={block} (ours: 128 x 128 blocks)"
    if module.gate_up_proj.dtype != FP8_DTYPE or module.gate_up_proj_scale_inv.dtype != torch.float32:
        return f"weights {module.gate_up_proj.dtype} with {module.gate_up_proj_scale_inv.dtype} scales"
    act = getattr(module.config, "hidden_act", None)
    if act not in _ACTIVATIONS:
        return f"activation {act!r} (ours: {', '.join(sorted(_ACTIVATIONS))})"
    experts, inner2, hidden = module.gate_up_proj.shape
    if hidden_states.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {hidden_states.dtype}"
    if experts > 256 or hidden % GROUP or (inner2 // 2) % GROUP or top_k > 8:
        return f"E={experts}, H={hidden}, I={inner2 // 2}, top_k={top_k} (ours: E <= 256, H and I multiples of 128, " \
               "top_k <= 8)"
    if hidden_states.is_cuda and torch.cuda.get_device_capability(hidden_states.device) < (8, 9):
        return "a GPU without FP8 tensor cores"
    return None


def fms_fp8_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' FP8 experts (FineGrainedFP8 checkpoints: float8_e4m3fn gate_up_proj and
    down_proj with float32 `*_scale_inv` per 128 x 128 block, DeepSeek-V3's format) on our FP8
    kernels; anything else runs transformers' FP8 grouped_mm experts, with a warning."""
    reason = _fp8_fallback_reason(self, hidden_states, top_k_index.shape[1])
    if reason is not None:
        from transformers.integrations.finegrained_fp8 import fp8_grouped_mm_experts_forward

        if (type(self), "fp8") not in _WARNED:
            _WARNED.add((type(self), "fp8"))
            warnings.warn(f"experts_implementation='{NAME}': {type(self).__name__} runs transformers' FP8 grouped_mm "
                          f"experts ({reason} is not supported by the fused FP8 kernels)", stacklevel=2)
        return fp8_grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return fused_experts(hidden_states, self.gate_up_proj, self.down_proj, top_k_weights, top_k_index,
                         activation=_ACTIVATIONS[self.config.hidden_act], w1_scale=self.gate_up_proj_scale_inv,
                         w2_scale=self.down_proj_scale_inv, block_shape=(128, 128))
