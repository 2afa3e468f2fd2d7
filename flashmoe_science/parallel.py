"""Expert parallelism on torch.distributed: `shard_experts(layer, group)`.

Rank r of a group of W holds experts [r E/W, (r+1) E/W) of a `FlashMoELayer`; the router and
the shared experts are replicated. A forward on each rank's own tokens:

1. routes them with the replicated router (top-k ids over all E experts, weights);
2. sorts the T x k (token, expert) assignments by the rank that owns the expert, exchanges the
   counts (`all_to_all_single` of W integers: the one host synchronisation, as every dropless
   token dispatcher has), then the token rows, and the owner's local expert ids;
3. runs the received rows through this rank's experts with the fused grouped GEMMs
   (`fused_experts`, one expert per row, weight 1);
4. sends the expert outputs back the same way, and sums each token's k outputs weighted by its
   routing weights in fp32, then adds the shared experts, computed while the tokens were in
   flight to their experts.

With a fixed `capacity` the exchanges have sizes fixed by the shapes instead: no count exchange,
no host synchronisation, assignments past the capacity dropped and counted.

The exchanges are torch.distributed's functional collectives (`all_to_all_single_autograd`,
whose backward is the reverse exchange), so autograd runs through them: input gradients come back to the tokens' ranks,
expert-weight gradients stay with the experts' owner (the sum over every rank's tokens), and the
router and shared-expert gradients are each rank's own (all-reduce them as for any replicated
parameter, with DDP or FSDP). NCCL on GPUs, gloo on CPUs: any backend with all_to_all_single.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from .layers.moe import FlashMoELayer, router_statistics
from .moe import fused_experts, moe_route
from .moe.reference import gated_activation_torch


def shard_experts(layer: FlashMoELayer, group=None, *, capacity: int | None = None) -> "ExpertParallelMoE":
    """This rank's expert-parallel copy of `layer` (which every rank holds in full, with the same
    weights): its slice of the experts, copied, with the router and shared experts replicated.
    `group`: a process group (default: the world). Needs num_experts divisible by its size.

    capacity: None (dropless: every assignment is computed; the exchange's sizes are counted
    first, one host synchronisation a call), or the most (token, expert) assignments a rank sends
    to each rank a call, the same on every rank: fixed-size exchanges, no count exchange and no host synchronisation (the
    call can be captured in a CUDA graph). Assignments past it, in token order, are dropped:
    they contribute nothing, as a slot whose expert id is out of range does, and the layer's
    `dropped_assignments` counts them (a device tensor)."""
    if not isinstance(layer, FlashMoELayer):
        raise TypeError(f"layer must be a FlashMoELayer, got {type(layer).__name__}")
    if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1):
        raise ValueError(f"capacity must be None (dropless) or an int >= 1, got {capacity!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shard_experts needs torch.distributed initialised (dist.init_process_group)")
    return ExpertParallelMoE(layer, group, capacity)


class ExpertParallelMoE(nn.Module):
    """A `FlashMoELayer` whose experts are spread over a process group (`shard_experts`).

    Parameters: router.weight (E, H) and the shared experts, replicated; w1 (E/W, 2I, H) and
    w2 (E/W, H, I), the experts [rank E/W, (rank + 1) E/W). forward(x: (..., H)) -> (..., H)
    on this rank's tokens, the same as the full layer's on them; aux_loss, z_loss and
    tokens_per_expert (E,) as the layer sets them, from this rank's tokens; dropped_assignments,
    the assignments the fixed capacity left out (0 when dropless).
    """

    def __init__(self, layer: FlashMoELayer, group=None, capacity: int | None = None):
        super().__init__()
        self.group, self.capacity = group, capacity
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
        exchange = self._dropless if self.capacity is None else self._fixed_capacity
        # The shared experts run while the tokens travel to their experts' ranks.
        expert_out, shared = exchange(tokens, ids.reshape(-1), lambda: self._shared(tokens))
        k = self.top_k
        out = (weights.unsqueeze(-1) * expert_out.view(-1, k, self.hidden_size).float()).sum(1).to(x.dtype)
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

    def _compute(self, rows, local_ids):
        """This rank's experts on the rows it received (one expert each, weight 1; an id of -1
        is an empty slot and gives zeros)."""
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        return fused_experts(rows, self.w1, self.w2, ones, local_ids.unsqueeze(1), activation=self.activation)

    def _sorted_by_owner(self, tokens, ids):
        """The assignments sorted (stably) by the rank owning their expert: (the order, each
        sorted assignment's owner, its token's row, its expert's id on the owner)."""
        owner = torch.div(ids, self.local_experts, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        owner_sorted = owner[order]
        rows = tokens[torch.div(order, self.top_k, rounding_mode="floor")]
        return order, owner_sorted, rows, (ids[order] - owner_sorted * self.local_experts).to(torch.int32)

    def _dropless(self, tokens, ids, meanwhile):
        """(each assignment's expert output, unweighted: rows in assignment order (token t's j-th
        expert at row t k + j), computed by the rank that owns the expert; what `meanwhile()`
        returns, called while the rows are in flight: the collectives are asynchronous until
        their results are read)."""
        group = self.group or dist.group.WORLD
        order, owner_sorted, rows, local_ids = self._sorted_by_owner(tokens, ids)
        self.dropped_assignments = torch.zeros((), dtype=torch.int64, device=tokens.device)
        send_counts = torch.bincount(owner_sorted, minlength=self.world_size)
        recv_counts = funcol.all_to_all_single(send_counts, None, None, group)
        send, recv = send_counts.tolist(), recv_counts.tolist()  # the exchange's sizes: one host sync
        received_ids = funcol.all_to_all_single(local_ids, recv, send, group)
        received = funcol.all_to_all_single_autograd(rows, recv, send, group)
        result = meanwhile()
        computed = self._compute(received, received_ids)
        returned = funcol.all_to_all_single_autograd(computed, send, recv, group)
        return returned[torch.argsort(order)], result

    def _fixed_capacity(self, tokens, ids, meanwhile):
        """As `_dropless`, through buffers of `capacity` rows per rank pair: each rank's
        assignments to a rank, in token order, fill its slots; those past the capacity get
        zeros. Every size is fixed by the shapes: no count exchange, no host synchronisation."""
        group = self.group or dist.group.WORLD
        capacity, world = self.capacity, self.world_size
        order, owner_sorted, rows, local_ids = self._sorted_by_owner(tokens, ids)
        counts = torch.bincount(owner_sorted, minlength=world)
        position = torch.arange(ids.numel(), device=ids.device) - (torch.cumsum(counts, 0) - counts)[owner_sorted]
        kept = position < capacity
        self.dropped_assignments = (~kept).sum()
        # Each sorted assignment's slot in the (world x capacity) buffer; dropped ones write to a
        # spare last row, which is never sent, and read back zeros.
        slot = torch.where(kept, owner_sorted * capacity + position, world * capacity)
        send = tokens.new_zeros(world * capacity + 1, self.hidden_size).index_copy(0, slot, rows)[:-1]
        slot_ids = torch.full((world * capacity + 1,), -1, dtype=torch.int32, device=ids.device)
        slot_ids = slot_ids.index_copy(0, slot, local_ids)
        received_ids = funcol.all_to_all_single(slot_ids[:-1], None, None, group)
        received = funcol.all_to_all_single_autograd(send, None, None, group)
        result = meanwhile()
        returned = funcol.all_to_all_single_autograd(self._compute(received, received_ids), None, None, group)
        back = torch.cat([returned, returned.new_zeros(1, self.hidden_size)])[slot]
        return back[torch.argsort(order)], result

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts} ({self.local_experts} on rank "
                f"{self.rank} of {self.world_size}), expert_dim={self.expert_dim}, top_k={self.top_k}, "
                f"capacity={self.capacity}")
