"""`flashmoe-science bench moe --mode train`: a small MoE transformer trained with our layers,
and the same model written in plain PyTorch ops, from the same initial weights on the same data.

Model: token embedding, `depth` blocks of [LayerNorm, attention, LayerNorm, MoE] with residual
connections, LayerNorm and a vocabulary head. Ours uses FlashMoEScienceAttention and
FlashMoELayer; the plain model has the same modules and parameter names (its state dict is
loaded from ours) with SDPA attention and the per-expert loop of `reference.fused_experts_torch`
after PyTorch routing, and the same router losses (`layers.router_statistics`).

Task: next-token prediction on sequences of a fixed random Markov chain (each token is followed
by one of four tokens drawn once, with probabilities SUCCESSOR_PROBS): the loss falls smoothly
from ln(vocab) towards the chain's entropy (1.1 nats), with no sudden phase change whose timing
could differ between two runs, so the curves can be compared step window by step window. Both
models train with AdamW under bf16 autocast (fp32 parameters) on the GPU, from one seed, on the
same batches.

Rows: per implementation and logging window (`--log-every` steps), the window's mean loss and
median step time (CUDA events around each step). meta: the model, the median step times over
the steps after the first WARMUP_STEPS (which compile kernels), the speedup, and
whether the curves match: every window's mean loss within LOSS_TOLERANCE (relative) of the
plain model's. bf16 rounding and the occasional different top-k choice of a near tie make the
two runs drift apart step by step, so matching curves, not matching bits, is the claim.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..device import interpreter_active
from ..layers import FlashMoELayer, FlashMoEScienceAttention, router_statistics
from ..moe.reference import fused_experts_torch, moe_route_torch

# GPU model (about 1 TFLOP per training step, 60 % of it in the experts: 18·T·k·H·I with
# T = 8192 tokens, per MoE layer) and run; --quick and the interpreter use TINY_MODEL.
MODEL = dict(vocab=512, dim=1024, heads=8, kv_heads=2, experts=32, expert_dim=512, top_k=4, depth=2,
             batch=8, seqlen=1024)
TINY_MODEL = dict(vocab=32, dim=64, heads=4, kv_heads=2, experts=4, expert_dim=32, top_k=2, depth=2,
                  batch=2, seqlen=16)
STEPS, LOG_EVERY = 300, 10
QUICK_STEPS, QUICK_LOG_EVERY = 6, 2
WARMUP_STEPS = 10
LEARNING_RATE = 1e-3
ROUTER_AUX_LOSS_COEF, ROUTER_Z_LOSS_COEF = 0.01, 1e-3
LOSS_TOLERANCE = 0.03
SUCCESSOR_PROBS = (0.55, 0.25, 0.15, 0.05)


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=None, help=f"--mode train: optimizer steps (default {STEPS})")
    parser.add_argument("--log-every", type=int, default=None,
                        help=f"--mode train: steps per logged loss window (default {LOG_EVERY})")


class TorchAttention(nn.Module):
    """FlashMoEScienceAttention's parameters and math in plain PyTorch: SDPA (grouped-query)."""

    def __init__(self, dim, n_heads, n_kv_heads, causal):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.causal = n_heads, n_kv_heads, dim // n_heads, causal
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x):
        batch, seqlen, _ = x.shape
        heads, kv_heads = self.n_heads, self.n_kv_heads
        qkv = self.qkv(x).view(batch, seqlen, heads + 2 * kv_heads, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=heads != kv_heads)
        return self.out(out.transpose(1, 2).reshape(batch, seqlen, heads * self.head_dim))


class TorchMoE(nn.Module):
    """FlashMoELayer's parameters and math in plain PyTorch: softmax top-k routing and the
    per-expert loop (index, two matmuls, index_add)."""

    def __init__(self, dim, experts, expert_dim, top_k):
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, 2 * expert_dim, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, expert_dim))
        self.aux_loss = self.z_loss = self.tokens_per_expert = None

    def forward(self, x):
        tokens, w1, w2 = x.reshape(-1, x.shape[-1]), self.w1, self.w2
        if torch.is_autocast_enabled(x.device.type):  # as FlashMoELayer: the experts in the autocast dtype
            dtype = torch.get_autocast_dtype(x.device.type)
            tokens, w1, w2 = tokens.to(dtype), w1.to(dtype), w2.to(dtype)
        logits = self.router(tokens)
        weights, ids = moe_route_torch(logits, self.top_k)
        out = fused_experts_torch(tokens, w1, w2, weights, ids)
        self.tokens_per_expert, self.aux_loss, self.z_loss = router_statistics(
            logits, ids, self.num_experts, ROUTER_AUX_LOSS_COEF, ROUTER_Z_LOSS_COEF)
        return out.reshape(x.shape)


class MoETransformer(nn.Module):
    """Embedding, `depth` blocks of [norm, attention, norm, MoE] with residuals, norm, head."""

    def __init__(self, vocab, dim, heads, kv_heads, experts, expert_dim, top_k, depth, plain_torch: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        blocks = []
        for _ in range(depth):
            if plain_torch:
                attention, moe = TorchAttention(dim, heads, kv_heads, True), TorchMoE(dim, experts, expert_dim, top_k)
            else:
                attention = FlashMoEScienceAttention(dim, heads, kv_heads, causal=True)
                moe = FlashMoELayer(dim, experts, expert_dim, top_k, router_aux_loss_coef=ROUTER_AUX_LOSS_COEF,
                                    router_z_loss_coef=ROUTER_Z_LOSS_COEF)
            blocks.append(nn.ModuleList([nn.LayerNorm(dim), attention, nn.LayerNorm(dim), moe]))
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for attention_norm, attention, moe_norm, moe in self.blocks:
            x = x + attention(attention_norm(x))
            x = x + moe(moe_norm(x))
        return self.head(self.norm(x))

    def router_loss(self) -> torch.Tensor:
        """The MoE layers' auxiliary and z losses of the last forward."""
        return sum(block[3].aux_loss + block[3].z_loss for block in self.blocks)


def markov_chain_batches(steps, batch, seqlen, vocab, device, seed=0):
    """(steps, batch, seqlen) int64 sequences of one random Markov chain: token v is followed by
    successors[v, i] with probability SUCCESSOR_PROBS[i]."""
    generator = torch.Generator(device=device).manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, len(SUCCESSOR_PROBS)), device=device, generator=generator)
    probs = torch.tensor(SUCCESSOR_PROBS, device=device)
    sequences = steps * batch
    choices = torch.multinomial(probs, sequences * (seqlen - 1), replacement=True, generator=generator)
    choices = choices.view(sequences, seqlen - 1)
    tokens = torch.empty(sequences, seqlen, dtype=torch.int64, device=device)
    tokens[:, 0] = torch.randint(0, vocab, (sequences,), device=device, generator=generator)
    for position in range(seqlen - 1):
        tokens[:, position + 1] = successors[tokens[:, position], choices[:, position]]
    return tokens.view(steps, batch, seqlen)


def _train(model, batches, autocast_dtype):
    """Trains `model` on `batches`; returns (per-step losses, per-step times in ms)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    device = batches.device
    losses, times = [], []
    for tokens in batches:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            begin = time.perf_counter()
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        (loss + model.router_loss()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if device.type == "cuda":
            end.record()
            times.append((start, end))
        else:
            times.append((time.perf_counter() - begin) * 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in times]
    return torch.stack(losses).tolist(), times


def run(args) -> dict:
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not (args.quick and interpreter_active()):
        raise SystemExit("bench moe --mode train needs a CUDA GPU; without one, --quick with TRITON_INTERPRET=1 "
                         "trains a tiny model through Triton's interpreter to exercise the code")
    config = dict(TINY_MODEL if args.quick or not on_gpu else MODEL)
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    log_every = args.log_every or (QUICK_LOG_EVERY if args.quick else LOG_EVERY)
    device = torch.device("cuda" if on_gpu else "cpu")
    autocast_dtype = torch.bfloat16 if on_gpu else None
    batch, seqlen = config.pop("batch"), config.pop("seqlen")
    batches = markov_chain_batches(steps, batch, seqlen + 1, config["vocab"], device)
    torch.manual_seed(0)
    ours = MoETransformer(**config, plain_torch=False).to(device)
    plain = MoETransformer(**config, plain_torch=True).to(device)
    plain.load_state_dict(ours.state_dict())
    results = {}
    for impl, model in args.progress([("ours", ours), ("torch", plain)], desc="bench moe train"):
        results[impl] = _train(model, batches, autocast_dtype)
    rows = []
    for impl, (losses, times) in results.items():
        for first in range(0, steps, log_every):
            window = slice(first, min(first + log_every, steps))
            rows.append({"mode": "train", "impl": impl, "step": window.stop, "loss": statistics.fmean(losses[window]),
                         "step_ms": statistics.median(times[window])})
    meta = {"mode": "train", "model": {**config, "batch": batch, "seqlen": seqlen}, "steps": steps,
            "log_every": log_every, "optimizer": f"AdamW lr={LEARNING_RATE}",
            "precision": "bf16 autocast, fp32 parameters" if on_gpu else "fp32 (interpreter)",
            "task": f"next token of a random Markov chain, successor probabilities {SUCCESSOR_PROBS}",
            "interpreter": interpreter_active(), "loss_tolerance": LOSS_TOLERANCE}
    meta.update(_comparison(rows, results, steps))
    return {"name": "moe_train", "rows": rows, "meta": meta}


def _comparison(rows, results, steps) -> dict:
    """Median step times (after the warm-up), the speedup, and the largest relative gap between
    the two loss curves' windows."""
    def median_ms(impl):
        times = results[impl][1]
        return statistics.median(times[WARMUP_STEPS:] if steps > WARMUP_STEPS else times)

    ours, plain = median_ms("ours"), median_ms("torch")
    curves = {impl: [r["loss"] for r in rows if r["impl"] == impl] for impl in ("ours", "torch")}
    gap = max(abs(a - b) / abs(b) for a, b in zip(curves["ours"], curves["torch"]))
    return {"ours_step_ms": ours, "torch_step_ms": plain, "speedup": plain / ours, "max_loss_gap": gap,
            "curves_match": gap <= LOSS_TOLERANCE, "final_loss_ours": curves["ours"][-1],
            "final_loss_torch": curves["torch"][-1]}


def summarize(result: dict) -> str:
    meta = result["meta"]
    return (f"train {meta['steps']} steps: final loss ours {meta['final_loss_ours']:.3f}, plain PyTorch "
            f"{meta['final_loss_torch']:.3f}; largest window gap {100 * meta['max_loss_gap']:.1f}% (tolerance "
            f"{100 * meta['loss_tolerance']:.0f}%: {'match' if meta['curves_match'] else 'NO MATCH'}); step "
            f"{meta['ours_step_ms']:.1f} ms ours vs {meta['torch_step_ms']:.1f} ms, {meta['speedup']:.2f}x")


def plot(rows, path_png) -> None:
    """Loss against step and step time against step, ours and plain PyTorch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, time_ax) = plt.subplots(1, 2, figsize=(9, 3.6))
    for impl in ("ours", "torch"):
        points = [(r["step"], r["loss"], r["step_ms"]) for r in rows if r["impl"] == impl]
        if points:
            steps, losses, times = zip(*points)
            loss_ax.plot(steps, losses, marker=".", label=impl)
            time_ax.plot(steps, times, marker=".", label=impl)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss (window mean)")
    time_ax.set_xlabel("step")
    time_ax.set_ylabel("step time, ms")
    for ax in (loss_ax, time_ax):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)
