"""Hostile input, class by class: index ranges, extreme magnitudes, large softcaps, NaN and Inf
where a row does not look, cumulative lengths changed behind the library's back, expanded
inputs with a negative scale, option types on the cached fast path, and dynamic shapes under
torch.compile. Each class is tested as a class (several members, both directions where there
are two), against the float64 reference where there is an answer to compare.
"""
import math

import pytest
import torch

from flashmoe_science import (FlashMoELayer, FlashMoEScienceAttention, flash_attention_backward,
                              flash_attention_forward, flash_attention_qkvpacked, flash_attention_science,
                              flash_attention_varlen, fused_experts, fused_moe, moe_route)
from flashmoe_science.attention import attention_reference, varlen_attention_reference
from flashmoe_science.moe.reference import fused_experts_torch
from test_attention_varlen import make_packed
from test_properties import assert_within_pytorch, gradient_terms


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


# 1. Index range ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad_id", [2**32 + 1, 2**31, -2**40, -1, 4, 2**31 - 1])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_expert_ids_outside_range_drop_their_slot(bad_id, dtype, device):
    """An id outside [0, E), of any magnitude and either dtype, drops its slot: never another
    expert's output (narrowing int64 ids to int32 first would make 2**32 + 1 expert 1)."""
    if dtype == torch.int32 and not -2**31 <= bad_id < 2**31:
        pytest.skip("not an int32 value")
    T, E, H, I = 6, 4, 32, 16
    x = torch.randn(T, H, device=device)
    w1, w2 = torch.randn(E, 2 * I, H, device=device) * 0.2, torch.randn(E, H, I, device=device) * 0.2
    weights = torch.rand(T, 2, device=device)
    ids = torch.tensor([[1, 2], [bad_id, 0], [3, bad_id], [bad_id, bad_id], [0, 1], [2, 3]], dtype=dtype,
                       device=device)
    kept = ids.clone()
    kept[(ids < 0) | (ids >= E)] = -1
    ref = fused_experts_torch(x.double(), w1.double(), w2.double(), weights.double(), kept.long())
    out = fused_experts(x, w1, w2, weights, ids)
    assert torch.equal(out[3], torch.zeros_like(out[3])), "a token whose slots are all dropped gets 0"
    assert _rel(out, ref) < 1e-5
    # The differentiable path drops the same slots, and their weights get zero gradient.
    weights_g = weights.clone().requires_grad_()
    out_g = fused_experts(x, w1, w2, weights_g, ids)
    (grad,) = torch.autograd.grad(out_g.sum(), weights_g)
    assert _rel(out_g.detach(), ref) < 1e-5
    assert torch.equal(grad[kept < 0], torch.zeros_like(grad[kept < 0]))


# 2. Extreme magnitudes ------------------------------------------------------------------------

def _grads(q, k, v, grad_out, dtype, fn):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out.to(dtype)))


def _attention(**options):
    """(ours, PyTorch's) attention with `options`, as functions of (q, k, v) returning out."""
    def ours(q, k, v):
        return flash_attention_science(q, k, v, **options)

    def pytorch(q, k, v):
        return attention_reference(q, k, v, upcast=False, **options)[0]

    return ours, pytorch


def assert_fp32_within_pytorch(q, k, v, grad_out, ours, pytorch):
    """fp32 out, dq, dk, dv of `ours` within twice `pytorch`'s own fp32 error against float64,
    plus fp32's resolution of the terms each sums (`test_properties.assert_within_pytorch`)."""
    ref = _grads(q, k, v, grad_out, torch.float64, pytorch)
    mine = _grads(q, k, v, grad_out, torch.float32, ours)
    theirs = _grads(q, k, v, grad_out, torch.float32, pytorch)
    terms = (0.0, *gradient_terms(q, k, v, 1 / math.sqrt(q.shape[-1])))
    for name, a, b, r, t in zip(("out", "dq", "dk", "dv"), mine, theirs, ref, terms):
        assert torch.isfinite(a).all(), name
        assert_within_pytorch(name, a, b, r, torch.float32, t)


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 30.0, 1000.0])
@pytest.mark.parametrize("causal", [False, True])
def test_fp32_gradients_as_accurate_as_pytorch_at_any_scale(magnitude, causal, device):
    """q, k, v scaled by `magnitude` (1000: every softmax row is one-hot in fp32): our fp32
    output and gradients stay within 2x of PyTorch's own fp32 error against float64, plus fp32's
    resolution of the terms each is a sum of (`test_properties.gradient_terms`: where the exact
    gradient is a difference of dot products that agree, no fp32 kernel can do better), forward
    and backward alike. On the GPU fp32 products run 3xTF32 (torch's "highest" precision)."""
    B, H, S, D = 1, 2, 40, 32
    q, k, v = (torch.randn(B, H, S, D, device=device) * magnitude for _ in range(3))
    grad_out = torch.randn(B, H, S, D, device=device)
    assert_fp32_within_pytorch(q, k, v, grad_out, *_attention(causal=causal))


# 3. Large softcaps ---------------------------------------------------------------------------

@pytest.mark.parametrize("softcap", [0.05, 1.0, 30.0, 1e4, 1e6, 1e12])
def test_softcap_accurate_over_its_whole_range(softcap, device):
    """softcap * tanh(s / softcap) from a cap that binds hard to one that barely acts: output and
    gradients within 2x of PyTorch's own fp32 composition (torch.tanh) against float64."""
    B, H, S, D = 1, 2, 24, 32
    q, k, v = (torch.randn(B, H, S, D, device=device) for _ in range(3))
    grad_out = torch.randn(B, H, S, D, device=device)
    assert_fp32_within_pytorch(q, k, v, grad_out, *_attention(softcap=softcap))


# 4. NaN and Inf where a row does not look ------------------------------------------------------

@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("case", ["causal_short_keys", "window_short_keys", "no_keys"])
def test_rows_without_keys_are_exactly_zero_whatever_v_holds(case, poison, device):
    """Rows that see no key return exactly 0 with lse -inf, and exactly zero dq, even when V
    holds NaN or Inf in keys that other rows of their block see; rows that see keys are as the
    reference (NaN where they see a NaN, as PyTorch)."""
    Sq, Sk, causal, window = {"causal_short_keys": (24, 8, True, (-1, -1)),
                              "window_short_keys": (24, 8, False, (1, 0)),
                              "no_keys": (12, 0, False, (-1, -1))}[case]
    q = torch.randn(1, 2, Sq, 16, device=device, requires_grad=True)
    k = torch.randn(1, 2, Sk, 16, device=device, requires_grad=True)
    v = torch.randn(1, 2, Sk, 16, device=device)
    v[..., :Sk // 2, :] = poison
    v.requires_grad_()
    out, lse = flash_attention_science(q, k, v, causal=causal, window_size=window, return_lse=True)
    ref, ref_lse = attention_reference(q.detach(), k.detach(), v.detach(), causal=causal, window_size=window)
    blind = torch.isinf(ref_lse) & (ref_lse < 0)
    assert blind.any(), "the case must have rows that see no key"
    assert torch.equal(out[blind], torch.zeros_like(out[blind]))
    assert torch.equal(lse[blind], ref_lse[blind])
    (dq,) = torch.autograd.grad(out, q, torch.randn_like(out))
    assert torch.equal(dq[blind], torch.zeros_like(dq[blind]))


def test_varlen_empty_key_sequence_is_zero_with_nan_in_other_sequences(device):
    q, k, v, cu_q, cu_k = make_packed([5, 7, 3], [6, 0, 9], 2, 1, 16, torch.float32, device)
    v[:6] = float("nan")  # the first sequence's values: the second sequence sees no key at all
    q.requires_grad_()
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 7, 9, return_lse=True)
    assert torch.equal(out[5:12], torch.zeros_like(out[5:12]))
    assert torch.isneginf(lse[:, 5:12]).all()
    third = (torch.tensor([0, 3], dtype=torch.int32, device=device), torch.tensor([0, 9], dtype=torch.int32,
                                                                                    device=device))
    ref, _ = varlen_attention_reference(q.detach()[12:], k[6:], v[6:], *third)
    assert _rel(out[12:], ref) < 1e-5
    (dq,) = torch.autograd.grad(out, q, torch.ones_like(out))
    assert torch.equal(dq[5:12], torch.zeros_like(dq[5:12]))
    assert torch.isfinite(dq[12:]).all()


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_non_finite_router_logits_pick_experts_in_range_and_give_nan_weights(scoring, device):
    """Router logits with NaN or infinities (a diverged model): each row still picks k distinct
    experts of [0, E), ranking a NaN score first as torch.topk does; a row whose picked scores
    are NaN gets NaN weights. A pick outside [0, E) made the layer's expert counts and the router
    gradient index out of range (a device-side assert on the GPU)."""
    E, k = 6, 2
    logits = torch.randn(5, E, device=device)
    logits[1] = float("nan")
    logits[2, 3] = float("nan")
    logits[3, 0] = float("inf")
    logits[4, :3] = -float("inf")
    weights, ids = moe_route(logits, k, scoring=scoring)
    assert ((ids >= 0) & (ids < E)).all() and (ids[:, 0] != ids[:, 1]).all()
    scores = torch.sigmoid(logits) if scoring == "sigmoid" else torch.softmax(logits, -1)
    ref_weights, ref_ids = torch.topk(scores, k)
    finite = ref_weights.isfinite().all(1)
    assert torch.equal(weights.isnan().any(1), ~finite)
    assert torch.equal(ids[finite].long(), ref_ids[finite])

    layer = FlashMoELayer(16, E, 16, k).to(device)
    x = torch.randn(5, 16, device=device, requires_grad=True)
    with torch.no_grad():
        layer.router.weight[0] = float("nan")
    out = layer(x)
    out.sum().backward()
    assert out.isnan().all() and layer.tokens_per_expert.sum() == 5 * k


# 5. Cumulative lengths changed behind the version counter ---------------------------------------

@pytest.mark.parametrize("how", ["data", "numpy"])
@pytest.mark.parametrize("value", [10**6, -50, 3, 2**31 - 1])
def test_cu_seqlens_changed_in_place_never_reads_outside_and_never_passes_silently(how, value, device):
    """After a checked call, cu_seqlens changed where the version counter does not see it: the
    kernels clamp what they read into the tensors (no crash, no read outside them), and the
    device-side check turns a result of malformed lengths into NaN, forward and backward; valid
    new lengths give the right answer for them."""
    if how == "numpy" and device.type == "cuda":
        pytest.skip("numpy views need CPU memory")
    q, k, v, cu_q, cu_k = make_packed([4, 6], [5, 7], 2, 2, 16, torch.float32, device, requires_grad=True)
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, 6, 7, causal=True)
    assert torch.isfinite(out).all()
    (cu_q.data if how == "data" else cu_q.numpy())[1] = value
    new_lengths_valid = 0 <= value <= 10 and max(value, 10 - value) <= 6
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, 6, 7, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    if new_lengths_valid:
        ref, _ = varlen_attention_reference(q.detach(), k.detach(), v.detach(), cu_q, cu_k, causal=True)
        assert _rel(out.detach(), ref) < 1e-5
    else:
        assert out.isnan().all()
        assert all(g.isnan().all() for g in grads)


# 6. Every valid argument combination on every path ----------------------------------------------

@pytest.mark.parametrize("scale", [-0.7, 0.0, 0.3])
@pytest.mark.parametrize("which", ["q", "k", "qkv"])
def test_expanded_inputs_with_any_scale(scale, which, device):
    """Stride-0 (expanded) inputs with negative, zero and positive scales, forward and backward."""
    base = {n: torch.randn(1, 2, 1 if n in which else 12, 16, device=device, requires_grad=True) for n in "qkv"}
    leaves = list(base.values())
    q, k, v = (base[n].expand(1, 2, 12, 16) for n in "qkv")
    out = flash_attention_science(q, k, v, causal=True, softmax_scale=scale)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    q64, k64, v64 = (b.detach().double().requires_grad_() for b in base.values())
    ref, _ = attention_reference(*(t.expand(1, 2, 12, 16) for t in (q64, k64, v64)), causal=True,
                                 softmax_scale=scale)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())
    assert _rel(out.detach(), ref) < 1e-5
    for g, r in zip(grads, ref_grads):  # an expanded k's exact gradient can be 0: an absolute floor
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5)


# 7. Option types on the cached fast path ----------------------------------------------------------

def _attention_calls(device):
    q, k, v = (torch.randn(1, 2, 8, 16, device=device) for _ in range(3))
    pq, pk, pv, cu_q, cu_k = make_packed([3, 5], [4, 4], 2, 2, 16, torch.float32, device)
    qkv = torch.randn(1, 8, 3, 2, 16, device=device)
    out, lse = flash_attention_forward(q, k, v)
    return {
        "science": lambda **o: flash_attention_science(q, k, v, **o),
        "forward": lambda **o: flash_attention_forward(q, k, v, **o),
        "backward": lambda **o: flash_attention_backward(torch.ones_like(out), q, k, v, out, lse, **o),
        "varlen": lambda **o: flash_attention_varlen(pq, pk, pv, cu_q, cu_k, 5, 4, **o),
        "qkvpacked": lambda **o: flash_attention_qkvpacked(qkv, **o),
    }


_BAD_OPTIONS = [
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(window_size=(1.0, 2)), TypeError, "window_size"),
    (dict(window_size=(2, -3)), ValueError, "window_size"),
    (dict(softcap=True), TypeError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softmax_scale=True), TypeError, "softmax_scale"),
    (dict(softmax_scale=float("inf")), ValueError, "softmax_scale"),
    (dict(return_lse="no"), TypeError, "return_lse must be a bool"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool"),
]


@pytest.mark.parametrize("options,error,match", _BAD_OPTIONS)
def test_option_checks_run_after_a_cached_call(options, error, match, device):
    """After a valid call of the same shapes (whose plan is cached), a bad option is still refused
    with an error naming it, by every public attention function that takes the option."""
    calls = _attention_calls(device)
    for name, call in calls.items():
        call()
        call()
        if "return_lse" in options and name in ("forward", "backward"):
            continue
        if "deterministic" in options and name == "forward":
            continue
        with pytest.raises(error, match=match):
            call(**options)


@pytest.mark.parametrize("options,error,match", [
    (dict(top_k=2.0), TypeError, "top_k must be an int"),
    (dict(top_k=True), TypeError, "top_k must be an int"),
    (dict(renormalize=1), TypeError, "renormalize must be a bool"),
    (dict(scoring="softmax2"), ValueError, "scoring"),
])
def test_moe_option_checks_run_after_a_cached_call(options, error, match, device):
    x, logits = torch.randn(5, 32, device=device), torch.randn(5, 4, device=device)
    w1, w2 = torch.randn(4, 32, 32, device=device), torch.randn(4, 32, 16, device=device)
    calls = {"fused_moe": lambda top_k=2, **o: fused_moe(x, w1, w2, logits, top_k, **o),
             "moe_route": lambda top_k=2, **o: moe_route(logits, top_k, **o)}
    for call in calls.values():
        call()
        call()
        with pytest.raises(error, match=match):
            call(**options)


# 8. Custom ops and dynamic shapes ------------------------------------------------------------------

def _opcheck_cases(device):
    from flashmoe_science.attention import ops as attention_ops
    from flashmoe_science.moe import ops as moe_ops

    q, k, v = (torch.randn(1, 4, 10, 16, device=device, requires_grad=True) for _ in range(3))
    k, v = k[:, :2].detach().requires_grad_(), v[:, :2].detach().requires_grad_()
    out, lse = attention_ops.attention_forward(q, k, v, True, 0.3, 3, -1, 5.0)
    pq, pk, pv, cu_q, cu_k = make_packed([3, 5], [4, 6], 2, 1, 16, torch.float32, device, requires_grad=True)
    pout, plse = attention_ops.attention_varlen_forward(pq, pk, pv, cu_q, cu_k, 5, 6, True, None, -1, -1, 0.0)
    x, logits = torch.randn(9, 32, device=device, requires_grad=True), torch.randn(9, 4, device=device)
    w1 = (torch.randn(4, 32, 32, device=device) * 0.2).requires_grad_()
    w2 = (torch.randn(4, 32, 16, device=device) * 0.2).requires_grad_()
    weights, ids = moe_ops.route_op(logits, 2, True, "softmax")
    saved = moe_ops.experts_gate_up_op(x, w1, w2, weights, ids, "silu")
    grad_gate_up = torch.randn_like(saved[1])
    w1_t, w2_t = (w.detach().transpose(1, 2).contiguous().transpose(1, 2) for w in (w1, w2))
    saved_t = moe_ops.experts_gate_up_op(x.detach(), w1_t, w2_t, weights.detach(), ids, "silu", None, True)
    return [
        (attention_ops.attention_forward, (q, k, v, True, 0.3, 3, -1, 5.0)),
        (attention_ops.attention_backward, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(),
                                            lse.detach(), True, 0.3, 3, -1, 5.0, torch.randn_like(lse))),
        (attention_ops.attention_varlen_forward, (pq, pk, pv, cu_q, cu_k, 5, 6, True, None, -1, -1, 0.0)),
        (attention_ops.attention_varlen_backward, (torch.randn_like(pout), pq.detach(), pk.detach(), pv.detach(),
                                                   pout.detach(), plse.detach(), cu_q, cu_k, 5, 6, True, None, -1,
                                                   -1, 0.0, None)),
        (moe_ops.route_op, (logits.requires_grad_(), 2, True, "softmax")),
        (moe_ops.experts_gate_up_op, (x, w1, w2, weights.detach(), ids, "silu")),
        (moe_ops.experts_down_op, (x.detach(), w1.detach(), w2, weights.detach().requires_grad_(), ids,
                                   saved[0].detach(), saved[1].detach().requires_grad_(), *saved[2:])),
        (moe_ops.experts_down_backward_op, (torch.randn(9, 32, device=device), x.detach(), w1.detach(), w2.detach(),
                                            weights.detach(), ids, *(t.detach() for t in saved), True, True)),
        (moe_ops.experts_gate_up_backward_op, (grad_gate_up, x.detach(), w1.detach(), w2.detach(), ids,
                                               *saved[2:], True, True)),
        # weights stored transposed (gpt-oss's), gate/up rows interleaved: gradients in their layout
        (moe_ops.experts_down_backward_op, (torch.randn(9, 32, device=device), x.detach(), w1_t, w2_t, weights.detach(),
                                            ids, *(t.detach() for t in saved_t), True, True, True)),
        (moe_ops.experts_gate_up_backward_op, (grad_gate_up, x.detach(), w1_t, w2_t, ids, *saved_t[2:], True, True)),
        (moe_ops.experts_inference_op, (x.detach(), w1.detach(), w2.detach(), weights.detach(), ids, "silu", None,
                                        None, None)),
        (attention_ops.attention_with_kvcache, (torch.randn(2, 1, 4, 16, device=device),
                                                torch.randn(2, 12, 2, 16, device=device),
                                                torch.randn(2, 12, 2, 16, device=device),
                                                torch.randn(2, 1, 2, 16, device=device),
                                                torch.randn(2, 1, 2, 16, device=device),
                                                torch.tensor([5, 11], dtype=torch.int32, device=device), None, None,
                                                True, None, -1, -1, 0.0, 0)),
    ]


def _tensors_in(obj, seen=None):
    """Every torch.Tensor reachable from obj's attributes, slots, tuples, lists and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.device, torch.dtype)):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = [*obj.keys(), *obj.values()]
    elif isinstance(obj, (tuple, list, set, frozenset)):
        children = list(obj)
    else:
        children = list(getattr(obj, "__dict__", {}).values())
        children += [getattr(obj, name) for cls in type(obj).__mro__ for name in getattr(cls, "__slots__", ())
                     if hasattr(obj, name)]
    return [t for child in children for t in _tensors_in(child, seen)]


def test_plans_keep_no_tensors(device):
    """What the plan caches keep from call to call holds no tensor: a device tensor a plan made
    while torch.compile's CUDA graphs recorded would stay in their memory pool, which they
    refuse (the KV-cache plan once kept a placeholder, and static-cache generation failed)."""
    import gc
    import warnings

    from flashmoe_science import flash_attention_with_kvcache
    from flashmoe_science.launch import PlanCache

    for op, args in _opcheck_cases(device):  # a call of every op, and of the lean paths below
        op(*args)
    q = torch.randn(2, 1, 4, 16, device=device)
    cache = torch.randn(4, 16, 2, 16, device=device)
    flash_attention_with_kvcache(q, cache, cache, cache_seqlens=7, block_table=torch.tensor([[0, 1], [2, 3]],
                                 dtype=torch.int32, device=device))
    x = torch.randn(5, 32, device=device)
    w1, w2 = torch.randn(4, 32, 32, device=device), torch.randn(4, 32, 16, device=device)
    fused_moe(x, w1, w2, torch.randn(5, 4, device=device), 2)
    def is_plan_cache(o):
        try:
            return isinstance(o, PlanCache) and bool(o)
        except ReferenceError:  # a dead weakref.proxy (some library's) among the live objects
            return False

    with warnings.catch_warnings():  # isinstance on every live object touches deprecated module attributes
        warnings.simplefilter("ignore")
        caches = [o for o in gc.get_objects() if is_plan_cache(o)]
    assert len(caches) >= 4
    for plans in caches:
        assert not _tensors_in(plans), [type(p).__name__ for p in plans.values() if _tensors_in(p)]


@pytest.mark.slow
def test_every_custom_op_passes_the_full_opcheck(device):
    """All of torch.library.opcheck's tests (schema, autograd registration, fake tensors, AOT
    dispatch static and dynamic) on every op the library registers."""
    for op, args in _opcheck_cases(device):
        torch.library.opcheck(op, args)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = FlashMoEScienceAttention(32, 2, 1, causal=True)
        self.moe = FlashMoELayer(32, 4, 16, top_k=2)

    def forward(self, x):
        x = x + self.attention(x)
        return x + self.moe(x)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dynamic", "mark_dynamic"])
def test_layers_compile_with_dynamic_shapes_without_recompiling(mode, device):
    """torch.compile(dynamic=True), or mark_dynamic on the sequence dimension: one graph, no graph
    break, no recompilation for new lengths, results equal to eager."""
    torch._dynamo.reset()
    model = _Block().to(device)
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=mode == "dynamic" or None)
    for seqlen in (5, 9, 13):
        x = torch.randn(2, seqlen, 32, device=device, requires_grad=True)
        if mode == "mark_dynamic":
            torch._dynamo.mark_dynamic(x, 1)
        out = compiled(x)
        (grad,) = torch.autograd.grad(out.square().sum(), x)
        eager = model(x)
        (eager_grad,) = torch.autograd.grad(eager.square().sum(), x)
        torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grad, eager_grad, rtol=1e-4, atol=1e-5)
    assert counts["stats"]["unique_graphs"] == 1, dict(counts["stats"])


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_hopper_paths_take_expanded_inputs_with_negative_scales(D):
    """The Hopper (TMA, Gluon) forward and backward with a stride-0 q and a negative scale."""
    base = torch.randn(1, 8, 1, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = base.expand(1, 8, 2048, D)
    k, v = (torch.randn(1, 8, 2048, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out = flash_attention_science(q, k, v, causal=True, softmax_scale=-0.05)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (base, k, v), grad_out)
    xs = [t.detach().double().requires_grad_() for t in (base, k, v)]
    ref, _ = attention_reference(xs[0].expand(1, 8, 2048, D), xs[1], xs[2], causal=True, softmax_scale=-0.05)
    ref_grads = torch.autograd.grad(ref, xs, grad_out.double())
    assert _rel(out, ref) < 1e-2
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < 2e-2


@pytest.mark.gpu
def test_gpu_graph_replay_with_malformed_lengths_gives_nan_not_a_fault():
    """Under CUDA graph capture cu_seqlens are trusted by the host, so a replay with new values
    is where malformed ones could do harm: the kernels clamp, the device check turns the result
    into NaN, and replays with well-formed values are right again."""
    q, k, v, cu_q, cu_k = make_packed([40, 24], [30, 50], 4, 2, 64, torch.bfloat16, torch.device("cuda"))
    flash_attention_varlen(q, k, v, cu_q, cu_k, 64, 64, causal=True)  # compile and check outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention_varlen(q, k, v, cu_q, cu_k, 64, 64, causal=True)
    for lengths_q, lengths_k, well_formed in (([0, 40, 64], [0, 30, 80], True), ([0, 10**6, 64], [0, 30, 80], False),
                                              ([0, 64, 64], [0, 16, 80], True), ([0, -7, 64], [0, 90, 80], False),
                                              ([0, 64, 64], [0, 0, 80], False)):  # 80 keys > max_seqlen_k
        cu_q.copy_(torch.tensor(lengths_q, dtype=torch.int32))
        cu_k.copy_(torch.tensor(lengths_k, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        if well_formed:
            ref, _ = varlen_attention_reference(q, k, v, cu_q, cu_k, causal=True)
            assert _rel(out, ref) < 1e-2
        else:
            assert out.isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["highest", "high"])
def test_gpu_fp32_products_follow_torch_matmul_precision(precision):
    """fp32 attention and MoE, forward and backward, at torch's "highest" (3xTF32: within 2x of
    PyTorch's own fp32 error, plus fp32's resolution of the terms) and "high" (TF32, at PyTorch's
    own error with TF32 matmuls allowed, the precision the user asked for)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        B, H, S, D = 2, 4, 200, 128
        q, k, v = (torch.randn(B, H, S, D, device="cuda") for _ in range(3))
        grad_out = torch.randn(B, H, S, D, device="cuda")
        ours, pytorch = _attention(causal=True)
        if precision == "highest":
            assert_fp32_within_pytorch(q, k, v, grad_out, ours, pytorch)
        else:  # TF32, as the user asked: its error, not fp32's
            ref = _grads(q, k, v, grad_out, torch.float64, pytorch)
            for name, a, b, r in zip(("out", "dq", "dk", "dv"), _grads(q, k, v, grad_out, torch.float32, ours),
                                     _grads(q, k, v, grad_out, torch.float32, pytorch), ref):
                assert _rel(a, r) < 3 * _rel(b, r) + 5e-3, (name, _rel(a, r), _rel(b, r))
        T, E, Hd, I = 300, 8, 256, 128
        x = torch.randn(T, Hd, device="cuda")
        w1, w2 = torch.randn(E, 2 * I, Hd, device="cuda") / 16, torch.randn(E, Hd, I, device="cuda") / 11
        logits = torch.randn(T, E, device="cuda")
        weights, ids = moe_route(logits, 2)
        out = fused_experts(x, w1, w2, weights, ids)
        ref = fused_experts_torch(x.double(), w1.double(), w2.double(), weights.double(), ids.long())
        theirs = fused_experts_torch(x, w1, w2, weights, ids.long())
        assert _rel(out, ref) <= 2 * _rel(theirs, ref) + (1e-6 if precision == "highest" else 5e-3)
    finally:
        torch.set_float32_matmul_precision(previous)


def test_tensor_facts_follow_the_tensor_not_its_address():
    """`tensor_facts.TensorFacts`, which keeps what host reads found (cu_seqlens, FP8 scales): a
    fact is dropped when the tensor is written in place or freed (a new tensor at the same address
    is not taken for it), and never kept for inference-mode tensors, which have no version."""
    import numpy as np

    from flashmoe_science.tensor_facts import TensorFacts

    facts = TensorFacts(max_entries=4)
    memory = np.zeros(8, dtype=np.int32)
    a = torch.from_numpy(memory)
    facts.remember("a's", a)
    assert facts.get(a) == "a's"
    a.add_(1)  # in place: the version moves
    assert facts.get(a) is None
    facts.remember("a's again", a)
    address = a.data_ptr()
    del a
    b = torch.from_numpy(memory)  # the same memory, version and shape
    assert b.data_ptr() == address and facts.get(b) is None
    c, d = torch.zeros(3), torch.ones(3)
    facts.remember("pair", c, d)
    assert facts.get(c, d) == "pair" and facts.get(d, c) is None and facts.get(c) is None
    with torch.inference_mode():
        e = torch.zeros(2)
    facts.remember("never", e)
    assert facts.get(e) is None


def test_tensor_facts_leave_with_their_tensors():
    """A fact, which may itself be a device tensor (the packed kernels' sequence order), is freed
    with the tensors it describes, not kept until the table fills: otherwise each packed call
    would leave memory held and move later allocations (a static KV cache at a new address makes
    torch.compile's CUDA graphs record again)."""
    import gc
    import weakref

    from flashmoe_science.tensor_facts import TensorFacts

    facts = TensorFacts(max_entries=64)
    c, d = torch.zeros(3), torch.ones(3)
    order = torch.arange(3)
    facts.remember(order, c, d)
    kept = weakref.ref(order)
    del order
    assert kept() is not None
    del d
    gc.collect()
    assert kept() is None and facts.get(c) is None
    facts.remember("c's", c)
    assert facts.get(c) == "c's"
