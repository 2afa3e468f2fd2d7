"""`flashmoe-science bench attention`: our attention against PyTorch's, side by side, one run.

Sections (rows carry a "section" column):
- small: small single-head and few-head calls (S = 32 to 512, D = 64), fp16 and bf16; wall-clock per call (what users
  feel: host and GPU) and GPU time, ours against SDPA's default dispatch, with the speedup's
  95% interval and correctness columns.
- throughput: 16k tokens per batch, Hq*D = 2048, bf16: TFLOP/s of ours, SDPA's FlashAttention-2,
  cuDNN and memory-efficient backends, and compiled FlexAttention.
- memory (modes with a backward): peak memory of forward+backward, ours against SDPA's math backend.
- train: forward+backward of a small transformer block on our attention against SDPA's default.
- sweeps (--sweep, --sweep-hopper, --sweep-gluon; `sweeps/attention_forward.py`): candidate
  forward configurations, for maintainers tuning the tables.
- varlen (only when listed in --sections): a packed batch of about 16k tokens whose lengths are
  drawn uniformly from 64 to 2048 (fixed seed), D = 128, Hq*D = 2048, bf16, causal and not: ours
  against SDPA on the zero-padded batch with a key-padding mask and against compiled
  FlexAttention with a document mask. TFLOP/s count the real (unpadded) pairs only.
- window (only when listed in --sections): causal sliding windows of 256, 1024 and 4096 at
  S = 16384: ours against our own full causal attention and FlexAttention's sliding-window mask.
- calls (only when listed in --sections): wall-clock per call of back-to-back attention calls from
  a QKV projection's output, forward and backward through autograd, at short and middle lengths
  (from host-bound calls to GPU-bound ones), on each side of the train section.
- decode (--mode decode, results attention_decode; `attention_decode.py`): one new token against
  contiguous and paged KV caches, ours against SDPA's fastest backend and the copy floor.
- fp8 (--mode fp8, results attention_fp8; `attention_fp8.py`): the FP8 forward against our bf16
  one and SDPA's cuDNN backend, and its error on FlashAttention-3's outlier distribution.
Sections varlen, window and calls (`attention_workloads.py`) time the --mode given; run alone, they write
attention_<sections>_<mode> (such as attention_varlen_window_fwd_bwd). Without a GPU they run
through the interpreter at a tiny size, without FlexAttention.
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from ..attention import attention_reference, flash_attention_qkvpacked, flash_attention_science
from ..device import interpreter_active
from ..flops import attention_flops
from .common import max_abs_error, measure_matmul_ceiling, rel_error
from .timing import Timing, paired_speedup_interval, speedup_interval, time_gpu, time_wall

SMALL_SHAPES = [(1, 1, 32, 64), (1, 1, 64, 64), (1, 1, 128, 64), (1, 1, 256, 64), (1, 1, 512, 64), (2, 4, 128, 64)]
TOKENS = 16384
HIDDEN = 2048  # Hq * D
INPUT_SETS = 8  # small calls rotate among this many input sets, so no side is flattered by a warm cache


def add_arguments(parser) -> None:
    parser.add_argument("--mode", choices=["fwd", "bwd", "fwd+bwd", "decode", "fp8"], default="fwd",
                        help="time the forward, the backward alone, both, one new token against a KV "
                             "cache (`attention_decode.py`), or the FP8 forward (`attention_fp8.py`) (default: fwd)")
    parser.add_argument("--sections", default=None,
                        help="comma list of overhead,small,throughput,memory,train,varlen,window,calls (default: "
                             "overhead,small,throughput for fwd, throughput,memory,train otherwise)")
    parser.add_argument("--head-dims", default="64,128,256",
                        help="throughput head dims; D/D_v gives v a head dim of its own (MLA: 192/128), whose "
                             "results go to attention_<mode>_mla")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384", help="throughput sequence lengths")
    parser.add_argument("--flex-head-dims", default="128",
                        help="head dims at which compiled FlexAttention is measured (each shape compiles)")
    parser.add_argument("--sweep", action="store_true", help="time every candidate forward config instead")
    parser.add_argument("--sweep-hopper", action="store_true",
                        help="time the Hopper TMA forward kernel's candidates against the generic kernel instead")
    parser.add_argument("--sweep-gluon", action="store_true",
                        help="with --sweep-hopper: of the Hopper kernels, time only the Triton kernel's shipped "
                             "configuration and the Gluon kernel's candidates")
    parser.add_argument("--sweep-fp8", action="store_true",
                        help="time the Gluon kernel's FP8 candidates against our bf16 forward instead")
    parser.add_argument("--window", type=int, default=None,
                        help="with --sweep or --sweep-hopper: time causal sliding-window calls of this left window "
                             "(window_size=(W, 0)) instead of plain and causal ones")
    parser.add_argument("--gluon-tiles", default=None,
                        help="with --sweep-hopper: only these Gluon candidates, as ROWSxBLOCK_NsSTAGES "
                             "(such as 192x128s2,128x128s2)")


def ints(text):
    """A comma list of ints (the options --head-dims, --seqlens)."""
    return [int(x) for x in str(text).split(",") if x]


def _sdpa_backends():
    from torch.nn.attention import SDPBackend
    return {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def _timed_call(fn, inputs, mode):
    """A callable timing `mode` of attention `fn` on (q, k, v) that require grad for bwd modes."""
    q, k, v = inputs
    if mode == "fwd":
        return lambda: fn(q, k, v)
    grad = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)  # the output's shape
    if mode == "bwd":
        out = fn(q, k, v)
        return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad)


def make_inputs(batch, heads, seqlen, head_dim, dtype, device, requires_grad=False, head_dim_v=None):
    """q, k, v: (B, S, H, D) memory viewed as (B, H, S, D), the layout models produce; v with
    head_dim_v where given."""
    dims = (head_dim, head_dim, head_dim_v or head_dim)
    return tuple(torch.randn(batch, seqlen, heads, d, dtype=dtype, device=device)
                 .transpose(1, 2).requires_grad_(requires_grad) for d in dims)


def head_dim_pairs(text) -> list[tuple[int, int]]:
    """(D, D_v) of each comma-separated entry: "128" (D_v = D) or "192/128"."""
    pairs = []
    for entry in text.split(","):
        d, _, dv = entry.partition("/")
        pairs.append((int(d), int(dv or d)))
    return pairs


def head_dims_label(head_dim: int, head_dim_v: int):
    """A row's head_dim: the int D, or "D/D_v" where v's differs."""
    return head_dim if head_dim_v == head_dim else f"{head_dim}/{head_dim_v}"


def _small(args, device):
    rows = []
    interp = interpreter_active()
    shapes = SMALL_SHAPES[:2] if interp else SMALL_SHAPES
    dtypes = [torch.float16] if interp else [torch.float16, torch.bfloat16]
    cases = list(itertools.product(shapes, dtypes, [False, True]))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for (batch, heads, seqlen, head_dim), dtype, causal in args.progress(cases, desc="attention small"):
        sets = [make_inputs(batch, heads, seqlen, head_dim, dtype, device) for _ in range(INPUT_SETS)]
        ours_cycle, sdpa_cycle = itertools.cycle(sets), itertools.cycle(sets)

        def ours():
            q, k, v = next(ours_cycle)
            return flash_attention_science(q, k, v, causal=causal)

        def theirs():
            q, k, v = next(sdpa_cycle)
            return sdpa(q, k, v, is_causal=causal)

        q, k, v = sets[0]
        ref, _ = attention_reference(q, k, v, causal=causal)
        out_ours = flash_attention_science(q, k, v, causal=causal)
        out_sdpa = sdpa(q, k, v, is_causal=causal)
        row = dict(section="small", mode="fwd", batch=batch, heads=heads, seqlen=seqlen, head_dim=head_dim,
                   dtype=str(dtype).replace("torch.", ""), causal=causal,
                   ours_max_abs_err=max_abs_error(out_ours, ref), sdpa_max_abs_err=max_abs_error(out_sdpa, ref),
                   ours_rel_err=rel_error(out_ours, ref), sdpa_rel_err=rel_error(out_sdpa, ref))
        if not interp:  # the interpreter's times compare a Python emulation with PyTorch's CPU kernels
            wall_ours = time_wall(ours, calls=300, repeats=args.repeats)
            wall_sdpa = time_wall(theirs, calls=300, repeats=args.repeats)
            gpu_ours = time_gpu(ours, warmup_ms=args.warmup, rep_ms=args.rep, repeats=args.repeats)
            gpu_sdpa = time_gpu(theirs, warmup_ms=args.warmup, rep_ms=args.rep, repeats=args.repeats)
            speed, lo, hi = speedup_interval(wall_ours, wall_sdpa)
            row.update(ours_wall_us=wall_ours.median_ms * 1e3, sdpa_wall_us=wall_sdpa.median_ms * 1e3,
                       ours_wall_us_ci=[wall_ours.lo_ms * 1e3, wall_ours.hi_ms * 1e3],
                       sdpa_wall_us_ci=[wall_sdpa.lo_ms * 1e3, wall_sdpa.hi_ms * 1e3],
                       ours_gpu_us=gpu_ours.median_ms * 1e3, sdpa_gpu_us=gpu_sdpa.median_ms * 1e3,
                       speedup_wall=speed, speedup_wall_ci=[lo, hi],
                       speedup_gpu=gpu_sdpa.median_ms / gpu_ours.median_ms)
        rows.append(row)
    return rows


@triton.jit
def empty_kernel(x, n: tl.constexpr):
    pass


def _overhead(args, device):
    """Host cost per call of launching an empty Triton kernel the ordinary way and through our
    launcher, next to a whole small attention call: what the wrapper itself adds."""
    from ..launch import KernelLauncher

    x = torch.empty(1, device=device)
    launcher = KernelLauncher("bench_empty", empty_kernel)
    q, k, v = make_inputs(1, 1, 128, 64, torch.float16, device)
    calls = {
        "empty Triton kernel, ordinary launch": lambda: empty_kernel[(1,)](x, 1),
        "empty Triton kernel, our launcher": lambda: launcher.launch(("empty",), (1, 1, 1), (x, 1), num_warps=1,
                                                                    num_stages=1),
        "flash_attention_science (1, 1, 128, 64) fp16": lambda: flash_attention_science(q, k, v),
        "scaled_dot_product_attention (1, 1, 128, 64) fp16":
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
    }
    rows = []
    for what, fn in calls.items():
        t = time_wall(fn, calls=2000, repeats=args.repeats)
        rows.append(dict(section="overhead", what=what, wall_us=t.median_ms * 1e3,
                         wall_us_ci=[t.lo_ms * 1e3, t.hi_ms * 1e3]))
    return rows


def _flex_with_mask(mask_mod, seqlen_q, seqlen_k, device):
    """Compiled FlexAttention (static shapes) with the block mask of `mask_mod` (None: no mask)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # Every benchmark shape and mask compiles its own kernel: lift dynamo's recompile limit so none
    # falls back to the unfused eager path.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, None, None, seqlen_q, seqlen_k, device=device)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


def _flex_impl(seqlen, causal, device):
    return _flex_with_mask(_causal_mask if causal else None, seqlen, seqlen, device)


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _reference_errors(impls, seqlen, head_dim, causal, mode, device, head_dim_v=None):
    """Relative error vs float64 of each implementation on one (batch, head) slice: the
    output for fwd, the worst of dq/dk/dv otherwise. Backend errors run in their own context."""
    from torch.nn.attention import sdpa_kernel
    q, k, v = make_inputs(1, 1, seqlen, head_dim, torch.bfloat16, device, requires_grad=mode != "fwd",
                          head_dim_v=head_dim_v)
    ref_inputs = [t.detach().double().requires_grad_(mode != "fwd") for t in (q, k, v)]
    ref, _ = attention_reference(*ref_inputs, causal=causal)
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad) if mode != "fwd" else None
    errors = {}
    for name, (fn, backend) in impls.items():
        try:
            with sdpa_kernel(backend) if backend is not None else _null():
                out = fn(q, k, v)
                if mode == "fwd":
                    errors[name] = rel_error(out, ref)
                else:
                    grads = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
                    errors[name] = max(rel_error(g, r) for g, r in zip(grads, ref_grads))
        except Exception as exc:  # a backend that rejects the shape is reported, not fatal
            errors[name] = f"{type(exc).__name__}"
    return errors


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _throughput(args, device):
    from torch.nn.attention import sdpa_kernel
    rows = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    flex_dims = set(ints(args.flex_head_dims))
    cases = list(itertools.product(head_dim_pairs(args.head_dims), ints(args.seqlens), [False, True]))
    for (head_dim, head_dim_v), seqlen, causal in args.progress(cases, desc=f"attention throughput {args.mode}"):
        heads, batch = HIDDEN // head_dim, max(1, TOKENS // seqlen)
        impls = {"ours": (lambda q, k, v: flash_attention_science(q, k, v, causal=causal), None)}
        for name, backend in _sdpa_backends().items():
            impls[name] = (lambda q, k, v: sdpa(q, k, v, is_causal=causal), backend)
        if head_dim in flex_dims:
            try:
                impls["flex"] = (_flex_impl(seqlen, causal, device), None)
            except Exception as exc:
                rows.append(dict(section="throughput", mode=args.mode, impl="flex", error=repr(exc)[:200]))
        inputs = make_inputs(batch, heads, seqlen, head_dim, torch.bfloat16, device, requires_grad=args.mode != "fwd",
                             head_dim_v=head_dim_v)
        flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal, args.mode, head_dim_v=head_dim_v)
        errors = _reference_errors(impls, seqlen, head_dim, causal, args.mode, device, head_dim_v)
        timings = {}
        for name, (fn, backend) in impls.items():
            row = dict(section="throughput", mode=args.mode, impl=name, batch=batch, heads=heads, seqlen=seqlen,
                       head_dim=head_dims_label(head_dim, head_dim_v), causal=causal, dtype="bfloat16")
            try:
                with sdpa_kernel(backend) if backend is not None else _null():
                    t = time_gpu(_timed_call(fn, inputs, args.mode), warmup_ms=args.warmup, rep_ms=args.rep,
                                 repeats=args.repeats)
            except Exception as exc:
                row.update(error=f"{type(exc).__name__}: {exc}"[:200])
            else:
                timings[name] = t
                row.update(ms=t.median_ms, ms_ci=[t.lo_ms, t.hi_ms], tflops=flops / (t.median_ms * 1e-3) / 1e12,
                           rel_err=errors.get(name))
            rows.append(row)
            torch.cuda.empty_cache()
        if "ours" in timings:
            for row in rows[-len(impls):]:
                if row.get("impl") in timings and row["impl"] != "ours":
                    ratio, lo, hi = speedup_interval(timings["ours"], timings[row["impl"]])
                    row.update(ours_speedup=ratio, ours_speedup_ci=[lo, hi])
        del inputs
        args.checkpoint(rows)
    return rows


def _memory(args, device):
    """Peak memory of forward+backward at S = 8192: ours against SDPA's math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    batch, heads, seqlen, head_dim = 1, 16, 8192, 128
    rows = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    impls = {"ours": (lambda q, k, v: flash_attention_science(q, k, v, causal=True), None),
             "sdpa_math": (lambda q, k, v: sdpa(q, k, v, is_causal=True), SDPBackend.MATH)}
    for name, (fn, backend) in impls.items():
        inputs = make_inputs(batch, heads, seqlen, head_dim, torch.bfloat16, device, requires_grad=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with sdpa_kernel(backend) if backend is not None else _null():
            _timed_call(fn, inputs, "fwd+bwd")()
        torch.cuda.synchronize()
        rows.append(dict(section="memory", mode="fwd+bwd", impl=name, batch=batch, heads=heads, seqlen=seqlen,
                         head_dim=head_dim, causal=True, dtype="bfloat16",
                         peak_extra_mib=(torch.cuda.max_memory_allocated() - base) / 2**20))
        del inputs
        torch.cuda.empty_cache()
    return rows


class Block(torch.nn.Module):
    """A pre-norm transformer block whose attention is pluggable: a function from the QKV
    projection's output (B, S, 3, H, D) to the attention's (B, S, H, D)."""

    def __init__(self, dim, heads, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, d = x.shape
        a = self.attention(self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads))
        x = x + self.proj(a.reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


def _on_views(attention):
    """The attention on (B, H, S, D) views of the projection, as a block written for SDPA takes
    them: autograd stacks their three gradients back into the projection's."""
    def call(qkv):
        return attention(*(t.transpose(1, 2) for t in qkv.unbind(2))).transpose(1, 2)
    return call


# Rounds of the train section at least: attention is about a fifth of the block's step, so the
# two sides differ by a few percent at most. Each round's pair of timings gives one ratio; the
# 95% interval of the median of forty spanned 0.4 to 1% on an H100, where fifteen rounds with
# each side resampled on its own spanned 3%.
TRAIN_ROUNDS = 40


def train_attentions() -> dict:
    """The train section's sides, causal: ours as `FlashMoEScienceAttention` calls it (the
    projection's output, gradients written into one dQKV), ours on views as SDPA takes them,
    SDPA's default dispatch."""
    return {"ours_packed": lambda qkv: flash_attention_qkvpacked(qkv, causal=True),
            "ours": _on_views(lambda q, k, v: flash_attention_science(q, k, v, causal=True)),
            "sdpa_default": _on_views(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True))}


def _train(args, device):
    """Forward+backward of a transformer block (dim 1024, 16 heads, S 2048, batch 8, bf16). The
    sides alternate, one timing each per round (`args.repeats` rounds, at least TRAIN_ROUNDS),
    so that a drift in clocks over the run falls on all alike; a speed-up is the median of the
    rounds' ratios (`paired_speedup_interval`). Its interval with each side resampled on its own
    (`speedup_interval`, as the other sections) is kept beside it."""
    batch, seqlen, dim, heads = 8, 2048, 1024, 16
    attentions = train_attentions()
    torch.manual_seed(0)
    x = torch.randn(batch, seqlen, dim, device=device, dtype=torch.bfloat16)
    block = Block(dim, heads, None).to(device, torch.bfloat16)
    samples, losses = {name: [] for name in attentions}, {}

    def step():
        block.zero_grad(set_to_none=True)
        loss = block(x).float().square().mean()
        loss.backward()
        return loss

    for round_ in range(max(TRAIN_ROUNDS, args.repeats)):
        for name, attention in attentions.items():
            block.attention = attention
            if round_ == 0:
                losses[name] = step().item()
            samples[name] += time_gpu(step, warmup_ms=args.warmup, rep_ms=args.rep, repeats=1).samples
    timings = {name: Timing.from_samples(s) for name, s in samples.items()}
    rows = []
    for name, t in timings.items():
        row = dict(section="train", mode="fwd+bwd", impl=name, batch=batch, seqlen=seqlen, dim=dim, heads=heads,
                   causal=True, dtype="bfloat16", ms=t.median_ms, ms_ci=[t.lo_ms, t.hi_ms], loss=losses[name],
                   rounds=len(samples[name]), ours_speedup=None)
        if name != "sdpa_default":  # this side's speed-up over SDPA's default
            ratio, lo, hi = paired_speedup_interval(samples[name], samples["sdpa_default"])
            _, unpaired_lo, unpaired_hi = speedup_interval(t, timings["sdpa_default"])
            row.update(ours_speedup=ratio, ours_speedup_ci=[lo, hi],
                       ours_speedup_ci_unpaired=[unpaired_lo, unpaired_hi])
        rows.append(row)
    return rows




def run(args) -> dict:
    """The benchmark's rows. `args.checkpoint(rows)`, where the caller sets it (`cli`), is handed
    the rows measured so far after each shape of the long sections, so a run cut short by a time
    limit still leaves them."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    checkpoint = getattr(args, "checkpoint", None) or (lambda rows: None)
    args.checkpoint = checkpoint
    meta = {"mode": args.mode, "tokens_per_batch": TOKENS, "hidden": HIDDEN}
    suffix = "" if args.window is None else f"_window{args.window}"
    if args.mode == "decode":
        from . import attention_decode
        if device.type == "cpu":
            meta["note"] = "no GPU: Triton CPU interpreter at small size; errors only"
        return {"name": "attention_decode", "rows": attention_decode.run(args, device), "meta": meta}
    if args.mode == "fp8":
        from . import attention_fp8
        meta["fa3_published_rmse"] = attention_fp8.FA3_PUBLISHED_RMSE
        if device.type == "cpu":
            meta["note"] = "no GPU: Triton CPU interpreter, a tiny accuracy case only"
        return {"name": "attention_fp8", "rows": attention_fp8.run(args, device), "meta": meta}
    if args.sweep or args.sweep_hopper or args.sweep_fp8:
        from .sweeps import attention_forward as sweeps
        if args.sweep_fp8:
            return {"name": f"attention_fp8_sweep{suffix}", "rows": sweeps.fp8_sweep(args, device), "meta": meta}
        if args.sweep:
            return {"name": f"attention_sweep{suffix}", "rows": sweeps.sweep(args, device), "meta": meta}
        name = f"attention_hopper_sweep{'_gluon' if args.sweep_gluon else ''}{suffix}"
        return {"name": name, "rows": sweeps.hopper_sweep(args, device), "meta": meta}
    from .attention_workloads import GPU_WORKLOAD, INTERPRETER_WORKLOAD, WORKLOAD_SECTIONS

    default = ["overhead", "small", "throughput"] if args.mode == "fwd" else ["throughput", "memory", "train"]
    sections = args.sections.split(",") if args.sections else default
    mode = args.mode.replace("+", "_")
    # The varlen and window sections run alone write a file of their own, so that their results
    # sit beside (not over) the mode's main results file.
    separate = set(sections) <= set(WORKLOAD_SECTIONS)
    if device.type == "cpu":
        # No GPU: through Triton's interpreter at small size; timings are CPU timings.
        meta["note"] = "no GPU: Triton CPU interpreter at small size; timings are not GPU figures"
        if not separate:
            rows = _small(args, device)
            checkpoint(rows)
            return {"name": "attention_interpreter", "rows": rows, "meta": meta}
    work = GPU_WORKLOAD if device.type == "cuda" else INTERPRETER_WORKLOAD
    if separate:
        meta.update(workload={k: str(v) if isinstance(v, torch.dtype) else v for k, v in vars(work).items()})
    if device.type == "cuda" and "throughput" in sections:
        # The denominator of the throughput tables' fraction of the ceiling, measured in this run.
        meta["matmul_tflops"] = round(measure_matmul_ceiling(), 1)
    rows = []
    for section in sections:
        args.checkpoint = lambda section_rows, done=list(rows): checkpoint(done + section_rows)
        if section in WORKLOAD_SECTIONS:
            rows += WORKLOAD_SECTIONS[section](args, device, work)
        else:
            rows += {"overhead": _overhead, "small": _small, "throughput": _throughput, "memory": _memory,
                     "train": _train}[section](args, device)
        checkpoint(rows)
    name = "attention_" + "_".join(sections + [mode]) if separate else "attention_" + mode
    if "/" in args.head_dims and "throughput" in sections:
        name += "_mla"  # beside, not over, the equal-head-dim results
    return {"name": name, "rows": rows, "meta": meta}


def plot(rows, path) -> None:
    """TFLOP/s against S for every implementation, one panel per (head dim, causal)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("section") == "throughput" and r.get("tflops")]
    if not rows:
        return
    panels = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    for ax, (head_dim, causal) in zip(axes[0], panels):
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = sorted((r["seqlen"], r["tflops"]) for r in rows
                         if r["impl"] == impl and r["head_dim"] == head_dim and r["causal"] == causal)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl, linewidth=2.5 if impl == "ours" else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D={head_dim} {'causal' if causal else 'non-causal'} ({rows[0]['mode']})")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(result: dict) -> str:
    """A short text table of the result, printed last by the command."""
    rows, lines = result["rows"], []
    small = [r for r in rows if r.get("section") == "small"]
    def case(r):
        return f"({r['batch']},{r['heads']},{r['seqlen']},{r['head_dim']}) {r['dtype']} {r['causal']!s:5}"

    if small and "speedup_wall" not in small[0]:
        lines.append("small calls through the interpreter (errors against float64; no timings on the CPU): "
                     "shape dtype causal | rel. error ours / SDPA")
        lines += [f"  {case(r)} | {r['ours_rel_err']:.1e} / {r['sdpa_rel_err']:.1e}" for r in small]
    elif small:
        lines.append("small calls: shape dtype causal | wall us ours / SDPA | speedup [95% CI] | GPU us ours / SDPA")
        for r in small:
            lo, hi = r["speedup_wall_ci"]
            lines.append(f"  {case(r)} | {r['ours_wall_us']:.1f} / {r['sdpa_wall_us']:.1f} | "
                         f"{r['speedup_wall']:.2f} [{lo:.2f}, {hi:.2f}] | "
                         f"{r['ours_gpu_us']:.1f} / {r['sdpa_gpu_us']:.1f}")
    table: dict = {}
    for r in rows:
        if r.get("section") in ("throughput", "sweep", "hopper_sweep") and r.get("tflops"):
            key = (r["head_dim"], r["seqlen"], r["causal"])
            label = r.get("impl") or f"{r['block_m']}x{r['block_n']} w{r['num_warps']} s{r['num_stages']}"
            table.setdefault(key, {})[label] = r["tflops"]
    for (d, s, causal), by_impl in sorted(table.items()):
        if result["name"].startswith("attention_sweep"):
            best = sorted(by_impl.items(), key=lambda kv: -kv[1])[:3]
            lines.append(f"D={d} S={s} causal={causal}: " + ", ".join(f"{k} {v:.0f}" for k, v in best))
        else:
            lines.append(f"D={d} S={s} causal={causal}: " + ", ".join(f"{k} {v:.0f}" for k, v in by_impl.items()))
    for r in rows:
        if r.get("section") == "overhead":
            lines.append(f"host per call: {r['what']}: {r['wall_us']:.1f} us")
        if r.get("section") in ("memory", "train"):
            lines.append(f"{r['section']} {r['impl']}: " + (f"{r['peak_extra_mib']:.0f} MiB" if "peak_extra_mib" in r
                                                            else f"{r['ms']:.3f} ms"))
            if r.get("ours_speedup") is not None and r["impl"] != "sdpa_default":
                lo, hi = r["ours_speedup_ci"]
                lines[-1] += f", {r['ours_speedup']:.3f}x [{lo:.3f}, {hi:.3f}] SDPA default's speed"
    for r in rows:
        if r.get("section") == "accuracy":
            lines.append(f"accuracy (outliers) {r['impl']}: RMSE {r['rmse']:.2e}, rel. error {r['rel_err']:.2e}")
    lines += _summarize_workloads(rows)
    return "\n".join(lines)


def _timing_text(r) -> str:
    if "ms" not in r:
        return f"{r['impl']} failed ({r.get('error')})"
    text = f"{r['impl']} {r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s"
    if r.get("ours_speedup") is not None:
        lo, hi = r["ours_speedup_ci"]
        text += f" (ours {r['ours_speedup']:.2f}x [{lo:.2f}, {hi:.2f}])"
    if r.get("speedup_vs_full") is not None:
        lo, hi = r["speedup_vs_full_ci"]
        text += f" ({r['speedup_vs_full']:.2f}x [{lo:.2f}, {hi:.2f}] faster than full causal, " \
                f"{1 / r['work_vs_full']:.1f}x less work)"
    if isinstance(r.get("rel_err"), float):
        text += f" err {r['rel_err']:.1e}"
    return text


def _summarize_workloads(rows) -> list[str]:
    """Lines for the varlen, window and calls sections: one per problem, every implementation on it."""
    lines, groups = [], {}
    for r in rows:
        if r.get("section") == "varlen":
            key = (f"varlen {r['mode']} causal={r['causal']}: {r.get('sequences')} sequences, {r.get('tokens')} tokens "
                   f"({r.get('padded_tokens')} padded)")
        elif r.get("section") == "window":
            window = "full" if r["window"] is None else r["window"]
            key = f"window {r['mode']} S={r.get('seqlen')} window={window}"
        elif r.get("section") == "calls":
            key = f"calls {r['mode']} (B, H, S, D) = {(r['batch'], r['heads'], r['seqlen'], r['head_dim'])}"
            text = f"{r['impl']} {r['wall_us']:.0f} us/call"
            if r.get("ours_speedup") is not None:
                text += f" ({r['ours_speedup']:.2f}x SDPA's speed)"
            groups.setdefault(key, []).append(text)
            continue
        else:
            continue
        groups.setdefault(key, []).append(_timing_text(r))
    for key, texts in groups.items():
        lines.append(key + ": " + "; ".join(texts))
    return lines
