"""Expert parallelism (`flashmoe_science.parallel.shard_experts`) on the CPU: 2 and 4 processes
over gloo, each with its own tokens, fp32, against the full layer that every rank also holds:
outputs and input gradients equal, each rank's expert-weight gradients the slice of the full
layer's summed over ranks, router gradients summed over ranks equal; the backward's rows'
gradient sent before w1's gradient is computed; tokens that need no gradient, no_grad, and a
second backward through the same graph;
routings that send every token to one rank's experts, a rank with no tokens, and an expert count
the group cannot split;
the fixed-capacity mode, with room for every assignment and with assignments dropped, and
traced whole by torch.compile (fullgraph); beside FSDP2 on the other layers. On a machine with
two GPUs or more the same checks run over NCCL, one GPU a process (fp32, exact products). And
`flashmoe-science bench ep --quick`, which starts itself under torchrun."""
import json
import os
import subprocess
import sys

import numpy
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
import torch.distributed as dist
import torch.multiprocessing as mp

TOL = 1e-5
# The gloo processes run the kernels through Triton's interpreter, which Triton 3.6 runs with
# numpy < 2.3 only (a GPU machine's image may have a newer numpy; its GPUs run the NCCL tests).
needs_interpreter = pytest.mark.skipif(numpy.lib.NumpyVersion(numpy.__version__) >= "2.3.0",
                                       reason="Triton 3.6's interpreter needs numpy < 2.3")


def _close(a, b, what):
    err = (a - b).abs().max().item() if a.numel() else 0.0
    scale = max(b.abs().max().item() if b.numel() else 0.0, 1.0)
    assert err <= TOL * scale, f"{what}: max error {err:.3g} for values up to {scale:.3g}"


def _summed(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def _with_drops(full, capacity, world):
    """The full layer's forward with the assignments a rank's fixed capacity leaves out (past
    `capacity` per owning rank, in token order) dropped, and how many."""
    from flashmoe_science.moe import fused_experts, moe_route
    from flashmoe_science.moe.reference import gated_activation_torch

    local = full.num_experts // world

    def forward(x):
        weights, ids = moe_route(full.router(x), full.top_k, renormalize=full.renormalize)
        owner = (ids // local).reshape(-1)
        position = torch.zeros_like(owner, dtype=torch.long)
        for rank in range(world):
            mine = (owner == rank).nonzero().squeeze(1)
            position[mine] = torch.arange(mine.numel())
        dropped = position >= capacity
        forward.dropped = int(dropped.sum())
        ids = torch.where(dropped, -1, ids.reshape(-1)).view_as(ids)
        out = fused_experts(x, full.w1, full.w2, weights, ids, activation=full.activation)
        gate, up = torch.nn.functional.linear(x, full.shared_w1).chunk(2, dim=-1)
        return out + torch.nn.functional.linear(gated_activation_torch(gate, up, full.activation), full.shared_w2)
    return forward


def _check_against_full_layer(full, sharded, x, rank, world, reference=None):
    """One forward and backward of both on this rank's tokens x; `reference` replaces the full
    layer's forward (its parameters')."""
    from flashmoe_science.parallel import ExpertParallelMoE

    assert isinstance(sharded, ExpertParallelMoE)
    for p in (*full.parameters(), *sharded.parameters()):
        p.grad = None
    x_full, x_sharded = (x.clone().requires_grad_() for _ in range(2))
    grad_out = torch.randn_like(x)
    out_full, out_sharded = (reference or full)(x_full), sharded(x_sharded)
    _close(out_sharded, out_full, f"rank {rank} output")
    if sharded.capacity is None and world > 1:  # each rank's rows: every rank's tokens with one of its experts
        from flashmoe_science.moe import moe_route

        owners = moe_route(full.router(x), full.top_k, renormalize=full.renormalize)[1].long() // sharded.local_experts
        to_each_rank = torch.tensor([sum(r in row.tolist() for row in owners) for r in range(world)])
        assert sharded.rows_received == _summed(to_each_rank)[rank].item()
    if reference is None:
        assert torch.equal(sharded.tokens_per_expert, full.tokens_per_expert)
        assert sharded.dropped_assignments == 0
    else:
        assert sharded.dropped_assignments == reference.dropped
    out_full.backward(grad_out)
    out_sharded.backward(grad_out)
    _close(x_sharded.grad, x_full.grad, f"rank {rank} input gradient")
    local = slice(rank * sharded.local_experts, (rank + 1) * sharded.local_experts)
    for name in ("w1", "w2"):
        _close(getattr(sharded, name).grad, _summed(getattr(full, name).grad)[local], f"rank {rank} {name} gradient")
    _close(_summed(sharded.router.weight.grad), _summed(full.router.weight.grad), "router gradient")
    _close(_summed(sharded.shared_w1.grad), _summed(full.shared_w1.grad), "shared expert gradient")


def _check_rows_gradient_leaves_before_w1_gradient(sharded, x):
    """The backward's exchanges and the experts' w1 gradient, in the order they are issued: the
    gradient of the returned rows, then that of the received rows, sent back before w1's gradient
    is computed (so that the exchange overlaps it), then the routing weights'."""
    from flashmoe_science.moe import backward

    events, exchange, launch_grad_w1 = [], dist.all_to_all_single, backward.launch_grad_w1

    def recorded_exchange(output, input, *args, **kwargs):
        events.append(f"exchange of {input.shape[1]} columns")
        return exchange(output, input, *args, **kwargs)

    def recorded_grad_w1(*args, **kwargs):
        events.append("w1 gradient")
        return launch_grad_w1(*args, **kwargs)

    out = sharded(x.requires_grad_())
    dist.all_to_all_single, backward.launch_grad_w1 = recorded_exchange, recorded_grad_w1
    try:
        out.backward(torch.randn_like(out))
    finally:
        dist.all_to_all_single, backward.launch_grad_w1 = exchange, launch_grad_w1
    H, k = sharded.hidden_size, sharded.top_k
    assert events == [f"exchange of {H} columns", f"exchange of {H} columns", "w1 gradient",
                      f"exchange of {2 * k} columns"], events


def _check_without_input_gradient(full, sharded, x, rank):
    """Tokens that need no gradient (a first layer's): the weights' gradients as the full
    layer's; and a forward under no_grad (inference), which records nothing, the same output."""
    for p in (*full.parameters(), *sharded.parameters()):
        p.grad = None
    grad_out = torch.randn_like(x)
    full(x).backward(grad_out)
    sharded(x).backward(grad_out)
    local = slice(rank * sharded.local_experts, (rank + 1) * sharded.local_experts)
    for name in ("w1", "w2"):
        _close(getattr(sharded, name).grad, _summed(getattr(full, name).grad)[local], f"rank {rank} {name} gradient")
    _close(_summed(sharded.router.weight.grad), _summed(full.router.weight.grad), "router gradient")
    with torch.no_grad():
        out = sharded(x)
        assert out.grad_fn is None
        _close(out, full(x), f"rank {rank} output under no_grad")


def _check_backward_twice(sharded, x, rank):
    """A second backward through the same graph (retain_graph=True) adds the same gradients again."""
    for p in sharded.parameters():
        p.grad = None
    x = x.requires_grad_()
    out, grad_out = sharded(x), torch.randn_like(x)
    out.backward(grad_out, retain_graph=True)
    first = [t.grad.clone() for t in (x, sharded.w1, sharded.w2)]
    out.backward(grad_out)
    for name, once, t in zip(("input", "w1", "w2"), first, (x, sharded.w1, sharded.w2)):
        _close(t.grad, 2 * once, f"rank {rank} {name} gradient after two backwards")


def _check_with_fsdp2(rank, world, device):
    """The sharded layer between two Linear layers that FSDP2 (fully_shard) shards: the output
    of the unsharded model, and FSDP's gradients (averaged over ranks) those of the unsharded
    model averaged over ranks."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from flashmoe_science import FlashMoELayer
    from flashmoe_science.parallel import shard_experts

    torch.manual_seed(0)
    first, last = torch.nn.Linear(32, 32, device=device), torch.nn.Linear(32, 32, device=device)
    moe = FlashMoELayer(32, 2 * world, 16, top_k=2, device=device)
    reference = torch.nn.Sequential(copy.deepcopy(first), moe, copy.deepcopy(last))
    model = torch.nn.Sequential(first, shard_experts(moe), last)
    mesh = init_device_mesh(device.type, (world,))
    for linear in (model[0], model[2]):
        fully_shard(linear, mesh=mesh)
    x = torch.randn(6, 32, device=device)
    out, out_ref = model(x), reference(x)
    _close(out, out_ref, f"rank {rank} output under FSDP2")
    out.square().sum().backward()
    out_ref.square().sum().backward()
    for ours, theirs in ((model[0], reference[0]), (model[2], reference[2])):
        _close(ours.weight.grad.full_tensor(), _summed(theirs.weight.grad) / world, "FSDP2 gradient")


def _worker(rank, world, store_path, backend):
    if backend == "nccl":  # one GPU a process; every tensor below on it
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        torch.set_default_device(device)
        dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=world,
                                device_id=device)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        from flashmoe_science import FlashMoELayer
        from flashmoe_science.parallel import shard_experts

        torch.manual_seed(0)  # the same full layer on every rank
        full = FlashMoELayer(32, 2 * world, 16, top_k=2, num_shared_experts=1, router_aux_loss_coef=0.01)
        sharded = shard_experts(full)
        torch.manual_seed(1 + rank)  # each rank its own tokens; the last of four has none
        tokens = 0 if world == 4 and rank == 3 else 5 + 3 * rank
        _check_against_full_layer(full, sharded, torch.randn(tokens, 32), rank, world)
        if world == 2:
            _check_rows_gradient_leaves_before_w1_gradient(sharded, torch.randn(tokens, 32))
            _check_without_input_gradient(full, sharded, torch.randn(tokens, 32), rank)
            _check_backward_twice(sharded, torch.randn(tokens, 32), rank)
        # Dropless in chunks of 2 tokens (a pipeline of up to 6 chunks, the last one short)
        _check_against_full_layer(full, shard_experts(full, chunk_tokens=2), torch.randn(tokens, 32), rank, world)
        for bad in (0, 2.0, True):
            with pytest.raises(ValueError, match="chunk_tokens"):
                shard_experts(full, chunk_tokens=bad)

        with torch.no_grad():  # every token's top 2 among experts 0 and 1: all to rank 0
            for layer in (full, sharded):
                layer.router.weight.zero_()
                layer.router.weight[:2, 0] = torch.tensor([5.0, 4.0])
        x = torch.randn(6, 32)
        x[:, 0] = 1 + x[:, 0].abs()
        _check_against_full_layer(full, sharded, x, rank, world)
        assert sharded.tokens_per_expert[2:].sum() == 0

        with pytest.raises(ValueError, match="divisible"):
            shard_experts(FlashMoELayer(32, 2 * world + 1, 16, top_k=2))

        # Fixed capacity (the same on every rank): room for every assignment, then for 3 per rank pair (the 12 assignments
        # of the last six tokens, all to rank 0, lose 9).
        torch.manual_seed(0)
        full = FlashMoELayer(32, 2 * world, 16, top_k=2, num_shared_experts=1)
        torch.manual_seed(1 + rank)
        x = torch.randn(tokens, 32)
        _check_against_full_layer(full, shard_experts(full, capacity=32), x, rank, world)
        _check_against_full_layer(full, shard_experts(full, capacity=3), x, rank, world, _with_drops(full, 3, world))
        with torch.no_grad():
            full.router.weight.zero_()
            full.router.weight[:2, 0] = torch.tensor([5.0, 4.0])
        x = torch.randn(6, 32)
        x[:, 0] = 1 + x[:, 0].abs()
        reference = _with_drops(full, 3, world)
        _check_against_full_layer(full, shard_experts(full, capacity=3), x, rank, world, reference)
        assert reference.dropped == 9
        with pytest.raises(ValueError, match="capacity"):
            shard_experts(full, capacity=0)

        if world == 2:  # the fixed-capacity forward and backward trace as one graph: no host synchronisation
            torch.manual_seed(0)
            full = FlashMoELayer(32, 2 * world, 16, top_k=2, num_shared_experts=1)
            compiled = torch.compile(shard_experts(full, capacity=16), fullgraph=True, backend="aot_eager")
            x = torch.randn(6, 32, requires_grad=True)
            compiled(x).sum().backward()
            _close(compiled(x), full(x), f"rank {rank} compiled output")
            # Dropless under torch.compile: its exchange runs eagerly between the compiled parts.
            compiled = torch.compile(shard_experts(full), backend="aot_eager")
            x_full, x_compiled = (x.detach().clone().requires_grad_() for _ in range(2))
            out = compiled(x_compiled)
            _close(out, full(x_full), f"rank {rank} compiled dropless output")
            grad_out = torch.randn_like(out)
            full(x_full).backward(grad_out)
            out.backward(grad_out)
            _close(x_compiled.grad, x_full.grad, f"rank {rank} compiled dropless input gradient")
            _check_with_fsdp2(rank, world, device)
    finally:
        dist.destroy_process_group()


@needs_interpreter
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_layer_matches_the_full_layer(world, tmp_path):
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), "gloo"), nprocs=world, join=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs or more")
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_layer_matches_the_full_layer_over_nccl(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), "nccl"), nprocs=world, join=True)


def test_bench_ep_runs_under_torchrun(tmp_path):
    """The benchmark starts itself under torchrun (two processes over gloo here), times every
    implementation at EP 1 and 2, and checks each output against the float64 unsharded layer."""
    from flashmoe_science.bench.ep import IMPLS

    if torch.cuda.is_available():
        pytest.skip("the GPU run is the benchmark itself (benchmarks/gpu_run.sh ep)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "flashmoe_science", "bench", "ep", "--quick", "--repeats", "1",
                           "--modes", "fwd+bwd", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = json.loads((tmp_path / "ep.json").read_text())["rows"]
    assert sorted((r["ep"], r["impl"]) for r in rows) == sorted((e, i) for e in (1, 2) for i in IMPLS)
    for r in rows:
        assert r["world"] == 2 and r["mode"] == "fwd+bwd" and r["tokens_per_s_per_gpu"] > 0, r
        assert r["rel_error"] < 1e-5 and r["torch_rel_error"] < 1e-5, r
        assert r.get("dropped", 0) == 0, r  # the tiny shape's routing fits 1.25 times the even share
        imbalance = r.get("rows_received_max_over_mean")
        assert (imbalance is not None) == (r["ep"] == 2 and r["impl"] in ("ours", "ours_chunked")), r
        assert imbalance is None or imbalance >= 1.0, r


def test_shard_experts_needs_a_process_group_and_a_layer():
    from flashmoe_science import FlashMoELayer
    from flashmoe_science.parallel import shard_experts

    with pytest.raises(TypeError, match="FlashMoELayer"):
        shard_experts(torch.nn.Linear(4, 4))
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            shard_experts(FlashMoELayer(32, 4, 16, top_k=2))


def _single_rank_worker(rank, store_path):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=0, world_size=1)
    try:
        from flashmoe_science import FlashMoELayer
        from flashmoe_science.parallel import shard_experts

        torch.manual_seed(0)
        full = FlashMoELayer(32, 4, 16, top_k=2, num_shared_experts=1)
        _check_against_full_layer(full, shard_experts(full), torch.randn(7, 32), 0, 1)
        _check_packed_rows()
    finally:
        dist.destroy_process_group()


def _check_packed_rows():
    """The rows sent to the experts' owners arrive with their routing packed behind them, and
    with a row stride of a multiple of 16 elements (what lets the kernels load them 16 bytes at
    a time), whatever the routing's width: Qwen3's k = 8 and DeepSeek's k = 6, bf16 and fp32."""
    from flashmoe_science.parallel import _GradientBack, _SendRows, _wait

    for dtype, H, k in ((torch.bfloat16, 2048, 8), (torch.bfloat16, 2048, 6), (torch.float32, 40, 6)):
        tokens = torch.randn(5, H).to(dtype)
        source = torch.tensor([3, 0, 3, 4])
        routing = torch.randn(4, 2 * k)
        pending = []
        rows, got = _SendRows.apply(tokens, routing, source, None, _GradientBack([4], [4], None), pending)
        _wait(pending)
        assert torch.equal(rows, tokens[source]) and torch.equal(got, routing)
        assert rows.stride(0) % 16 == 0 and rows.stride(1) == 1, (dtype, k, rows.stride())


@needs_interpreter
def test_a_group_of_one_runs_the_experts_in_place(tmp_path):
    mp.spawn(_single_rank_worker, args=(str(tmp_path / "store"),), nprocs=1, join=True)


@st.composite
def routings(draw):
    """A chunk's routing: T tokens (0 included), k distinct experts each of E = world * local, and
    their weights."""
    world, local = draw(st.sampled_from([1, 2, 3, 4])), draw(st.sampled_from([1, 2, 4]))
    E = world * local
    k = draw(st.integers(1, min(E, 8)))
    T = draw(st.integers(0, 9))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
    if T and draw(st.booleans()):  # every token to the first rank's experts, when it has k of them
        ids = ids % local if k <= local else ids
    ids = ids.to(draw(st.sampled_from([torch.int32, torch.int64])))
    return ids, torch.rand(T, k, generator=g), local, world


@given(routings())
def test_pairs_send_each_token_once_to_each_rank_owning_its_experts(case):
    """`_Pairs`, what a dropless call sends: for any routing, the first n = per_rank.sum()
    pairs are exactly the (token, rank) pairs where the rank owns one of the token's experts, each
    once, rank by rank; each carries the token's local expert ids on that rank (-1 elsewhere)
    and their weights (0 elsewhere); position names each token's pair per rank, n where it has
    none; and gather_sum over position adds each token's pairs and nothing else."""
    from flashmoe_science.moe.experts import gather_sum
    from flashmoe_science.parallel import _Pairs

    ids, weights, local, world = case
    T, k = ids.shape
    pairs = _Pairs(ids, weights, local, world)
    owner = ids.long() // local
    expected = [(t, r) for r in range(world) for t in range(T) if (owner[t] == r).any()]
    n = int(pairs.per_rank.sum())
    assert n == len(expected) and pairs.per_rank.tolist() == [sum(1 for _, r in expected if r == q)
                                                              for q in range(world)]
    for p, (t, r) in enumerate(expected):
        assert int(pairs.source[p]) == t
        mine = owner[t] == r
        assert torch.equal(pairs.routing[p, :k], torch.where(mine, ids[t].long() - r * local, -1).float())
        assert torch.equal(pairs.routing[p, k:], torch.where(mine, weights[t], 0.0))
        assert int(pairs.position[t, r]) == p
    absent = [(t, r) for t in range(T) for r in range(world) if not (owner[t] == r).any()]
    assert all(int(pairs.position[t, r]) == n for t, r in absent)
    rows = torch.randn(n, 3)
    # The n rows that come back, in a buffer whose memory past them is poison (never read: n, the
    # mark of a missing pair, is outside the rows).
    summed = gather_sum(torch.cat([rows, torch.full((2, 3), float("nan"))])[:n], pairs.position)
    expected_sum = torch.zeros(T, 3, dtype=torch.float64)
    for p, (t, _) in enumerate(expected):
        expected_sum[t] += rows[p].double()
    torch.testing.assert_close(summed.double(), expected_sum, rtol=1e-6, atol=1e-6)


def test_ep_trace_reads_a_trace_back():
    """`bench/sweeps/ep_trace.py --read`: the middle call's timeline of a committed trace, its
    kernels and the four row exchanges of a forward+backward, with no GPU."""
    from pathlib import Path

    from flashmoe_science.bench.sweeps.ep_trace import timeline

    trace = Path(__file__).parent.parent / "benchmarks/results/ep_trace/qwen3_16k_ep4_fwd_bwd_rank0.json.gz"
    lines = timeline(str(trace)).splitlines()
    assert lines[0].endswith("events or gaps of at least 20 us:") and "call 2 of 3" in lines[0]
    names = [line.split(None, 4)[-1] for line in lines[2:]]
    assert sum(name.startswith("ncclDevKernel") for name in names) >= 5  # the counts, then four row exchanges
    assert sum(name.startswith("gather_sum_kernel") for name in names) == 2
    assert any(name.startswith("grad_w1_kernel") for name in names)
