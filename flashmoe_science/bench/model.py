"""`flashmoe-science bench model`: real transformers architectures, end to end, on our kernels
against transformers' own implementations, side by side in one run.

Models: random weights in bf16 with the real widths of Qwen3-30B-A3B (layers cut to
--layers), Mixtral-8x7B (fewer layers still: 14336-wide experts), OLMoE-1B-7B (8 of its 16
layers: the whole model's training step with AdamW ran out of an 80 GB H100's memory) and
gpt-oss-20b (4 of its 24 layers). Implementations (attn_implementation / experts_implementation):
"fms" / "fms" (ours, through `flashmoe_science.integrations.transformers`), "sdpa" / "grouped_mm",
"eager" / "eager", and "eager" / "grouped_mm" (measured in place of "sdpa" / "grouped_mm" for a
model without sdpa attention: `BASELINES`).
Measured per model and implementation:
- train: one step (forward, loss, backward, AdamW) at batch x --seqlen tokens, in tokens/s;
- prefill: the forward of the same batch without gradients, with the logits of the last position
  only (`logits_to_keep=1`, as `generate` runs a prompt), in ms;
- decode: `generate` of --new-tokens tokens after a short prompt at batch 1 and 32, tokens/s,
  the implementations' runs interleaved on one shared copy of the weights (the host, whose speed
  drifts, bounds eager decoding).
With --static-cache, only the decode, with a static cache (`cache_implementation="static"`, which
transformers compiles with torch.compile(mode="reduce-overhead"): each step replays CUDA graphs),
at batch 1 and 32, written as results model_static_decode: the way to serve without the host
time of eager decoding.
Times are medians of CUDA-event-timed repetitions after warm-up. On a machine without a GPU a
tiny configuration of each family runs once through the interpreter to exercise the code, and
the timings mean nothing.
"""
from __future__ import annotations

import copy
import functools
import gc
import statistics

import torch

from ..device import interpreter_active

# name: (config class, config overrides with the real widths, layers at full size, GPU batch)
MODELS = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                              moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4,
                                              head_dim=128, num_experts=128, num_experts_per_tok=8), 4, 4),
    "mixtral-8x7b": ("MixtralConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                           num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                           num_experts_per_tok=2), 2, 2),
    "olmoe-1b-7b": ("OlmoeConfig", dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                                        num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                                        num_experts_per_tok=8), 8, 1),
    "gpt-oss-20b": ("GptOssConfig", dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                                         num_local_experts=32, num_experts_per_tok=4, num_attention_heads=64,
                                         num_key_value_heads=8, head_dim=64, sliding_window=128), 4, 1),
}
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=32, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=4, num_local_experts=4, num_experts_per_tok=2)
IMPLEMENTATIONS = {"ours": ("fms", "fms"), "sdpa_grouped_mm": ("sdpa", "grouped_mm"), "eager": ("eager", "eager"),
                   "eager_grouped_mm": ("eager", "grouped_mm")}
# What ours is measured against: transformers' fast path, sdpa attention with grouped_mm experts,
# or where a model has no sdpa attention (gpt-oss: attention sinks) eager attention with
# grouped_mm experts, which `run` then measures in sdpa_grouped_mm's place.
BASELINES = ("sdpa_grouped_mm", "eager_grouped_mm")
BASELINE_NAMES = {"sdpa_grouped_mm": "sdpa + grouped_mm", "eager_grouped_mm": "eager + grouped_mm"}
PROMPT = 32
DECODE_REPEATS = 5  # interleaved generate runs per implementation and batch


def add_arguments(parser) -> None:
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--impls", nargs="+", choices=list(IMPLEMENTATIONS), default=list(IMPLEMENTATIONS))
    parser.add_argument("--layers", type=int, default=None, help="layers of every model (default: each model's)")
    parser.add_argument("--seqlen", type=int, default=4096, help="tokens per sequence of the train and prefill runs")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens each decode run generates")
    parser.add_argument("--static-cache", action="store_true",
                        help="only decode with a static cache, compiled into CUDA graphs by transformers "
                             "(results model_static_decode)")
    parser.add_argument("--profile", action="store_true",
                        help="also break one training step's GPU time down by kernel kind (torch.profiler)")


def _config(name, layers, device):
    import transformers

    cls, widths, default_layers, batch = MODELS[name]
    config_cls = getattr(transformers, cls)
    fields = set(config_cls().to_dict())
    if device.type == "cpu":
        widths = {k: v for k, v in TINY.items() if k in fields}
        layers, batch = 2, 1
    config = config_cls(**{k: v for k, v in widths.items() if k in fields},
                        num_hidden_layers=layers or default_layers, max_position_embeddings=32768)
    return config, batch


def _timed(fn, repeats):
    """Median milliseconds of `fn` over `repeats` runs after one warm-up (CUDA events on a GPU)."""
    return _timed_side_by_side({None: fn}, repeats)[None]


def _timed_side_by_side(fns: dict, repeats: int) -> dict:
    """Median milliseconds of each of `fns` over `repeats` runs after one warm-up each, the runs
    interleaved (each round in a rotated order), so that all of them see the same drift of the
    host's speed: host-bound runs on the GPU machine drifted by a third within a minute. CUDA
    events on a GPU, the wall clock on the CPU."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if torch.cuda.is_available():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end))
            else:
                import time
                t = time.perf_counter()
                fns[name]()
                times[name].append((time.perf_counter() - t) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


# Kernel kinds of a training step, by the first pattern (lower case) a kernel's name contains: our
# kernels, PyTorch's SDPA backends (flash, cuDNN, memory-efficient), torch._grouped_mm (CUTLASS
# grouped GEMMs), dense GEMMs (the projections, the router, the LM head), AdamW's fused
# multi-tensor kernels, and the rest (norms, activations, the loss, copies, indexing).
KERNEL_KINDS = (("attention", ("attention", "flash", "fmha", "sdpa", "attn")),
                ("experts", ("gate_up", "down_kernel", "combine_kernel", "route_kernel", "align_pairs", "count_pairs",
                             "grad_x_kernel", "grad_w", "moe", "grouped", "groupproblemshape")),
                ("dense gemm", ("gemm", "nvjet", "xmma", "cutlass", "matmul")),
                ("optimizer", ("multi_tensor", "adam")))


def kernel_kind(name: str) -> str:
    """Which part of a training step a GPU kernel belongs to (KERNEL_KINDS), or "other"."""
    lower = name.lower()
    for kind, patterns in KERNEL_KINDS:
        if any(p in lower for p in patterns):
            return kind
    return "other"


def _profile(step) -> dict:
    """GPU milliseconds of one call of `step` (already warmed up) per kernel kind, and its eight
    longest kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [(e.key, e.self_device_time_total / 1e3) for e in prof.key_averages()
               if e.self_device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA]
    kinds = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for name, ms in kernels:
        kinds[kernel_kind(name)] += ms
    top = sorted(kernels, key=lambda k: -k[1])[:8]
    return {"ms_by_kind": kinds, "total_ms": sum(kinds.values()),
            "top_kernels": [{"name": name[:120], "kind": kernel_kind(name), "ms": ms} for name, ms in top]}


def _measure(model, batch, seqlen, vocab, device, repeats, profile=False):
    ids = torch.randint(0, vocab, (batch, seqlen), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def train_step():
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def prefill():
        with torch.no_grad():
            model(ids, logits_to_keep=1)

    row = {}
    model.train()
    row["train_ms"] = _timed(train_step, repeats)
    row["train_tokens_per_s"] = batch * seqlen / row["train_ms"] * 1e3
    if profile and device.type == "cuda":
        row["train_profile"] = _profile(train_step)
    model.eval()
    row["prefill_ms"] = _timed(prefill, repeats)
    return row


def _decode(models: dict, new_tokens, vocab, device, repeats, cache=None) -> dict:
    """{name: tokens/s of `generate` at batch 1 and 32 (the CPU: 1)} for each of `models`, their runs
    interleaved (`_timed_side_by_side`), with transformers' default cache or `cache` ("static":
    compiled into CUDA graphs by transformers on a GPU; the warm-up call compiles)."""
    rows = {name: {} for name in models}
    for decode_batch in ((1, 32) if device.type == "cuda" else (1,)):
        prompt = torch.randint(0, vocab, (decode_batch, PROMPT), device=device)
        fns = {name: functools.partial(model.generate, prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                       do_sample=False, cache_implementation=cache)
               for name, model in models.items()}
        for name, ms in _timed_side_by_side(fns, repeats).items():
            rows[name][f"decode_b{decode_batch}_tokens_per_s"] = decode_batch * new_tokens / ms * 1e3
    return rows


def _decoders(config, rows, state, device, dtype) -> dict:
    """{impl: the model of each row's implementations in eval mode}, every one on the same weight
    tensors (`state`, assigned, not copied): one copy of the weights for all of them."""
    import transformers

    models = {}
    for row in rows:
        with device:
            model = transformers.AutoModelForCausalLM.from_config(
                copy.deepcopy(config), attn_implementation=row["attn_implementation"],
                experts_implementation=row["experts_implementation"], dtype=dtype)
        model.load_state_dict(state, assign=True)
        models[row["impl"]] = model.eval()
    return models


def baseline(rows, model: str):
    """(name, row) of what `model`'s ours is measured against (BASELINES): the first that ran."""
    ran = {r["impl"]: r for r in rows if r["model"] == model and "error" not in r}
    return next(((BASELINE_NAMES[b], ran[b]) for b in BASELINES if b in ran), (None, None))


def _release_memory(gpu: bool) -> None:
    """Frees what a finished model held before the next is built (the cycle collector for whatever
    reference cycles kept it), then gives the allocator's cache back to the device."""
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()


def run(args) -> dict:
    import transformers
    from torch._dynamo.utils import counters

    from ..integrations.transformers import register

    register()
    gpu = torch.cuda.is_available()
    if not gpu and not interpreter_active():
        raise SystemExit("bench model needs a CUDA GPU, or TRITON_INTERPRET=1 for a tiny run through the interpreter")
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    seqlen, new_tokens, repeats = (args.seqlen, args.new_tokens, 3) if gpu else (16, 4, 1)
    rows = []
    for name in args.progress(args.models, desc="bench model"):
        config, batch = _config(name, args.layers, device)
        torch.manual_seed(0)
        state = None
        impls = list(args.impls)
        for impl in impls:
            attn, experts = IMPLEMENTATIONS[impl]
            try:
                with device:  # initialised where it runs: billions of parameters drawn on the CPU took minutes
                    # its own config: from_config writes the implementations into the one it is given
                    model = transformers.AutoModelForCausalLM.from_config(
                        copy.deepcopy(config), attn_implementation=attn, experts_implementation=experts, dtype=dtype)
            except ValueError as exc:  # an implementation this model does not offer (gpt-oss: sdpa)
                rows.append(dict(model=name, impl=impl, attn_implementation=attn, experts_implementation=experts,
                                 layers=config.num_hidden_layers, batch=batch, seqlen=seqlen, new_tokens=new_tokens,
                                 error=f"{type(exc).__name__}: {exc}"[:300]))
                if impl == "sdpa_grouped_mm" and "eager_grouped_mm" not in impls:
                    impls.append("eager_grouped_mm")  # the baseline where sdpa is missing (BASELINES)
                continue
            if state is None:
                state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            else:
                model.load_state_dict(state)
            row = dict(model=name, impl=impl, attn_implementation=attn, experts_implementation=experts,
                       layers=config.num_hidden_layers, batch=batch, seqlen=seqlen, new_tokens=new_tokens)
            try:
                if args.static_cache:
                    # Each model compiles from scratch: the compiled step's code is shared by every model,
                    # and guards piling up from earlier ones would reach dynamo's recompile limit (eager).
                    torch._dynamo.reset()
                    counters.clear()
                    model.eval()
                    row.update(_decode({impl: model}, new_tokens, config.vocab_size, device, repeats,
                                       cache="static")[impl])
                    # what the CUDA graphs cost beyond their kernels: skipped graphs, inputs copied in per replay
                    row["cudagraph_counters"] = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
                else:
                    row.update(_measure(model, batch, seqlen, config.vocab_size, device, repeats,
                                        profile=args.profile))
            except (RuntimeError, NotImplementedError) as exc:  # out of memory, or a path a backend lacks
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            args.checkpoint(rows)
            del model
            _release_memory(gpu)
        if not args.static_cache:
            # Eager decode is bound by the host, whose speed drifts: every implementation's runs interleaved.
            decoding = [r for r in rows if r["model"] == name and "error" not in r]
            models = _decoders(config, decoding, state, device, dtype)
            try:
                speeds = _decode(models, new_tokens, config.vocab_size, device, DECODE_REPEATS if gpu else 1)
            except (RuntimeError, NotImplementedError) as exc:
                speeds = {impl: {"decode_error": f"{type(exc).__name__}: {exc}"[:300]} for impl in models}
            for row in decoding:
                row.update(speeds[row["impl"]])
            args.checkpoint(rows)
            del models
        del state
        _release_memory(gpu)
    meta = {"mode": "static-cache decode" if args.static_cache else "model", "dtype": str(dtype).replace("torch.", ""),
            "transformers": transformers.__version__, "interpreter": interpreter_active()}
    if not gpu:
        meta["note"] = "no GPU: tiny configurations through Triton's interpreter; the timings mean nothing"
    return {"name": "model_static_decode" if args.static_cache else "model", "rows": rows, "meta": meta}


def summarize(result: dict) -> str:
    lines = ["model impl | train tokens/s | prefill ms | decode tokens/s (batch 1, 32)"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"  {r['model']} {r['impl']} | {r['error']}")
            continue
        decode = ", ".join(f"{r[k]:.1f}" for k in ("decode_b1_tokens_per_s", "decode_b32_tokens_per_s") if k in r)
        if "train_tokens_per_s" not in r:  # --static-cache: decode alone
            lines.append(f"  {r['model']} {r['impl']} | | | {decode} (static cache)")
            continue
        lines.append(f"  {r['model']} {r['impl']} | {r['train_tokens_per_s']:.0f} | {r['prefill_ms']:.1f} | {decode}")
        if "train_profile" in r:
            kinds = ", ".join(f"{k} {ms:.1f}" for k, ms in r["train_profile"]["ms_by_kind"].items())
            lines.append(f"    train step GPU ms by kernel kind: {kinds}")
    return "\n".join(lines)
