"""flash_attention_varlen: packed variable-length batches against a float64 reference that runs
each sequence on its own, forward and gradients, with every option; cu_seqlens checks; autograd,
torch.compile and the custom ops.

On the CPU these run through Triton's interpreter in fp32 and fp16 at small sizes; the GPU tests
(marked `gpu`) add bf16 at realistic lengths and compare our error with PyTorch's own.
"""
import itertools

import pytest
import torch

from flashmoe_science import flash_attention_varlen
from flashmoe_science.attention import varlen_attention_reference
from flashmoe_science.attention.reference import band_mask
from test_attention_forward import lse_tolerance, max_error_tolerance, rel_error



def cumulative(lengths, device):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def make_packed(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, device, requires_grad=False):
    """Fresh random packed q, k, v and their cu_seqlens."""
    q = torch.randn(sum(lengths_q), heads_q, head_dim, dtype=dtype, device=device)
    k = torch.randn(sum(lengths_k), heads_kv, head_dim, dtype=dtype, device=device)
    v = torch.randn(sum(lengths_k), heads_kv, head_dim, dtype=dtype, device=device)
    q, k, v = (t.requires_grad_(requires_grad) for t in (q, k, v))
    return q, k, v, cumulative(lengths_q, device), cumulative(lengths_k, device)


def reference(q, k, v, cu_q, cu_k, grad_out, grad_lse, **options):
    """float64 (out, lse) and the gradients of (out, lse) weighted by (grad_out, grad_lse)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = varlen_attention_reference(q64, k64, v64, cu_q, cu_k, **options)
    # Rows that see no key have lse = -inf, whose gradient through logsumexp is NaN: they get
    # no lse gradient (ours are zero there, checked separately).
    grad_lse = torch.where(torch.isfinite(lse), grad_lse.double(), 0.0)
    grads = torch.autograd.grad((out, lse), (q64, k64, v64), (grad_out.double(), grad_lse), allow_unused=True)
    return out.detach(), lse.detach(), [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v))]


def check(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, device, **options):
    q, k, v, cu_q, cu_k = make_packed(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, device, True)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q, default=0), max(lengths_k, default=0),
                                      return_lse=True, **options)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (heads_q, q.shape[0])
    grad_out, grad_lse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    ref, ref_lse, ref_grads = reference(q, k, v, cu_q, cu_k, grad_out, grad_lse, **options)
    tol = max_error_tolerance(q)
    assert not out.isnan().any()
    assert (out.double() - ref).abs().max().item() <= tol * max(ref.abs().max().item(), 1.0)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows that see no key must have lse = -inf, and only they"
    assert torch.equal(out[~seen.T], torch.zeros_like(out[~seen.T])), "rows that see no key must be zero"
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=lse_tolerance(q), rtol=1e-4)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.shape == r.shape and not g.isnan().any(), name
        err, scale = (g.double() - r).abs().max().item(), r.abs().max().item()
        assert err <= tol * max(scale, 1.0), f"{name}: max error {err:.3g} for gradients up to {scale:.3g}"
    return q, k, v, cu_q, cu_k, out, lse


@pytest.mark.parametrize("lengths_q,lengths_k,heads_q,heads_kv,head_dim,dtype,options", [
    # Sq = Sk per sequence, lengths of 0 and 1 among longer ones, a sequence over several blocks.
    ([37, 0, 1, 100, 5], None, 2, 2, 32, torch.float32, dict()),
    ([37, 0, 1, 100, 5], None, 2, 2, 32, torch.float32, dict(causal=True)),
    # Sq != Sk in every sequence (decode-like, longer queries, no keys at all), GQA.
    ([3, 70, 19, 1, 8], [40, 30, 19, 66, 0], 4, 2, 40, torch.float32, dict(causal=True)),
    ([3, 70, 19, 1, 8], [40, 30, 19, 66, 0], 4, 1, 40, torch.float32, dict(softmax_scale=0.3)),
    # Windows: left only with causal, right only, both; with a softcap.
    ([90, 12, 65], [90, 40, 65], 2, 1, 64, torch.float32, dict(causal=True, window_size=(20, -1))),
    ([90, 12, 65], [90, 40, 65], 2, 2, 64, torch.float32, dict(window_size=(-1, 7), softcap=2.0)),
    ([90, 12, 65], [60, 40, 65], 3, 1, 16, torch.float32, dict(window_size=(0, 0))),
    ([50, 77, 2], [50, 77, 9], 4, 2, 80, torch.float16, dict(causal=True, window_size=(33, 10), softcap=5.0)),
    ([50, 77, 2], [50, 77, 9], 2, 2, 128, torch.float16, dict()),
])
def test_varlen_matches_reference(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, options, device):
    check(lengths_q, lengths_k or lengths_q, heads_q, heads_kv, head_dim, dtype, device, **options)


def test_every_element_written_and_rows_without_keys_zero(device, poisoned_allocations):
    """Sequences whose queries see no key (no keys at all, or causal with more queries than keys)
    give zero output, lse -inf and zero gradients: no NaN, every element written."""
    q, k, v, cu_q, cu_k, out, lse = check([6, 40, 9], [0, 25, 9], 2, 1, 32, torch.float32, device, causal=True)
    blind = torch.zeros(q.shape[0], dtype=torch.bool)
    blind[:6] = True  # the first sequence has no keys
    blind[6:6 + 15] = True  # causal, bottom-right: query i of the second sees keys j <= i - 15
    assert torch.all(lse[:, blind.to(lse.device)] == float("-inf"))
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, 40, 25, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.equal(dq[blind], torch.zeros_like(dq[blind]))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


def test_empty_batch_and_batch_of_empty_sequences(device):
    q, k, v, cu_q, cu_k = make_packed([0, 0], [0, 0], 2, 2, 32, torch.float32, device)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 0, 0, return_lse=True)
    assert out.shape == (0, 2, 32) and lse.shape == (2, 0)
    q, k, v, cu_q, cu_k = make_packed([], [], 2, 2, 32, torch.float32, device)
    assert flash_attention_varlen(q, k, v, cu_q, cu_k, 0, 0).shape == (0, 2, 32)
    q, k, v, cu_q, cu_k = make_packed([4, 3], [0, 0], 2, 2, 32, torch.float32, device, requires_grad=True)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 4, 0, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.all(lse == float("-inf"))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert torch.equal(dq, torch.zeros_like(dq)) and dk.shape == k.shape


def test_max_seqlen_larger_than_needed_changes_nothing(device):
    q, k, v, cu_q, cu_k = make_packed([20, 7], [11, 30], 2, 1, 32, torch.float32, device)
    tight = flash_attention_varlen(q, k, v, cu_q, cu_k, 20, 30, causal=True)
    loose = flash_attention_varlen(q, k, v, cu_q, cu_k, 200, 300, causal=True)
    assert torch.equal(tight, loose)


def test_strided_packed_views_are_read_in_place(device):
    """q, k, v as slices of one packed (total, 3, H, D) projection: token stride 3 * H * D."""
    lengths = [13, 30, 1]
    qkv = torch.randn(sum(lengths), 3, 2, 32, device=device)
    q, k, v = qkv.unbind(1)
    cu = cumulative(lengths, device)
    out = flash_attention_varlen(q, k, v, cu, cu, 30, 30, causal=True)
    ref, _ = varlen_attention_reference(q, k, v, cu, cu, causal=True)
    assert rel_error(out, ref) < max_error_tolerance(out)
    assert torch.equal(out, flash_attention_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, 30, 30,
                                                   causal=True))


def test_gradients_bitwise_reproducible(device):
    q, k, v, cu_q, cu_k = make_packed([33, 70, 5], [33, 70, 5], 4, 1, 32, torch.float16, device, True)
    grad_out = torch.randn_like(q)
    runs = [torch.autograd.grad(flash_attention_varlen(q, k, v, cu_q, cu_k, 70, 70, causal=True, deterministic=True),
                                (q, k, v), grad_out) for _ in range(2)]
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_compiled_varlen_equals_eager(device):
    """fullgraph torch.compile through the varlen custom ops, forward and backward (lse too)."""
    q, k, v, cu_q, cu_k = make_packed([9, 0, 21], [15, 4, 21], 4, 2, 16, torch.float32, device, True)
    grad_out, grad_lse = torch.randn_like(q), torch.randn(4, q.shape[0], device=device)

    def attention(q, k, v, cu_q, cu_k):
        return flash_attention_varlen(q, k, v, cu_q, cu_k, 21, 21, causal=True, window_size=(5, -1), softcap=3.0,
                                      return_lse=True)

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    out, lse = compiled(q, k, v, cu_q, cu_k)
    eager_out, eager_lse = attention(q, k, v, cu_q, cu_k)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    grad_lse = torch.where(torch.isfinite(lse), grad_lse, 0.0)
    compiled_grads = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    eager_grads = torch.autograd.grad((eager_out, eager_lse), (q, k, v), (grad_out, grad_lse))
    for c, e in zip(compiled_grads, eager_grads):
        assert torch.equal(c, e)


def test_varlen_custom_ops_pass_opcheck(device):
    forward = torch.ops.flashmoe_science.attention_varlen_forward.default
    backward = torch.ops.flashmoe_science.attention_varlen_backward.default
    q, k, v, cu_q, cu_k = make_packed([7, 12], [10, 12], 4, 2, 16, torch.float32, device, True)
    torch.library.opcheck(forward, (q, k, v, cu_q, cu_k, 12, 12, True, None, 4, -1, 0.0))
    out, lse = forward(q.detach(), k.detach(), v.detach(), cu_q, cu_k, 12, 12, False, 0.3, -1, 2, 1.5)
    torch.library.opcheck(backward, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k,
                                     12, 12, False, 0.3, -1, 2, 1.5, torch.randn_like(lse)))


def test_in_place_change_of_cu_seqlens_is_checked_again(device):
    """Checked values are remembered per tensor, until the tensor is changed in place."""
    q, k, v, cu, _ = make_packed([5, 6], [5, 6], 2, 2, 16, torch.float32, device)
    flash_attention_varlen(q, k, v, cu, cu, 6, 6)
    cu[1] = 7  # now [0, 7, 11]: the second sequence is 4 long, the first 7 > max_seqlen
    with pytest.raises(ValueError, match=r"max_seqlen_q \(6\) is smaller than the longest sequence"):
        flash_attention_varlen(q, k, v, cu, cu, 6, 6)
    cu[1] = 12
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        flash_attention_varlen(q, k, v, cu, cu, 12, 12)


def test_sequences_run_longest_first_and_the_order_follows_changes(device):
    """The grid's sequence order: longest (query plus key tokens) first, ties in batch order;
    remembered per pair of tensors, recomputed after an in-place change."""
    from flashmoe_science.attention.varlen import longest_first

    cu_q = torch.tensor([0, 3, 3, 10, 17, 18], dtype=torch.int32, device=device)  # lengths 3, 0, 7, 7, 1
    cu_k = torch.tensor([0, 3, 3, 10, 12, 13], dtype=torch.int32, device=device)  # lengths 3, 0, 7, 2, 1
    order = longest_first(cu_q, cu_k)
    assert order.dtype == torch.int32 and order.device == cu_q.device
    assert order.tolist() == [2, 3, 0, 4, 1]
    assert longest_first(cu_q, cu_k) is order
    assert longest_first(cu_q, cu_q).tolist() == [2, 3, 0, 4, 1]
    cu_q[1:] += 20  # the first sequence becomes the longest
    assert longest_first(cu_q, cu_k).tolist() == [0, 2, 3, 4, 1]


def _bad_cases():
    good = [0, 5, 11]
    return [
        (dict(cu_seqlens_q=torch.tensor(good)), TypeError, "cu_seqlens_q must be int32"),
        (dict(cu_seqlens_k=torch.tensor(good, dtype=torch.float32)), TypeError, "cu_seqlens_k must be int32"),
        (dict(cu_seqlens_q=[0, 5, 11]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
        (dict(cu_seqlens_q=torch.tensor([good], dtype=torch.int32)), ValueError, "cu_seqlens_q must be 1-D"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 11, 11], dtype=torch.int32)), ValueError,
         "cu_seqlens_q and cu_seqlens_k must have the same length"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 11, 11, 11], dtype=torch.int32)[::2]), ValueError,
         "cu_seqlens_q must be contiguous"),
        (dict(cu_seqlens_q=torch.tensor([1, 5, 11], dtype=torch.int32)), ValueError, "cu_seqlens_q must start at 0"),
        (dict(cu_seqlens_k=torch.tensor([0, 7, 5], dtype=torch.int32)), ValueError,
         "cu_seqlens_k must be non-decreasing"),
        (dict(cu_seqlens_q=torch.tensor([0, 5, 10], dtype=torch.int32)), ValueError,
         r"cu_seqlens_q must end at the number of query tokens \(11\), got last entry 10"),
        (dict(cu_seqlens_k=torch.tensor([0, 5, 12], dtype=torch.int32)), ValueError,
         r"cu_seqlens_k must end at the number of key tokens \(11\)"),
        (dict(max_seqlen_q=5), ValueError, r"max_seqlen_q \(5\) is smaller than the longest sequence"),
        (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be >= 0"),
        (dict(max_seqlen_q=6.5), TypeError, "max_seqlen_q must be an int"),
        (dict(q=torch.randn(1, 11, 2, 16)), ValueError, r"q must have 3 dimensions \(total_tokens, heads, head_dim\)"),
        (dict(k=torch.randn(11, 3, 16), v=torch.randn(11, 3, 16)), ValueError,
         "multiple of the number of key/value heads"),
        (dict(window_size=(-3, 1)), ValueError, "window_size entries must be >= 0, or -1"),
        (dict(softcap=-0.5), ValueError, "softcap must be a finite number"),
        (dict(causal=None), TypeError, "causal must be a bool"),
        (dict(deterministic=1), TypeError, "deterministic must be a bool"),
    ]


def _same_layout_on(t, device):
    """t on `device` with its strides kept (`.to` would make a strided view contiguous)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).copy_(t)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("change,error,match", _bad_cases())
def test_bad_input_raises_clear_error(change, error, match, requires_grad, device):
    q, k, v, cu_q, cu_k = make_packed([5, 6], [5, 6], 2, 2, 16, torch.float32, device, requires_grad)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6, max_seqlen_k=6)
    args.update({key: (_same_layout_on(value, device) if isinstance(value, torch.Tensor) else value)
                 for key, value in change.items()})
    with pytest.raises(error, match=match):
        flash_attention_varlen(**args)


# ---- GPU: bf16 at realistic lengths, error compared with PyTorch's own ----

def _pytorch_per_sequence(q, k, v, cu_q, cu_k, grad_out, causal, window_size):
    """PyTorch's own result in the input precision: SDPA on each sequence with the band as an
    explicit mask, K and V repeated for GQA; out packed like ours, and its gradients."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    outs = []
    for b in range(len(starts_q) - 1):
        qb = leaves[0][starts_q[b]:starts_q[b + 1]].transpose(0, 1)
        kb = leaves[1][starts_k[b]:starts_k[b + 1]].transpose(0, 1).repeat_interleave(group, 0)
        vb = leaves[2][starts_k[b]:starts_k[b + 1]].transpose(0, 1).repeat_interleave(group, 0)
        mask = band_mask(qb.shape[1], kb.shape[1], causal, window_size, q.device)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask).transpose(0, 1))
    out = torch.cat(outs)
    return out, torch.autograd.grad(out, leaves, grad_out)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal,window_size", [(False, (-1, -1)), (True, (-1, -1)), (True, (256, -1))])
@pytest.mark.parametrize("heads_q,heads_kv,head_dim", [(16, 16, 128), (8, 2, 64), (4, 4, 256)])
def test_gpu_varlen_within_twice_pytorch(heads_q, heads_kv, head_dim, causal, window_size, dtype):
    lengths = torch.randint(64, 2048, (8,)).tolist() + [1, 17]
    q, k, v, cu_q, cu_k = make_packed(lengths, lengths, heads_q, heads_kv, head_dim, dtype, "cuda", True)
    grad_out = torch.randn_like(q)
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths), max(lengths), causal=causal,
                                 window_size=window_size)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref, _, ref_grads = reference(q, k, v, cu_q, cu_k, grad_out, torch.zeros(heads_q, q.shape[0], device="cuda"),
                                  causal=causal, window_size=window_size)
    theirs, their_grads = _pytorch_per_sequence(q, k, v, cu_q, cu_k, grad_out, causal, window_size)
    for name, ours, pytorch, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (theirs, *their_grads),
                                      (ref, *ref_grads)):
        assert torch.isfinite(ours).all(), name
        assert rel_error(ours, r) <= 2 * rel_error(pytorch, r) + 5e-4, (name, rel_error(ours, r),
                                                                        rel_error(pytorch, r))


@pytest.mark.gpu
def test_gpu_varlen_fully_written_and_deterministic():
    """NaN-filled allocator blocks before each run, so an unwritten element would show; two runs
    must agree bitwise."""
    lengths = [1000, 0, 3, 517, 2048, 64]
    q, k, v, cu_q, cu_k = make_packed(lengths, lengths, 8, 2, 128, torch.bfloat16, "cuda", True)
    grad_out = torch.randn_like(q)
    runs = []
    for _ in range(2):
        poison = [torch.full_like(t, float("nan")) for t in (q, k, v, q, k, v)]
        del poison
        out = flash_attention_varlen(q, k, v, cu_q, cu_k, 2048, 2048, causal=True)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
    for first, second in zip(*runs):
        assert torch.isfinite(first).all()
        assert torch.equal(first, second)
