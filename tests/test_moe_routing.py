"""Routing (top-k) and the dispatch layout, on the CPU interpreter (and on the GPU when present)."""
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashmoe_science.moe import configs, moe_route, routing
from flashmoe_science.moe.reference import moe_route_torch

POISON_INT = -7


def poisoned_allocate(shape, dtype, device):
    """A buffer filled with NaN (floats) or POISON_INT (ints), for `routing.allocate`."""
    fill = float("nan") if dtype.is_floating_point else POISON_INT
    return torch.full(shape, fill, dtype=dtype, device=device)


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the launchers allocate starts as NaN (floats) or POISON_INT (ints)."""
    monkeypatch.setattr(routing, "allocate", poisoned_allocate)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T,E,k", [(1, 1, 1), (5, 4, 2), (33, 8, 8), (300, 64, 6), (17, 200, 8)])
def test_route_matches_reference(device, poisoned, T, E, k, scoring, renormalize):
    logits = torch.randn(T, E, device=device) * 2
    weights, ids = moe_route(logits, k, renormalize=renormalize, scoring=scoring)
    ref_w, _ = moe_route_torch(logits.double(), k, renormalize=renormalize, scoring=scoring)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (T, k)
    # Scores are computed in fp32: logits closer than its rounding (common where a sigmoid
    # saturates) tie, and either order is right. So the chosen experts must carry the k largest
    # float64 scores, in order, rather than be the reference's exact ids.
    ref_scores = torch.sigmoid(logits.double()) if scoring == "sigmoid" else torch.softmax(logits.double(), dim=-1)
    torch.testing.assert_close(ref_scores.gather(1, ids.long()), torch.topk(ref_scores, k, dim=-1).values,
                               rtol=1e-6, atol=1e-7)
    assert all(len(set(row)) == k for row in ids.tolist())
    torch.testing.assert_close(weights.double(), ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_route_low_precision_logits(device, dtype):
    """Half-precision logits are scored in fp32; equal scores (common in 16 bits) may be picked in
    either order, so check the chosen scores are the k largest rather than the exact ids."""
    T, E, k = 40, 64, 8
    logits = (torch.randn(T, E, device=device) * 3).to(dtype)
    weights, ids = moe_route(logits, k, renormalize=False)
    scores = torch.softmax(logits.double(), dim=-1)
    top = torch.topk(scores, k, dim=-1).values
    torch.testing.assert_close(scores.gather(1, ids.long()), top, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weights.double(), top, rtol=1e-5, atol=1e-7)
    assert all(len(set(row)) == k for row in ids.tolist())


def test_route_ties_go_to_the_lower_expert(device):
    logits = torch.zeros(3, 8, device=device)
    logits[1, 5] = logits[1, 6] = 1.0
    weights, ids = moe_route(logits, 3)
    assert ids.tolist() == [[0, 1, 2], [5, 6, 0], [0, 1, 2]]
    torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3, device=device))


def test_route_empty(device):
    weights, ids = moe_route(torch.randn(0, 16, device=device), 4)
    assert weights.shape == ids.shape == (0, 4) and weights.dtype == torch.float32 and ids.dtype == torch.int32


def expected_layout(ids: torch.Tensor, num_experts: int, block_m: int, num_blocks: int):
    """The layout written out in Python: per expert its pairs in increasing order, in whole
    blocks; returns (rows: a pair or None for padding, block experts, block row counts)."""
    flat = ids.flatten().tolist()
    rows, experts, counts = [], [], []
    for e in range(num_experts):
        pairs = [p for p, x in enumerate(flat) if x == e]
        blocks = -(-len(pairs) // block_m)
        rows += pairs + [None] * (blocks * block_m - len(pairs))
        experts += [e] * blocks
        counts += [min(block_m, len(pairs) - b * block_m) for b in range(blocks)]
    padding = num_blocks - len(experts)
    return rows, experts + [-1] * padding, counts + [0] * padding


def check_layout(layout, ids, num_experts):
    rows, experts, counts = expected_layout(ids.cpu(), num_experts, layout.block_m, layout.num_blocks)
    assert layout.block_expert.tolist() == experts
    assert layout.block_rows.tolist() == counts
    assert layout.sorted_pairs.tolist() == [-1 if r is None else r for r in rows] + [-1] * (
        layout.num_blocks * layout.block_m - len(rows))


# (T, E, k): one token (its layout from its picks alone), one launch (`configs.route_layout`: T
# <= 32 or at most 128 pairs, over one dispatch chunk or two), and routing + count + align; up to
# 200 experts; one expert for all; E at and just past the powers of two that the routing launch
# pads the experts to (`configs.route_expert_pad`).
LAYOUT_CASES = [(1, 8, 2), (1, 200, 8), (1, 1, 1), (33, 8, 3), (70, 64, 8), (300, 8, 2), (300, 200, 4), (129, 1, 1),
                (40, 16, 4), (40, 17, 5), (5, 128, 8), (20, 129, 8)]


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("T,E,k", LAYOUT_CASES)
def test_routing_builds_the_sorted_layout(device, poisoned, T, E, k, block_m):
    """fused_moe's path: routing and layout in one launch (few tokens) or route + count + align."""
    plan = routing.DispatchPlan(T, E, k, block_m, torch.device(device))
    assert (plan.num_chunks == 1) == (T <= configs.CHUNK_TOKENS)
    logits = torch.randn(T, E, device=device)
    weights, ids, layout = routing.route_pairs(logits, plan, ("test", T, E, k, block_m), sigmoid=False,
                                               renormalize=True, with_layout=True)
    assert torch.equal(ids.long().cpu(), moe_route_torch(logits.double(), k)[1].cpu())
    check_layout(layout, ids, E)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("E,k,nan", [(8, 2, False), (64, 6, False), (256, 8, False), (16, 4, True)])
def test_one_token_routes_as_moe_route(device, poisoned, E, k, nan, scoring, renormalize):
    """Decode at batch 1 routes a one-row tile and writes the layout from the picks alone: the same
    picks and weights as `moe_route` (fp32 rounding apart: the row sums in another order), and
    the sorted layout. A NaN logit still gives k distinct experts of [0, E), with NaN weights."""
    logits = torch.randn(1, E, device=device) * 2
    if nan:
        logits[0, 3] = float("nan")
    plan = routing.DispatchPlan(1, E, k, 16, torch.device(device))
    weights, ids, layout = routing.route_pairs(logits, plan, ("test-one", E, k, scoring, renormalize),
                                               sigmoid=scoring == "sigmoid", renormalize=renormalize,
                                               with_layout=True)
    ref_w, ref_ids = moe_route(logits, k, renormalize=renormalize, scoring=scoring)
    assert torch.equal(ids, ref_ids) and len(set(ids[0].tolist())) == k and 0 <= ids.min() and ids.max() < E
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7, equal_nan=True)
    assert weights.isnan().any() == nan
    check_layout(layout, ids, E)


@given(st.data())
def test_any_one_token_layout_is_the_sorted_one(data):
    """Property: any expert count, k, layout block and scoring, and logits with ties (rounded to
    a few values) or with the picks' scores far apart: the one-token launch's picks are
    `moe_route`'s and its layout the counting sort's, every row written (poisoned buffers)."""
    draw = data.draw
    E = draw(st.integers(1, configs.MAX_EXPERTS))
    k = draw(st.integers(1, min(E, configs.MAX_TOP_K)))
    block_m = draw(st.sampled_from([16, 32, 64, 128]))
    scoring = draw(st.sampled_from(["softmax", "sigmoid"]))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    logits = torch.randn(1, E, device=device) * draw(st.sampled_from([0.1, 3.0]))
    if draw(st.booleans()):
        logits = logits.round()  # ties: the lower expert first
    plan = routing.DispatchPlan(1, E, k, block_m, device)
    with mock.patch.object(routing, "allocate", poisoned_allocate):  # a fixture would span every example
        weights, ids, layout = routing.route_pairs(logits, plan, ("test-any-one", E, k, block_m, scoring),
                                                   sigmoid=scoring == "sigmoid", renormalize=True,
                                                   with_layout=True)
    ref_w, ref_ids = moe_route(logits, k, scoring=scoring)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)
    check_layout(layout, ids, E)


@pytest.mark.parametrize("T,E,k", LAYOUT_CASES)
def test_align_given_ids(device, poisoned, T, E, k):
    """fused_experts' path (count + align, or align alone), with ids that skip most experts and
    ids outside [0, E), which are left out of the layout."""
    ids = torch.randint(0, min(E, 3), (T, k), device=device, dtype=torch.int32) * (E // min(E, 3))
    ids[::7, 0] = -1
    ids[3::11, -1] = E
    plan = routing.DispatchPlan(T, E, k, 32, torch.device(device))
    layout = routing.align_pairs(ids, plan, ("test-align", T, E, k))
    check_layout(layout, ids, E)


@pytest.mark.parametrize("bad,match", [
    (lambda d: moe_route([[1.0, 2.0]], 1), "router_logits must be a torch.Tensor"),
    (lambda d: moe_route(torch.randn(2, 3, 4, device=d), 1), "router_logits must be 2-D"),
    (lambda d: moe_route(torch.randint(0, 3, (2, 4), device=d), 1), "router_logits has dtype"),
    (lambda d: moe_route(torch.randn(2, 300, device=d), 1), "router_logits has E = 300"),
    (lambda d: moe_route(torch.randn(2, 4, device=d), 5), "top_k must be between 1 and min"),
    (lambda d: moe_route(torch.randn(2, 16, device=d), 9), "top_k must be between 1 and min"),
    (lambda d: moe_route(torch.randn(2, 4, device=d), 0), "top_k must be between"),
    (lambda d: moe_route(torch.randn(2, 4, device=d), 2.0), "top_k must be an int"),
    (lambda d: moe_route(torch.randn(2, 4, device=d), [2]), "top_k must be an int"),
    (lambda d: moe_route(torch.randn(2, 4, device=d), 2, scoring="relu"), "scoring must be one of"),
    (lambda d: moe_route(torch.randn(2, 4, device=d), 2, renormalize=1), "renormalize must be a bool"),
])
def test_route_rejects_bad_input(device, bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        bad(device)


@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True),
                                                 ("sigmoid", False)])
@pytest.mark.parametrize("dtype,T,E,k", [(torch.float32, 37, 6, 2), (torch.float32, 70, 60, 8),
                                         (torch.float16, 5, 130, 3)])
def test_route_backward_matches_autograd_of_the_formula(device, poisoned, scoring, renormalize, dtype, T, E, k):
    """d logits from the routing's one-launch backward against float64 autograd through the
    routing formula (the same picks), on logits with a row stride of their own and over several
    programs; within 2x of PyTorch's own error in fp32 plus its output dtype's rounding."""
    logits = torch.randn(T, E + 3, device=device)[:, :E].to(dtype)
    weights, ids = moe_route(logits, k, renormalize=renormalize, scoring=scoring)
    grad_weights = torch.randn(T, k, device=device)
    grad = routing.route_backward(grad_weights, logits, weights, ids, renormalize, scoring)
    assert grad.dtype == dtype and grad.shape == (T, E) and not torch.isnan(grad).any()

    def reference(x):
        scores = torch.sigmoid(x) if scoring == "sigmoid" else torch.softmax(x, dim=-1)
        chosen = scores.gather(1, ids.long())
        return chosen / chosen.sum(dim=-1, keepdim=True) if renormalize else chosen

    x64 = logits.double().requires_grad_()
    (ref,) = torch.autograd.grad(reference(x64), x64, grad_weights.double())
    x32 = logits.float().requires_grad_()
    (theirs,) = torch.autograd.grad(reference(x32), x32, grad_weights)
    scale = ref.abs().max().item()
    ours_err = (grad.double() - ref).abs().max().item() / scale
    torch_err = (theirs.double() - ref).abs().max().item() / scale
    assert ours_err <= 2 * torch_err + (1e-3 if dtype == torch.float16 else 1e-6), (ours_err, torch_err)


def test_route_backward_of_no_tokens(device):
    logits = torch.randn(0, 8, device=device)
    weights, ids = moe_route(logits, 2)
    grad = routing.route_backward(torch.randn(0, 2, device=device), logits, weights, ids, True, "softmax")
    assert grad.shape == (0, 8)
