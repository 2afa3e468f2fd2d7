"""Generate the benchmark tables of the README and docs/benchmarks.md from committed results files.

Every table sits between `<!-- results:NAME -->` and `<!-- /results:NAME -->`, where NAME is a
results file's stem in benchmarks/results (attention_fwd, moe, ...), or `headline`: the README's
short table of figures picked from several files (`render_headline`). The tables are never typed
by hand: `flashmoe-science report` rewrites them, and a test checks the documents match the files.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from . import model as model_bench

_MARKER = re.compile(r"(<!-- results:(?P<name>[\w+-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)", re.S)
_IMPL_NAMES = {"sdpa_flash": "SDPA FA2", "sdpa_cudnn": "SDPA cuDNN", "sdpa_efficient": "SDPA efficient",
               "flex": "Flex (compiled)", "ours": "ours", "sdpa_default": "SDPA default", "sdpa_math": "SDPA math",
               "sdpa_padded": "SDPA padded + mask", "flex_document": "Flex document mask",
               "naive": "per-expert loop", "grouped_mm": "grouped-mm", "gmm": "grouped-mm", "sonic": "SonicMoE",
               "scaled_gmm": "scaled grouped-mm"}
# The train section's sides: how each calls attention from the block's QKV projection.
_TRAIN_NAMES = {"ours_packed": "ours, `flash_attention_qkvpacked` on the projection",
                "ours": "ours, `flash_attention_science` on q, k, v views", "sdpa_default": "SDPA default"}


def _source_line(name: str, meta: dict) -> str:
    gpu = meta.get("gpu") or "CPU (Triton interpreter)"
    cap = f" (sm{meta['capability'].replace('.', '')})" if meta.get("capability") else ""
    return (f"_{gpu}{cap}, torch {meta.get('torch')}, triton {meta.get('triton')}, cuDNN {meta.get('cudnn')}, "
            f"{str(meta.get('date', ''))[:10]}; file `benchmarks/results/{name}.json`, "
            f"command `flashmoe-science {meta.get('command', '')}`._\n")


def _fmt(x, digits=0):
    return "" if x is None else f"{x:.{digits}f}"


def _ratio_ci(r, key="ours_speedup", digits=2):
    if r.get(key) is None:
        return ""
    lo, hi = r.get(key + "_ci") or (None, None)
    return f"{r[key]:.{digits}f}" + (f" [{lo:.{digits}f}, {hi:.{digits}f}]" if lo is not None else "")


def _attention_small(rows) -> str:
    out = ["| B, H, S, D | dtype | causal | ours µs/call | SDPA µs/call | speedup [95% CI] | ours GPU µs | "
           "SDPA GPU µs | rel. error ours / SDPA |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['batch']}, {r['heads']}, {r['seqlen']}, {r['head_dim']} | {r['dtype']} | "
                   f"{'yes' if r['causal'] else 'no'} | {r['ours_wall_us']:.1f} | {r['sdpa_wall_us']:.1f} | "
                   f"{_ratio_ci(r, 'speedup_wall')} | {r['ours_gpu_us']:.1f} | {r['sdpa_gpu_us']:.1f} | "
                   f"{r['ours_rel_err']:.1e} / {r['sdpa_rel_err']:.1e} |")
    return "\n".join(out) + "\n"


def _head_dims_order(head_dim) -> tuple:
    """A row's head_dim (D, or "D/D_v" where v's differs) as a sortable (D, D_v)."""
    d, _, dv = str(head_dim).partition("/")
    return int(d), int(dv or d)


def _attention_throughput(rows, ceiling=None) -> str:
    """TFLOP/s of every implementation by (D, S, causal), ours' time ratios to the PyTorch
    backends, and (given the run's bf16 matmul `ceiling`) ours and cuDNN as a share of it."""
    impls = list(dict.fromkeys(r["impl"] for r in rows if r.get("impl")))
    others = [i for i in impls if i != "ours"]
    shares = [i for i in ("ours", "sdpa_cudnn") if i in impls] if ceiling else []
    grid: dict = {}
    for r in rows:
        grid.setdefault((r["head_dim"], r["seqlen"], r["causal"]), {})[r["impl"]] = r
    head = ["D", "S", "causal"] + [_IMPL_NAMES.get(i, i) for i in impls] + \
        [f"ours / {_IMPL_NAMES.get(i, i)}" for i in others if i in ("sdpa_flash", "sdpa_cudnn", "flex")] + \
        [f"{_IMPL_NAMES[i]} / matmul" for i in shares]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (d, s, causal), by in sorted(grid.items(), key=lambda item: (_head_dims_order(item[0][0]), *item[0][1:])):
        cells = [str(d), str(s), "yes" if causal else "no"]
        cells += [_fmt(by.get(i, {}).get("tflops")) for i in impls]
        cells += [_ratio_ci(by[i]) if i in by else "" for i in others if i in ("sdpa_flash", "sdpa_cudnn", "flex")]
        cells += [f"{by[i]['tflops'] / ceiling:.0%}" if by.get(i, {}).get("tflops") else "" for i in shares]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _attention_extra(rows) -> str:
    out = []
    for r in rows:
        if r["section"] == "overhead":
            lo, hi = r["wall_us_ci"]
            out.append(f"- host time per call, {r['what']}: {r['wall_us']:.1f} µs [{lo:.1f}, {hi:.1f}]")
        elif r["section"] == "memory":
            out.append(f"- peak extra memory, forward+backward, B={r['batch']} H={r['heads']} S={r['seqlen']} "
                       f"D={r['head_dim']} causal: {_IMPL_NAMES.get(r['impl'], r['impl'])} {r['peak_extra_mib']:.0f} MiB")
        elif r["section"] == "train":
            speed = ""
            if r.get("ours_speedup"):  # a ratio near 1: three decimals, and how it was taken
                ratio = _ratio_ci(r, digits=3)
                # Files before the packed side carried ours' speed-up on SDPA's row.
                speed = f", ours {ratio}x faster" if r["impl"] == "sdpa_default" else f", {ratio}x SDPA default's speed"
                if r.get("rounds"):
                    speed += f" (median of {r['rounds']} interleaved rounds' ratios)"
            out.append(f"- transformer block forward+backward (B={r['batch']}, S={r['seqlen']}, dim={r['dim']}, "
                       f"{r['heads']} heads, causal, bf16): {_TRAIN_NAMES.get(r['impl'], r['impl'])} "
                       f"{r['ms']:.3f} ms{speed}")
    return "\n".join(out) + ("\n" if out else "")


def _versus(ours: float, theirs: float, digits: int, note: str = "") -> str:
    """"ours / theirs (theirs over ours x[, note])": two times and how much faster ours is."""
    return f"{ours:.{digits}f} / {theirs:.{digits}f} ({theirs / ours:.2f}x{note})"


def _graph_cell(ours, sdpa) -> str:
    if not ours or "graph_us" not in ours or not sdpa or "graph_us" not in sdpa:
        return ""
    graph_backend = sdpa.get("graph_backend", sdpa.get("backend"))
    return _versus(ours["graph_us"], sdpa["graph_us"], 1,
                   f", {graph_backend}" if graph_backend != sdpa.get("backend") else "")


def _attention_decode(rows) -> str:
    out = ["| B | Sk | Hq / Hkv / D | ours | paged 16 | paged 256 | SDPA best | floor | copy share | "
           "SDPA / ours | CUDA graph: ours / SDPA µs | CUDA graph: paged 16 / 256 time over contiguous | "
           "FP8 cache µs (time / bf16 cache's) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    cases: dict = {}
    for r in rows:
        cases.setdefault((r["heads_q"], r["heads_kv"], r["head_dim"], r["batch"], r["seqlen"]), {})[r["impl"]] = r
    for (hq, hkv, d, b, s), impls in sorted(cases.items()):
        ours, sdpa = impls.get("ours"), impls.get("sdpa_best")
        cell = [_fmt(impls[i]["us"], 1) if i in impls else "" for i in ("ours", "ours_paged16", "ours_paged256")]
        out.append(f"| {b} | {s} | {hq} / {hkv} / {d} | " + " | ".join(cell) + " | "
                   f"{_fmt(sdpa['us'], 1) + ' (' + sdpa['backend'] + ')' if sdpa else ''} | "
                   f"{_fmt(ours['floor_us'], 1) if ours else ''} | "
                   f"{_fmt(ours['floor_us'] / ours['us'], 2) if ours else ''} | "
                   f"{_ratio_ci(ours, 'speedup_vs_sdpa') if ours else ''} | "
                   f"{_graph_cell(ours, sdpa)} | {_paged_graph_cell(impls)} | "
                   f"{_fp8_cache_cell(impls.get('ours_fp8_cache'))} |")
    return "\n".join(out) + "\n"


def _paged_graph_cell(impls) -> str:
    ratios = [impls.get(i, {}).get("graph_vs_contiguous") for i in ("ours_paged16", "ours_paged256")]
    return " / ".join(_fmt(r, 2) for r in ratios) if all(r is not None for r in ratios) else ""


def _fp8_cache_cell(r) -> str:
    if not r or r.get("us") is None:
        return ""
    return f"{r['us']:.1f} ({_ratio_ci(r, 'time_vs_bf16_cache')})"


def render_attention(name: str, result: dict) -> str:
    rows, meta = result["rows"], result["meta"]
    parts = [_source_line(name, meta)]
    small = [r for r in rows if r.get("section") == "small"]
    if small:
        parts.append("\nSmall calls: wall-clock per call of back-to-back "
                     "calls (host and GPU, what a user feels) and GPU time from CUDA events, ours against "
                     "SDPA's default dispatch; error relative to float64.\n\n" + _attention_small(small))
    tput = [r for r in rows if r.get("section") == "throughput" and r.get("tflops")]
    if tput:
        ceiling = meta.get("matmul_tflops")
        share = (f"; / matmul: the share of the bf16 matmul ceiling measured in the same run, {ceiling:.0f} TFLOP/s"
                 if ceiling else "")
        parts.append(f"\nThroughput, TFLOP/s ({meta.get('mode')}; 16k tokens per batch, Hq·D = 2048, bf16; "
                     f"ratios are time ratios with 95% intervals{share}):\n\n" + _attention_throughput(tput, ceiling))
    extra = _attention_extra([r for r in rows if r.get("section") in ("overhead", "memory", "train")])
    if extra:
        parts.append("\n" + extra)
    varlen = [r for r in rows if r.get("section") == "varlen" and r.get("ms") is not None]
    if varlen:
        first, (shortest, longest) = varlen[0], meta["workload"]["lengths"]
        parts.append(f"\nVariable-length batch ({meta.get('mode')}): {first['sequences']} sequences of "
                     f"{first['tokens']} tokens in all (lengths uniform in {shortest}..{longest}, longest drawn "
                     f"{first['max_seqlen']}; "
                     f"{first['padded_tokens']} when padded), Hq = {first['heads']}, D = {first['head_dim']}, "
                     f"{first['dtype']}; TFLOP/s count the real pairs only; error on the longest sequence:\n\n"
                     + _attention_workload(varlen, ("causal",)))
    window = [r for r in rows if r.get("section") == "window" and r.get("ms") is not None]
    if window:
        first = window[0]
        parts.append(f"\nCausal sliding window ({meta.get('mode')}), S = {first['seqlen']}, Hq = {first['heads']}, "
                     f"D = {first['head_dim']}, {first['dtype']}; TFLOP/s count the pairs inside the window:\n\n"
                     + _attention_workload(window, ("window",)))
    decode = [r for r in rows if r.get("section") == "decode" and r.get("us") is not None]
    if decode:
        parts.append("\nOne new token against a KV cache of Sk tokens per sequence: GPU time in µs of ours "
                     "(contiguous, and paged in pages of 16 and 256 tokens) and of SDPA's fastest backend, the "
                     "copy floor (K and V bytes over the copy bandwidth measured in the run), and ours' share of "
                     "it; where 32 layers' caches fit 8 GiB, the time per layer of a CUDA graph of 32 calls, each "
                     "against its own layer's cache, as serving frameworks replay a decode step (SDPA: its fastest "
                     "backend in the graph, named where it is not the eager one).\n\n" + _attention_decode(decode))
    calls = [r for r in rows if r.get("section") == "calls"]
    if calls:
        what = "forward" if calls[0]["mode"] == "fwd" else "forward and backward through autograd"
        parts.append(f"\nAttention calls ({calls[0]['mode']}, causal, {calls[0]['dtype']}) from a QKV projection's "
                     f"output (B, S, 3, H, D), {what}, back to back: wall-clock per call (host and GPU, what a "
                     "user feels) and SDPA's over ours with 95% intervals; where measured, the host's time to "
                     "issue a call (until it returns, before the GPU is waited for) and ours over SDPA's:\n\n"
                     + _attention_calls(calls))
    return "".join(parts)


def _attention_calls(rows) -> str:
    """One line per shape of the calls section: each side's wall-clock per call."""
    grid: dict = {}
    for r in rows:
        grid.setdefault((r["batch"], r["heads"], r["seqlen"], r["head_dim"]), {})[r["impl"]] = r
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    ours = [i for i in impls if i != "sdpa_default"]
    names = {"ours_packed": "ours packed", "ours": "ours on views", "sdpa_default": "SDPA"}
    host = any("host_us" in r for r in rows)  # the host's share, where the run measured it
    head = (["B, H, S, D"] + [f"{names.get(i, i)} µs/call" for i in impls]
            + [f"{names.get(i, i)} / SDPA" for i in ours]
            + ([f"host µs/call: {' / '.join(names.get(i, i) for i in impls)}"]
               + [f"{names.get(i, i)} host time / SDPA's" for i in ours] if host else []))
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape, by in grid.items():
        cells = [", ".join(map(str, shape))]
        cells += [f"{by[i]['wall_us']:.0f}" if i in by else "" for i in impls]
        cells += [_ratio_ci(by[i]) if i in by else "" for i in ours]
        if host:
            cells.append(" / ".join(_fmt(by.get(i, {}).get("host_us")) for i in impls))
            cells += [_ratio_ci(by[i], "host_vs_sdpa") if i in by else "" for i in ours]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _attention_workload(rows, keys) -> str:
    """One line per (problem, implementation) of the varlen and window sections."""
    head = [*keys, "impl", "ms", "TFLOP/s", "ours faster by [95% CI]", "faster than full causal [95% CI]",
            "rel. error"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = ["full" if r[k] is None else str(r[k]) for k in keys]
        cells += [_IMPL_NAMES.get(r["impl"], r["impl"]), f"{r['ms']:.3f}", _fmt(r["tflops"]), _ratio_ci(r),
                  _ratio_ci(r, "speedup_vs_full"), f"{r['rel_err']:.1e}" if isinstance(r.get("rel_err"), float) else ""]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def render_moe(name: str, result: dict) -> str:
    """One line per (shape, T): ours against the grouped-mm path and the per-expert loop."""
    rows, meta = result["rows"], result["meta"]
    grid: dict = {}
    for r in rows:
        if r.get("ms") is not None:
            grid.setdefault((r["shape"], r["E"], r["top_k"], r["H"], r["I"], r["T"]), {})[r["impl"]] = r
    flops_name = "TFLOP/s (18·T·k·H·I)" if "bwd" in name else "TFLOP/s (6·T·k·H·I)"
    out = [_source_line(name, meta).rstrip("\n"), ""]
    if meta.get("copy_tbps"):
        out += [f"Copy bandwidth measured in the same run: {meta['copy_tbps']:.2f} TB/s. Decode rows "
                "(T <= 64) also give the bytes of the experts they touch over the time, as a fraction of "
                "that bandwidth.", ""]
    if "bwd" in name:
        out += ["Forward and backward (gradients for hidden_states, w1, w2 and the router logits) under "
                "autograd; the error is the largest relative error of the gradients against float64.", ""]
    graphs = any("graph_ms" in r for r in rows)
    if graphs:
        out += ["Small calls are also timed as a CUDA graph replay (graph ms: GPU time without the host's "
                "launch work, which single eager calls of a few tens of microseconds mostly measure).", ""]
    sonic = any(r["impl"] == "sonic" for r in rows)
    if sonic:
        out += [f"SonicMoE: {meta.get('sonic')}, on the same router logits and weights; its {flops_name} "
                "in its column.", ""]
    out += [
           f"| model (E, k, H, I) | T | ours ms | grouped-mm ms | per-expert loop ms | ours {flops_name} | "
           "ours / grouped-mm [95% CI] | "
           + (f"SonicMoE ms | SonicMoE {flops_name.split(' ')[0]} | ours / SonicMoE [95% CI] | " if sonic else "")
           + ("graph ms ours / grouped-mm" + (" / SonicMoE" if sonic else "") + " | " if graphs else "")
           + "weight bandwidth | path | rel. error ours / PyTorch |",
           "|---|---|---|---|---|---|---|" + ("---|---|---|" if sonic else "") + ("---|" if graphs else "")
           + "---|---|---|"]
    for (shape, e, k, h, i, t), by in grid.items():
        ours = by.get("ours", {})
        speed = ""
        if ours.get("speedup_vs_gmm") is not None:
            speed = f"{ours['speedup_vs_gmm']:.2f} [{ours['speedup_lo']:.2f}, {ours['speedup_hi']:.2f}]"
        frac = ours.get("weight_fraction_of_copy")
        bandwidth = f"{ours['weight_tbps']:.2f} TB/s ({100 * frac:.0f}%)" if frac is not None else ""
        err = (f"{ours['rel_error']:.1e} / {ours['torch_rel_error']:.1e}"
               if ours.get("rel_error") is not None else "")
        graph = ""
        if graphs:
            graph_ms = ours.get("graph_ms"), by.get("gmm", {}).get("graph_ms")
            graph = _versus(*graph_ms, 3) if None not in graph_ms else _fmt(graph_ms[0], 3)
            sonic_ms = by.get("sonic", {}).get("graph_ms")
            if sonic_ms is not None and graph_ms[0] is not None:
                graph += f" / {sonic_ms:.3f} ({sonic_ms / graph_ms[0]:.2f}x)"
            graph += " | "
        versus_sonic = ""
        if sonic:
            theirs = by.get("sonic", {})
            ratio = (f"{ours['speedup_vs_sonic']:.2f} [{ours['speedup_sonic_lo']:.2f}, {ours['speedup_sonic_hi']:.2f}]"
                     if ours.get("speedup_vs_sonic") is not None else "")
            versus_sonic = f"{_fmt(theirs.get('ms'), 3)} | {_fmt(theirs.get('tflops'))} | {ratio} | "
        out.append(f"| {shape} ({e}, {k}, {h}, {i}) | {t} | {_fmt(ours.get('ms'), 3)} | "
                   f"{_fmt(by.get('gmm', {}).get('ms'), 3)} | {_fmt(by.get('naive', {}).get('ms'), 3)} | "
                   f"{_fmt(ours.get('tflops'))} | {speed} | {versus_sonic}{graph}{bandwidth} | "
                   f"{ours.get('path', '')} | {err} |")
    memory = [(key, by) for key, by in grid.items() if any("peak_extra_mib" in r for r in by.values())]
    if memory:
        impls = [i for i in ("ours", "gmm", "sonic", "naive") if any(i in by for _, by in memory)]
        out += ["", "Peak memory of one forward+backward beyond its inputs (activations, saved tensors, gradients), "
                "MiB:", "", "| model | T | " + " | ".join(_IMPL_NAMES[i] for i in impls) + " |",
                "|---|---|" + "---|" * len(impls)]
        for (shape, *_, t), by in memory:
            out.append(f"| {shape} | {t} | " + " | ".join(_fmt(by.get(i, {}).get("peak_extra_mib")) for i in impls)
                       + " |")
    return "\n".join(out) + "\n"


def render_moe_fp8(name: str, result: dict) -> str:
    """FP8 experts against our bf16 path on the same weights (and grouped-mm): times (and, at the
    sizes the benchmark also replays as a CUDA graph, the graph's, without the host's launch
    cost, as a server runs decode), the FP8 weight bandwidth at decode sizes (from the graph's
    time where there is one), and each one's error against the float64 layer of the unquantised
    weights."""
    rows, meta = result["rows"], result["meta"]
    grid: dict = {}
    for r in rows:
        grid.setdefault((r["shape"], r["E"], r["top_k"], r["H"], r["I"], r["T"]), {})[r["impl"]] = r
    scaled = meta.get("scaled_gmm", "not run in this file")
    out = [_source_line(name, meta).rstrip("\n"), "",
           f"Copy bandwidth measured in the same run: {meta.get('copy_tbps', float('nan')):.2f} TB/s. "
           f"Scaled grouped-mm: {scaled}.", "",
           "| model (E, k, H, I) | T | bf16 ms | FP8 ms | FP8 / bf16 time | CUDA graph: bf16 / FP8 µs (FP8 / bf16) | "
           "FP8 TFLOP/s | FP8 weight bandwidth | grouped-mm ms | scaled grouped-mm (FP8) ms | rel. error FP8 / bf16 |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    copy_tbps = meta.get("copy_tbps")
    for (shape, e, k, h, i, t), by in grid.items():
        ours, fp8 = by.get("ours", {}), by.get("fp8", {})
        if not fp8:
            continue
        bandwidth = ""
        if fp8.get("weight_tbps_graph") is not None and copy_tbps:
            bandwidth = f"{fp8['weight_tbps_graph']:.2f} TB/s ({100 * fp8['weight_tbps_graph'] / copy_tbps:.0f}%, graph)"
        elif fp8.get("weight_fraction_of_copy") is not None:
            bandwidth = f"{fp8['weight_tbps']:.2f} TB/s ({100 * fp8['weight_fraction_of_copy']:.0f}%)"
        ratio = f"{fp8['ms'] / ours['ms']:.2f}" if ours.get("ms") else ""
        graph = ""
        if fp8.get("graph_ms") and ours.get("graph_ms"):
            graph = (f"{1e3 * ours['graph_ms']:.1f} / {1e3 * fp8['graph_ms']:.1f} "
                     f"({fp8['graph_ms'] / ours['graph_ms']:.2f})")
        out.append(f"| {shape} ({e}, {k}, {h}, {i}) | {t} | {_fmt(ours.get('ms'), 3)} | {fp8['ms']:.3f} | {ratio} | "
                   f"{graph} | {_fmt(fp8.get('tflops'))} | {bandwidth} | {_fmt(by.get('gmm', {}).get('ms'), 3)} | "
                   f"{_fmt(by.get('scaled_gmm', {}).get('ms'), 3)} | "
                   f"{fp8['rel_error']:.1e} / " + (f"{ours['rel_error']:.1e}" if ours.get("rel_error") else "") + " |")
    return "\n".join(out) + "\n"


def render_attention_fp8(name: str, result: dict) -> str:
    """The FP8 forward against our bf16 forward and SDPA's cuDNN backend (bf16) in the same run,
    and each side's error on FlashAttention-3's outlier distribution next to the paper's figures."""
    rows, meta = result["rows"], result["meta"]
    out = [_source_line(name, meta).rstrip("\n"), ""]
    accuracy = [r for r in rows if r.get("section") == "accuracy"]
    if accuracy:
        r0 = accuracy[0]
        out += [f"Error on N(0, 1) entries plus 0.1% drawn from N(0, 10), (B, S, H, D) = ({r0['batch']}, "
                f"{r0['seqlen']}, {r0['heads']}, {r0['head_dim']}), non-causal, against float64 of the "
                "unquantised inputs:", "", "| implementation | RMSE | rel. error |", "|---|---|---|"]
        names = {"ours_bf16": "ours, bf16", "ours_fp8": "ours, FP8 (scales per batch and KV head)",
                 "ours_fp8_rotated": "ours, FP8 after `hadamard_rotate`", "ours_fp8_per_tensor": "ours, FP8, one scale a tensor"}
        out += [f"| {names.get(r['impl'], r['impl'])} | {r['rmse']:.2e} | {r['rel_err']:.2e} |" for r in accuracy]
        published = meta.get("fa3_published_rmse") or {}
        if published:
            out += ["", "FlashAttention-3's published RMSE on this distribution (Shah et al. 2024, not measured here): "
                    + ", ".join(f"{k.replace('_', ' ')} {v:.1e}" for k, v in published.items()) + "."]
        out.append("")
    grid: dict = {}
    for r in rows:
        if r.get("section") == "throughput":
            grid.setdefault((r["head_dim"], r["seqlen"], r["causal"]), {})[r["impl"]] = r
    if grid:
        out += ["| D | S | causal | FP8 TFLOP/s | ours bf16 | SDPA cuDNN (bf16) | FP8 / ours bf16 [95% CI] | "
                "FP8 / SDPA cuDNN | rel. error FP8 / bf16 |", "|---|---|---|---|---|---|---|---|---|"]
        for (d, seqlen, causal), by in sorted(grid.items()):
            fp8, bf16, cudnn = by.get("ours_fp8", {}), by.get("ours_bf16", {}), by.get("sdpa_cudnn", {})
            out.append(f"| {d} | {seqlen} | {causal} | {_fmt(fp8.get('tflops'))} | {_fmt(bf16.get('tflops'))} | "
                       f"{_fmt(cudnn.get('tflops'))} | {_ratio_ci(fp8, 'speedup_vs_ours_bf16')} | "
                       f"{_ratio_ci(fp8, 'speedup_vs_sdpa_cudnn')} | {_fmt(fp8.get('rel_err'), 3)} / "
                       f"{_fmt(bf16.get('rel_err'), 4)} |")
    return "\n".join(out) + "\n"


def render_generic(name: str, result: dict) -> str:
    """A table of every column, for results files without a dedicated renderer."""
    rows = result["rows"]
    cols = [c for c in dict.fromkeys(k for r in rows for k in r) if not c.endswith("_ci")]
    out = [_source_line(name, result["meta"]), "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |")
    return "\n".join(out) + "\n"


def _cell(v):
    if isinstance(v, float):
        return f"{v:.3g}"
    return "" if v is None else str(v)


def _model_ratio(ours, theirs, key, higher_is_better=True):
    if ours.get(key) is None or theirs.get(key) is None:
        return ""
    ratio = ours[key] / theirs[key] if higher_is_better else theirs[key] / ours[key]
    return f" ({ratio:.2f}x)"


def render_model(name: str, result: dict) -> str:
    """transformers models end to end: per model, each implementation's training step, prefill and
    decode (each with its ratio to the model's baseline, `bench.model.BASELINES`), then where each training
    step's GPU time goes by kernel kind (bench model --profile)."""
    rows = result["rows"]
    meta = result["meta"]
    out = [_source_line(name, meta).rstrip("\n") + f" _transformers {meta.get('transformers')}._", "",
           "| model (layers, batch x tokens) | implementation | training step, tokens/s | prefill, ms | "
           "decode batch 1, tokens/s | decode batch 32, tokens/s |", "|---|---|---|---|---|---|"]
    for r in rows:
        shape = f"{r['model']} ({r['layers']}, {r['batch']} x {r['seqlen']})"
        impl = f"{r['attn_implementation']} + {r['experts_implementation']}"
        if "error" in r:
            out.append(f"| {shape} | {impl} | {r['error'].split(':')[0]} | | | |")
            continue
        theirs = _other_than(r, model_bench.baseline(rows, r["model"])[1])
        cells = [f"{_fmt(r.get(key), digits)}{_model_ratio(r, theirs, key, higher) if theirs else ''}"
                 for key, digits, higher in (("train_tokens_per_s", 0, True), ("prefill_ms", 1, False),
                                             ("decode_b1_tokens_per_s", 0, True),
                                             ("decode_b32_tokens_per_s", 0, True))]
        out.append(f"| {shape} | {impl} | " + " | ".join(cells) + " |")
    profiled = [r for r in rows if "train_profile" in r]
    if profiled:
        kinds = list(profiled[0]["train_profile"]["ms_by_kind"])
        out += ["", "GPU time of one training step by kernel kind, ms (torch.profiler; \"experts\" is our MoE "
                "kernels or torch._grouped_mm's GEMMs; the routing, sorting and weighting around grouped_mm are "
                "elementwise kernels, under \"other\"):", "",
                "| model | implementation | " + " | ".join(kinds) + " | total |", "|---|---|" + "---|" * (len(kinds) + 1)]
        for r in profiled:
            p = r["train_profile"]
            out.append(f"| {r['model']} | {r['attn_implementation']} + {r['experts_implementation']} | "
                       + " | ".join(f"{p['ms_by_kind'][k]:.1f}" for k in kinds) + f" | {p['total_ms']:.1f} |")
    return "\n".join(out) + "\n"


def _other_than(row: dict, baseline: dict | None) -> dict | None:
    """The row a model-table row's ratio is taken against: its model's baseline, unless it is it."""
    return None if baseline is row else baseline


def _ours_and_baseline(result: dict):
    """(model, our row, the baseline's name, its row) of each model a `bench model` results file
    has both of (`bench.model.BASELINES`: sdpa + grouped_mm, or eager + grouped_mm)."""
    for ours in result["rows"]:
        if ours["impl"] == "ours" and "error" not in ours:
            base_name, theirs = model_bench.baseline(result["rows"], ours["model"])
            if theirs is not None:
                yield ours["model"], ours, base_name, theirs


def _decode_headline(label: str, model: str, ours: dict, base_name: str, theirs: dict, name: str) -> list:
    """The headline row of `generate` tokens/s at the batches both sides measured (none: no row)."""
    keys = [k for k in ("decode_b1_tokens_per_s", "decode_b32_tokens_per_s") if k in ours and k in theirs]
    if not keys:
        return []
    batches = " / ".join(k.split("_")[1][1:] for k in keys)
    return [f"| {label} | {model}, batch {batches} | " + " / ".join(f"{ours[k]:.0f}" for k in keys) + " tokens/s | "
            + " / ".join(f"{theirs[k]:.0f}" for k in keys) + f" ({base_name}) | "
            + " / ".join(f"{ours[k] / theirs[k]:.2f}x" for k in keys) + f" | `{name}.json` |"]


def render_model_static_decode(name: str, result: dict) -> str:
    """`generate` with a static cache, compiled into CUDA graphs by transformers: per model, each
    implementation's tokens/s at batch 1 and 32 (each with its ratio to the model's baseline)."""
    rows = result["rows"]
    out = [_source_line(name, result["meta"]).rstrip("\n") + f" _transformers {result['meta'].get('transformers')}._",
           "", "| model (layers) | implementation | decode batch 1, tokens/s | decode batch 32, tokens/s |",
           "|---|---|---|---|"]
    for r in rows:
        shape, impl = f"{r['model']} ({r['layers']})", f"{r['attn_implementation']} + {r['experts_implementation']}"
        if "error" in r:
            out.append(f"| {shape} | {impl} | {r['error'].split(':')[0]} | |")
            continue
        theirs = _other_than(r, model_bench.baseline(rows, r["model"])[1])
        out.append(f"| {shape} | {impl} | " + " | ".join(
            f"{_fmt(r.get(key), 0)}{_model_ratio(r, theirs, key) if theirs else ''}"
            for key in ("decode_b1_tokens_per_s", "decode_b32_tokens_per_s")) + " |")
    return "\n".join(out) + "\n"


_EP_NAMES = {"ours": "ours", "ours_chunked": "ours, pipelined in chunks", "ours_capacity": "ours, fixed capacity",
             "reference": "all_to_all + grouped_mm"}


def render_ep(name: str, result: dict) -> str:
    """Expert parallelism: per shape, mode and tokens per rank, each implementation's tokens/s per
    GPU at every EP size (with the ratio to the reference at the same size) and its weak-scaling
    efficiency at the largest, then the overlap profile of the forwards."""
    rows, meta = result["rows"], result["meta"]
    sizes = sorted({r["ep"] for r in rows})
    out = [_source_line(name, meta).rstrip("\n") + f" _{meta.get('world')} GPUs, {meta.get('backend')}._", "",
           "| shape | mode | tokens per rank | implementation | " + " | ".join(f"EP {e}, tokens/s per GPU" for e in sizes)
           + f" | weak scaling EP 1 to {sizes[-1]} |", "|---|---|---|---|" + "---|" * (len(sizes) + 1)]
    cases = dict.fromkeys((r["shape"], r["mode"], r["tokens_per_rank"]) for r in rows)
    for shape, mode, tokens in cases:
        for impl in dict.fromkeys(r["impl"] for r in rows):
            by_ep = {r["ep"]: r for r in rows if (r["shape"], r["mode"], r["tokens_per_rank"], r["impl"])
                     == (shape, mode, tokens, impl)}
            if not by_ep:
                continue
            cells = []
            for e in sizes:
                r = by_ep.get(e)
                ratio = f" ({r['speedup_vs_reference']:.2f}x)" if r and r.get("speedup_vs_reference") else ""
                cells.append(f"{r['tokens_per_s_per_gpu'] / 1e3:.0f}k{ratio}" if r else "")
            last = by_ep.get(sizes[-1], {})
            out.append(f"| {shape} | {mode} | {tokens} | {_EP_NAMES.get(impl, impl)} | " + " | ".join(cells)
                       + f" | {_fmt(last.get('weak_scaling'), 2)} |")
    if meta.get("overlap"):
        out += ["", "One forward profiled on rank 0 (torch.profiler): GPU time in NCCL kernels, in the other "
                "kernels, and with both running at once, ms:", "",
                "| shape | tokens per rank | EP | implementation | NCCL | compute | both at once |",
                "|---|---|---|---|---|---|---|"]
        for o in meta["overlap"]:
            out.append(f"| {o['shape']} | {o['tokens_per_rank']} | {o['ep']} | {_EP_NAMES.get(o['impl'], o['impl'])} | "
                       f"{o['nccl_ms']:.2f} | {o['compute_ms']:.2f} | {o['overlapped_ms']:.2f} |")
    return "\n".join(out) + "\n"


def render(name: str, result: dict) -> str:
    if name.startswith("ep"):
        return render_ep(name, result)
    if name == "attention_fp8":
        return render_attention_fp8(name, result)
    if name.startswith("attention_"):
        return render_attention(name, result)
    if name == "model":
        return render_model(name, result)
    if name == "model_static_decode":
        return render_model_static_decode(name, result)
    if name == "moe_fp8":
        return render_moe_fp8(name, result)
    if name in ("moe", "moe_fwd_bwd", "moe_fwd_peers"):
        return render_moe(name, result)
    if name == "moe_train":
        return render_moe_train(name, result)
    return render_generic(name, result)


def render_moe_train(name: str, result: dict) -> str:
    """The training check: both loss curves at every logged step, and the step times."""
    meta = result["meta"]
    curves: dict = {}
    for r in result["rows"]:
        curves.setdefault(r["step"], {})[r["impl"]] = r["loss"]
    m = meta["model"]
    model = (f"a {m['depth']}-block model (dim {m['dim']}, {m['heads']} heads, {m['kv_heads']} KV heads, "
             f"{m['experts']} experts of width {m['expert_dim']}, top-{m['top_k']}; batch {m['batch']} x "
             f"{m['seqlen']} tokens)")
    out = [_source_line(name, meta).rstrip("\n"), "",
           f"{meta['steps']} steps of {model} on the {meta['task']} ({meta['precision']}, {meta['optimizer']}), "
           f"from the same initial weights: ours {meta['ours_step_ms']:.1f} ms per step, plain PyTorch "
           f"(SDPA and a per-expert loop) {meta['torch_step_ms']:.1f} ms: **{meta['speedup']:.2f}x**. Final loss "
           f"{meta['final_loss_ours']:.3f} against {meta['final_loss_torch']:.3f}; largest gap between the curves "
           f"{100 * meta['max_loss_gap']:.1f}% (tolerance {100 * meta['loss_tolerance']:.0f}%).", "",
           "| step | loss, ours | loss, plain PyTorch |", "|---|---|---|"]
    steps = sorted(curves)
    shown = list(dict.fromkeys(steps[::max(1, len(steps) // 10)] + steps[-1:]))
    for step in shown:
        out.append(f"| {step} | {curves[step].get('ours', float('nan')):.4f} | "
                   f"{curves[step].get('torch', float('nan')):.4f} |")
    return "\n".join(out) + "\n"


# The README's headline cases: attention (head dim, causal, S), FP8 attention's, and MoE (shape, T).
_HEADLINE_ATTENTION = ((128, True, 4096), (128, True, 16384))
_HEADLINE_FP8_ATTENTION = ((128, False, 16384), (256, False, 16384))
_HEADLINE_MOE = (("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 16384), ("mixtral-8x7b", 16384))
_HEADLINE_MOE_FP8 = (("qwen3-30b-a3b", 16384),)
# KV-cache decode: Qwen3-30B-A3B's attention (Hq 32, Hkv 4, D 128) against 4096 cached tokens at batch
# 1 and 32 (`bench.attention_decode.MODEL_CASES`), per layer of a 32-layer CUDA graph.
_HEADLINE_DECODE = ((32, 4, 128, 4096), (1, 32))
# transformers models end to end: training step and prefill; decoding with a static cache under CUDA
# graphs (eager `generate`, bound by the host, and the other models: docs/benchmarks.md).
_HEADLINE_MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b")


def _load(results_dir, name):
    path = Path(results_dir) / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def render_headline(results_dir) -> str:
    """One short table: attention forward and backward (bf16, D = 128, causal) against the fastest
    PyTorch backend in the same run, the MoE layer forward and forward+backward against
    torch._grouped_mm, transformers models' training step and prefill against transformers'
    sdpa + grouped_mm, and the expert-parallel layer against torchtitan's dispatcher, each row
    naming its results file."""
    out = ["| what | shape | ours | PyTorch's best in the same run | ours / theirs | file |",
           "|---|---|---|---|---|---|"]
    gpus = []
    for name, label in (("attention_fwd", "attention forward"), ("attention_bwd", "attention backward")):
        result = _load(results_dir, name)
        if result is None:
            continue
        gpus.append(result["meta"].get("gpu") or "CPU")
        for head_dim, causal, seqlen in _HEADLINE_ATTENTION:
            rows = [r for r in result["rows"] if r.get("section") == "throughput" and r.get("tflops")
                    and (r["head_dim"], r["causal"], r["seqlen"]) == (head_dim, causal, seqlen)]
            ours = next((r for r in rows if r["impl"] == "ours"), None)
            theirs = max((r for r in rows if r["impl"].startswith("sdpa")), key=lambda r: r["tflops"], default=None)
            if ours and theirs:
                out.append(f"| {label} | bf16 D={head_dim} S={seqlen}{' causal' if causal else ''} | "
                           f"{ours['tflops']:.0f} TFLOP/s | {theirs['tflops']:.0f} "
                           f"({_IMPL_NAMES.get(theirs['impl'])}) | "
                           f"{ours['tflops'] / theirs['tflops']:.2f}x | `{name}.json` |")
    result = _load(results_dir, "attention_fp8")
    if result is not None:
        gpus.append(result["meta"].get("gpu") or "CPU")
        for head_dim, causal, seqlen in _HEADLINE_FP8_ATTENTION:
            by = {r["impl"]: r for r in result["rows"] if r.get("section") == "throughput" and r.get("tflops")
                  and (r["head_dim"], r["causal"], r["seqlen"]) == (head_dim, causal, seqlen)}
            if "ours_fp8" in by and "sdpa_cudnn" in by:
                ours, theirs = by["ours_fp8"], by["sdpa_cudnn"]
                out.append(f"| attention forward, FP8 | D={head_dim} S={seqlen}{' causal' if causal else ''} | "
                           f"{ours['tflops']:.0f} TFLOP/s | {theirs['tflops']:.0f} (SDPA cuDNN, bf16; no FP8 in "
                           f"PyTorch) | {ours['tflops'] / theirs['tflops']:.2f}x | `attention_fp8.json` |")
    result = _load(results_dir, "attention_decode")
    if result is not None:
        (heads_q, heads_kv, head_dim, seqlen), batches = _HEADLINE_DECODE
        by = {(r["batch"], r["impl"]): r for r in result["rows"] if r.get("graph_us") is not None
              and (r["heads_q"], r["heads_kv"], r["head_dim"], r["seqlen"]) == (heads_q, heads_kv, head_dim, seqlen)}
        pairs = [(by[b, "ours"], by[b, "sdpa_best"]) for b in batches if (b, "ours") in by and (b, "sdpa_best") in by]
        if len(pairs) == len(batches):
            gpus.append(result["meta"].get("gpu") or "CPU")
            names = ", ".join(sorted({_IMPL_NAMES.get(t["graph_backend"], t["graph_backend"]) for _, t in pairs}))
            ours_us = " / ".join(_fmt(o["graph_us"], 1) for o, _ in pairs)
            theirs_us = " / ".join(_fmt(t["graph_us"], 1) for _, t in pairs)
            ratios = " / ".join(_fmt(t["graph_us"] / o["graph_us"], 2) + "x" for o, t in pairs)
            out.append(f"| attention decode, KV cache, CUDA graph | Hq {heads_q} / Hkv {heads_kv} / D {head_dim} "
                       f"(qwen3-30b-a3b), Sk {seqlen}, batch {' / '.join(map(str, batches))} | {ours_us} µs a layer | "
                       f"{theirs_us} ({names}) | {ratios} | `attention_decode.json` |")
    for name, label in (("moe", "MoE layer forward"), ("moe_fwd_bwd", "MoE layer forward+backward")):
        result = _load(results_dir, name)
        if result is None:
            continue
        gpus.append(result["meta"].get("gpu") or "CPU")
        for shape, tokens in _HEADLINE_MOE:
            rows = {r["impl"]: r for r in result["rows"] if r["shape"] == shape and r["T"] == tokens}
            if "ours" in rows and "gmm" in rows:
                # grouped_mm, and SonicMoE where the run had it; a decode-sized call: its GPU
                # time in a CUDA graph, where every side has one
                peers = [impl for impl in ("gmm", "sonic") if impl in rows]
                key = "graph_ms" if all("graph_ms" in rows[i] for i in ("ours", *peers)) else "ms"
                ours = rows["ours"][key]
                case = f"{shape} T={tokens}" + (", CUDA graph" if key == "graph_ms" else "")
                theirs = " / ".join(f"{rows[impl][key]:.3f} ms ({_IMPL_NAMES[impl]})" for impl in peers)
                ratios = " / ".join(f"{rows[impl][key] / ours:.2f}x" for impl in peers)
                out.append(f"| {label} | {case} | {ours:.3f} ms | {theirs} | {ratios} | `{name}.json` |")
    result = _load(results_dir, "moe_fp8")
    if result is not None:
        gpus.append(result["meta"].get("gpu") or "CPU")
        for shape, tokens in _HEADLINE_MOE_FP8:
            rows = {r["impl"]: r for r in result["rows"] if r["shape"] == shape and r["T"] == tokens}
            if {"fp8", "gmm", "scaled_gmm"} <= set(rows):
                ours = rows["fp8"]["ms"]
                peers = (("gmm", "bf16"), ("scaled_gmm", "FP8"))
                theirs = " / ".join(f"{rows[impl]['ms']:.3f} ms ({_IMPL_NAMES[impl]}, {kind})" for impl, kind in peers)
                ratios = " / ".join(f"{rows[impl]['ms'] / ours:.2f}x" for impl, _ in peers)
                out.append(f"| MoE layer forward, FP8 | {shape} T={tokens} | {ours:.3f} ms | {theirs} | {ratios} | "
                           f"`moe_fp8.json` |")
    result = _load(results_dir, "model")
    if result is not None:
        gpus.append(result["meta"].get("gpu") or "CPU")
        for model, ours, base_name, theirs in _ours_and_baseline(result):
            if model not in _HEADLINE_MODELS:
                continue
            shape = f"{model}, {ours['layers']} layers, {ours['batch']} x {ours['seqlen']} tokens"
            out.append(f"| transformers training step | {shape} | {ours['train_tokens_per_s']:.0f} tokens/s | "
                       f"{theirs['train_tokens_per_s']:.0f} ({base_name}) | "
                       f"{ours['train_tokens_per_s'] / theirs['train_tokens_per_s']:.2f}x | `model.json` |")
            out.append(f"| transformers prefill | {shape} | {ours['prefill_ms']:.1f} ms | "
                       f"{theirs['prefill_ms']:.1f} ms ({base_name}) | "
                       f"{theirs['prefill_ms'] / ours['prefill_ms']:.2f}x | `model.json` |")
    result = _load(results_dir, "model_static_decode")
    if result is not None:
        gpus.append(result["meta"].get("gpu") or "CPU")
        for model, ours, base_name, theirs in _ours_and_baseline(result):
            if model in _HEADLINE_MODELS:
                out += _decode_headline("transformers decode, static cache + CUDA graphs", model, ours, base_name,
                                        theirs, "model_static_decode")
    result = _load(results_dir, "ep_4gpu")
    if result is not None:
        gpus.append(result["meta"].get("gpu") or "CPU")
        rows = [r for r in result["rows"] if r["mode"] == "fwd+bwd" and r["tokens_per_rank"] == 16384]
        rows = [r for r in rows if r["shape"] == rows[0]["shape"]] if rows else rows  # the file's first shape
        top = max((r["ep"] for r in rows), default=None)
        by = {r["impl"]: r for r in rows if r["ep"] == top}
        if "ours" in by and "reference" in by:
            ours, theirs = by["ours"], by["reference"]
            out.append(f"| expert-parallel MoE layer forward+backward | {ours['shape']}, EP {top}, "
                       f"16384 tokens a GPU | "
                       f"{ours['tokens_per_s_per_gpu'] / 1e3:.0f}k tokens/s per GPU | "
                       f"{theirs['tokens_per_s_per_gpu'] / 1e3:.0f}k (all_to_all + grouped_mm) | "
                       f"{ours['tokens_per_s_per_gpu'] / theirs['tokens_per_s_per_gpu']:.2f}x | `ep_4gpu.json` |")
    out += _tc_headline(results_dir, gpus)
    gpus = list(dict.fromkeys(gpus))
    if len(gpus) > 1:  # rows from a GPU other than the first named: their file cell names it
        out[2:] = [_with_gpu(line, results_dir, gpus[0]) for line in out[2:]]
        note = f"{gpus[0]} unless the file names another"
    else:
        note = ", ".join(gpus)
    return f"_{note}; bf16 unless marked FP8._\n\n" + "\n".join(out) + "\n"


def _with_gpu(row: str, results_dir, usual: str) -> str:
    """A headline row whose file cell also names the GPU its results file ran on, where the file
    records one other than `usual`."""
    name = row.rsplit("`", 2)[-2]
    gpu = ((_load(results_dir, name.removesuffix(".json")) or {}).get("meta") or {}).get("gpu")
    return row if not gpu or gpu == usual else row.replace(f"`{name}` |", f"`{name}` ({gpu}) |")


# The Tc cross-validation run whose epoch timings (`tc train --compare-backends`) the headline shows.
TC_HEADLINE_RUN = "tc/cluster_superconductors"


def _tc_headline(results_dir, gpus) -> list:
    """The Tc set transformer's training epoch on our kernels against SDPA + grouped_mm (none
    when the run did not compare them)."""
    result = _load(results_dir, f"{TC_HEADLINE_RUN}/metrics")
    speed = (result or {}).get("meta", {}).get("speed", {})
    ours, theirs = speed.get("kernels", {}), speed.get("torch_grouped_mm", {})
    if "seconds_per_epoch" not in ours or "seconds_per_epoch" not in theirs:
        return []
    if "gpu" in result["meta"]:  # runs record it since the CUDA-graph steps (earlier ones: an H100)
        gpus.append(result["meta"]["gpu"] or "CPU")
    return [f"| Tc set transformer training epoch (fp32, CUDA graphs) | SuperCon, {result['meta']['compounds']} "
            f"compounds, {result['meta']['split']} split | {ours['seconds_per_epoch']:.2f} s | "
            f"{theirs['seconds_per_epoch']:.2f} s (SDPA + grouped_mm, eager) | "
            f"{theirs['seconds_per_epoch'] / ours['seconds_per_epoch']:.2f}x | `{TC_HEADLINE_RUN}/metrics.json` |"]


def update_readme(results_dir, readme_path, *, check: bool = False) -> bool:
    """Rewrites every results table in a document (the README, docs/benchmarks.md); returns
    whether anything changed."""
    readme = Path(readme_path)
    text = readme.read_text()

    def replace(match):
        if match["name"] == "headline":
            return match.group(1) + render_headline(results_dir) + match.group(4)
        path = Path(results_dir) / f"{match['name']}.json"
        if not path.exists():
            body = f"_No results file `{path}` yet._\n"
        else:
            body = render(match["name"], json.loads(path.read_text()))
        return match.group(1) + body + match.group(4)

    new = _MARKER.sub(replace, text)
    changed = new != text
    if changed and not check:
        readme.write_text(new)
    return changed
