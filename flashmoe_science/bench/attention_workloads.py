"""The workload sections of `flashmoe-science bench attention` (`--sections varlen,window,calls`):
packed variable-length batches against SDPA on the padded batch and FlexAttention's document
mask, causal sliding windows against our full causal attention and FlexAttention, and
back-to-back calls from a QKV projection on each side of the train section. `attention.py`'s
module docstring describes each; without a GPU they run through the interpreter at a tiny size
(`INTERPRETER_WORKLOAD`)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..attention import attention_reference, flash_attention_science, flash_attention_varlen
from ..flops import attention_flops, attention_pairs
from .attention import HIDDEN, TOKENS, _flex_with_mask, _timed_call, make_inputs, train_attentions
from .common import rel_error
from .timing import Timing, paired_speedup_interval, speedup_interval, time_gpu, time_wall


@dataclass(frozen=True)
class Workload:
    """The problem sizes of the varlen and window sections."""

    tokens: int  # varlen: sequences are drawn until the next would pass this many tokens
    lengths: tuple  # varlen: lengths drawn uniformly from this inclusive range
    seqlen: int  # window: the sequence length
    windows: tuple  # window: left window sizes (causal), each compared with full causal attention
    heads: int
    head_dim: int
    dtype: torch.dtype


GPU_WORKLOAD = Workload(TOKENS, (64, 2048), 16384, (256, 1024, 4096), HIDDEN // 128, 128, torch.bfloat16)
# Through the interpreter (bf16 products are wrong there): small enough for seconds, large enough
# for several blocks per sequence.
INTERPRETER_WORKLOAD = Workload(160, (8, 48), 128, (8, 32), 2, 32, torch.float32)


def varlen_lengths(tokens, lengths, seed=0) -> list[int]:
    """Sequence lengths drawn uniformly from the inclusive range `lengths` with a fixed seed,
    until the next one would make the batch longer than `tokens`."""
    generator = torch.Generator().manual_seed(seed)
    drawn = []
    while True:
        n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=generator))
        if sum(drawn) + n > tokens:
            return drawn
        drawn.append(n)


@dataclass
class _Layout:
    """How one implementation holds a packed (total, H, D) tensor, and where sequence `index`
    (rows start:end of the packed tensor) lies in an output or gradient of that layout."""

    to_layout: object  # packed (total, H, D) -> the implementation's tensor
    sequence: object  # (tensor in the layout) -> (length, H, D) of the measured sequence


# FlexAttention's packed batch is padded to a multiple of its block size; the padding rows form
# a document of their own. Its backward has misbehaved on lengths that are not (benchmark rows
# with a causal document mask once showed a relative error of 0.69 against float64).
FLEX_BLOCK = 128


def _packed_layouts(lengths, index, device):
    """Layouts of the varlen section: packed (ours), zero-padded (B, H, L, D) views of (B, L, H, D)
    memory (SDPA), and the packed tokens as one (1, H, total, D) sequence padded to FLEX_BLOCK rows
    (FlexAttention); with the document of each row of FlexAttention's sequence."""
    starts = [0, *itertools.accumulate(lengths)]
    start, end, longest, total = starts[index], starts[index + 1], max(lengths), starts[-1]
    sequence_of = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                          torch.tensor(lengths, device=device))
    position = torch.arange(total, device=device) - torch.tensor(starts[:-1], device=device)[sequence_of]
    flex_rows = -(-total // FLEX_BLOCK) * FLEX_BLOCK
    flex_documents = torch.cat([sequence_of, sequence_of.new_full((flex_rows - total,), len(lengths))])

    def pad(packed):
        padded = packed.new_zeros(len(lengths), longest, *packed.shape[1:])
        padded[sequence_of, position] = packed
        return padded.transpose(1, 2)

    def flex(packed):
        rows = torch.cat([packed, packed.new_zeros(flex_rows - total, *packed.shape[1:])])
        return rows[None].transpose(1, 2)

    return flex_documents, {
        "ours": _Layout(lambda x: x, lambda x: x[start:end]),
        "sdpa_padded": _Layout(pad, lambda x: x[index, :, :end - start].transpose(0, 1)),
        "flex_document": _Layout(flex, lambda x: x[0, :, start:end].transpose(0, 1)),
    }


def _varlen(args, device, work: Workload):
    """Packed variable-length batch: ours against SDPA on the padded batch and FlexAttention with
    a document mask, timed in args.mode; error on the longest sequence against float64."""
    lengths = varlen_lengths(work.tokens, work.lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    index = lengths.index(max(lengths))
    flex_documents, layouts = _packed_layouts(lengths, index, device)
    longest, total, heads, head_dim = max(lengths), sum(lengths), work.heads, work.head_dim
    packed = [torch.randn(total, heads, head_dim, dtype=work.dtype, device=device) for _ in range(3)]
    grad = torch.randn_like(packed[0])
    key_valid = torch.arange(longest, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for causal in args.progress([False, True], desc=f"attention varlen {args.mode}"):
        # SDPA: queries of every padded row see their sequence's keys (padding rows too, so that no
        # row is fully masked); with causal also only keys up to their own position.
        mask = key_valid[:, None, None, :]
        if causal:
            mask = mask & torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
        impls = {
            "ours": lambda q, k, v, causal=causal: flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal),
            "sdpa_padded": lambda q, k, v, mask=mask: sdpa(q, k, v, attn_mask=mask),
        }
        if device.type == "cuda":
            try:
                impls["flex_document"] = _flex_with_mask(_document_mask(flex_documents, causal), len(flex_documents),
                                                         len(flex_documents), device)
            except Exception as exc:  # FlexAttention missing or failing: reported, not fatal
                rows.append(dict(section="varlen", mode=args.mode, impl="flex_document", causal=causal,
                                 error=f"{type(exc).__name__}: {exc}"[:200]))
        flops = sum(attention_flops(1, heads, n, n, head_dim, causal, args.mode) for n in lengths)
        errors = _sequence_errors(impls, layouts, packed, grad, index, causal, args.mode)
        timings = _time_impls(args, impls, {name: [layouts[name].to_layout(t).detach().requires_grad_(
            args.mode != "fwd") for t in packed] for name in impls})
        for name, t in timings.items():
            row = dict(section="varlen", mode=args.mode, impl=name, sequences=len(lengths), tokens=total,
                       padded_tokens=len(lengths) * longest, max_seqlen=longest, heads=heads, head_dim=head_dim,
                       causal=causal, dtype=str(work.dtype).replace("torch.", ""), rel_err=errors.get(name))
            if isinstance(t, str):
                row.update(error=t)
            else:
                row.update(ms=t.median_ms, ms_ci=[t.lo_ms, t.hi_ms], tflops=flops / (t.median_ms * 1e-3) / 1e12)
                if name != "ours" and not isinstance(timings.get("ours"), str):
                    ratio, lo, hi = speedup_interval(timings["ours"], t)
                    row.update(ours_speedup=ratio, ours_speedup_ci=[lo, hi])
            rows.append(row)
    return rows


def _document_mask(sequence_of, causal: bool):
    """FlexAttention mask_mod of a packed batch: same sequence (and key not after query).

    The causal and non-causal masks are separate functions: torch.compile guards a compiled
    flex_attention on the mask's code, not on a closure's default arguments, so one function
    with a `causal` default would silently reuse the first mask's kernel for the second."""
    def document(b, h, q_idx, kv_idx):
        return sequence_of[q_idx] == sequence_of[kv_idx]

    def causal_document(b, h, q_idx, kv_idx):
        return (sequence_of[q_idx] == sequence_of[kv_idx]) & (q_idx >= kv_idx)

    return causal_document if causal else document


def _time_impls(args, impls, inputs) -> dict:
    """GPU time of each implementation in args.mode on its own inputs (an error string if it fails)."""
    timings = {}
    for name, fn in impls.items():
        try:
            timings[name] = time_gpu(_timed_call(fn, inputs[name], args.mode), warmup_ms=args.warmup, rep_ms=args.rep,
                                     repeats=args.repeats)
        except Exception as exc:  # an implementation that rejects the problem is reported, not fatal
            timings[name] = f"{type(exc).__name__}: {exc}"[:200]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return timings


def _sequence_errors(impls, layouts, packed, grad, index, causal, mode) -> dict:
    """Relative error against float64 on one sequence of the batch: of the output for fwd, the
    worst of out, dq, dk and dv otherwise (the sequences are independent, so the batch's
    gradients restricted to that sequence are that sequence's own)."""
    ours = layouts["ours"]
    ref_inputs = [ours.sequence(t).transpose(0, 1)[None].detach().double().requires_grad_(mode != "fwd")
                  for t in packed]
    ref, _ = attention_reference(*ref_inputs, causal=causal)
    expected = [ref[0].transpose(0, 1)]
    if mode != "fwd":
        ref_grads = torch.autograd.grad(ref, ref_inputs, ours.sequence(grad).transpose(0, 1)[None].double())
        expected += [g[0].transpose(0, 1) for g in ref_grads]
    errors = {}
    for name, fn in impls.items():
        layout = layouts[name]
        inputs = [layout.to_layout(t).detach().requires_grad_(mode != "fwd") for t in packed]
        try:
            out = fn(*inputs)
            results = [out]
            if mode != "fwd":
                results += torch.autograd.grad(out, inputs, layout.to_layout(grad))
        except Exception as exc:  # reported in the row, as the timing's failure is
            errors[name] = type(exc).__name__
            continue
        errors[name] = max(rel_error(layout.sequence(r), e) for r, e in zip(results, expected))
    return errors


def _window(args, device, work: Workload):
    """Causal sliding windows against full causal attention (ours) and FlexAttention's
    sliding-window mask, one sequence of work.seqlen, timed in args.mode."""
    seqlen, heads, head_dim = work.seqlen, work.heads, work.head_dim
    inputs = make_inputs(1, heads, seqlen, head_dim, work.dtype, device, requires_grad=args.mode != "fwd")
    # The last rows of one head against float64 (all of it would be an S x S float64 matrix).
    tail = min(seqlen, 2048)
    q_ref, k_ref, v_ref = (t.detach()[:, :1].double() for t in inputs)
    q_ref = q_ref[:, :, seqlen - tail:]
    flex_window = torch.tensor(0, device=device)  # read by the mask at run time: one compiled kernel for all windows

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= flex_window)

    pairs_full = attention_pairs(seqlen, seqlen, True)
    rows, full = [], None
    for window in args.progress([None, *work.windows], desc=f"attention window {args.mode}"):
        window_size = (-1, -1) if window is None else (window, -1)
        impls = {"ours": lambda q, k, v, window_size=window_size: flash_attention_science(
            q, k, v, causal=True, window_size=window_size)}
        if device.type == "cuda":
            flex_window.fill_(seqlen if window is None else window)
            try:
                impls["flex"] = _flex_with_mask(sliding, seqlen, seqlen, device)
            except Exception as exc:  # FlexAttention missing or failing: reported, not fatal
                rows.append(dict(section="window", mode=args.mode, impl="flex", window=window,
                                 error=f"{type(exc).__name__}: {exc}"[:200]))
        ref, _ = attention_reference(q_ref, k_ref, v_ref, causal=True, window_size=window_size)
        pairs = attention_pairs(seqlen, seqlen, True, window_size)
        flops = attention_flops(1, heads, seqlen, seqlen, head_dim, True, args.mode, window_size)
        timings = _time_impls(args, impls, {name: inputs for name in impls})
        full = timings["ours"] if window is None else full
        for name, t in timings.items():
            row = dict(section="window", mode=args.mode, impl=name, seqlen=seqlen, heads=heads, head_dim=head_dim,
                       causal=True, window=window, dtype=str(work.dtype).replace("torch.", ""),
                       work_vs_full=pairs / pairs_full)
            if isinstance(t, str):
                rows.append({**row, "error": t})
                continue
            with torch.no_grad():
                out = impls[name](*inputs)
            row.update(ms=t.median_ms, ms_ci=[t.lo_ms, t.hi_ms], tflops=flops / (t.median_ms * 1e-3) / 1e12,
                       rel_err=rel_error(out[:, :1, seqlen - tail:], ref))
            if name == "ours" and window is not None and not isinstance(full, str):
                ratio, lo, hi = speedup_interval(t, full)
                row.update(speedup_vs_full=ratio, speedup_vs_full_ci=[lo, hi])
            if name != "ours" and not isinstance(timings["ours"], str):
                ratio, lo, hi = speedup_interval(timings["ours"], t)
                row.update(ours_speedup=ratio, ours_speedup_ci=[lo, hi])
            rows.append(row)
    return rows


# The calls section's (B, H, S, D), causal: from where host time decides a training call's speed
# to where the GPU does.
CALL_SHAPES = ((1, 8, 256, 64), (8, 16, 256, 64), (8, 16, 1024, 64), (8, 16, 2048, 64), (4, 16, 2048, 128))
# Rounds per shape at least, each timing every side once: host time drifts over a run.
CALL_ROUNDS = 15


def _calls(args, device, work: Workload):
    """Wall-clock per attention call, back to back, from a QKV projection's output (B, S, 3, H,
    D) in work.dtype: forward and backward through autograd to the projection's gradient (the
    forward alone in fwd mode), on each side of `train_attentions`, which alternate in rounds
    with paired ratios as in the train section. At short sequences the host's time decides what
    a user feels, which the throughput tables (GPU time only) cannot show."""
    interp = device.type == "cpu"
    shapes = ((1, 2, 24, work.head_dim),) if interp else CALL_SHAPES
    backward = args.mode != "fwd"
    rows = []
    for batch, heads, seqlen, head_dim in args.progress(shapes, desc="attention calls"):
        qkv = torch.randn(batch, seqlen, 3, heads, head_dim, dtype=work.dtype, device=device,
                          requires_grad=backward)
        grad = torch.randn(batch, seqlen, heads, head_dim, dtype=work.dtype, device=device)
        calls = {name: (lambda attention=attention: torch.autograd.grad(attention(qkv), qkv, grad) if backward
                        else attention(qkv)) for name, attention in train_attentions().items()}
        samples = {name: [] for name in calls}
        host = {name: [] for name in calls}
        for _ in range(2 if interp else max(args.repeats, CALL_ROUNDS)):  # the sides alternate, as in train
            for name, call in calls.items():
                samples[name] += time_wall(call, calls=3 if interp else 100, repeats=1, host_samples=host[name]).samples
        timings = {name: Timing.from_samples(s) for name, s in samples.items()}
        for name, wall in timings.items():
            issue = Timing.from_samples(host[name])
            row = dict(section="calls", mode="fwd+bwd" if backward else "fwd", impl=name, batch=batch, heads=heads,
                       seqlen=seqlen, head_dim=head_dim, causal=True, dtype=str(work.dtype).replace("torch.", ""),
                       wall_us=wall.median_ms * 1e3, wall_us_ci=[wall.lo_ms * 1e3, wall.hi_ms * 1e3],
                       host_us=issue.median_ms * 1e3, host_us_ci=[issue.lo_ms * 1e3, issue.hi_ms * 1e3],
                       ours_speedup=None)
            if name != "sdpa_default":
                speed, lo, hi = paired_speedup_interval(samples[name], samples["sdpa_default"])
                row.update(ours_speedup=speed, ours_speedup_ci=[lo, hi])
                # host time over SDPA's (below 1: ours issues a call in less host time)
                ratio, lo, hi = paired_speedup_interval(host["sdpa_default"], host[name])
                row.update(host_vs_sdpa=ratio, host_vs_sdpa_ci=[lo, hi])
            rows.append(row)
        args.checkpoint(rows)
    return rows


WORKLOAD_SECTIONS = {"varlen": _varlen, "window": _window, "calls": _calls}
