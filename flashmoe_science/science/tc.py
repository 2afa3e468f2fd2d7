"""Superconductor critical temperature (Tc) from composition, on NIMS SuperCon.

Each compound is a set of (element, amount) tokens: a packed variable-length batch with no
padding, the workload of our varlen attention. The model (`TcSetTransformer`): per element
token, a learned embedding of the element plus its standardised Magpie elemental properties and
its fraction in the compound; `depth` blocks of [LayerNorm, self-attention over the compound's
tokens (`flash_attention_varlen`), LayerNorm, `FlashMoELayer`]; attention pooling per compound;
a regression head on log(1 + Tc). The same parameters run through PyTorch instead with
backend="torch" (SDPA on a padded batch and the per-expert loop of `moe.reference`: the CPU path
and the plain side of the speed comparison) or "torch_grouped_mm" (SDPA and
`moe.reference.fused_moe_grouped_mm`, bf16 on a GPU as torch._grouped_mm wants).

Training (`train_model`): AdamW on a one-cycle schedule; on a GPU each full batch's step replays a
CUDA graph (`GraphedSteps`: the batch padded to a bucket of tokens by one more sequence that
stays out of the loss), as the host's launches would otherwise take several times the GPU's work.

Data (`load_supercon`): formulas parsed with pymatgen; a malformed row is reported with its line
and skipped, or stops the run (`on_error`); duplicates (the same reduced composition) merged,
Tc averaged, the count kept. Folds (`assign_folds`): random, or by cluster: every compound of
one element set (all Y-Ba-Cu-O) in one fold. The baseline: gradient-boosted trees
(scikit-learn) on matminer's Magpie composition features, on the same folds.

Needs the `science` extra (pymatgen, matminer, scikit-learn).
"""
from __future__ import annotations

import csv
import json
import math
import random
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import flash_attention_varlen
from ..layers import FlashMoELayer
from ..moe.reference import fused_moe_grouped_mm, fused_moe_torch

MAX_Z = 103
MAGPIE_PROPERTIES = ("Number", "MendeleevNumber", "AtomicWeight", "MeltingT", "Column", "Row", "CovalentRadius",
                     "Electronegativity", "NsValence", "NpValence", "NdValence", "NfValence", "NValence",
                     "NsUnfilled", "NpUnfilled", "NdUnfilled", "NfUnfilled", "NUnfilled", "GSvolume_pa",
                     "GSbandgap", "GSmagmom", "SpaceGroupNumber")
TC_CLASS_K = 10.0  # Stanev et al.'s classification threshold
GRAPH_TOKEN_BUCKET = 128  # a graphed training step's tokens, padded to a multiple of this (`GraphedSteps`)
TC_SCALE_K = 100.0
# What the model and the baseline regress, and back to Tc in K: Tc / 100 K (the mean squared error
# in kelvin, what R² and RMSE score) or log(1 + Tc) (relative errors: the many low-Tc compounds
# weigh as much as the cuprates).
TARGETS = {"kelvin": (lambda tc: tc / TC_SCALE_K, lambda y: y * TC_SCALE_K),
           "log1p": (torch.log1p, torch.expm1)}


@dataclass
class Compound:
    formula: str
    elements: list  # atomic numbers
    fractions: list  # molar fractions, summing to 1
    tc: float
    count: int = 1

    @property
    def element_set(self) -> str:
        return "-".join(map(str, sorted(self.elements)))


def parse_formula(formula: str):
    """(reduced formula, atomic numbers, fractions) of a chemical formula; ValueError if pymatgen
    cannot read it or it holds an element past Lr."""
    from pymatgen.core import Composition, Element

    try:
        comp = Composition(formula)
    except Exception as exc:  # pymatgen raises several types for bad input
        raise ValueError(f"cannot parse formula {formula!r}: {exc}") from None
    if comp.num_atoms <= 0:
        raise ValueError(f"formula {formula!r} has no atoms")
    unknown = [str(el) for el in comp.elements if not isinstance(el, Element)]
    if unknown:  # pymatgen reads unknown symbols as dummy species
        raise ValueError(f"formula {formula!r} holds unknown elements ({', '.join(unknown)})")
    fractional = comp.fractional_composition
    elements = [el.Z for el in fractional.elements]
    if max(elements) > MAX_Z:
        raise ValueError(f"formula {formula!r} holds an element past Z = {MAX_Z}")
    return comp.reduced_formula, elements, [float(fractional[el]) for el in fractional.elements]


def load_supercon(path, *, limit: int | None = None, on_error: str = "skip") -> list[Compound]:
    """Compounds of a SuperCon CSV (columns name, Tc), duplicates merged (Tc averaged). A row whose
    formula or Tc cannot be read is reported with its line number and skipped (on_error="skip")
    or raises ValueError (on_error="stop")."""
    if on_error not in ("skip", "stop"):
        raise ValueError(f"on_error must be 'skip' or 'stop', got {on_error!r}")
    merged: dict = {}
    with open(path, newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            if limit is not None and line - 1 > limit:
                break
            try:
                try:
                    tc = float(row["Tc"])
                except (TypeError, ValueError):
                    tc = float("nan")
                if not math.isfinite(tc) or tc < 0:
                    raise ValueError(f"Tc must be a finite number >= 0, got {row['Tc']!r}")
                reduced, elements, fractions = parse_formula(row["name"])
            except (ValueError, KeyError, TypeError) as exc:
                message = f"{path}, line {line}: {exc}"
                if on_error == "stop":
                    raise ValueError(message) from None
                warnings.warn(message + " (row skipped)", stacklevel=2)
                continue
            if reduced in merged:
                c = merged[reduced]
                c.tc = (c.tc * c.count + tc) / (c.count + 1)
                c.count += 1
            else:
                merged[reduced] = Compound(reduced, elements, fractions, tc)
    return list(merged.values())


def assign_folds(compounds, folds: int, split: str = "random", seed: int = 0) -> list[int]:
    """A fold for each compound: at random, or ("cluster") by element set, whole sets per fold,
    balanced by size (largest sets first into the emptiest fold)."""
    if not isinstance(folds, int) or isinstance(folds, bool) or folds < 2:
        raise ValueError(f"folds must be an int >= 2 (each fold is held out once), got {folds!r}")
    rng = random.Random(seed)
    if split == "random":
        order = list(range(len(compounds)))
        rng.shuffle(order)
        out = [0] * len(compounds)
        for rank, i in enumerate(order):
            out[i] = rank % folds
        return out
    if split != "cluster":
        raise ValueError(f"split must be 'random' or 'cluster', got {split!r}")
    groups: dict = {}
    for i, c in enumerate(compounds):
        groups.setdefault(c.element_set, []).append(i)
    keys = sorted(groups, key=lambda k: (-len(groups[k]), rng.random()))
    sizes, out = [0] * folds, [0] * len(compounds)
    for key in keys:
        fold = min(range(folds), key=lambda f: sizes[f])
        sizes[fold] += len(groups[key])
        for i in groups[key]:
            out[i] = fold
    return out


def element_table() -> torch.Tensor:
    """(MAX_Z + 1, properties) standardised Magpie elemental properties (0 where unknown)."""
    from matminer.utils.data import MagpieData

    data = MagpieData()
    from pymatgen.core import Element

    rows = []
    for z in range(MAX_Z + 1):
        if z == 0:
            rows.append([float("nan")] * len(MAGPIE_PROPERTIES))
            continue
        el = Element.from_Z(z)
        rows.append([float(data.get_elemental_property(el, p)) for p in MAGPIE_PROPERTIES])
    table = torch.tensor(rows, dtype=torch.float64)
    mean = torch.nanmean(table, 0)
    std = torch.sqrt(torch.nanmean((table - mean) ** 2, 0)).clamp_min(1e-12)
    return torch.nan_to_num((table - mean) / std).float()


def _host_batch(compounds, pad_to: int | None = None) -> tuple:
    """(atomic numbers (T,), fractions (T,), cu_seqlens (B + 1,) int32, Tc in K (B,)) on the host.
    With `pad_to`, one more sequence of padding tokens (hydrogen at fraction 1; its Tc is not
    part of the batch) brings the tokens to `pad_to`, which must leave it at least one."""
    lengths = [len(c.elements) for c in compounds]
    tokens = sum(lengths)
    padding = [] if pad_to is None else [pad_to - tokens]
    if padding and padding[0] < 1:
        raise ValueError(f"pad_to ({pad_to}) must exceed the batch's {tokens} tokens")
    z = torch.tensor([e for c in compounds for e in c.elements] + [1] * sum(padding), dtype=torch.long)
    frac = torch.tensor([f for c in compounds for f in c.fractions] + [1.0] * sum(padding), dtype=torch.float32)
    cu = torch.tensor([0] + lengths + padding, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return z, frac, cu, torch.tensor([c.tc for c in compounds], dtype=torch.float32)


def pack(compounds, device) -> tuple:
    """(atomic numbers (T,), fractions (T,), cu_seqlens (B + 1,) int32, longest, Tc in K (B,))."""
    z, frac, cu, tc = _host_batch(compounds)
    longest = max((len(c.elements) for c in compounds), default=0)
    if torch.device(device).type == "cuda":  # from pinned memory, a copy that does not wait for the GPU
        z, frac, cu, tc = (t.pin_memory().to(device, non_blocking=True) for t in (z, frac, cu, tc))
        return z, frac, cu, longest, tc
    return z.to(device), frac.to(device), cu.to(device), longest, tc.to(device)


class TcSetTransformer(nn.Module):
    """Set transformer over a compound's element tokens (module docstring)."""

    def __init__(self, table: torch.Tensor, dim: int = 128, heads: int = 4, depth: int = 3, experts: int = 8,
                 expert_dim: int = 128, top_k: int = 2, backend: str = "kernels", target: str = "kelvin",
                 fraction_frequencies: int = 16, composition_stats: bool = False, dropout: float = 0.0):
        super().__init__()
        if target not in TARGETS:
            raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
        self.backend, self.heads, self.dim = backend, heads, dim
        # Every option, saved with the weights (`write_outputs`) so that a reload builds this model.
        self.options = dict(dim=dim, heads=heads, depth=depth, experts=experts, expert_dim=expert_dim, top_k=top_k,
                            backend=backend, target=target, fraction_frequencies=fraction_frequencies,
                            composition_stats=composition_stats, dropout=dropout)
        self.encode, self.decode = TARGETS[target]
        self.register_buffer("table", table)
        self.embed = nn.Embedding(MAX_Z + 1, dim)
        self.props = nn.Linear(table.shape[1], dim)
        # The fraction f as f and log f, and (CrabNet's idea) sines and cosines of both at
        # geometric frequencies, so that doping steps of a percent move the token.
        self.register_buffer("frequencies", 2 * math.pi * torch.logspace(0, 3, fraction_frequencies))
        self.frac = nn.Linear(2 + 4 * fraction_frequencies, dim)
        self.blocks = nn.ModuleList()
        for _ in range(depth):
            self.blocks.append(nn.ModuleDict(dict(norm1=nn.LayerNorm(dim), qkv=nn.Linear(dim, 3 * dim),
                                                  out=nn.Linear(dim, dim), norm2=nn.LayerNorm(dim),
                                                  moe=FlashMoELayer(dim, experts, expert_dim, top_k))))
        self.pool_query = nn.Linear(dim, 1)
        self.dropout = nn.Dropout(dropout)  # on each block's two residual branches
        # Magpie's composition statistics of the elemental properties (fraction-weighted mean and
        # mean absolute deviation, minimum, maximum: what the gradient-boosting baseline sees),
        # beside the pooled tokens at the head.
        self.stats = (nn.Sequential(nn.LayerNorm(4 * table.shape[1]), nn.Linear(4 * table.shape[1], dim))
                      if composition_stats else None)
        head_in = 2 * dim if composition_stats else dim
        self.head = nn.Sequential(nn.LayerNorm(head_in), nn.Linear(head_in, dim), nn.GELU(), nn.Linear(dim, 1))

    def _attention(self, q, k, v, cu, longest):
        if self.backend == "kernels":
            return flash_attention_varlen(q, k, v, cu, cu, longest, longest)
        # PyTorch: a zero-padded (B, H, L, D) batch with a key padding mask, unpadded after.
        batch = cu.numel() - 1
        lengths = (cu[1:] - cu[:-1]).long()
        seq = torch.repeat_interleave(torch.arange(batch, device=q.device), lengths)
        pos = torch.arange(q.shape[0], device=q.device) - cu[:-1].long()[seq]
        padded = [t.new_zeros(batch, longest, *t.shape[1:]) for t in (q, k, v)]
        for p, t in zip(padded, (q, k, v)):
            p[seq, pos] = t
        mask = torch.arange(longest, device=q.device)[None, :] < lengths[:, None]
        out = F.scaled_dot_product_attention(*(p.transpose(1, 2) for p in padded), attn_mask=mask[:, None, None, :])
        return out.transpose(1, 2)[seq, pos]

    def _moe(self, layer, x):
        if self.backend == "kernels":
            return layer(x)
        logits = layer.router(x)
        if self.backend == "torch_grouped_mm":
            dtype = torch.bfloat16 if x.is_cuda else x.dtype
            return fused_moe_grouped_mm(x.to(dtype), layer.w1.to(dtype), layer.w2.to(dtype), logits,
                                        layer.top_k).to(x.dtype)
        return fused_moe_torch(x, layer.w1, layer.w2, logits, layer.top_k)

    def _fraction_features(self, frac):
        scaled = torch.stack([frac, torch.log(frac) / 10], -1)  # log f of a 1e-4 share is -0.92
        angles = (scaled[..., None] * self.frequencies).flatten(-2)
        return torch.cat([scaled, torch.sin(angles), torch.cos(angles)], -1)

    def forward(self, z, frac, cu, longest):
        x = self.embed(z) + self.props(self.table[z]) + self.frac(self._fraction_features(frac))
        for block in self.blocks:
            q, k, v = block["qkv"](block["norm1"](x)).view(-1, 3, self.heads, self.dim // self.heads).unbind(1)
            x = x + self.dropout(block["out"](self._attention(q, k, v, cu, longest).reshape(-1, self.dim)))
            x = x + self.dropout(self._moe(block["moe"], block["norm2"](x)))
        # Attention pooling: a softmax over each compound's tokens of a learned score.
        batch = cu.numel() - 1
        seq = torch.repeat_interleave(torch.arange(batch, device=x.device), (cu[1:] - cu[:-1]).long(),
                                      output_size=x.shape[0])  # sized without a host read of cu
        score = self.pool_query(x).squeeze(-1)
        score = score - score.max()
        weight = torch.exp(score)
        total = torch.zeros(batch, device=x.device).index_add(0, seq, weight)
        pooled = torch.zeros(batch, self.dim, device=x.device).index_add(0, seq, weight[:, None] * x)
        pooled = pooled / total[:, None]
        if self.stats is not None:
            pooled = torch.cat([pooled, self.stats(self._composition_stats(z, frac, seq, batch))], -1)
        return self.head(pooled).squeeze(-1)

    def _composition_stats(self, z, frac, seq, batch):
        """(batch, 4 x properties): per compound, the fraction-weighted mean and mean absolute
        deviation of its elements' properties, and their minimum and maximum."""
        props = self.table[z]
        w = frac[:, None]
        zeros = props.new_zeros(batch, props.shape[1])
        mean = zeros.index_add(0, seq, w * props)
        deviation = zeros.index_add(0, seq, w * (props - mean[seq]).abs())
        low = zeros.index_reduce(0, seq, props, "amin", include_self=False)
        high = zeros.index_reduce(0, seq, props, "amax", include_self=False)
        return torch.cat([mean, deviation, low, high], -1)


# The speed comparison's sides: our kernels (CUDA graphs on a GPU), the same without graphs, plain
# PyTorch and PyTorch with grouped_mm (`TcSetTransformer`'s backends).
SPEED_SIDES = {"kernels": dict(backend="kernels"), "kernels_eager": dict(backend="kernels", cuda_graphs=False),
               "torch": dict(backend="torch"), "torch_grouped_mm": dict(backend="torch_grouped_mm")}
SPEED_EPOCHS = 3  # the last one is timed: the earlier ones compile kernels and capture graphs


def compare_backends(compounds, device, *, batch_size=256, model_options=None, seed=0, table=None) -> dict:
    """Training on `compounds` per side of SPEED_SIDES, from the same initial weights: the last of
    SPEED_EPOCHS epochs' seconds and tokens/s, or the error that kept a side from running.
    `table`: as for `run_cross_validation`."""
    out = {}
    table = element_table() if table is None else table
    tokens = sum(len(c.elements) for c in compounds)
    for name, options in SPEED_SIDES.items():
        try:
            run = train_model(compounds, table, device, epochs=SPEED_EPOCHS, batch_size=batch_size, seed=seed,
                              model_options=model_options, **options)
        except Exception as exc:  # a side this device cannot run (no GPU for the kernels, no bf16 grouped_mm)
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        else:
            out[name] = {"seconds_per_epoch": run.epoch_seconds[-1], "tokens_per_s": tokens / run.epoch_seconds[-1]}
    return out


def metrics(pred_tc, true_tc) -> dict:
    """R², RMSE and MAE in K, and the accuracy of classifying Tc above TC_CLASS_K."""
    pred, true = torch.as_tensor(pred_tc, dtype=torch.float64), torch.as_tensor(true_tc, dtype=torch.float64)
    resid = pred - true
    ss_tot = ((true - true.mean()) ** 2).sum().item()
    return {"r2": 1 - (resid ** 2).sum().item() / ss_tot if ss_tot > 0 else float("nan"),
            "rmse_k": resid.pow(2).mean().sqrt().item(), "mae_k": resid.abs().mean().item(),
            "accuracy_10k": ((pred > TC_CLASS_K) == (true > TC_CLASS_K)).double().mean().item()}


class Training(NamedTuple):
    """What `train_model` returns."""

    model: nn.Module
    losses: list  # per epoch, the mean training loss
    seconds: float  # the whole training, wall-clock
    tokens_per_s: float  # compound tokens (padding not counted) over `seconds`
    epoch_seconds: list  # wall-clock of each epoch


def train_model(train, table, device, *, epochs, batch_size=256, lr=1e-3, seed=0, backend="kernels",
                model_options=None, progress=None, cuda_graphs=None) -> Training:
    """A model trained on `train` compounds (AdamW, one-cycle schedule). `cuda_graphs` (default:
    on for the kernels on a GPU) runs each full batch as a CUDA graph replay (`GraphedSteps`)."""
    capturable = backend == "kernels" and torch.device(device).type == "cuda"
    if cuda_graphs and not capturable:  # the PyTorch backends read device values on the host
        raise ValueError(f"cuda_graphs needs the kernels backend on a CUDA device, got backend {backend!r} on "
                         f"{torch.device(device)}")
    torch.manual_seed(seed)
    model = TcSetTransformer(table.to(device), backend=backend, **(model_options or {})).to(device)
    graphed = capturable if cuda_graphs is None else cuda_graphs
    if graphed:
        # A captured step reads the learning rate and Adam's beta1 from device tensors, which the
        # schedule refills between replays (`GraphedSteps.follow_schedule`). Not the foreach
        # update: it reads tensor betas back to the host, which capture forbids.
        betas = (torch.tensor(0.9, device=device), torch.tensor(0.999, device=device))
        optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(lr, device=device), betas=betas,
                                      weight_decay=1e-4, capturable=True, foreach=False)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    # before the schedule, which sets beta1 to a float
    steps = GraphedSteps(model, optimizer, batch_size, max(len(c.elements) for c in train)) if graphed else None
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=max(1, epochs * math.ceil(
        len(train) / batch_size)))
    if steps is not None:
        steps.follow_schedule()
    rng = random.Random(seed)
    losses, epoch_seconds, tokens, start = [], [], 0, time.perf_counter()
    for _ in (progress or (lambda x, desc="": x))(range(epochs), desc="epochs"):
        epoch_start = time.perf_counter()
        order = list(range(len(train)))
        rng.shuffle(order)
        epoch_losses = []
        for first in range(0, len(order), batch_size):
            batch = [train[i] for i in order[first:first + batch_size]]
            if steps is not None and len(batch) == batch_size:
                loss = steps.step(batch)
            else:
                z, frac, cu, longest, tc = pack(batch, device)
                loss = train_step(model, optimizer, z, frac, cu, longest, tc)
            schedule.step()
            if steps is not None:
                steps.follow_schedule()
            epoch_losses.append(loss)  # read once an epoch: a read each step waits for the GPU
            tokens += sum(len(c.elements) for c in batch)
        losses.append(torch.stack(epoch_losses).mean().item())
        epoch_seconds.append(time.perf_counter() - epoch_start)
    seconds = time.perf_counter() - start
    return Training(model, losses, seconds, tokens / seconds, epoch_seconds)


def train_step(model, optimizer, z, frac, cu, longest, tc, compounds=None) -> torch.Tensor:
    """One optimizer step on a packed batch; the loss (detached). `compounds`: how many of the
    batch's sequences are compounds (the rest, padding, stay out of the loss; None: all)."""
    pred = model(z, frac, cu, longest)
    loss = F.mse_loss(pred if compounds is None else pred[:compounds], model.encode(tc))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


class GraphedSteps:
    """Training steps of `batch_size` compounds as CUDA graph replays, one graph per token count.

    A step's host work (hundreds of kernel launches through autograd and the optimizer) costs
    several times its GPU time at these sizes. A batch's tokens are padded up to the next multiple
    of GRAPH_TOKEN_BUCKET by one more sequence (`_host_batch`), whose prediction stays out of the
    loss, so the padding takes no part in the step; the attention's longest sequence is fixed at
    the data's longest compound or the bucket, whichever is more. The first batch of a token
    count runs eagerly on a side stream (compiling the kernels, initialising the optimizer's state:
    what capture needs done before it), the second is captured and replayed, later ones are copied
    into the graph's input buffers and replayed. Each is the step the eager loop takes on the same
    compounds, up to the order of floating-point sums in kernels tiled for the padded count. The
    optimizer must be capturable, with its learning rate and betas in device tensors."""

    def __init__(self, model, optimizer, batch_size: int, longest: int):
        self.model, self.optimizer, self.batch_size = model, optimizer, batch_size
        self.longest = max(longest, GRAPH_TOKEN_BUCKET)
        self.device = next(model.parameters()).device
        beta1, beta2 = optimizer.param_groups[0]["betas"]
        # beta1 stays a tensor (the schedule changes it); beta2, which it does not, a float: the
        # update multiplies by 1 - beta2 as a Python number
        self._beta1, self._beta2 = beta1, float(beta2)
        self._graphs = {}  # token count -> [input buffers, graph or None, loss buffer]

    def follow_schedule(self) -> None:
        """After the schedule steps: its beta1 (a float it sets) into the device tensor that a
        captured step reads (it refills the learning rate's tensor itself), beta2 a float."""
        group = self.optimizer.param_groups[0]  # train_model's one group, whose betas __init__ took
        if not isinstance(group["betas"][0], torch.Tensor):
            self._beta1.fill_(group["betas"][0])
        group["betas"] = (self._beta1, self._beta2)

    def step(self, compounds) -> torch.Tensor:
        """One optimizer step on `batch_size` compounds; the loss (a device tensor of its own)."""
        tokens = sum(len(c.elements) for c in compounds)
        padded = (tokens // GRAPH_TOKEN_BUCKET + 1) * GRAPH_TOKEN_BUCKET
        host = [t.pin_memory() for t in _host_batch(compounds, pad_to=padded)]
        entry = self._graphs.get(padded)
        if entry is None:
            inputs = [t.to(self.device, non_blocking=True) for t in host]
            self._graphs[padded] = [inputs, None, None]
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                loss = train_step(self.model, self.optimizer, *inputs[:3], self.longest, inputs[3],
                                  self.batch_size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            return loss
        inputs, graph, loss = entry
        for buffer, t in zip(inputs, host):
            buffer.copy_(t, non_blocking=True)
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    loss = train_step(self.model, self.optimizer, *inputs[:3], self.longest, inputs[3],
                                      self.batch_size)
            except RuntimeError as exc:  # CUDA's own message names no cause
                raise RuntimeError("capturing the Tc training step in a CUDA graph failed (an operation of the "
                                   "model reads a device value on the host, or synchronises); train with "
                                   "cuda_graphs=False (tc train --no-cuda-graphs)") from exc
            entry[1:] = [graph, loss]
        graph.replay()
        return loss.clone()


@torch.no_grad()
def predict(model, compounds, device, batch_size=1024) -> torch.Tensor:
    """Predicted Tc in K (clamped at 0)."""
    model.eval()
    out = []
    for first in range(0, len(compounds), batch_size):
        z, frac, cu, longest, _ = pack(compounds[first:first + batch_size], device)
        out.append(model.decode(model(z, frac, cu, longest)).clamp_min(0).cpu())
    return torch.cat(out)


def magpie_features(compounds):
    """matminer's Magpie composition features (132 per compound)."""
    from matminer.featurizers.composition import ElementProperty
    from pymatgen.core import Composition

    featurizer = ElementProperty.from_preset("magpie")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = [featurizer.featurize(Composition(c.formula)) for c in compounds]
    return torch.nan_to_num(torch.tensor(rows, dtype=torch.float64)).numpy()


FEATURES_FORMAT = "flashmoe-science tc features 1"


def featurize(compounds, path, *, baseline=True) -> Path:
    """Writes what training needs from pymatgen and matminer to one file (torch.save): the
    compounds, the element table and, with `baseline`, the Magpie features of each compound.
    `tc train --data` reads it on a machine without the science extra (a GPU machine, say)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": FEATURES_FORMAT, "compounds": [vars(c) for c in compounds], "element_table": element_table(),
                "properties": list(MAGPIE_PROPERTIES),
                "magpie": torch.from_numpy(magpie_features(compounds)) if baseline else None}, path)
    return path


def load_features(path) -> tuple:
    """(compounds, element table, Magpie features or None) of a file `featurize` wrote."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or saved.get("format") != FEATURES_FORMAT:
        raise ValueError(f"{path} is not a features file of `flashmoe-science tc featurize`")
    if saved["properties"] != list(MAGPIE_PROPERTIES):
        raise ValueError(f"{path} holds other elemental properties than this version reads; featurize again")
    magpie = saved["magpie"]
    return ([Compound(**c) for c in saved["compounds"]], saved["element_table"],
            None if magpie is None else magpie.numpy())


def run_cross_validation(compounds, *, folds, split, epochs, device, backend="kernels", baseline=True, seed=0,
                         batch_size=256, lr=1e-3, model_options=None, progress=None, table=None, features=None,
                         cuda_graphs=None, ensemble=1):
    """Per fold: the model's and the baseline's metrics on the held-out compounds; their means.
    `table` and `features` (the Magpie features of `compounds`), when given (`load_features`),
    are used instead of computing them with matminer; `cuda_graphs` as `train_model` takes it.
    `ensemble`: models per fold (seeds of their own), scored on their mean prediction."""
    if not isinstance(ensemble, int) or isinstance(ensemble, bool) or ensemble < 1:
        raise ValueError(f"ensemble must be an int >= 1, got {ensemble!r}")
    fold_of = assign_folds(compounds, folds, split, seed)
    table = element_table() if table is None else table
    if baseline and features is None:
        features = magpie_features(compounds)
    results, predictions = [], []
    for fold in range(folds):
        train = [c for c, f in zip(compounds, fold_of) if f != fold]
        test_idx = [i for i, f in enumerate(fold_of) if f == fold]
        test = [compounds[i] for i in test_idx]
        runs = [train_model(train, table, device, epochs=epochs, seed=seed + fold + folds * member, backend=backend,
                            batch_size=batch_size, lr=lr, model_options=model_options, progress=progress,
                            cuda_graphs=cuda_graphs) for member in range(ensemble)]
        model = runs[0].model
        true = [c.tc for c in test]
        member_preds = [predict(run.model, test, device) for run in runs]
        pred = torch.stack(member_preds).mean(0)
        row = {"fold": fold, "train": len(train), "test": len(test), "losses": runs[0].losses,
               "train_seconds": sum(run.seconds for run in runs), "tokens_per_s": runs[0].tokens_per_s,
               "model": metrics(pred, true)}
        if ensemble > 1:
            row["member_r2"] = [metrics(p, true)["r2"] for p in member_preds]
        if baseline:
            from sklearn.ensemble import HistGradientBoostingRegressor

            train_idx = [i for i, f in enumerate(fold_of) if f != fold]
            gbt = HistGradientBoostingRegressor(max_iter=500, learning_rate=0.05, random_state=seed)
            # The baseline regresses what the fold's model regresses.
            gbt.fit(features[train_idx], model.encode(torch.tensor([compounds[i].tc for i in train_idx])).numpy())
            base = model.decode(torch.tensor(gbt.predict(features[test_idx]))).clamp_min(0)
            row["baseline"] = metrics(base, true)
        else:
            base = None
        predictions += [(compounds[i].formula, compounds[i].tc, float(p), None if base is None else float(b))
                        for i, p, b in zip(test_idx, pred, base if base is not None else [None] * len(test_idx))]
        results.append((row, [run.model for run in runs]))
    mean = {side: {k: statistics.fmean(r[0][side][k] for r in results) for k in results[0][0][side]}
            for side in ("model", "baseline") if side in results[0][0]}
    return [r for r, _ in results], mean, [m for _, models in results for m in models], predictions


def write_outputs(out_dir, folds_rows, mean, models, predictions, meta) -> Path:
    """metrics.json, predictions.csv, the fold models (model.pt) and parity.png (if matplotlib)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "metrics.json"
    path.write_text(json.dumps({"meta": meta, "folds": folds_rows, "mean": mean}, indent=1) + "\n")
    with open(out / "predictions.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["formula", "tc", "predicted_tc", "baseline_tc"])
        writer.writerows(predictions)
    torch.save({"options": models[0].options, "states": [m.state_dict() for m in models]}, out / "model.pt")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return path
    true = [p[1] for p in predictions]
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(true, [p[2] for p in predictions], s=3, alpha=0.4,
               label=f"set transformer (R² {mean['model']['r2']:.3f})")
    if "baseline" in mean:
        ax.scatter(true, [p[3] for p in predictions], s=3, alpha=0.4,
                   label=f"Magpie gradient boosting (R² {mean['baseline']['r2']:.3f})")
    top = max(true + [1.0])
    ax.plot([0, top], [0, top], "k--", lw=0.8)
    ax.set(xlabel="measured Tc (K)", ylabel="predicted Tc (K)")
    ax.legend()
    fig.savefig(out / "parity.png", dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path


def load_ensemble(path, device):
    """The fold models saved by `write_outputs` (each holds its element table)."""
    saved = torch.load(path, map_location=device, weights_only=True)
    models = []
    for state in saved["states"]:
        model = TcSetTransformer(state["table"], **saved["options"]).to(device)
        model.load_state_dict(state)
        models.append(model)
    return models


def predict_formulas(models, formulas, device):
    """(mean predicted Tc, spread across the ensemble) for each formula."""
    compounds = [Compound(f, *parse_formula(f)[1:], tc=0.0) for f in formulas]
    preds = torch.stack([predict(m, compounds, device) for m in models])
    return preds.mean(0), preds.std(0) if len(models) > 1 else torch.zeros(len(formulas))
