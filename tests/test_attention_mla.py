"""Attention whose values have a head dim of their own (D_v != D, as in DeepSeek's multi-head
latent attention: 192 / 128 in prefill and training): forward, backward, packed batches,
torch.compile and the tensor-descriptor kernels against the float64 reference, the argument
checks, and on the GPU bf16 at DeepSeek's widths with the error compared to PyTorch's own."""
import pytest
import torch

from flashmoe_science import flash_attention_backward, flash_attention_forward, flash_attention_science
from flashmoe_science.attention import attention_reference, flash_attention_varlen
from flashmoe_science.attention.backward import attention_backward
from flashmoe_science.attention.configs import VALUE_HEAD_DIM_BLOCKS, head_dim_block
from flashmoe_science.attention.reference import causal_mask
from flashmoe_science.launch import clear_records, last_launch
from test_attention_backward import TINY_BLOCKS, assert_within_twice
from test_attention_forward import max_error_tolerance, rel_error
from test_attention_varlen import cumulative, reference as varlen_reference


def make_qkv(B, Hq, Hkv, Sq, Sk, D, Dv, dtype, device, layout="bhsd"):
    """Fresh random q, k (head dim D) and v (head dim Dv); "bshd": (B, S, H, D).transpose(1, 2) views."""
    shapes = ((B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv))
    if layout == "bshd":
        return tuple(torch.randn(b, s, h, d, dtype=dtype, device=device).transpose(1, 2) for b, h, s, d in shapes)
    return tuple(torch.randn(shape, dtype=dtype, device=device) for shape in shapes)


def reference(q, k, v, grad_out, grad_lse=None, **options):
    """float64 (out, lse) and the gradients of (out, lse) weighted by (grad_out, grad_lse)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, **options)
    outputs, weights = [out], [grad_out.double()]
    if grad_lse is not None:
        outputs.append(lse)
        weights.append(torch.where(torch.isfinite(lse), grad_lse.double(), 0.0))
    return out.detach(), lse.detach(), torch.autograd.grad(outputs, leaves, weights)


def assert_close(ours, ref, dtype_of):
    tol = max_error_tolerance(dtype_of)
    assert ours.shape == ref.shape
    assert torch.isfinite(ours).all()
    assert (ours.double() - ref).abs().max().item() <= tol * max(ref.abs().max().item(), 1.0)


@pytest.mark.parametrize("options", [dict(causal=False), dict(causal=True),
                                     dict(causal=True, window_size=(9, 0), softcap=4.0)],
                         ids=["full", "causal", "window_softcap"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,Dv,dtype", [
    (2, 4, 2, 37, 45, 48, 32, torch.float32),   # GQA, D_v < D, both padded (64 / 32 tiles)
    (1, 3, 1, 40, 29, 32, 48, torch.float32),   # MQA, D_v > D, Sq > Sk
    (1, 2, 2, 33, 70, 96, 64, torch.float16),   # DeepSeek's small pair: 96 / 64
    (1, 2, 1, 1, 50, 64, 16, torch.float32),    # one query row
])
def test_forward_and_backward_match_reference(B, Hq, Hkv, Sq, Sk, D, Dv, dtype, options, device,
                                              poisoned_allocations):
    q, k, v = (t.requires_grad_() for t in make_qkv(B, Hq, Hkv, Sq, Sk, D, Dv, dtype, device, layout="bshd"))
    out, lse = flash_attention_science(q, k, v, return_lse=True, **options)
    assert out.shape == (B, Hq, Sq, Dv) and out.dtype == dtype and lse.shape == (B, Hq, Sq)
    assert out.transpose(1, 2).is_contiguous()  # q's (B, S, H, D) memory order, with D_v
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    ref, ref_lse, ref_grads = reference(q, k, v, grad_out, grad_lse, **options)
    assert_close(out, ref, q)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - ref_lse[finite]).abs().max().item() < 1e-2
    for g, r, t in zip(grads, ref_grads, (q, k, v)):
        assert g.shape == t.shape and g.dtype == dtype
        assert_close(g, r, q)


@pytest.mark.parametrize("causal", [False, True])
def test_small_tiles_walk_every_loop(causal, device):
    """Tiles far smaller than the sequences (many key and query blocks, both masked runs, the GQA
    head loop), through the explicit forward and backward functions."""
    q, k, v = make_qkv(1, 4, 2, 70, 53, 40, 24, torch.float32, device)
    out, lse = flash_attention_forward(q, k, v, causal=causal)
    grad_out = torch.randn_like(out)
    tiny = attention_backward(grad_out, q, k, v, out, lse, causal, None, config=TINY_BLOCKS)
    assert last_launch("attention_backward_dkdv").constexprs["BLOCK_DV"] == 32
    table = flash_attention_backward(grad_out, q, k, v, out, lse, causal=causal)
    _, _, ref_grads = reference(q, k, v, grad_out, causal=causal)
    for grads in (tiny, table):
        for g, r in zip(grads, ref_grads):
            assert_close(g, r, q)


def test_packed_batches_match_reference(device):
    lengths_q, lengths_k = [5, 0, 17, 9], [7, 3, 17, 30]
    Hq, Hkv, D, Dv = 4, 2, 40, 24
    q = torch.randn(sum(lengths_q), Hq, D, device=device, requires_grad=True)
    k = torch.randn(sum(lengths_k), Hkv, D, device=device, requires_grad=True)
    v = torch.randn(sum(lengths_k), Hkv, Dv, device=device, requires_grad=True)
    cu_q, cu_k = cumulative(lengths_q, device), cumulative(lengths_k, device)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                      return_lse=True)
    assert out.shape == (sum(lengths_q), Hq, Dv)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    ref, _, ref_grads = varlen_reference(q, k, v, cu_q, cu_k, grad_out, grad_lse, causal=True)
    assert_close(out, ref, q)
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, q)


@pytest.mark.parametrize("causal", [False, True])
def test_tma_tiles_give_the_pointer_kernels_bits(causal, device, monkeypatch):
    """The backward's descriptors tile v, dO and dv by v's own padded head dim: the same bits as
    the pointer kernels (the interpreter runs descriptors on CPU tensors; the sm90 check is lifted)."""
    from flashmoe_science.attention import descriptors
    from flashmoe_science.attention.configs import BackwardConfig

    monkeypatch.setattr(descriptors, "supports_backward", lambda *args: True)
    q, k, v = make_qkv(2, 4, 2, 37, 53, 64, 32, torch.float32, device, layout="bshd")
    out, lse = flash_attention_forward(q, k, v, causal=causal)
    grad_out = torch.randn_like(out)
    expected = attention_backward(grad_out, q, k, v, out, lse, causal, None, config=TINY_BLOCKS)
    tma = BackwardConfig(TINY_BLOCKS.dkdv, TINY_BLOCKS.dq, tma=True)
    grads = attention_backward(grad_out, q, k, v, out, lse, causal, None, config=tma)
    assert last_launch("attention_backward_dkdv").constexprs["TMA"] is True
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert torch.equal(g, e), name


def test_compiled_call_equals_eager(device):
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 2, 24, 40, 48, 32, torch.float32, device, layout="bshd"))

    def attention(q, k, v):
        return flash_attention_science(q, k, v, causal=True, return_lse=True)

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    out, lse = compiled(q, k, v)
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    compiled_grads = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    eager_out, eager_lse = attention(q, k, v)
    eager_grads = torch.autograd.grad((eager_out, eager_lse), (q, k, v), (grad_out, grad_lse))
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    for c, e in zip(compiled_grads, eager_grads):
        assert torch.equal(c, e)


@pytest.mark.parametrize("make_args, error, match", [
    (lambda q, k, v: (q, k, v[..., :8]), ValueError, "head_dim of v"),
    (lambda q, k, v: (q, k, torch.randn(1, 2, 9, 32)), ValueError, "k and v must have the same shape but for the "
                                                                    "head dim"),
    (lambda q, k, v: (q[..., :32], k, v), ValueError, "q and k must have the same head_dim"),
])
def test_bad_head_dims_are_named(make_args, error, match, device):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 48, 32, torch.float32, "cpu")
    with pytest.raises(error, match=match):
        flash_attention_science(*(t.to(device) for t in make_args(q, k, v)))


def test_backward_names_a_gradient_of_the_wrong_head_dim(device):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 48, 32, torch.float32, device)
    out, lse = flash_attention_forward(q, k, v)
    with pytest.raises(ValueError, match=r"grad_output must have the shape of q with v's head dim \(1, 2, 8, 32\)"):
        flash_attention_backward(torch.zeros_like(q), q, k, v, out, lse)


def test_the_compile_check_covers_deepseeks_head_dims():
    """The pairs DeepSeek's models use pad to builds the compile-and-fit check compiles."""
    for d, dv in ((192, 128), (128, 64), (96, 64)):
        assert VALUE_HEAD_DIM_BLOCKS[head_dim_block(d)] == head_dim_block(dv)


# ---- GPU: bf16 at DeepSeek's widths, error compared with PyTorch's own ----

@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,S,D,Dv,softcap,kernels", [
    # DeepSeek-V2/V3 prefill: the Gluon kernels
    (2, 16, 16, 2048, 192, 128, 0.0, ("attention_forward_gluon", "attention_backward_dkdv_gluon")),
    # softcap: the Triton TMA kernels
    (2, 8, 8, 2048, 192, 128, 8.0, ("attention_forward_hopper", "attention_backward_dkdv")),
    # short: the generic kernels
    (1, 8, 8, 333, 192, 128, 0.0, ("attention_forward", "attention_backward_dkdv")),
    (2, 16, 4, 2048, 128, 64, 0.0, ("attention_forward_gluon", "attention_backward_dkdv_gluon")),
])
def test_gpu_bf16_within_twice_pytorch(B, Hq, Hkv, S, D, Dv, softcap, kernels, causal):
    """Our error against float64 within twice PyTorch's own in bf16: SDPA (K, V repeated for GQA),
    or with a softcap the reference formula run in bf16."""
    from flashmoe_science.device import info_for

    dtype = torch.bfloat16
    q, k, v = (t.requires_grad_() for t in make_qkv(B, Hq, Hkv, S, S, D, Dv, dtype, "cuda", layout="bshd"))
    grad_out = torch.randn(B, S, Hq, Dv, dtype=dtype, device="cuda").transpose(1, 2)
    clear_records()
    out = flash_attention_science(q, k, v, causal=causal, softcap=softcap)
    ours = torch.autograd.grad(out, (q, k, v), grad_out)
    if info_for(q).capability == 90:
        assert all(last_launch(kernel) is not None for kernel in kernels)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if softcap:
        theirs_out, _ = attention_reference(*leaves, causal=causal, upcast=False, softcap=softcap)
    else:
        group = Hq // Hkv
        mask = causal_mask(S, S, "cuda") if causal else None
        theirs_out = torch.nn.functional.scaled_dot_product_attention(
            leaves[0], leaves[1].repeat_interleave(group, 1), leaves[2].repeat_interleave(group, 1), attn_mask=mask)
    theirs = torch.autograd.grad(theirs_out, leaves, grad_out)
    ref, _, ref_grads = reference(q, k, v, grad_out, causal=causal, softcap=softcap)
    assert rel_error(out, ref) <= 2 * rel_error(theirs_out, ref) + 5e-4
    assert_within_twice(ours, theirs, ref_grads)
