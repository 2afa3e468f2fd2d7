"""`flash_attention_qkvpacked`: attention on a packed QKV projection, whose backward writes dq,
dk and dv into one gradient tensor laid out like the projection."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashmoe_science import FlashMoEScienceAttention, flash_attention_qkvpacked, flash_attention_science
from test_attention_backward import assert_grads_close, reference_grads


def split(qkv, num_kv_heads=None):
    """q, k, v as (B, H, S, D) views of a (B, S, 3, H, D) or (B, S, Hq + 2 * Hkv, D) qkv."""
    if qkv.dim() == 5:
        return tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))
    heads_kv = num_kv_heads or qkv.shape[2] // 3
    heads_q = qkv.shape[2] - 2 * heads_kv
    return (qkv[:, :, :heads_q].transpose(1, 2), qkv[:, :, heads_q:heads_q + heads_kv].transpose(1, 2),
            qkv[:, :, heads_q + heads_kv:].transpose(1, 2))


def packed_grads(qkv, num_kv_heads, causal, grad_out, **options):
    qkv = qkv.detach().requires_grad_()
    out = flash_attention_qkvpacked(qkv, causal, num_kv_heads=num_kv_heads, **options)
    (dqkv,) = torch.autograd.grad(out, qkv, grad_out)
    return out, dqkv


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape,num_kv_heads,dtype", [
    ((2, 37, 3, 2, 32), None, torch.float32),  # flash-attn's layout, a length that is not a block multiple
    ((1, 45, 8, 40), 2, torch.float32),        # grouped-query heads, a padded head dim
    ((1, 29, 5, 16), 1, torch.float32),        # multi-query
    ((1, 33, 3, 2, 64), None, torch.float16),
])
def test_gradients_match_reference(shape, num_kv_heads, dtype, causal, device, poisoned_allocations):
    """dqkv, poisoned where unwritten, holds each of dq, dk, dv in its place (float64 reference)."""
    qkv = torch.randn(shape, dtype=dtype, device=device)
    q, k, v = split(qkv, num_kv_heads)
    grad_out = torch.randn(q.transpose(1, 2).shape, dtype=dtype, device=device)
    out, dqkv = packed_grads(qkv, num_kv_heads, causal, grad_out)
    assert out.shape == grad_out.shape and out.is_contiguous()
    assert dqkv.shape == qkv.shape and dqkv.stride() == qkv.stride() and dqkv.dtype == dtype
    assert_grads_close(split(dqkv, num_kv_heads), reference_grads(q, k, v, grad_out.transpose(1, 2), causal), dtype)


def test_same_bits_as_flash_attention_science_on_views(device):
    """The same kernels as the unpacked call, so the same output and gradients, bit for bit."""
    qkv = torch.randn(2, 50, 6, 32, device=device)
    grad_out = torch.randn(2, 50, 4, 32, device=device)
    out, dqkv = packed_grads(qkv, 1, True, grad_out, window_size=(7, 0), softcap=5.0)
    qkv_ref = qkv.clone().requires_grad_()
    ref = flash_attention_science(*split(qkv_ref, 1), causal=True, window_size=(7, 0), softcap=5.0)
    (dref,) = torch.autograd.grad(ref, qkv_ref, grad_out.transpose(1, 2))
    assert torch.equal(out, ref.transpose(1, 2)) and torch.equal(dqkv, dref)


@pytest.mark.parametrize("layout", ["slice", "last_dim_strided"])
def test_qkv_that_is_not_dense(layout, device):
    """A slice of a wider tensor gets a dense dqkv; a qkv strided in D is copied first."""
    if layout == "slice":
        base = torch.randn(2, 21, 8, 24, device=device)
        qkv = base[:, :, 1:7]
    else:
        qkv = torch.randn(2, 21, 24, 6, device=device).transpose(2, 3)
    q, k, v = split(qkv)
    grad_out = torch.randn(2, 21, 2, 24, device=device)
    _, dqkv = packed_grads(qkv, None, True, grad_out)
    assert dqkv.shape == qkv.shape
    assert_grads_close(split(dqkv), reference_grads(q, k, v, grad_out.transpose(1, 2), True), torch.float32)


def test_lse_is_differentiable(device):
    qkv = torch.randn(1, 26, 3, 2, 16, device=device)
    q, k, v = split(qkv)
    grad_out, grad_lse = torch.randn(1, 26, 2, 16, device=device), torch.randn(1, 2, 26, device=device)
    qkv_ = qkv.clone().requires_grad_()
    out, lse = flash_attention_qkvpacked(qkv_, True, return_lse=True)
    assert lse.shape == (1, 2, 26)
    (dqkv,) = torch.autograd.grad((out, lse), qkv_, (grad_out, grad_lse))
    refs = reference_grads(q, k, v, grad_out.transpose(1, 2), True, grad_lse=grad_lse)
    assert_grads_close(split(dqkv), refs, torch.float32)
    (only_lse,) = torch.autograd.grad(flash_attention_qkvpacked(qkv_, True, return_lse=True)[1], qkv_, grad_lse)
    refs = reference_grads(q, k, v, torch.zeros_like(q), True, grad_lse=grad_lse)
    assert_grads_close(split(only_lse), refs, torch.float32)


@pytest.mark.parametrize("shape", [(0, 5, 3, 2, 16), (2, 0, 3, 2, 16), (1, 1, 3, 2, 16)])
def test_empty_batch_and_length_one(shape, device):
    qkv = torch.randn(shape, device=device)
    grad_out = torch.randn(shape[0], shape[1], 2, 16, device=device)
    out, dqkv = packed_grads(qkv, None, True, grad_out)
    assert out.shape == grad_out.shape and dqkv.shape == qkv.shape
    if qkv.numel():  # one query sees one key: its weight is 1, so out = v and dv = grad_out
        tol = 2e-3 if qkv.is_cuda else 1e-5  # products in tf32 on the GPU
        torch.testing.assert_close(out, qkv[:, :, 2], rtol=tol, atol=tol)
        torch.testing.assert_close(dqkv[:, :, 2], grad_out, rtol=tol, atol=tol)
        assert dqkv[:, :, :2].abs().max() < tol  # dO.O - delta: 0 in exact arithmetic


def test_no_grad_call_matches(device):
    qkv = torch.randn(2, 19, 9, 32, device=device)
    with torch.no_grad():
        out, lse = flash_attention_qkvpacked(qkv, True, num_kv_heads=3, return_lse=True)
    ref, ref_lse = flash_attention_science(*split(qkv, 3), causal=True, return_lse=True)
    assert torch.equal(out, ref.transpose(1, 2)) and torch.equal(lse, ref_lse) and out.is_contiguous()


def test_compiled_call_equals_eager(device):
    qkv = torch.randn(2, 24, 8, 16, device=device)
    grad_out = torch.randn(2, 24, 4, 16, device=device)

    def attention(qkv):
        return flash_attention_qkvpacked(qkv, True, num_kv_heads=2)

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    qkv_ = qkv.clone().requires_grad_()
    out = compiled(qkv_)
    (dqkv,) = torch.autograd.grad(out, qkv_, grad_out)
    eager, eager_dqkv = packed_grads(qkv, 2, True, grad_out)
    assert torch.equal(out, eager) and torch.equal(dqkv, eager_dqkv)


def test_layer_backward_takes_no_gradient_copies(device):
    """The layer's graph from its output back to the projection: no slice, stack or transpose
    node whose backward would copy dq, dk and dv into the projection's gradient."""
    layer = FlashMoEScienceAttention(64, 4, 2, causal=True, device=device)
    out = layer(torch.randn(2, 9, 64, device=device))
    names, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            names.add(type(node).__name__)
            stack += [f for f, _ in node.next_functions]
    assert "_PackedFunctionBackward" in names
    assert not {n for n in names if n.startswith(("Slice", "Stack", "Unbind", "Transpose", "Clone"))}, names


@pytest.mark.parametrize("args,kwargs,error,match", [
    (([1, 2],), {}, TypeError, "qkv must be a torch.Tensor"),
    ((torch.zeros(1, 4, 6, 16, dtype=torch.int32),), {}, TypeError, "qkv has dtype torch.int32"),
    ((torch.zeros(1, 4, 6, 16),), {"num_kv_heads": 0}, ValueError, "num_kv_heads must be a positive int"),
    ((torch.zeros(1, 4, 6, 16),), {"num_kv_heads": True}, ValueError, "num_kv_heads must be a positive int"),
    ((torch.zeros(4, 6, 16),), {}, ValueError, r"qkv must be \(batch, seqlen, 3, heads, head_dim\)"),
    ((torch.zeros(1, 4, 2, 2, 16),), {}, ValueError, r"a 5-D qkv must be \(batch, seqlen, 3, heads, head_dim\)"),
    ((torch.zeros(1, 4, 3, 2, 16),), {"num_kv_heads": 1}, ValueError, "as many key/value heads as query heads"),
    ((torch.zeros(1, 4, 7, 16),), {}, ValueError, "not a multiple of 3"),
    ((torch.zeros(1, 4, 7, 16),), {"num_kv_heads": 2}, ValueError, "leaves 3 query heads"),
    ((torch.zeros(1, 4, 6, 16),), {"num_kv_heads": 3}, ValueError, "leaves 0 query heads"),
    ((torch.zeros(1, 4, 6, 8),), {}, ValueError, "head_dim"),
    ((torch.zeros(1, 4, 6, 16), 1), {}, TypeError, "causal must be a bool"),
])
def test_bad_input_raises_clear_error(args, kwargs, error, match, device):
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.raises(error, match=match):
        flash_attention_qkvpacked(*args, **kwargs)


_OPTIONS = st.fixed_dictionaries(dict(
    causal=st.booleans(), window_size=st.sampled_from([(-1, -1), (3, 0), (2, 5)]),
    softcap=st.sampled_from([0.0, 2.0]), softmax_scale=st.sampled_from([None, 0.3]), return_lse=st.booleans(),
    grad=st.booleans()))


@given(calls=st.lists(_OPTIONS, min_size=2, max_size=4))
def test_calls_on_one_tensor_with_any_options_match_the_unpacked_call(calls):
    """Calls on one qkv (the same tensor facts, so one cached entry per option set) in any order,
    with and without gradients: each returns the unpacked call's bits, lse and dqkv included, so no
    call's cached plans ever serve another's options."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    qkv = torch.randn(1, 24, 6, 16, device=device)
    grad_out = torch.randn(1, 24, 2, 16, device=device)
    for options in calls:
        grad = options.pop("grad")
        return_lse = options["return_lse"]
        x, x_ref = (qkv.clone().requires_grad_(grad) for _ in range(2))
        got = flash_attention_qkvpacked(x, num_kv_heads=2, **options)
        ref = flash_attention_science(*split(x_ref, 2), **options)
        out, ref_out = (got[0], ref[0]) if return_lse else (got, ref)
        assert torch.equal(out, ref_out.transpose(1, 2)), options
        if return_lse:
            assert torch.equal(got[1], ref[1]), options
        if grad:
            (dx,) = torch.autograd.grad(out, x, grad_out)
            (dref,) = torch.autograd.grad(ref_out, x_ref, grad_out.transpose(1, 2))
            assert torch.equal(dx, dref), options


@pytest.mark.parametrize("kwargs,error,match", [
    ({"causal": 1}, TypeError, "causal must be a bool"),
    ({"window_size": (1.0, 2)}, TypeError, "window_size must be a pair of ints"),
    ({"window_size": (-2, 0)}, ValueError, "window_size entries must be >= 0"),
    ({"softmax_scale": float("nan")}, ValueError, "softmax_scale must be finite"),
    ({"softcap": True}, TypeError, "softcap must be a float"),
    ({"return_lse": 1}, TypeError, "return_lse must be a bool"),
    ({"deterministic": 0}, TypeError, "deterministic must be a bool"),
    ({"num_kv_heads": 1.0}, ValueError, "num_kv_heads must be a positive int"),
])
def test_a_call_like_a_checked_one_is_still_checked(kwargs, error, match, device):
    """A call whose tensor facts match an earlier, valid call reuses that call's plans; options
    equal to the valid ones but of another type (1 == True, (1.0, 2) == (1, 2)), or invalid, are
    still refused with the usual error, before and after a call with the same tensor."""
    qkv = torch.randn(1, 16, 6, 16, device=device, requires_grad=True)
    good = dict(causal=True, window_size=(1, 2), softmax_scale=0.5, softcap=0.0, return_lse=False,
                deterministic=False, num_kv_heads=1 if "num_kv_heads" in kwargs else None)
    expected = flash_attention_qkvpacked(qkv, **good)
    for _ in range(2):
        with pytest.raises(error, match=match):
            flash_attention_qkvpacked(qkv, **{**good, **kwargs})
        assert torch.equal(flash_attention_qkvpacked(qkv, **good), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gpu_descriptor_kernels_write_into_dqkv(D):
    """At sizes that take the sm90 kernels with tensor descriptors (Gluon; Triton's with a
    softcap), the gradients' descriptors address views of dqkv: the same bits as the unpacked
    call, with the allocator's blocks filled with NaN first so that an unwritten element shows."""
    from flashmoe_science.launch import clear_records, last_launch

    qkv = torch.randn(2, 2100, 24, D, dtype=torch.bfloat16, device="cuda")  # 2e10 FLOPs or more
    grad_out = torch.randn(2, 2100, 16, D, dtype=torch.bfloat16, device="cuda")
    for softcap in (0.0, 30.0):
        poison = [torch.full_like(qkv, float("nan")) for _ in range(3)]
        del poison
        clear_records()
        out, dqkv = packed_grads(qkv, 4, True, grad_out, softcap=softcap)
        if torch.cuda.get_device_capability() == (9, 0):
            triton_dkdv = last_launch("attention_backward_dkdv")
            if triton_dkdv is None:
                assert last_launch("attention_backward_dkdv_gluon") is not None
            else:
                assert triton_dkdv.constexprs["TMA"]
        qkv_ref = qkv.clone().requires_grad_()
        ref = flash_attention_science(*split(qkv_ref, 4), causal=True, softcap=softcap)
        (dref,) = torch.autograd.grad(ref, qkv_ref, grad_out.transpose(1, 2))
        assert torch.isfinite(dqkv).all()
        assert torch.equal(out, ref.transpose(1, 2)) and torch.equal(dqkv, dref)
