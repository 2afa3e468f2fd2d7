"""Expert parallelism on torch.distributed: `shard_experts(layer, group)`.

Rank r of a group of W holds experts [r E/W, (r+1) E/W) of a `FlashMoELayer`; the router and
the shared experts are replicated. A forward on each rank's own tokens:

1. routes them with the replicated router (top-k ids over all E experts, weights);
2. sends each token once to each rank that owns any of its experts (not once per expert), with
   its k local expert ids there (-1 for another rank's) and weights, sorted by rank: first the
   counts (`all_to_all_single` of a few integers: the one host synchronisation, as every
   dropless token dispatcher has), then the rows and their routing;
3. runs the received rows through this rank's experts with the fused grouped GEMMs
   (`fused_experts`: each row's local experts, their routing weights applied in fp32 in the down
   projection's epilogue and summed, as the single-GPU layer does);
4. sends that one row per (token, rank) back the same way and sums each token's rows (fp32
   accumulation), then adds the shared experts, computed while the tokens were in flight to
   their experts.

With a fixed `capacity` the exchanges (one row per assignment) have sizes fixed by the shapes
instead: no count exchange, no host synchronisation, assignments past the capacity dropped and
counted.

Autograd runs through the exchanges (each one's backward is the reverse exchange): input
gradients come back to the tokens' ranks (the experts' backward sends the rows' gradient back
as soon as it has it, then computes w1's gradient while it travels), expert-weight gradients
stay with the experts' owner (the sum over every rank's tokens), and the router and
shared-expert gradients are each rank's own (all-reduce them as for any replicated parameter,
with DDP or FSDP). The dropless exchanges are `dist.all_to_all_single` calls made asynchronous
and waited for on the stream (each token's row and its routing packed into one exchange), the
least host time a call, since a dropless call synchronises with the host once anyway; the
fixed-capacity ones are torch.distributed's functional collectives, which torch.compile traces.
NCCL on GPUs, gloo on CPUs: any backend with all_to_all_single.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from .layers.moe import FlashMoELayer, count_values, router_statistics
from .moe import backward, experts, fused_experts, moe_route
from .moe.experts import gather_sum
from .moe.routing import needs_gradient
from .moe.reference import gated_activation_torch

# The most chunks a dropless call is pipelined in (their count travels with the exchange's sizes).
MAX_CHUNKS = 16


def shard_experts(layer: FlashMoELayer, group=None, *, capacity: int | None = None,
                  chunk_tokens: int | None = None) -> "ExpertParallelMoE":
    """This rank's expert-parallel copy of `layer` (which every rank holds in full, with the same
    weights): its slice of the experts, copied, with the router and shared experts replicated.
    `group`: a process group (default: the world). Needs num_experts divisible by its size.

    capacity: None (dropless: every assignment is computed; the exchange's sizes are counted
    first, one host synchronisation a call), or the most (token, expert) assignments a rank sends
    to each rank a call, the same on every rank: fixed-size exchanges, no count exchange and no host synchronisation (the
    call can be captured in a CUDA graph). Assignments past it, in token order, are dropped:
    they contribute nothing, as a slot whose expert id is out of range does, and the layer's
    `dropped_assignments` counts them (a device tensor).

    chunk_tokens: None (one exchange each way a call), or dropless calls send their tokens in
    chunks of this many, pipelined: one chunk is computed while the next travels to its experts
    and the one before comes back. Over NVLink (H100s) chunks of 4096 tokens lose more
    in the smaller expert GEMMs than the overlap hides (`bench ep`, ours_chunked); slower links
    may gain.

    A group of one rank runs the experts in place, as the unsharded layer does (no exchange)."""
    if not isinstance(layer, FlashMoELayer):
        raise TypeError(f"layer must be a FlashMoELayer, got {type(layer).__name__}")
    if layer.is_fp8:
        raise ValueError("shard_experts takes a layer with fp16, bf16 or fp32 experts, not FP8 ones (to_fp8)")
    if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1):
        raise ValueError(f"capacity must be None (dropless) or an int >= 1, got {capacity!r}")
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool)
                                     or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be None (one chunk) or an int >= 1, got {chunk_tokens!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shard_experts needs torch.distributed initialised (dist.init_process_group)")
    return ExpertParallelMoE(layer, group, capacity, chunk_tokens)


class ExpertParallelMoE(nn.Module):
    """A `FlashMoELayer` whose experts are spread over a process group (`shard_experts`).

    Parameters: router.weight (E, H) and the shared experts, replicated; w1 (E/W, 2I, H) and
    w2 (E/W, H, I), the experts [rank E/W, (rank + 1) E/W). forward(x: (..., H)) -> (..., H)
    on this rank's tokens, the same as the full layer's on them; aux_loss, z_loss and
    tokens_per_expert (E,) as the layer sets them, from this rank's tokens; dropped_assignments,
    the assignments the fixed capacity left out (0 when dropless); rows_received, the rows this
    rank's experts computed in its last dropless exchange (a host int, known from the count
    exchange; None for the fixed capacity or a group of one): how evenly the routing loads the ranks.
    """

    def __init__(self, layer: FlashMoELayer, group=None, capacity: int | None = None,
                 chunk_tokens: int | None = None):
        super().__init__()
        self.group, self.capacity, self.chunk_tokens = group, capacity, chunk_tokens
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if layer.num_experts % self.world_size:
            raise ValueError(f"num_experts ({layer.num_experts}) must be divisible by the group's size "
                             f"({self.world_size}) to shard the experts evenly")
        for name in ("hidden_size", "num_experts", "expert_dim", "top_k", "renormalize", "activation",
                     "num_shared_experts", "router_aux_loss_coef", "router_z_loss_coef"):
            setattr(self, name, getattr(layer, name))
        self.local_experts = layer.num_experts // self.world_size
        first = self.rank * self.local_experts
        local = slice(first, first + self.local_experts)
        with torch.no_grad():
            self.router = nn.Linear(layer.hidden_size, layer.num_experts, bias=False, dtype=layer.w1.dtype,
                                    device=layer.w1.device)
            self.router.weight.copy_(layer.router.weight)
            self.w1 = nn.Parameter(layer.w1[local].clone())
            self.w2 = nn.Parameter(layer.w2[local].clone())
            self.shared_w1 = nn.Parameter(layer.shared_w1.clone()) if layer.shared_w1 is not None else None
            self.shared_w2 = nn.Parameter(layer.shared_w2.clone()) if layer.shared_w2 is not None else None
        self.aux_loss = self.z_loss = self.tokens_per_expert = self.dropped_assignments = None
        self.rows_received = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be (..., hidden_size = {self.hidden_size}), got shape {tuple(x.shape)}")
        if x.dtype != self.w1.dtype:
            raise TypeError(f"x has dtype {x.dtype} but the layer's parameters are {self.w1.dtype}")
        tokens = x.reshape(-1, self.hidden_size)
        logits = self.router(tokens)
        weights, ids = moe_route(logits, self.top_k, renormalize=self.renormalize)
        if self.world_size == 1 and self.capacity is None:  # every expert here: nothing to exchange
            out, shared = fused_experts(tokens, self.w1, self.w2, weights, ids, activation=self.activation), \
                self._shared(tokens)
            self.dropped_assignments = torch.zeros((), dtype=torch.int64, device=tokens.device)
        else:
            exchange = self._dropless if self.capacity is None else self._fixed_capacity
            # The shared experts run while the tokens travel to their experts' ranks.
            out, shared = exchange(tokens, ids.reshape(-1), weights.reshape(-1), lambda: self._shared(tokens))
        if shared is not None:
            out = out + shared
        self.tokens_per_expert, self.aux_loss, self.z_loss = router_statistics(
            logits, ids, self.num_experts, self.router_aux_loss_coef, self.router_z_loss_coef)
        return out.reshape(x.shape)

    def _shared(self, tokens):
        if self.shared_w1 is None:
            return None
        gate, up = F.linear(tokens, self.shared_w1).chunk(2, dim=-1)
        return F.linear(gated_activation_torch(gate, up, self.activation), self.shared_w2)

    def _compute(self, rows, local_ids, weights, back: "_GradientBack | None" = None):
        """This rank's experts on the rows it received: each row through its local experts (ids
        (n, m); -1 is a slot for another rank's expert, or empty, and adds nothing), scaled by
        their routing weights (n, m) and summed. With `back` (the dropless exchange's), and
        autograd recording, the gate/up half is `_LocalGateUp`: the rows' gradient leaves for
        their ranks before w1's gradient is computed."""
        if back is not None and needs_gradient(rows, weights, self.w1, self.w2):
            weights, local_ids = weights.contiguous(), local_ids.contiguous()
            layout = _LocalGateUp.apply(rows, self.w1, self.w2, weights, local_ids, self.activation, back)
            return torch.ops.flashmoe_science.moe_experts_down(rows, self.w1, self.w2, weights, local_ids, *layout)
        return fused_experts(rows, self.w1, self.w2, weights, local_ids, activation=self.activation)

    def _sorted_by_owner(self, ids):
        """The assignments sorted (stably) by the rank owning their expert: (the order, each
        sorted assignment's owner, its expert's id on the owner)."""
        owner = torch.div(ids, self.local_experts, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        owner_sorted = owner[order]
        return order, owner_sorted, (ids[order] - owner_sorted * self.local_experts).to(torch.int32)

    # Run eagerly under torch.compile: the call synchronises with the host once to size its
    # exchanges, so there is nothing to trace whole, and its exchanges are eager c10d calls.
    @torch.compiler.disable
    def _dropless(self, tokens, ids, weights, meanwhile):
        """(the tokens' expert outputs (T, H), computed by the ranks that own the experts and
        summed; what `meanwhile()` returns, called while the rows are in flight).

        Each token travels once to each rank that owns any of its k experts (not once per
        expert), with its k local expert ids (-1 where another rank owns the expert) and weights
        packed behind its row: one exchange each way. The owner sums its share of the k weighted
        outputs before sending one row back. With `chunk_tokens` the tokens go in chunks of that
        many (at most MAX_CHUNKS, larger ones past that), a pipeline: chunk c + 2 is sent, and
        chunk c's results come back, while chunk c + 1 is computed. Every chunk's sizes, and each
        rank's chunk count, are exchanged at once first: one host synchronisation a call, before
        which everything but the rows' gather is prepared, so the exchange starts as soon as the
        sizes are known."""
        group = self.group or dist.group.WORLD
        k, world = self.top_k, self.world_size
        T = tokens.shape[0]
        ids = ids.view(T, k)
        weights = weights.view(T, k)
        size = max(self.chunk_tokens or T, -(-T // MAX_CHUNKS), 1)
        bounds = [(s, min(s + size, T)) for s in range(0, T, size)]
        counts = torch.zeros(world, 1 + MAX_CHUNKS, dtype=torch.int64, device=tokens.device)
        counts[:, 0] = max(1, len(bounds))  # this rank's chunks, then each chunk's rows per destination
        chunks = []
        for c, (s, e) in enumerate(bounds):
            chunk = _Pairs(ids[s:e], weights[s:e], self.local_experts, world)
            counts[:, 1 + c] = chunk.per_rank
            chunks.append(chunk)
        received = _all_to_all(counts, [1] * world, [1] * world, group)
        self.dropped_assignments = torch.zeros((), dtype=torch.int64, device=tokens.device)
        sent, received = torch.stack([counts, received]).tolist()  # one host synchronisation
        # Every rank runs as many exchanges as the rank with the most chunks; the others send nothing in theirs.
        num_chunks = max(row[0] for row in sent + received)
        send_sizes = [[row[1 + c] for row in sent] for c in range(num_chunks)]
        recv_sizes = [[row[1 + c] for row in received] for c in range(num_chunks)]
        sent_rows = [sum(sizes) for sizes in send_sizes]
        self.rows_received = sum(map(sum, recv_sizes))
        starts = [s for s, _ in bounds]
        if num_chunks > len(chunks):
            chunks += [_Pairs(ids[:0], weights[:0], self.local_experts, world)] * (num_chunks - len(chunks))
            starts += [0] * (num_chunks - len(starts))

        def send(c):
            pending, n = [], sent_rows[c]
            chunk, rows = chunks[c], tokens[starts[c]:starts[c] + chunks[c].tokens]
            back = _GradientBack(send_sizes[c], recv_sizes[c], group)
            rows, routing = _SendRows.apply(rows, chunk.routing[:n], chunk.source[:n], chunk.position, back, pending)
            return rows, routing, pending, back

        in_flight = [send(c) for c in range(min(2, num_chunks))]
        result = meanwhile()
        returned = []
        for c in range(num_chunks):
            rows, routing, pending, back = in_flight[c]
            _wait(pending)
            computed = self._compute(rows, routing[:, :k].to(torch.int32), routing[:, k:], back)
            returned.append(_Exchange.apply(computed, send_sizes[c], recv_sizes[c], group, pending))
            if c + 2 < num_chunks:
                in_flight.append(send(c + 2))
        # Summed only now: reading a chunk's returned rows makes the computation wait for them.
        outputs = []
        for c, rows in enumerate(returned):
            _wait(in_flight[c][2])
            outputs.append(_Combine.apply(rows, chunks[c].source[:sent_rows[c]], chunks[c].position))
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)), result

    def _fixed_capacity(self, tokens, ids, weights, meanwhile):
        """As `_dropless` (in one chunk), through buffers of `capacity` rows per rank pair: each
        rank's assignments to a rank, in token order, fill its slots; those past the capacity get
        zeros. Every size is fixed by the shapes: no count exchange, no host synchronisation."""
        group = self.group or dist.group.WORLD
        capacity, world = self.capacity, self.world_size
        order, owner_sorted, local_ids = self._sorted_by_owner(ids)
        rows = tokens[torch.div(order, self.top_k, rounding_mode="floor")]
        weights = weights[order]
        counts = count_values(owner_sorted, world)
        position = torch.arange(ids.numel(), device=ids.device) - (torch.cumsum(counts, 0) - counts)[owner_sorted]
        kept = position < capacity
        self.dropped_assignments = (~kept).sum()
        # Each sorted assignment's slot in the (world x capacity) buffer; dropped ones write to a
        # spare last row, which is never sent, and read back zeros.
        slot = torch.where(kept, owner_sorted * capacity + position, world * capacity)
        send = tokens.new_zeros(world * capacity + 1, self.hidden_size).index_copy(0, slot, rows)[:-1]
        slot_ids = torch.full((world * capacity + 1,), -1, dtype=torch.int32, device=ids.device)
        slot_ids = slot_ids.index_copy(0, slot, local_ids)
        slot_weights = weights.new_zeros(world * capacity + 1).index_copy(0, slot, weights)[:-1]
        received_ids = funcol.all_to_all_single(slot_ids[:-1], None, None, group)
        received_weights = funcol.all_to_all_single_autograd(slot_weights, None, None, group)
        received = funcol.all_to_all_single_autograd(send, None, None, group)
        result = meanwhile()
        computed = self._compute(_waited(received), _waited(received_ids).unsqueeze(1),
                                 _waited(received_weights).unsqueeze(1))
        returned = funcol.all_to_all_single_autograd(computed, None, None, group)
        back = torch.cat([returned, returned.new_zeros(1, self.hidden_size)])[slot]
        return back[torch.argsort(order)].view(-1, self.top_k, self.hidden_size).sum(1), result

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts} ({self.local_experts} on rank "
                f"{self.rank} of {self.world_size}), expert_dim={self.expert_dim}, top_k={self.top_k}, "
                f"capacity={self.capacity}, chunk_tokens={self.chunk_tokens}")


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result as a plain tensor (waiting for the exchange)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


class _Pairs:
    """One chunk's (token, rank) pairs, each token once per rank owning any of its k experts,
    built on the device without reading anything back:
    - per_rank (W,): how many pairs go to each rank;
    - source (W Tc,): each pair's token, rank-major with the present pairs first (the first
      per_rank.sum() of them are sent; that count is read with the exchange's sizes);
    - routing (W Tc, 2k) fp32: each pair's k local expert ids (-1 where another rank owns the
      expert), then their weights (0 there);
    - position (Tc, W): each token's pair per rank, per_rank.sum() where it has none."""

    def __init__(self, ids, weights, local_experts, world):
        T = self.tokens = ids.shape[0]
        owner = torch.div(ids, local_experts, rounding_mode="floor")
        present = torch.zeros(T, world, dtype=torch.bool, device=ids.device).scatter_(1, owner.long(), True)
        self.per_rank = present.sum(0)
        flat = present.t().flatten()
        pairs = torch.argsort(~flat, stable=True)
        rank, self.source = torch.div(pairs, max(T, 1), rounding_mode="floor"), pairs % max(T, 1)
        pair_ids = ids[self.source]
        owned = torch.div(pair_ids, local_experts, rounding_mode="floor") == rank.unsqueeze(1)
        local_ids = torch.where(owned, pair_ids - rank.unsqueeze(1) * local_experts, -1)
        weights = weights.to(torch.float32)
        self.routing = torch.cat([local_ids.to(torch.float32), torch.where(owned, weights[self.source], 0.0)], 1)
        inverse = torch.empty_like(pairs).index_copy_(0, pairs, torch.arange(pairs.numel(), device=ids.device))
        self.position = torch.where(flat, inverse, self.per_rank.sum()).view(world, T).t()


def _all_to_all(t: torch.Tensor, output_sizes, input_sizes, group, pending: list | None = None) -> torch.Tensor:
    """`dist.all_to_all_single` of t's rows into a new tensor. With `pending` the exchange is
    asynchronous: its work goes on `pending`, to be waited for (`_wait`) before the result is
    read. Without it, an NCCL exchange only orders the current stream after it (no host wait)."""
    out = t.new_empty((sum(output_sizes), *t.shape[1:]))
    work = dist.all_to_all_single(out, t.contiguous(), output_sizes, input_sizes, group=group,
                                  async_op=pending is not None)
    if pending is not None:
        pending.append(work)
    return out


def _wait(pending: list) -> None:
    """Wait for the exchanges on `pending` (NCCL: the current stream waits, not the host)."""
    while pending:
        pending.pop().wait()


class _GradientBack:
    """The received rows' gradient on its way back to their ranks (the reverse of one `_SendRows`
    exchange): sent by the experts' backward (`_LocalGateUp`) as soon as it has it, so that the
    exchange overlaps the experts' w1 gradient, and taken by `_SendRows`' backward."""

    def __init__(self, send_sizes, recv_sizes, group):
        self.send_sizes, self.recv_sizes, self.group = send_sizes, recv_sizes, group
        self.pending, self.grad = [], None

    def send(self, grad_rows: torch.Tensor) -> None:
        self.grad = _all_to_all(grad_rows, self.send_sizes, self.recv_sizes, self.group, self.pending)

    def take(self) -> torch.Tensor | None:
        """The gradient of the rows this rank sent (None when no gradient reached them)."""
        _wait(self.pending)
        grad, self.grad = self.grad, None
        return grad


class _SendRows(torch.autograd.Function):
    """The rows for the experts' owners and their routing, in one exchange: rows[p] =
    tokens[source[p]], with routing[p] packed behind it in one byte row, sent asynchronously (the
    work on `pending`). Returns the received rows and routing, views of the received bytes. Its
    backward takes the rows' gradient from `back` (where the experts' backward sent it: the rows'
    consumers, `_LocalGateUp` and the down custom op, return none for them), sums each token's
    rows' gradients (position: each token's rows, (T, m)) and sends the routing's gradient back.

    The routing starts 16-byte aligned, and a byte row is a multiple of 16 elements of the rows'
    dtype: the experts' kernels read the received rows in place only with such a stride
    (`moe.experts.rows_read_in_place`), and would otherwise copy them first."""

    @staticmethod
    def forward(ctx, tokens, routing, source, position, back, pending):
        row_bytes, routing_bytes = tokens.shape[1] * tokens.element_size(), routing.shape[1] * 4
        routing_start, align = -(-row_bytes // 16) * 16, 16 * tokens.element_size()
        packed = torch.empty(source.numel(), -(-(routing_start + routing_bytes) // align) * align, dtype=torch.uint8,
                             device=tokens.device)
        torch.index_select(tokens, 0, source, out=packed[:, :row_bytes].view(tokens.dtype))
        packed[:, routing_start:routing_start + routing_bytes].view(torch.float32).copy_(routing)
        received = _all_to_all(packed, back.recv_sizes, back.send_sizes, back.group, pending)
        ctx.save_for_backward(position)
        ctx.back = back
        ctx.set_materialize_grads(False)
        return (received[:, :row_bytes].view(tokens.dtype),
                received[:, routing_start:routing_start + routing_bytes].view(torch.float32))

    @staticmethod
    def backward(ctx, grad_rows, grad_routing):
        (position,) = ctx.saved_tensors
        back = ctx.back
        grad_tokens = grad_routing_sent = None
        grad_sent = back.take()
        if ctx.needs_input_grad[0] and grad_sent is not None:
            grad_tokens = gather_sum(grad_sent, position)
        if ctx.needs_input_grad[1] and grad_routing is not None:
            grad_routing_sent = _all_to_all(grad_routing, back.send_sizes, back.recv_sizes, back.group)
        return grad_tokens, grad_routing_sent, None, None, None, None


class _LocalGateUp(torch.autograd.Function):
    """The gate/up half of `fused_experts` on the received rows (weights (n, m) float32 and
    local_ids (n, m) int32, contiguous), as its custom op `moe_experts_gate_up` runs it, with the
    backward in the order expert parallelism wants: the rows' gradient first, sent back to their
    ranks at once (`back`), then w1's gradient while that exchange travels. The rows' own
    gradient is None: `_SendRows`' backward takes it from `back`. The down half is the custom op
    `moe_experts_down`, whose backward gives d w2, the weights' gradient and d [gate, up]."""

    @staticmethod
    def forward(ctx, rows, w1, w2, weights, local_ids, activation, back):
        layout = experts.gate_up_for_backward(rows, w1, w2, weights, local_ids, activation)
        ctx.save_for_backward(rows, w1, w2, local_ids, *layout[2:])
        ctx.back = back
        ctx.mark_non_differentiable(*layout[2:])
        ctx.set_materialize_grads(False)
        return layout

    @staticmethod
    def backward(ctx, grad_h, grad_gate_up, *layout_grads):
        need_rows, need_w1 = ctx.needs_input_grad[:2]
        grad_w1 = None
        if grad_gate_up is not None:
            saved = ctx.saved_tensors
            if need_rows:
                ctx.back.send(backward.gate_up_backward(grad_gate_up, *saved, True, False)[0])
            if need_w1:
                grad_w1 = backward.gate_up_backward(grad_gate_up, *saved, False, True)[1]
        return None, grad_w1, None, None, None, None, None


class _Exchange(torch.autograd.Function):
    """`_all_to_all` of t, asynchronous (the work on `pending`); its backward sends the
    gradient back the reverse way."""

    @staticmethod
    def forward(ctx, t, output_sizes, input_sizes, group, pending):
        ctx.sizes, ctx.group = (output_sizes, input_sizes), group
        return _all_to_all(t, output_sizes, input_sizes, group, pending)

    @staticmethod
    def backward(ctx, grad):
        output_sizes, input_sizes = ctx.sizes
        return _all_to_all(grad, input_sizes, output_sizes, ctx.group), None, None, None, None


class _Combine(torch.autograd.Function):
    """The tokens' outputs from the rows that came back: out[t] = sum over j of
    rows[position[t, j]]; its backward hands each row its token's gradient."""

    @staticmethod
    def forward(ctx, rows, source, position):
        ctx.save_for_backward(source)
        return gather_sum(rows, position)

    @staticmethod
    def backward(ctx, grad_out):
        (source,) = ctx.saved_tensors
        return grad_out.index_select(0, source), None, None
