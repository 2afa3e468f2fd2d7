"""Sliding windows and softcap on dense attention: forward and gradients against the float64
reference, block skipping, rows that see no key, bad options.

On the CPU these run through Triton's interpreter in fp32 and fp16 with small forced blocks, so
that every band edge (left, right, both, none) falls inside and between blocks; the GPU tests
(marked `gpu`) add bf16 at realistic sizes and compare our error with PyTorch's own.
"""
import pytest
import torch

from flashmoe_science import flash_attention_backward, flash_attention_forward, flash_attention_science
from flashmoe_science.attention import attention_reference
from flashmoe_science.attention.configs import AttentionConfig, BackwardConfig
from flashmoe_science.attention.backward import attention_backward
from flashmoe_science.attention.forward import attention_forward
from flashmoe_science.attention.reference import band_mask
from test_attention_forward import lse_tolerance, make_qkv, max_error_tolerance, rel_error

# Blocks of 16 rows and keys, so that even CPU-sized inputs span several blocks per dimension.
FORWARD_BLOCKS = AttentionConfig(16, 16, 4, 1)
BACKWARD_BLOCKS = BackwardConfig(dkdv=AttentionConfig(16, 16, 4, 1), dq=AttentionConfig(16, 16, 4, 1))


def reference_with_grads(q, k, v, grad_out, **options):
    """float64 (out, lse) and gradients of out weighted by grad_out, through the reference."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = attention_reference(q64, k64, v64, **options)
    return out.detach(), lse, torch.autograd.grad(out, (q64, k64, v64), grad_out.double())


def run_both(q, k, v, grad_out, causal, window_size, softcap=0.0, forced_blocks=True):
    out, lse = attention_forward(q, k, v, causal, None, True, FORWARD_BLOCKS if forced_blocks else None, window_size,
                                 softcap)
    grads = attention_backward(grad_out, q, k, v, out, lse, causal, None, window_size, softcap,
                               config=BACKWARD_BLOCKS if forced_blocks else None)
    return out, lse, grads


def assert_matches_reference(q, k, v, causal, window_size, softcap=0.0, forced_blocks=True):
    grad_out = torch.randn_like(q)
    out, lse, grads = run_both(q, k, v, grad_out, causal, window_size, softcap, forced_blocks)
    ref, ref_lse, ref_grads = reference_with_grads(q, k, v, grad_out, causal=causal, window_size=window_size,
                                                   softcap=softcap)
    tol = max_error_tolerance(q)
    assert not out.isnan().any()
    assert (out.double() - ref).abs().max().item() <= tol * max(ref.abs().max().item(), 1.0)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "rows that see no key must have lse = -inf, and only they"
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=lse_tolerance(q), rtol=1e-4)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert not g.isnan().any(), f"NaN in {name}"
        err, scale = (g.double() - r).abs().max().item(), r.abs().max().item()
        assert err <= tol * max(scale, 1.0), f"{name}: max error {err:.3g} for gradients up to {scale:.3g}"


@pytest.mark.parametrize("Sq,Sk", [(40, 40), (21, 53), (53, 21)])
@pytest.mark.parametrize("causal,window_size", [
    (False, (5, -1)),   # left bound only
    (False, (-1, 3)),   # right bound only
    (False, (0, 0)),    # the diagonal alone
    (False, (7, 18)),   # both bounds, the right one wider than a block
    (True, (6, -1)),    # causal local attention
    (True, (20, 9)),    # causal overrides the right bound: (20, 0)
])
def test_window_matches_reference(Sq, Sk, causal, window_size, device):
    q, k, v = make_qkv(1, 4, 2, Sq, Sk, 32, torch.float32, device)
    assert_matches_reference(q, k, v, causal, window_size)


@pytest.mark.parametrize("causal,window_size,softcap,dtype", [
    (False, (-1, -1), 1.0, torch.float32),
    (True, (-1, -1), 2.5, torch.float32),
    (True, (9, -1), 0.5, torch.float32),
    (False, (4, 11), 3.0, torch.float16),
])
def test_softcap_matches_reference(causal, window_size, softcap, dtype, device):
    q, k, v = make_qkv(1, 2, 1, 37, 45, 48, dtype, device)
    q = q * 3  # scores well into tanh's curved part
    assert_matches_reference(q, k, v, causal, window_size, softcap)


def test_window_with_table_configs_and_gqa(device):
    q, k, v = make_qkv(2, 6, 2, 70, 90, 64, torch.float16, device)
    assert_matches_reference(q, k, v, True, (33, -1), softcap=4.0, forced_blocks=False)


def test_blocks_outside_the_window_are_skipped(device):
    """Rows poisoned with NaN in blocks outside the band must not reach a result: a visited
    block, even a masked one, would turn p * v = 0 * NaN (or p * dO) into NaN. Query block m
    (16 rows) sees key blocks m - 1 and m only; key block n is seen by query blocks n and n + 1."""
    seqlen, window = 64, (4, 0)
    q, k, v = make_qkv(1, 2, 2, seqlen, seqlen, 16, torch.float32, device)
    grad_out = torch.randn_like(q)
    out, lse, (dq, dk, dv) = run_both(q, k, v, grad_out, False, window)
    outer = list(range(16)) + list(range(48, 64))  # query blocks 0 and 3 never see key block 1

    def poisoned(t, rows):
        t = t.clone()
        t[:, :, rows] = float("nan")
        return t

    key_block_1, query_block_3 = slice(16, 32), slice(48, 64)
    k_bad, v_bad = poisoned(k, key_block_1), poisoned(v, key_block_1)
    out_bad, _ = attention_forward(q, k_bad, v_bad, False, None, True, FORWARD_BLOCKS, window)
    assert out_bad[:, :, 16:32].isnan().all(), "the poison must reach the rows that see it"
    assert torch.equal(out_bad[:, :, outer], out[:, :, outer])
    dq_bad, _, _ = attention_backward(grad_out, q, k_bad, v_bad, out, lse, False, None, window, config=BACKWARD_BLOCKS)
    assert torch.equal(dq_bad[:, :, outer], dq[:, :, outer])
    # Key blocks 0 and 1 are seen by query blocks 0 to 2 only.
    _, dk_bad, dv_bad = attention_backward(poisoned(grad_out, query_block_3), poisoned(q, query_block_3), k, v, out,
                                           lse, False, None, window, config=BACKWARD_BLOCKS)
    assert torch.equal(dk_bad[:, :, :32], dk[:, :, :32]) and torch.equal(dv_bad[:, :, :32], dv[:, :, :32])
    assert dk_bad[:, :, 32:].isnan().any()


def test_rows_outside_every_window_are_zero(device):
    """Sq > Sk with the diagonal-only window: query i sees key i - (Sq - Sk), so the first Sq - Sk
    rows see none: output 0, lse -inf, zero gradients, no NaN anywhere."""
    q, k, v = make_qkv(1, 2, 2, 53, 21, 32, torch.float32, device)
    grad_out = torch.randn_like(q)
    out, lse, (dq, dk, dv) = run_both(q, k, v, grad_out, False, (0, 0))
    blind = 53 - 21
    assert torch.equal(out[:, :, :blind], torch.zeros_like(out[:, :, :blind]))
    assert torch.all(lse[:, :, :blind] == float("-inf")) and torch.isfinite(lse[:, :, blind:]).all()
    assert torch.equal(dq[:, :, :blind], torch.zeros_like(dq[:, :, :blind]))
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))


def test_window_wider_than_the_sequence_is_full_attention(device):
    q, k, v = make_qkv(1, 2, 2, 30, 30, 32, torch.float32, device)
    full = flash_attention_science(q, k, v)
    for window in ((29, 29), (1 << 40, 1 << 40), (-1, 1 << 40)):
        torch.testing.assert_close(flash_attention_science(q, k, v, window_size=window), full, rtol=0, atol=1e-6)
    causal = flash_attention_science(q, k, v, causal=True)
    torch.testing.assert_close(flash_attention_science(q, k, v, causal=True, window_size=(100, -1)), causal,
                               rtol=0, atol=1e-6)


def test_autograd_with_window_softcap_and_lse(device):
    """flash_attention_science's autograd path and flash_attention_backward carry the options."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 2, 33, 40, 32, torch.float32, device))
    grad_out, grad_lse = torch.randn_like(q), torch.randn(1, 4, 33, device=device)
    options = dict(causal=True, window_size=[5, -1], softcap=1.5)  # a list is accepted as well as a tuple
    out, lse = flash_attention_science(q, k, v, return_lse=True, **options)
    grads = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_reference(q64, k64, v64, causal=True, window_size=(5, -1), softcap=1.5)
    refs = torch.autograd.grad((ref, ref_lse), (q64, k64, v64), (grad_out.double(), grad_lse.double()))
    for g, r in zip(grads, refs):
        assert (g.double() - r).abs().max().item() <= max_error_tolerance(g) * max(r.abs().max().item(), 1.0)
    out2, lse2 = flash_attention_forward(q.detach(), k.detach(), v.detach(), **options)
    assert torch.equal(out2, out.detach()) and torch.equal(lse2, lse.detach())
    direct = flash_attention_backward(grad_out, q.detach(), k.detach(), v.detach(), out2, lse2, **options)
    only_out = torch.autograd.grad(flash_attention_science(q, k, v, **options), (q, k, v), grad_out)
    for a, b in zip(direct, only_out):
        assert torch.equal(a, b)


def test_compiled_window_and_softcap_equal_eager(device):
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 1, 24, 30, 16, torch.float32, device, layout="bshd"))
    grad_out = torch.randn_like(q)

    def attention(q, k, v):
        return flash_attention_science(q, k, v, causal=True, window_size=(6, -1), softcap=2.0)

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    eager = attention(q, k, v)
    assert torch.equal(out, eager)
    for c, e in zip(torch.autograd.grad(out, (q, k, v), grad_out), torch.autograd.grad(eager, (q, k, v), grad_out)):
        assert torch.equal(c, e)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(window_size=(-2, 0)), ValueError, "window_size entries must be >= 0, or -1"),
    (dict(window_size=(3,)), TypeError, "window_size must be a pair of ints"),
    (dict(window_size=(1.5, 2)), TypeError, "window_size must be a pair of ints"),
    (dict(window_size=(True, 2)), TypeError, "window_size must be a pair of ints"),
    (dict(window_size="ab"), TypeError, "window_size must be a pair of ints"),
    (dict(window_size=None), TypeError, "window_size must be a pair of ints"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap=float("nan")), ValueError, "softcap must be a finite number >= 0"),
    (dict(softcap="1"), TypeError, "softcap must be a float"),
])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_bad_window_or_softcap_raises(kwargs, error, match, requires_grad, device):
    q, k, v = (t.requires_grad_(requires_grad) for t in make_qkv(1, 2, 2, 8, 8, 16, torch.float32, device))
    with pytest.raises(error, match=match):
        flash_attention_science(q, k, v, **kwargs)
    out, lse = flash_attention_forward(q.detach(), k.detach(), v.detach())
    with pytest.raises(error, match=match):
        flash_attention_backward(torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, **kwargs)


# ---- GPU: bf16 at realistic sizes, error compared with PyTorch's own ----

def _pytorch_out_and_grads(q, k, v, grad_out, causal, window_size, softcap):
    """PyTorch's own result in the input precision: SDPA with the band as an explicit mask, or,
    with a softcap (which SDPA lacks), the reference's math run in the input dtype."""
    group = q.shape[1] // k.shape[1]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if softcap:
        out, _ = attention_reference(*leaves, causal=causal, window_size=window_size, softcap=softcap, upcast=False)
    else:
        mask = band_mask(q.shape[2], k.shape[2], causal, window_size, q.device)
        out = torch.nn.functional.scaled_dot_product_attention(
            leaves[0], leaves[1].repeat_interleave(group, 1), leaves[2].repeat_interleave(group, 1), attn_mask=mask)
    return out, torch.autograd.grad(out, leaves, grad_out)


@pytest.mark.gpu
@pytest.mark.parametrize("causal,window_size,softcap", [
    (True, (256, -1), 0.0), (False, (128, 128), 0.0), (False, (-1, 0), 0.0), (True, (-1, -1), 30.0),
    (False, (300, 50), 20.0),
])
# Sq <= Sk, so that every row sees a key: SDPA returns NaN for a row its mask hides entirely
# (rows that see no key are checked on the CPU).
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D", [(2, 8, 2, 1024, 1024, 128), (1, 4, 4, 700, 1500, 64),
                                               (1, 4, 1, 777, 999, 256)])
def test_gpu_window_and_softcap_within_twice_pytorch(B, Hq, Hkv, Sq, Sk, D, causal, window_size, softcap):
    q, k, v = (t.requires_grad_() for t in make_qkv(B, Hq, Hkv, Sq, Sk, D, torch.bfloat16, "cuda", layout="bshd"))
    grad_out = torch.randn_like(q)
    options = dict(causal=causal, window_size=window_size, softcap=softcap)
    out = flash_attention_science(q, k, v, **options)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref, _, ref_grads = reference_with_grads(q, k, v, grad_out, **options)
    theirs, their_grads = _pytorch_out_and_grads(q, k, v, grad_out, causal, window_size, softcap)
    for name, ours, pytorch, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (theirs, *their_grads),
                                      (ref, *ref_grads)):
        assert torch.isfinite(ours).all(), name
        assert rel_error(ours, r) <= 2 * rel_error(pytorch, r) + 5e-4, (name, rel_error(ours, r),
                                                                        rel_error(pytorch, r))
