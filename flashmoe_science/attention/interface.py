"""The public attention functions on dense (B, H, S, D) batches: `flash_attention_science`,
`flash_attention_forward`, `flash_attention_backward`.

Each checks its options and hands the call to `forward.attention_forward` or
`backward.attention_backward`, which pick the kernels and launch them (their module docstrings
say which kernel runs for which call). Calls that need gradients run under a
torch.autograd.Function (`_AttentionFunction`); calls traced by torch.compile go through the
torch.library custom ops of `ops.py`, which carry fake implementations and the same backward.
"""
from __future__ import annotations

import torch

from .backward import attention_backward
from .checks import NO_WINDOW, check_band, check_bool, check_flags, check_options
from .fp8 import fp8_descales, refuse_fp8_gradients
from .forward import attention_forward


def save_for_backward(ctx, tensors, options) -> None:
    """What the backward needs, saved on an autograd context (shared with the custom ops): the
    tensors (q, k, v, out, lse, then any more the backward takes) and the call's other
    arguments, in the order the backward takes them after the tensors."""
    ctx.save_for_backward(*tensors)
    ctx.options = options
    # An output the loss does not use gets None instead of a tensor of zeros.
    ctx.set_materialize_grads(False)


def gradients_from_context(ctx, grad_out, grad_lse, backward):
    """(dq, dk, dv) from a context `save_for_backward` filled: runs
    `backward(grad_out, *tensors, *options, grad_lse)`."""
    tensors = ctx.saved_tensors
    if grad_out is None:  # only lse was used
        grad_out = torch.zeros_like(tensors[3])
    return backward(grad_out, *tensors, *ctx.options, grad_lse)


def records_gradients(q, k, v, descales) -> bool:
    """Whether a forward call runs under autograd: grad mode on and q, k or v requiring grad (False
    for arguments that are not tensors, which the checks then name). FP8 calls (`descales` given)
    never do: an FP8 input that requires grad is an error."""
    if descales is not None:
        refuse_fp8_gradients(q, k, v)
        return False
    try:
        return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    except AttributeError:
        return False


def refuse_double_backward(name: str) -> None:
    """The kernels' gradients have no graph of their own: a gradient penalty would silently
    drop dq's own dependence on q, k and v."""
    if torch.is_grad_enabled():  # create_graph=True
        raise RuntimeError(f"{name} has no second derivative; backward with create_graph=True is not supported")


class _AttentionFunction(torch.autograd.Function):
    """Eager autograd over the kernels. It skips the custom ops' dispatcher round trips (which
    about double the host time of a small training call); torch.compile uses the ops instead."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, window_size, softcap):
        out, lse = attention_forward(q, k, v, causal, softmax_scale, True, None, window_size, softcap)
        save_for_backward(ctx, (q, k, v, out, lse), (causal, softmax_scale, window_size, softcap))
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        refuse_double_backward("flash_attention_science")
        return (*gradients_from_context(ctx, grad_out, grad_lse, attention_backward), None, None, None, None)


def flash_attention_forward(q, k, v, causal=False, softmax_scale=None, *, window_size=NO_WINDOW, softcap=0.0,
                            q_descale=None, k_descale=None, v_descale=None):
    """Fused attention forward; returns (out, lse). See `flash_attention_science` for the contract
    (FP8 inputs with their descales included).

    lse: (B, Hq, Sq) float32, the natural-log sum of exponentials of each query row's scaled
    scores (-inf for rows that see no key); the backward pass takes it.
    """
    descales = fp8_descales(q, k, v, q_descale, k_descale, v_descale, softmax_scale)
    return attention_forward(q, k, v, causal, softmax_scale, True, None, window_size, softcap, descales)


def flash_attention_backward(grad_output, q, k, v, output, softmax_lse, causal=False, softmax_scale=None, *,
                             window_size=NO_WINDOW, softcap=0.0, deterministic=False):
    """Gradients of fused attention; returns (dq, dk, dv).

    Args:
        grad_output: (B, Hq, Sq, D_v) gradient of the attention output, the dtype of q; any strides.
        q, k, v, causal, softmax_scale, window_size, softcap: the forward call's arguments (see
            `flash_attention_science`).
        output: (B, Hq, Sq, D_v) the forward's output.
        softmax_lse: (B, Hq, Sq) float32, the lse `flash_attention_forward` returned.
        deterministic: accepted for compatibility with flash-attn. Gradients are always bitwise
            reproducible here: every element of dq, dk and dv is summed by one program in a fixed
            order (dQ has its own kernel instead of atomic adds), so True costs nothing.

    dq has q's layout and dtype, dk and dv those of k and v, summed over the
    query heads of each group under GQA/MQA. Rows that saw no key get zero gradients. fp32
    inputs' products follow torch's float32 matmul precision (see `flash_attention_science`).
    Memory beyond the outputs is O(B * Hq * Sq).
    """
    check_bool("deterministic", deterministic)
    return attention_backward(grad_output, q, k, v, output, softmax_lse, causal, softmax_scale, window_size, softcap)


def flash_attention_science(q, k, v, causal=False, softmax_scale=None, *, window_size=NO_WINDOW, softcap=0.0,
                            return_lse=False, deterministic=False, q_descale=None, k_descale=None, v_descale=None):
    """Fused scaled-dot-product attention, differentiable in q, k and v.

    Args:
        q: (B, Hq, Sq, D) query, fp16, bf16 or fp32. fp32 products on the GPU follow
            `torch.get_float32_matmul_precision()`: "highest" (PyTorch's default) runs 3xTF32,
            with errors near fp32's; "high" or "medium" one TF32 product (about 3x faster).
        k, v: (B, Hkv, Sk, D) keys and (B, Hkv, Sk, D_v) values, the dtype of q. Hq must be a
            multiple of Hkv (grouped-query / multi-query attention); K and V are never repeated
            in memory. D_v may differ from D, as in DeepSeek's multi-head latent attention (MLA:
            D = 192, D_v = 128 in prefill and training); the output then has D_v. Such calls run
            the same kernels (not the KV-cache ones: short queries run the general forward).
        causal: mask scores above the diagonal. The diagonal is aligned bottom-right: query i sees
            keys j <= i + (Sk - Sq), as in flash-attn >= 2.1 and as decoding with a KV cache needs.
            This differs from `scaled_dot_product_attention(is_causal=True)` when Sq != Sk (SDPA
            aligns top-left). Query rows that see no key return 0 (and lse -inf), never NaN.
        softmax_scale: multiplies q.k^T before the softmax; default 1/sqrt(D).
        window_size: (left, right) sliding window, as in flash-attn: with c = i + Sk - Sq (the
            same bottom-right alignment), query i sees keys c - left <= j <= c + right; -1 leaves
            a side unbounded, and causal=True sets right = 0 whatever is passed. Key blocks
            outside the window are skipped, so the cost grows with the window, not with Sk.
        softcap: when > 0, scores s (after softmax_scale) become softcap * tanh(s / softcap)
            before the softmax (Gemma-2, Grok), forward and backward. 0 turns it off.
        return_lse: also return lse (B, Hq, Sq) float32, natural log. It is differentiable too.
        deterministic: accepted for compatibility with flash-attn. The backward is always bitwise
            reproducible (no atomic adds: dQ has its own kernel), so True costs nothing.
        q_descale, k_descale, v_descale: FP8 attention (FlashAttention-3's interface, `fp8.py`):
            q, k and v all in torch.float8_e4m3fn, and these float32 (B, Hkv) tensors (None: 1)
            the factors that turn the stored values into real ones, >= 0. Both products run on the
            FP8 tensor cores (sm89, sm90; sm80 and sm86 refuse), the output is bf16, lse as usual;
            forward only (no gradients; torch.compile traces it). `fp8_attention_inputs(q, k, v)`
            makes all six from 16-bit tensors.

    Any Sq, Sk >= 0 and any D, D_v from 16 to 256. Inputs may have any strides with unit stride in D
    (such as (B, S, H, D).transpose(1, 2) views), which are read in place; a tensor whose last
    dimension is not contiguous is copied first. The output has q's layout and dtype.

    Gradients flow when autograd is on and q, k or v requires grad. Under torch.compile the call
    goes through the torch.library ops `flashmoe_science::attention_forward` and
    `::attention_backward` (`fullgraph=True` works, forward and backward); eager calls launch the
    same kernels directly. The backward keeps memory O(S): it recomputes the attention weights
    from q, k and lse instead of storing them.

    Returns:
        out (B, Hq, Sq, D_v), or (out, lse) when return_lse.
    """
    check_flags(deterministic, return_lse)
    descales = fp8_descales(q, k, v, q_descale, k_descale, v_descale, softmax_scale)
    differentiable = records_gradients(q, k, v, descales)
    if torch.compiler.is_compiling():
        check_options(causal, softmax_scale)
        window_left, window_right = check_band(window_size, softcap)
        out, lse = torch.ops.flashmoe_science.attention_forward(q, k, v, causal, softmax_scale, window_left,
                                                                window_right, float(softcap), descales)
    elif differentiable:
        out, lse = _AttentionFunction.apply(q, k, v, causal, softmax_scale, window_size, softcap)
    else:
        out, lse = attention_forward(q, k, v, causal, softmax_scale, return_lse, None, window_size, softcap,
                                     descales)
    return (out, lse) if return_lse else out
