"""Attention backward: gradients against the float64 reference, edge cases, determinism, bad input.

On the CPU these run through Triton's interpreter in fp32 and fp16 at small sizes (bf16 products
are wrong under the interpreter); the GPU tests (marked `gpu`) add bf16, realistic sizes and
D = 256, and compare our error with PyTorch's own in the same precision.
"""
import itertools

import pytest
import torch

from flashmoe_science import flash_attention_backward, flash_attention_forward, flash_attention_science
from flashmoe_science.attention import attention_reference
from flashmoe_science.attention.backward import attention_backward
from flashmoe_science.attention.configs import (BACKWARD, AttentionConfig, BackwardConfig, backward_config,
                                                backward_configs, head_dim_block)
from flashmoe_science.bench.sweeps.attention_backward import backward_candidates
from flashmoe_science.attention.reference import causal_mask
from flashmoe_science.device import SHARED_MEMORY_PER_BLOCK, SUPPORTED_TARGETS, DeviceInfo
from flashmoe_science.launch import clear_records, last_launch
from test_attention_forward import make_qkv, rel_error

# Tiny blocks: many key and query blocks per program even at CPU sizes, so every loop of the
# kernels (diagonal, unmasked, query tail, key tail, several GQA heads) runs.
TINY_BLOCKS = BackwardConfig(dkdv=AttentionConfig(16, 32, 4, 1), dq=AttentionConfig(32, 16, 4, 1))

# Largest |ours - reference| allowed, relative to the largest reference gradient element.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def reference_grads(q, k, v, grad_out, causal, softmax_scale=None, grad_lse=None, window_size=(-1, -1)):
    """float64 gradients of (out, lse) through the reference, weighted by grad_out (and grad_lse)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = attention_reference(q64, k64, v64, causal=causal, softmax_scale=softmax_scale, window_size=window_size)
    outputs, grads = [out], [grad_out.double()]
    if grad_lse is not None:
        outputs.append(lse)
        grads.append(grad_lse.double())
    return torch.autograd.grad(outputs, (q64, k64, v64), grads)


def assert_grads_close(ours, refs, dtype):
    for name, g, ref in zip(("dq", "dk", "dv"), ours, refs):
        assert g.shape == ref.shape, name
        assert not g.isnan().any(), f"NaN in {name}"
        err = (g.double() - ref).abs().max().item()
        scale = ref.abs().max().item()
        tol = 3e-2 if g.is_cuda and dtype == torch.float32 else TOL[dtype]  # fp32 dots run in tf32 on the GPU
        assert err <= tol * max(scale, 1.0), f"{name}: max error {err:.3g} for gradients up to {scale:.3g}"


def run_backward(q, k, v, grad_out, causal, config=None, softmax_scale=None):
    out, lse = flash_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    return attention_backward(grad_out, q, k, v, out, lse, causal, softmax_scale, config=config)


@pytest.mark.parametrize("config", [None, TINY_BLOCKS], ids=["table", "tiny_blocks"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,dtype", [
    (2, 2, 2, 37, 37, 16, torch.float32),    # lengths not block multiples
    (1, 4, 2, 19, 70, 40, torch.float32),    # GQA, Sq < Sk, non-power-of-two D
    (1, 3, 1, 70, 45, 80, torch.float32),    # MQA, Sq > Sk: causal rows i < Sq - Sk see no key
    (1, 2, 2, 1, 33, 64, torch.float32),     # decode: one query against a cache
    (1, 2, 1, 40, 1, 64, torch.float32),     # one key
    (1, 2, 1, 50, 66, 128, torch.float16),
    (1, 2, 2, 33, 33, 64, torch.float16),
    (1, 2, 1, 24, 40, 160, torch.float16),   # padded to the D = 256 tiles
])
def test_gradients_match_reference(B, Hq, Hkv, Sq, Sk, D, dtype, causal, config, device, poisoned_allocations):
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype, device)
    grad_out = torch.randn_like(q)
    grads = run_backward(q, k, v, grad_out, causal, config)
    assert_grads_close(grads, reference_grads(q, k, v, grad_out, causal), dtype)
    assert [g.dtype for g in grads] == [dtype] * 3


@pytest.mark.parametrize("D", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_one_element_calls_with_softcap_at_every_head_dim_tier(D, dtype, device):
    """B = H = Sq = Sk = 1: every size argument 1, which Triton specialises as a constant (ptxas
    once crashed on such a build of the sm90 dQ kernel)."""
    q, k, v = make_qkv(1, 1, 1, 1, 1, D, dtype, device)
    grad_out = torch.randn_like(q)
    for softcap in (0.0, 0.5):
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        flash_attention_science(q_, k_, v_, softcap=softcap).backward(grad_out)
        ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
        attention_reference(*ref, softcap=softcap)[0].backward(grad_out.double())
        assert_grads_close([q_.grad, k_.grad, v_.grad], [t.grad for t in ref], dtype)


@pytest.mark.parametrize("offset", [-17, -1, 1, 14, 15, 16, 30, 31])
def test_causal_diagonal_at_every_block_alignment(offset, device):
    """Sk - Sq sweeps the diagonal across the tiny blocks' boundaries (16 and 32 rows), where an
    off-by-one in the split between masked and unmasked blocks would show."""
    q, k, v = make_qkv(1, 2, 1, 40, 40 + offset, 16, torch.float32, device)
    grad_out = torch.randn_like(q)
    grads = run_backward(q, k, v, grad_out, True, TINY_BLOCKS)
    assert_grads_close(grads, reference_grads(q, k, v, grad_out, True), torch.float32)


@pytest.mark.parametrize("config", [None, TINY_BLOCKS], ids=["table", "tiny_blocks"])
def test_very_negative_scores_stay_finite(config, device):
    """Every score near -130: lse is too, so exp(s - lse) of a zero-padded key past Sk (s = 0)
    would overflow fp32; the masks must keep it out of the gradients."""
    q = 1 + 0.01 * torch.randn(1, 2, 30, 16, device=device)
    k = -(1 + 0.01 * torch.randn(1, 2, 45, 16, device=device))
    v = torch.randn(1, 2, 45, 16, device=device)
    grad_out = torch.randn_like(q)
    for causal in (False, True):
        grads = run_backward(q, k, v, grad_out, causal, config, softmax_scale=8.0)
        assert_grads_close(grads, reference_grads(q, k, v, grad_out, causal, softmax_scale=8.0), torch.float32)


def test_autograd_through_flash_attention_science(device):
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 4, 2, 45, 60, 64, torch.float32, device))
    grad_out = torch.randn_like(q)
    flash_attention_science(q, k, v, causal=True).backward(grad_out)
    assert_grads_close((q.grad, k.grad, v.grad), reference_grads(q, k, v, grad_out, True), torch.float32)


def test_gradients_of_packed_qkv_slices_are_dense_in_its_order(device):
    qkv = torch.randn(2, 19, 3, 2, 32, device=device)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    grad_out = torch.randn_like(q)
    grads = run_backward(q, k, v, grad_out, causal=True)
    assert all(g.transpose(1, 2).is_contiguous() for g in grads)
    assert_grads_close(grads, reference_grads(q, k, v, grad_out, True), torch.float32)


def test_strided_inputs_and_grad_output(device):
    """(B, S, H, D).transpose(1, 2) views are read in place, a grad_output with a non-unit stride
    in D is copied, and the gradients keep the inputs' layouts and equal the contiguous run's."""
    q, k, v = make_qkv(1, 4, 2, 40, 52, 64, torch.float32, device, layout="bshd")
    grad_out = torch.randn(1, 4, 40, 128, device=device)[..., ::2]
    assert grad_out.stride(-1) == 2 and q.stride(2) == 4 * 64
    grads = run_backward(q, k, v, grad_out, causal=True)
    for g, t in zip(grads, (q, k, v)):
        assert g.stride() == t.stride()
    assert_grads_close(grads, reference_grads(q, k, v, grad_out, True), torch.float32)
    contiguous = run_backward(*(t.contiguous() for t in (q, k, v, grad_out)), causal=True)
    for g, c in zip(grads, contiguous):
        assert torch.equal(g, c), "the layout changed the result"


def test_broadcast_grad_output(device):
    """out.sum() backpropagates an expanded tensor of ones: strides of zero everywhere."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 30, 30, 32, torch.float32, device))
    flash_attention_science(q, k, v, causal=True).sum().backward()
    ones = torch.ones_like(q)
    assert_grads_close((q.grad, k.grad, v.grad), reference_grads(q, k, v, ones, True), torch.float32)


def test_rows_that_see_no_key_get_zero_gradients(device):
    q, k, v = make_qkv(1, 2, 1, 50, 20, 64, torch.float32, device)
    grad_out = torch.randn_like(q)
    dq, dk, dv = run_backward(q, k, v, grad_out, causal=True, config=TINY_BLOCKS)
    blind = 50 - 20  # causal, bottom-right: query i sees keys j <= i - 30
    assert torch.equal(dq[:, :, :blind], torch.zeros_like(dq[:, :, :blind]))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert_grads_close((dq, dk, dv), reference_grads(q, k, v, grad_out, True), torch.float32)


def test_no_keys_and_no_queries(device):
    q, k, v = make_qkv(1, 2, 2, 5, 0, 32, torch.float32, device)
    dq, dk, dv = run_backward(q, k, v, torch.randn_like(q), causal=False)
    assert dq.shape == q.shape and torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape
    q, k, v = make_qkv(1, 2, 2, 0, 7, 32, torch.float32, device)
    dq, dk, dv = run_backward(q, k, v, torch.randn_like(q), causal=True)
    assert dq.shape == q.shape and torch.equal(dk, torch.zeros_like(k)) and torch.equal(dv, torch.zeros_like(v))


def test_custom_softmax_scale(device):
    q, k, v = make_qkv(1, 2, 2, 24, 40, 32, torch.float32, device)
    grad_out = torch.randn_like(q)
    grads = run_backward(q, k, v, grad_out, causal=True, softmax_scale=0.37)
    assert_grads_close(grads, reference_grads(q, k, v, grad_out, True, softmax_scale=0.37), torch.float32)


def test_lse_is_differentiable(device):
    """A loss may use lse too: d lse_i / d s_ij = p_ij enters the backward through delta."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 2, 33, 48, 32, torch.float32, device))
    grad_out, grad_lse = torch.randn_like(q), torch.randn(1, 4, 33, device=device)
    out, lse = flash_attention_science(q, k, v, causal=True, return_lse=True)
    torch.autograd.backward((out, lse), (grad_out, grad_lse))
    refs = reference_grads(q, k, v, grad_out, True, grad_lse=grad_lse)
    assert_grads_close((q.grad, k.grad, v.grad), refs, torch.float32)
    only_lse = torch.autograd.grad(flash_attention_science(q, k, v, causal=True, return_lse=True)[1],
                                   (q, k, v), grad_lse)
    refs = reference_grads(q, k, v, torch.zeros_like(q), True, grad_lse=grad_lse)
    assert_grads_close(only_lse, refs, torch.float32)


def test_launch_keys_fix_the_kernels_constexprs(device, monkeypatch):
    """Launches are cached by key (`launch.KernelLauncher`), so a key must fix every constexpr:
    the same backward with and without lse's gradient (the dQ kernel computes delta, or loads the
    preprocess kernel's) launches each kernel with one set of constexprs per key."""
    from flashmoe_science.launch import KernelLauncher

    seen, launch = {}, KernelLauncher.launch

    def checked(self, key, grid, args, **options):
        if key is not None:
            constexprs = self._constexprs_of(args)
            assert seen.setdefault((self.op, key), constexprs) == constexprs, self.op
        return launch(self, key, grid, args, **options)

    monkeypatch.setattr(KernelLauncher, "launch", checked)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 2, 33, 48, 32, torch.float32, device))
    grad_out, grad_lse = torch.randn_like(q), torch.randn(1, 4, 33, device=device)
    out, lse = flash_attention_science(q, k, v, causal=True, return_lse=True)
    plain = torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
    both = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    assert any(op == "attention_backward_dq" for op, _ in seen)
    assert_grads_close(plain, reference_grads(q, k, v, grad_out, True), torch.float32)
    assert_grads_close(both, reference_grads(q, k, v, grad_out, True, grad_lse=grad_lse), torch.float32)


@pytest.mark.parametrize("deterministic", [False, True])
def test_gradients_bitwise_reproducible(deterministic, device):
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 1, 70, 70, 32, torch.float16, device))
    grad_out = torch.randn_like(q)
    runs = []
    for _ in range(2):
        out = flash_attention_science(q, k, v, causal=True, deterministic=deterministic)
        runs.append(torch.autograd.grad(out, (q, k, v), grad_out))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_flash_attention_backward_matches_autograd(device):
    q, k, v = make_qkv(2, 2, 2, 31, 31, 48, torch.float32, device)
    grad_out = torch.randn_like(q)
    out, lse = flash_attention_forward(q, k, v, causal=True)
    direct = flash_attention_backward(grad_out, q, k, v, out, lse, causal=True, deterministic=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    via_autograd = torch.autograd.grad(flash_attention_science(*leaves, causal=True), leaves, grad_out)
    for a, b in zip(direct, via_autograd):
        assert torch.equal(a, b)


def test_double_backward_is_refused(device):
    """A gradient penalty would otherwise silently drop dq's own dependence on q, k and v."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 8, 8, 16, torch.float32, device))
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(flash_attention_science(q, k, v).sum(), q, create_graph=True)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing(use_reentrant, device):
    """Checkpointing re-runs the forward inside the backward: gradients must not change."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 1, 20, 28, 16, torch.float32, device))
    grad_out = torch.randn_like(q)
    flash_attention_science(q, k, v, causal=True).backward(grad_out)
    plain = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    checkpoint(lambda *qkv: flash_attention_science(*qkv, causal=True), q, k, v,
               use_reentrant=use_reentrant).backward(grad_out)
    for before, t in zip(plain, (q, k, v)):
        assert torch.equal(before, t.grad)


def test_no_grad_calls_keep_the_lean_path_and_match(device):
    q, k, v = make_qkv(1, 2, 2, 20, 20, 32, torch.float32, device)
    lean = flash_attention_science(q, k, v, causal=True)
    differentiable = flash_attention_science(q.requires_grad_(), k, v, causal=True)
    assert lean.grad_fn is None and differentiable.grad_fn is not None
    assert torch.equal(lean, differentiable.detach())
    with torch.no_grad():
        assert flash_attention_science(q, k, v, causal=True).grad_fn is None


@pytest.mark.parametrize("change,error,match", [
    (dict(grad_output=torch.zeros(1, 2, 9, 32)), ValueError, "grad_output must have the shape of q"),
    (dict(grad_output=torch.zeros(1, 2, 8, 32, dtype=torch.float16)), TypeError,
     "grad_output must have the dtype of q"),
    (dict(grad_output=[1.0]), TypeError, "grad_output must be a torch.Tensor"),
    (dict(output=torch.zeros(1, 2, 8, 16)), ValueError, "output must have the shape of q"),
    (dict(softmax_lse=torch.zeros(1, 2, 9)), ValueError, r"softmax_lse must have shape \(batch, heads_q, seqlen_q\)"),
    (dict(softmax_lse=torch.zeros(1, 2, 8, dtype=torch.float64)), TypeError, "softmax_lse must be float32"),
    (dict(softmax_lse=None), TypeError, "softmax_lse must be a torch.Tensor"),
    (dict(k=torch.zeros(1, 3, 8, 32), v=torch.zeros(1, 3, 8, 32)), ValueError,
     "multiple of the number of key/value heads"),
    (dict(q="q"), TypeError, "q must be a torch.Tensor"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(softmax_scale="0.5"), TypeError, "softmax_scale must be a float"),
    (dict(deterministic=None), TypeError, "deterministic must be a bool"),
])
def test_backward_bad_input_raises_clear_error(change, error, match, device):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 32, torch.float32, device)
    out, lse = flash_attention_forward(q, k, v)
    args = dict(grad_output=torch.randn_like(q), q=q, k=k, v=v, output=out, softmax_lse=lse)
    args.update({key: (value.to(device) if isinstance(value, torch.Tensor) else value)
                 for key, value in change.items()})
    with pytest.raises(error, match=match):
        flash_attention_backward(**args)


def test_differentiable_call_rejects_bad_options(device):
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 8, 8, 32, torch.float32, device))
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flash_attention_science(q, k, v, deterministic="yes")
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention_science(q, k, v, causal="no")


def test_custom_ops_pass_opcheck(device):
    """Schema, fake (meta) implementations with the real strides, autograd registration and
    AOT dispatch with dynamic shapes, as torch.library checks them."""
    forward = torch.ops.flashmoe_science.attention_forward.default
    backward = torch.ops.flashmoe_science.attention_backward.default
    for layout, causal in (("bhsd", True), ("bshd", False)):
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 2, 20, 24, 16, torch.float32, device, layout))
        torch.library.opcheck(forward, (q, k, v, causal, None))
        out, lse = forward(q.detach(), k.detach(), v.detach(), causal, 0.3)
        grad_lse = torch.randn_like(lse) if causal else None
        torch.library.opcheck(backward, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse,
                                         causal, 0.3, -1, -1, 0.0, grad_lse))


@pytest.mark.parametrize("layouts", [("bhsd",) * 3, ("bshd",) * 3, ("bshd", "bhsd", "odd")])
def test_fake_outputs_have_the_real_layouts(layouts, device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def make(layout, heads):
        if layout == "odd":  # non-unit stride in D: the forward copies
            return torch.randn(1, heads, 12, 64, device=device)[..., ::2]
        return make_qkv(1, heads, heads, 12, 12, 32, torch.float32, device, layout)[0]

    q, k, v = make(layouts[0], 4), make(layouts[1], 2), make(layouts[2], 2)
    real = torch.ops.flashmoe_science.attention_forward(q, k, v, True, None)
    real_grads = torch.ops.flashmoe_science.attention_backward(torch.randn_like(q), q, k, v, *real, True, None, -1, -1,
                                                               0.0, None)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = torch.ops.flashmoe_science.attention_forward(fq, fk, fv, True, None)
        fake_grads = torch.ops.flashmoe_science.attention_backward(torch.empty_like(fq), fq, fk, fv, *fake, True,
                                                                   None, -1, -1, 0.0, None)
    for r, f in zip(real + real_grads, fake + fake_grads):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


@pytest.mark.parametrize("capability", SUPPORTED_TARGETS)
def test_backward_dispatcher_only_picks_shipped_configs(capability):
    """Whatever the dispatcher picks is among the builds the compile-and-fit check compiles."""
    shipped = set(backward_configs(capability))
    device = DeviceInfo("probe", capability, 132, SHARED_MEMORY_PER_BLOCK[capability], 0)
    for element_size, head_dim, packed_causal in itertools.product(
            (2, 4), (16, 24, 40, 64, 80, 96, 128, 160, 192, 256), (False, True)):
        cfg = backward_config(device, element_size, head_dim, packed_causal)
        assert (element_size, head_dim_block(head_dim), cfg) in shipped


@pytest.mark.parametrize("family", [90, 80, 89])
def test_backward_sweep_candidates_start_with_the_table_and_vary_one_kernel(family):
    for element_size, block_d in itertools.product((2, 4), (16, 32, 64, 128, 256)):
        base = BACKWARD[family][element_size][block_d]
        candidates = list(backward_candidates(family, element_size, block_d))
        assert candidates[0] == base and len(set(candidates)) == len(candidates)
        assert all(c.dkdv == base.dkdv or c.dq == base.dq for c in candidates)
        assert all(c.tma == base.tma for c in candidates)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,dtype,layout,window", [
    (2, 4, 2, 37, 53, 32, torch.float32, "bshd", (-1, -1)),  # GQA, tails in both lengths, strided rows
    (1, 3, 1, 70, 45, 40, torch.float32, "bhsd", (-1, -1)),  # MQA, Sq > Sk, D padded to the 64 tile
    (1, 2, 2, 33, 61, 64, torch.float16, "bshd", (9, 4)),    # a sliding window
])
def test_tma_tiles_give_the_pointer_kernels_bits(B, Hq, Hkv, Sq, Sk, D, dtype, layout, window, causal, device,
                                                 monkeypatch):
    """BackwardConfig.tma moves the same tiles through descriptors: the same products in the same
    order, so the same bits, tails (zero-filled loads, dropped stores) included. The interpreter
    runs descriptors on CPU tensors, so the dispatcher's sm90 check is lifted here."""
    from flashmoe_science.attention import descriptors

    monkeypatch.setattr(descriptors, "supports_backward", lambda *args: True)
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype, device, layout=layout)
    grad_out = torch.randn_like(q)
    out, lse = flash_attention_forward(q, k, v, causal=causal, window_size=window)
    expected = attention_backward(grad_out, q, k, v, out, lse, causal, None, window, config=TINY_BLOCKS)
    tma = BackwardConfig(TINY_BLOCKS.dkdv, TINY_BLOCKS.dq, tma=True)
    grads = attention_backward(grad_out, q, k, v, out, lse, causal, None, window, config=tma)
    assert last_launch("attention_backward_dkdv").constexprs["TMA"] is True
    assert last_launch("attention_backward_dq").constexprs["TMA"] is True
    for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
        assert torch.equal(g, e), name
        assert g.stride() == e.stride(), name


@pytest.mark.parametrize("causal", [False, True])
def test_tma_tiles_of_packed_sequences_give_the_pointer_kernels_bits(causal, device, monkeypatch):
    """Packed batches through descriptors: a tile's rows past a sequence's end hold the next
    sequence's tokens, which must reach nothing stored, even when they are not finite."""
    from flashmoe_science.attention import descriptors
    from flashmoe_science.attention.backward import BackwardPlan, launch_backward
    from flashmoe_science.attention.varlen import longest_first, varlen_forward
    from test_attention_varlen import make_packed

    monkeypatch.setattr(descriptors, "supports_backward", lambda *args: True)
    lengths = [37, 0, 5, 64, 20, 9]
    q, k, v, cu, _ = make_packed(lengths, lengths, 4, 2, 40, torch.float32, device)
    poisoned = slice(cu[3].item(), cu[4].item())  # the 64-token sequence: not finite
    for t in (q, k, v):
        t[poisoned] = float("nan")
    out, lse = varlen_forward(q, k, v, cu, cu, max(lengths), max(lengths), causal, None, True)
    grad_out = torch.randn_like(out)
    tensors = (grad_out, q, k, v, out, lse)
    runs = []
    for tma in (False, True):
        config = BackwardConfig(TINY_BLOCKS.dkdv, TINY_BLOCKS.dq, tma=tma)
        plan = BackwardPlan(tensors, len(lengths), max(lengths), max(lengths), causal, (-1, -1), 0.0, True, config)
        assert plan.tma is tma
        runs.append(launch_backward(plan, None, *tensors, cu, cu, None, None, longest_first(cu, cu)))
    clean = torch.ones(q.shape[0], dtype=torch.bool)
    clean[poisoned] = False
    for name, pointer, tma in zip(("dq", "dk", "dv"), *runs):
        assert torch.isfinite(pointer[clean]).all(), name
        assert torch.equal(pointer[clean], tma[clean]), name


# ---- GPU: bf16, realistic sizes and D = 256, error compared with PyTorch's own ----

def _pytorch_grads(q, k, v, grad_out, causal):
    """PyTorch's own gradients in the input precision: SDPA's default dispatch (a fused kernel,
    like ours), with our bottom-right causal mask spelled out and K, V repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    mask = causal_mask(q.shape[2], k.shape[2], q.device) if causal else None
    out = torch.nn.functional.scaled_dot_product_attention(
        leaves[0], leaves[1].repeat_interleave(group, 1), leaves[2].repeat_interleave(group, 1), attn_mask=mask)
    return torch.autograd.grad(out, leaves, grad_out)


def assert_within_twice_pytorch(ours, q, k, v, grad_out, causal):
    """Our gradients finite, and their error against float64 within twice PyTorch's own."""
    assert_within_twice(ours, _pytorch_grads(q, k, v, grad_out, causal), reference_grads(q, k, v, grad_out, causal))


def assert_within_twice(ours, theirs, refs):
    """Our gradients finite, and their error against float64 `refs` within twice that of `theirs`."""
    for name, g, t, ref in zip(("dq", "dk", "dv"), ours, theirs, refs):
        assert torch.isfinite(g).all(), name
        assert rel_error(g, ref) <= 2 * rel_error(t, ref) + 5e-4, (name, rel_error(g, ref), rel_error(t, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D", [
    (2, 8, 8, 1024, 1024, 64), (1, 16, 4, 777, 1500, 128), (2, 4, 4, 513, 513, 256),
    (1, 8, 2, 300, 300, 80), (1, 4, 1, 2048, 2048, 128), (1, 4, 4, 1, 1024, 128),
])
def test_gpu_gradients_within_twice_pytorch(B, Hq, Hkv, Sq, Sk, D, causal, dtype):
    q, k, v = (t.requires_grad_() for t in make_qkv(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout="bshd"))
    grad_out = torch.randn(B, Sq, Hq, D, dtype=dtype, device="cuda").transpose(1, 2)
    ours = torch.autograd.grad(flash_attention_science(q, k, v, causal=causal), (q, k, v), grad_out)
    assert_within_twice_pytorch(ours, q, k, v, grad_out, causal)


@pytest.mark.gpu
def test_gpu_fp32_gradients_use_tf32_within_tolerance():
    q, k, v = make_qkv(1, 4, 2, 300, 400, 64, torch.float32, "cuda")
    grad_out = torch.randn_like(q)
    grads = run_backward(q, k, v, grad_out, causal=True)
    for g, ref in zip(grads, reference_grads(q, k, v, grad_out, True)):
        assert rel_error(g, ref) < 1e-2  # tf32 keeps 10 mantissa bits; dP - delta cancels some


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gpu_deterministic_and_fully_written(D):
    """Two runs agree bitwise (a race would show), with the caching allocator's blocks filled
    with NaN before each run so that an unwritten gradient element would show too."""
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 8, 2, 1000, 1000, D, torch.bfloat16, "cuda"))
    grad_out = torch.randn_like(q)
    runs = []
    for _ in range(2):
        poison = [torch.full_like(t, float("nan")) for t in (q, k, v, q, k, v)]
        del poison
        out = flash_attention_science(q, k, v, causal=True, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), grad_out))
    for first, second in zip(*runs):
        assert torch.isfinite(first).all()
        assert torch.equal(first, second)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D", [(2, 8, 2, 1000, 1000, 128), (1, 4, 4, 513, 777, 256),
                                             (1, 8, 8, 300, 300, 64), (1, 4, 2, 200, 200, 96)])
def test_gpu_tma_tiles_give_the_pointer_kernels_bits(B, Hq, Hkv, Sq, Sk, D, causal):
    """On sm90 the descriptor-moved tiles (BackwardConfig.tma) give the pointer kernels' bits with
    the table's tiles, on NaN-poisoned memory; and the table's choice is within twice PyTorch."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("tensor descriptors need sm90")
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Sk, D, torch.bfloat16, "cuda", layout="bshd")
    grad_out = torch.randn_like(q)
    base = BACKWARD[90][2][head_dim_block(D)]
    runs = []
    for tma in (False, True):
        poison = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        del poison
        runs.append(run_backward(q, k, v, grad_out, causal, BackwardConfig(base.dkdv, base.dq, tma=tma)))
        assert last_launch("attention_backward_dq").constexprs["TMA"] is tma
    for name, pointer, tma in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(pointer, tma), name
    assert_within_twice_pytorch(runs[1], q, k, v, grad_out, causal)


@pytest.mark.parametrize("D", [128, 256])
def test_gluon_backward_launches_describe_each_tile_of_its_tensor(D, monkeypatch):
    """The Gluon launches (recorded, not run: Gluon has no interpreter) get a descriptor of the
    right tensor and tile for every tiled argument; the kernels share those of equal tiles."""
    from flashmoe_science.attention import backward
    from flashmoe_science.attention.configs import GLUON_BACKWARD

    calls = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def launch(self, key, grid, args, **options):
            calls[self.name] = args

    monkeypatch.setattr(backward, "_GLUON_DQ", Recorder("dq"))
    monkeypatch.setattr(backward, "_GLUON_DKDV", Recorder("dkdv"))
    q, k, v = make_qkv(1, 4, 2, 100, 120, D, torch.bfloat16, "cpu", layout="bshd")
    grad_out, out, dq = torch.randn_like(q), torch.randn_like(q), torch.full_like(q, float("nan"))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    lse = delta = torch.zeros(1, 4, 100)
    cfg = GLUON_BACKWARD[D]
    backward.launch_gluon_backward(grad_out, q, k, v, out, lse, delta, dq, dk, dv, 0.1, cfg, (-1, 0), delta_here=True)
    expected = {"dq": [(q, cfg.dq.block_m), (k, cfg.dq.block_n), (v, cfg.dq.block_n), (grad_out, cfg.dq.block_m),
                       (dq, cfg.dq.block_m)],
                "dkdv": [(q, cfg.dkdv.block_m), (k, cfg.dkdv.block_n), (v, cfg.dkdv.block_n),
                         (grad_out, cfg.dkdv.block_m), (dk, cfg.dkdv.block_n), (dv, cfg.dkdv.block_n)]}
    for name, tiles in expected.items():
        for desc, (t, rows) in zip(calls[name], tiles):
            assert desc.base is t and desc.block_shape == [1, 1, rows, head_dim_block(D)], name
            assert list(desc.shape) == list(t.shape) and list(desc.strides) == list(t.stride()), name
    shared = [i for i, (t, rows) in enumerate(expected["dq"][:4]) if expected["dkdv"][i][1] == rows]
    assert all(calls["dq"][i] is calls["dkdv"][i] for i in shared)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D,Hq,Hkv,Sq,Sk,causal,window", [
    (128, 8, 2, 1700, 1700, False, (-1, -1)),   # GQA, lengths not block multiples
    (64, 8, 8, 700, 4000, True, (-1, -1)),      # causal, Sq < Sk: the band starts mid-keys
    (96, 8, 1, 3000, 1000, True, (-1, -1)),     # MQA, Sq > Sk: rows before Sq - Sk see no key; D padded
    (128, 8, 4, 2000, 2000, False, (300, 45)),  # a sliding window: masked blocks on both edges
    (200, 8, 2, 1500, 1000, True, (-1, -1)),    # D = 256 tiles (columns split between warpgroups), padded
])
def test_gpu_gluon_backward_matches_reference(D, Hq, Hkv, Sq, Sk, causal, window, dtype):
    """The Gluon kernels (sm90) with the sweep's candidates for this head dim, one per way of
    laying out each kernel's resident and streamed blocks (rows and warps), on NaN-poisoned
    memory: gradients within twice PyTorch's own error against float64, zero for rows that see no
    key, and bitwise equal across runs."""
    from flashmoe_science.attention.reference import band_mask
    from flashmoe_science.bench.sweeps.attention_backward import gluon_backward_candidates
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are for sm90")
    q, k, v = make_qkv(1, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout="bshd")
    grad_out = torch.randn_like(q)
    out, lse = flash_attention_forward(q, k, v, causal=causal, window_size=window)
    refs = reference_grads(q, k, v, grad_out, causal, window_size=window)
    # PyTorch's own error over the rows that see a key (SDPA gives NaN for the others).
    mask = band_mask(Sq, Sk, causal, window, q.device)
    rows = mask.any(dim=1)
    group = Hq // Hkv
    leaves = [t.detach().requires_grad_() for t in (q[:, :, rows], k, v)]
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        leaves[0], leaves[1].repeat_interleave(group, 1), leaves[2].repeat_interleave(group, 1), attn_mask=mask[rows])
    theirs = torch.autograd.grad(sdpa, leaves, grad_out[:, :, rows])
    bounds = [2 * rel_error(t, ref) + 5e-4 for t, ref in zip(theirs, (refs[0][:, :, rows], refs[1], refs[2]))]
    block_d = head_dim_block(D)
    layouts = {}
    for cfg in gluon_backward_candidates(block_d):
        layouts.setdefault((cfg.dkdv.block_n, cfg.dkdv.num_warps, cfg.dq.block_m, cfg.dq.num_warps), cfg)
    checked_again = False
    for cfg in layouts.values():
        poison = [torch.full_like(t, float("nan")) for t in (q, k, v, q, k, v)]
        del poison
        clear_records()
        grads = attention_backward(grad_out, q, k, v, out, lse, causal, None, window, config=cfg)
        dkdv = last_launch("attention_backward_dkdv_gluon").constexprs
        assert (dkdv["BLOCK_N"], dkdv["BLOCK_M"]) == (cfg.dkdv.block_n, cfg.dkdv.block_m)
        assert last_launch("attention_backward_dq_gluon").constexprs["BLOCK_M"] == cfg.dq.block_m
        for name, g, ref, bound in zip(("dq", "dk", "dv"), grads, refs, bounds):
            assert torch.isfinite(g).all(), (name, cfg)
            assert rel_error(g, ref) <= bound, (name, str(cfg), rel_error(g, ref), bound)
        assert torch.all(grads[0][:, :, ~rows] == 0)
        if not checked_again:
            checked_again = True
            again = attention_backward(grad_out, q, k, v, out, lse, causal, None, window, config=cfg)
            assert all(torch.equal(a, b) for a, b in zip(grads, again))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gpu_backward_dispatch_takes_the_gluon_kernels_where_measured_faster(D):
    """Large dense calls on sm90 take the Gluon kernels at the head dims of `GLUON_BACKWARD`
    (the Triton kernels elsewhere, and for softcapped calls), within twice PyTorch's error."""
    from flashmoe_science.attention.configs import GLUON_BACKWARD
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are for sm90")
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 8, 2, 2048, 2048, D, torch.bfloat16, "cuda", layout="bshd"))
    grad_out = torch.randn_like(q)
    for softcap in (0.0, 30.0):
        clear_records()
        ours = torch.autograd.grad(flash_attention_science(q, k, v, causal=True, softcap=softcap), (q, k, v), grad_out)
        gluon = softcap == 0 and D in GLUON_BACKWARD
        assert (last_launch("attention_backward_dkdv_gluon") is not None) is gluon
        assert (last_launch("attention_backward_dkdv") is None) is gluon
        if softcap == 0:
            assert_within_twice_pytorch(ours, q, k, v, grad_out, True)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [128, 256])
def test_gpu_gluon_backward_with_a_differentiated_lse(D):
    """When lse has a gradient too, delta comes from the preprocess kernel and the Gluon dQ kernel
    loads it (DELTA_HERE off), also right after the same call without it: gradients of (out, lse)
    within twice those of PyTorch's math in bf16, both against float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels are for sm90")
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 8, 2, 2048, 2048, D, torch.bfloat16, "cuda", layout="bshd"))
    grad_out, grad_lse = torch.randn_like(q), torch.randn(2, 8, 2048, device="cuda")
    out, lse = flash_attention_science(q, k, v, causal=True, return_lse=True)
    torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)  # the same call without it first
    clear_records()
    ours = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    assert last_launch("attention_backward_dq_gluon").constexprs["DELTA_HERE"] is False
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    theirs = torch.autograd.grad(attention_reference(*leaves, causal=True, upcast=False), leaves, (grad_out, grad_lse))
    assert_within_twice(ours, theirs, reference_grads(q, k, v, grad_out, True, grad_lse=grad_lse))


@pytest.mark.gpu
def test_gpu_backward_memory_is_linear_in_sequence_length():
    """No Sq x Sk buffer: the backward's extra memory beyond its inputs and gradients is O(S)."""
    q, k, v = make_qkv(1, 8, 8, 8192, 8192, 128, torch.bfloat16, "cuda")
    grad_out = torch.randn_like(q)
    out, lse = flash_attention_forward(q, k, v, causal=True)
    flash_attention_backward(grad_out, q, k, v, out, lse, causal=True)  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = flash_attention_backward(grad_out, q, k, v, out, lse, causal=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - sum(g.numel() * g.element_size() for g in grads)
    assert extra <= 2 * 8 * 8192 * 4 + (1 << 20), extra  # delta (fp32 per query row), plus slack


def test_backward_sweep_of_a_sliding_window_times_every_candidate_alike(device):
    from flashmoe_science.bench.sweeps import attention_backward as backward_sweep

    rows = backward_sweep.sweep(head_dims=(16,), seqlens=(40,), dtype=torch.float32, device=device, tokens=40,
                                window=8, hidden=32, limit=6)  # each candidate compiles: a few of them
    assert len(rows) == 6 and rows[0]["table_config"] and all(r["causal"] and r["window"] == 8 for r in rows)
    timed = [r for r in rows if "ms" in r]
    assert len(timed) == len(rows) and all(r["rel_diff_vs_table"] < 1e-5 for r in timed)
    assert backward_sweep.best_per_case(rows)[0].startswith("D=16 S=40 causal=True")


@pytest.mark.gpu
def test_gpu_descriptor_kernels_launch_from_a_thread_new_to_cuda():
    """A thread that has made no CUDA call yet (as autograd's backward thread is when attention's
    backward is the first node it runs) launches the TMA-descriptor kernels: forward and backward
    on sm90 (Gluon at D = 128), the generic kernels elsewhere."""
    import threading

    q, k, v, grad_out = (torch.randn(2, 4096, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                         for _ in range(4))
    # Compiled and cached here first: a first launch compiles, and loading the binary binds a context.
    ref_out, ref_lse = flash_attention_forward(q, k, v, causal=True)
    ref_grads = flash_attention_backward(grad_out, q, k, v, ref_out, ref_lse, causal=True)
    torch.cuda.synchronize()
    results, errors = [], []

    def work():
        try:
            out, lse = flash_attention_forward(q, k, v, causal=True)
            results.append((out, *flash_attention_backward(grad_out, q, k, v, out, lse, causal=True)))
            torch.cuda.synchronize()
        except Exception as exc:  # reported on the test's thread
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, repr(errors)
    out, *grads = results[0]
    assert torch.equal(out, ref_out)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert torch.equal(g, r), name
    for name, g, r in zip(("dq", "dk", "dv"), grads, reference_grads(q, k, v, grad_out, True)):
        assert rel_error(g, r) < 1e-2, name
