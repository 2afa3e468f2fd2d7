"""Attention over packed variable-length batches: `flash_attention_varlen`.

Sequences of different lengths are packed along one token axis, as in flash-attn's varlen
interface: q (total_q, Hq, D) holds the queries of sequence b in rows
cu_seqlens_q[b]:cu_seqlens_q[b + 1], k and v (total_k, Hkv, D) its keys in rows
cu_seqlens_k[b]:cu_seqlens_k[b + 1]. Nothing is padded: the kernels (the dense ones with VARLEN
on, through `forward.launch_forward` and `backward.launch_backward`) run ceil(max_seqlen / BLOCK) programs per
(sequence, head), and a program past its sequence's end returns at once. The grid takes the
sequences longest first (`longest_first`): a program's work grows with its sequence's length, and
starting the longest ones first leaves the short ones to fill the GPU at the end.

Malformed cu_seqlens would make the kernels read and write outside the tensors, so their values
are checked. Values on the GPU cost a device-to-host copy to read, which waits for the work
already queued; `_CheckedLengths` reads each cu_seqlens tensor once and remembers what it found,
so the layers of a model that share one cu_seqlens per batch pay one read per batch, not one per
layer. While a CUDA graph is being captured nothing can be read: the values are then trusted.
"""
from __future__ import annotations

import torch

from ..launch import KernelLauncher, PlanCache
from ..tensor_facts import TensorFacts
from ._kernels.lengths import malformed_lengths_poison_kernel
from .backward import BackwardPlan, launch_backward
from .checks import NO_WINDOW, check_backward_tensors, check_band, check_flags, check_inputs, check_options, is_int
from .forward import ForwardPlan, launch_forward
from .fp8 import fp8_descales
from .interface import gradients_from_context, records_gradients, refuse_double_backward, save_for_backward

# (cumulative lengths argument, its max_seqlen argument, what it counts), for error messages.
_LENGTHS = (("cu_seqlens_q", "max_seqlen_q", "query"), ("cu_seqlens_k", "max_seqlen_k", "key"))


def _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, fp8: bool = False) -> None:
    """Shapes, dtypes and devices (values are `_CheckedLengths`'s, max_seqlen `_check_max_seqlens`'s);
    fp8: FP8 q, k, v allowed (a forward whose descales `fp8.fp8_descales` checked)."""
    check_inputs(q, k, v, packed=True, fp8=fp8)
    for (name, _, _), cu in zip(_LENGTHS, (cu_seqlens_q, cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32 (cumulative sequence lengths), got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() == 0:
            raise ValueError(f"{name} must be 1-D with batch + 1 entries, got shape {tuple(cu.shape)}")
        if cu.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {cu.stride(0)}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {cu.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")


def _check_max_seqlens(max_seqlen_q, max_seqlen_k) -> None:
    for (_, name, _), bound in zip(_LENGTHS, (max_seqlen_q, max_seqlen_k)):
        if not is_int(bound):
            raise TypeError(f"{name} must be an int, got {type(bound).__name__}")
        if bound < 0:
            raise ValueError(f"{name} must be >= 0, got {bound}")


class _CheckedLengths:
    """(last entry, longest length) of each cu_seqlens tensor whose values were read and found
    well formed (starting at 0, never decreasing), remembered as `tensor_facts` says."""

    def __init__(self):
        self._facts = TensorFacts(max_entries=64)

    def facts(self, named) -> list | None:
        """[(last, longest)] for (name, tensor) pairs, reading every unknown tensor in one copy;
        None while a CUDA graph is being captured. Raises ValueError naming a malformed tensor."""
        unknown = {}
        for name, t in named:
            if self._facts.get(t) is None:
                unknown.setdefault(id(t), (name, t))  # one tensor passed twice is read once
        found = {}
        if unknown:
            tensors = [t for _, t in unknown.values()]
            if tensors[0].is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            values = (torch.cat(tensors) if len(tensors) > 1 else tensors[0]).cpu().long()
            for (name, t), part in zip(unknown.values(), values.split([t.numel() for t in tensors])):
                lengths = part.diff()
                if part[0] != 0:
                    raise ValueError(f"{name} must start at 0, got {part[0].item()}")
                if (lengths < 0).any():
                    i = int((lengths < 0).nonzero()[0])
                    raise ValueError(f"{name} must be non-decreasing (cumulative lengths), got entry {i + 1} = "
                                     f"{part[i + 1].item()} after {part[i].item()}")
                found[id(t)] = (part[-1].item(), lengths.max().item() if lengths.numel() else 0)
                self._facts.remember(found[id(t)], t)
        return [found[id(t)] if id(t) in found else self._facts.get(t) for _, t in named]


_CHECKED = _CheckedLengths()

_POISON = KernelLauncher("attention_varlen_lengths_check", malformed_lengths_poison_kernel)
_POISON_BLOCK_B = 256
_POISON_BLOCK = 1024
_POISON_PROGRAMS = 64


def poison_if_malformed(key, cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k, outputs) -> None:
    """Fills `outputs` (dense tensors, or None) with NaN, on the device and without a host read,
    if cu_seqlens are malformed as the kernels read them now (`_kernels/lengths.py`). `key` is
    the call's plan key (None: Triton's ordinary launch path): it fixes everything this kernel
    specialises on, since the outputs are allocations of the call's own, of shapes and dtypes the
    key determines."""
    flat = [(t, t.numel()) for t in outputs if t is not None and t.numel()]
    if not flat:
        return
    flat += [flat[0][:1] + (0,)] * (3 - len(flat))
    programs = min(_POISON_PROGRAMS, -(-max(n for _, n in flat) // _POISON_BLOCK))
    ints = (cu_seqlens_q.numel() - 1, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    _POISON.launch(key, (programs, 1, 1),
                   (cu_seqlens_q, cu_seqlens_k, *ints, *(x for pair in flat for x in pair), _POISON_BLOCK_B,
                    _POISON_BLOCK),
                   num_warps=4, num_stages=1, device_index=q.device.index if q.is_cuda else None)


def _check_lengths(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k) -> None:
    """The values of cu_seqlens: well formed, ending at the token counts of q and k, with no
    sequence longer than its max_seqlen (which sizes the launch grid)."""
    facts = _CHECKED.facts((("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)))
    if facts is None:  # capturing a CUDA graph
        return
    for (name, max_name, tokens), (last, longest), total, bound in zip(
            _LENGTHS, facts, (q.shape[0], k.shape[0]), (max_seqlen_q, max_seqlen_k)):
        if last != total:
            raise ValueError(f"{name} must end at the number of {tokens} tokens ({total}), got last entry {last}")
        if longest > bound:
            raise ValueError(f"{max_name} ({bound}) is smaller than the longest sequence in {name} ({longest})")


class _LongestFirst:
    """The sequences of a packed batch, longest first: an int32 tensor on the device that the
    kernels read to map their grid's sequence index, so that the programs of the longest
    sequences (the longest programs) start first and those of short ones fill the tail. Length is
    query plus key tokens; ties keep batch order. Computed on the device, so no value is read back.

    Kept like `_CheckedLengths`'s facts (`tensor_facts`: both cu_seqlens tensors, weakly, with
    their version counters), so the layers of a model that share one batch compute it once;
    computed per call for tensors without version counters and while a CUDA graph is being
    captured.
    """

    def __init__(self):
        self._orders = TensorFacts(max_entries=64)

    def __call__(self, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
        order = self._orders.get(cu_seqlens_q, cu_seqlens_k)
        if order is not None:
            return order
        lengths = cu_seqlens_q.diff() + cu_seqlens_k.diff()
        order = torch.argsort(lengths, descending=True, stable=True).to(torch.int32)
        if not (cu_seqlens_q.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._orders.remember(order, cu_seqlens_q, cu_seqlens_k)
        return order


longest_first = _LongestFirst()


def _varlen_key(tensors, cu_seqlens_q, cu_seqlens_k, *options):
    """What determines a packed call's plan and kernel specialisation (as `forward.plan_key`)."""
    return (tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors),
            tuple((cu.shape, cu.stride(), cu.dtype, cu.device, cu.data_ptr() % 16)
                  for cu in (cu_seqlens_q, cu_seqlens_k)), options)


_FORWARD_PLANS = PlanCache()
_BACKWARD_PLANS = PlanCache()


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                   write_lse, window_size=NO_WINDOW, softcap=0.0, descales=None):
    """Runs the forward kernel on a packed batch: returns (out, lse) with lse (Hq, total_q), None
    unless `write_lse`. FP8 calls pass their (batch, Hkv, 3) descales (`fp8.fp8_descales`)."""
    check_options(causal, softmax_scale)  # every call, as in `forward.attention_forward`
    window_size = check_band(window_size, softcap)
    _check_max_seqlens(max_seqlen_q, max_seqlen_k)
    try:
        key = _varlen_key((q, k, v), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_size,
                          softcap, write_lse)
        plan = _FORWARD_PLANS.get(key)
    except AttributeError:  # not tensors: the checks say which
        key = plan = None
    if plan is None:
        _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, fp8=descales is not None)
        plan = ForwardPlan(q, k, v, cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k, causal, window_size,
                            softcap, write_lse, True)
        if key is not None:
            _FORWARD_PLANS.remember(key, plan)
    if plan.fp8 != (descales is not None):  # a cached plan's fast path too (as `forward.attention_forward`)
        raise TypeError("FP8 q, k, v run through flash_attention_varlen with their descales; other dtypes take no "
                        "descales")
    _check_lengths(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k)
    out, lse = launch_forward(plan, key, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, write_lse,
                           longest_first(cu_seqlens_q, cu_seqlens_k), descales)
    poison_if_malformed(key, cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k, (out, lse))
    return out, lse


def varlen_backward(grad_output, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                    softmax_scale, window_size=NO_WINDOW, softcap=0.0, grad_lse=None):
    """Runs the backward kernels on a packed batch: returns (dq, dk, dv) with the layouts of q, k
    and v; lse and grad_lse are (Hq, total_q)."""
    tensors = (grad_output, q, k, v, out, lse)
    check_options(causal, softmax_scale)  # every call, as in `forward.attention_forward`
    window_size = check_band(window_size, softcap)
    _check_max_seqlens(max_seqlen_q, max_seqlen_k)
    try:
        key = _varlen_key(tensors, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_size,
                          softcap)
        plan = _BACKWARD_PLANS.get(key)
    except AttributeError:  # not tensors: the checks say which
        key = plan = None
    if plan is None:
        _check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
        check_backward_tensors(grad_output, q, v, out, lse, (q.shape[1], q.shape[0]), "(heads_q, total_q)")
        plan = BackwardPlan(tensors, cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k, causal, window_size,
                             softcap, True)
        if key is not None:
            _BACKWARD_PLANS.remember(key, plan)
    _check_lengths(cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k)
    grads = launch_backward(plan, key, grad_output, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                         grad_lse, longest_first(cu_seqlens_q, cu_seqlens_k))
    poison_if_malformed(key, cu_seqlens_q, cu_seqlens_k, q, k, max_seqlen_q, max_seqlen_k, grads)
    return grads


class _VarlenFunction(torch.autograd.Function):
    """Eager autograd over the packed kernels (torch.compile uses the custom ops of `ops.py`)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                window_size, softcap):
        out, lse = varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                  softmax_scale, True, window_size, softcap)
        save_for_backward(ctx, (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k),
                          (max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size, softcap))
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        refuse_double_backward("flash_attention_varlen")
        return (*gradients_from_context(ctx, grad_out, grad_lse, varlen_backward), *(None,) * 8)


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           softmax_scale=None, *, window_size=NO_WINDOW, softcap=0.0, return_lse=False,
                           deterministic=False, q_descale=None, k_descale=None, v_descale=None):
    """Fused attention over a packed batch of sequences of different lengths, differentiable in
    q, k and v.

    Args:
        q: (total_q, Hq, D) the queries of every sequence, one after the other; fp16, bf16 or
            fp32 (see `flash_attention_science` for fp32's precision).
        k, v: (total_k, Hkv, D) keys and (total_k, Hkv, D_v) values, packed the same way, the
            dtype of q; Hq must be a multiple of Hkv (GQA / MQA). D_v may differ from D (MLA, as
            in `flash_attention_science`).
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) cumulative lengths on q's device:
            sequence b has queries cu_seqlens_q[b]:cu_seqlens_q[b + 1] and keys
            cu_seqlens_k[b]:cu_seqlens_k[b + 1]. They start at 0, never decrease and end at
            total_q and total_k; sequences of length 0 are allowed.
        max_seqlen_q, max_seqlen_k: ints at least the longest query and key lengths (they size
            the launch; a larger value only launches programs that return at once).
        causal, softmax_scale, window_size, softcap: as for `flash_attention_science`, applied to
            each sequence on its own (bottom-right alignment uses that sequence's lengths).
        return_lse: also return lse (Hq, total_q) float32, natural log; differentiable.
        deterministic: accepted for compatibility; the backward is always bitwise reproducible.
        q_descale, k_descale, v_descale: FP8 inputs, as for `flash_attention_science`: q, k and v
            in torch.float8_e4m3fn and float32 (batch, Hkv) descales, one per sequence and KV head
            (None: 1); bf16 output, forward only.

    The values of cu_seqlens are checked (ValueError for one that does not start at 0, decreases,
    ends at a count other than the tokens of q or k, or holds a sequence longer than its
    max_seqlen). Checking reads them to the host, which waits for the GPU's queued work, so each
    cu_seqlens tensor is read once and remembered (until it is changed in place); pass the same
    tensor to every layer of a batch. During CUDA graph capture they cannot be read and are
    trusted.

    Under torch.compile the call goes through the torch.library ops
    `flashmoe_science::attention_varlen_forward` and `::attention_varlen_backward`.

    Returns:
        out (total_q, Hq, D_v) with q's layout and dtype, or (out, lse) when return_lse.
    """
    check_flags(deterministic, return_lse)
    packed_batch = cu_seqlens_q.numel() - 1 if isinstance(cu_seqlens_q, torch.Tensor) else None
    descales = fp8_descales(q, k, v, q_descale, k_descale, v_descale, softmax_scale, packed_batch=packed_batch)
    differentiable = records_gradients(q, k, v, descales)
    if torch.compiler.is_compiling():
        check_options(causal, softmax_scale)
        window_left, window_right = check_band(window_size, softcap)
        out, lse = torch.ops.flashmoe_science.attention_varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left,
            window_right, float(softcap), descales)
    elif differentiable:
        out, lse = _VarlenFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                         softmax_scale, window_size, softcap)
    else:
        out, lse = varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                  softmax_scale, return_lse, window_size, softcap, descales)
    return (out, lse) if return_lse else out
