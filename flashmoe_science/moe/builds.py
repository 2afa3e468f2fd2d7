"""The MoE kernels' builds: every specialisation the launchers of `experts.py`, `routing.py` and
`backward.py` can run, as `KernelBuild`s that `target_compile` compiles for sm80, sm86, sm89
and sm90 (the CPU test checks each fits its target). The tables they enumerate are in
`configs.py`.
"""
from __future__ import annotations

import functools
from itertools import product

from ..kernel_build import KernelBuild
from .configs import (_TRITON_DTYPES, ACTIVATIONS, COMBINE_BLOCK_H, COMBINE_BLOCK_T, COMBINE_STAGES, COMBINE_WARPS,
                      COUNT_TILE, DISPATCH_ROWS, DISPATCH_STAGES, DISPATCH_WARPS, FP8_GATHER_ROWS, FP8_GROUP,
                      FP8_QUANTIZE_ROWS, GATHER_ROWS_TILE, GATHER_ROWS_WARPS, MAX_EXPERTS, MAX_TOP_K, ROUTE_EXPERT_PADS,
                      SORT_PAIRS, backward_configs, experts_configs, fp8_configs, route_backward_rows,
                      route_rows, route_warps)


def shipped_builds(capability: int):
    """Every kernel specialisation the MoE launchers can run on `capability`.

    The GEMMs: each table configuration x input dtype (x activation for gate/up). The
    backward GEMMs: each entry of the backward table x input dtype (the activation only
    enters the forward); the weight-gradient kernels depend on the layout's BLOCK_M (a runtime
    value) only through whether their BLOCK_K divides it, so entries that share their tiling
    and that divisibility share a build. Routing, dispatch and
    combine: each layout mode x logits or output dtype; every other argument of those kernels
    is a runtime value. Index tensors are int32 and routing weights fp32 at every launch (the
    launchers convert other dtypes first). Each build once: the backward tables share every
    kernel's tiling but dW1's (BACKWARD_GATHER_X), which would list the others twice.
    """
    labels = set()
    for build in _builds(capability):
        if build.label not in labels:
            labels.add(build.label)
            yield build


def _builds(capability: int):
    """`shipped_builds`, possibly repeated."""
    from ._kernels.backward import (gather_rows_kernel, grad_gate_up_kernel, grad_w1_kernel, grad_w2_kernel,
                                    grad_x_kernel)
    from ._kernels.combine import combine_kernel, gather_sum_kernel
    from ._kernels.dispatch import align_pairs_kernel, count_pairs_kernel, route_backward_kernel, route_kernel
    from ._kernels.grouped_gemm import down_kernel, gate_up_kernel

    def build(label, fn, pointers, constexprs, num_warps, num_stages, aligned=(), descriptors=None):
        """`descriptors` (TMA builds): the pointer arguments passed as tensor
        descriptors instead, with their block shapes (constexpr names or numbers)."""
        signature = {name: "i32" for name in fn.arg_names}
        signature.update(pointers)
        if descriptors:
            dtype = label.split()[1]
            for name, block in descriptors.items():
                shape = ",".join(str(constexprs.get(dim, dim)) for dim in block)
                signature[name] = f"tensordesc<{dtype}[{shape}]>"
            pointers = {name: kind for name, kind in pointers.items() if name not in descriptors}
            label += " tma"
        signature.update({name: "constexpr" for name in constexprs})
        return KernelBuild(label, fn, signature, constexprs, num_warps, num_stages,
                           aligned=tuple(pointers) + tuple(aligned))

    layout = dict(sorted_pairs_ptr="*i32", block_expert_ptr="*i32", block_rows_ptr="*i32")
    # Entries with `tma` build on sm90 with descriptors too (their pointer builds serve the
    # calls whose tensors TMA cannot address): the operands each kernel reads as dense tiles.
    descriptors = {"moe_gate_up": dict(w1_ptr=(1, "BLOCK_N", 2, "BLOCK_K")),
                   "moe_down": dict(h_ptr=("BLOCK_M", "BLOCK_K"), w2_ptr=(1, "BLOCK_N", "BLOCK_K")),
                   "moe_grad_gate_up": dict(w2_ptr=(1, "BLOCK_K", "BLOCK_N")),
                   "moe_grad_x": dict(grad_gate_up_ptr=("BLOCK_M", "BLOCK_K"), w1_ptr=(1, "BLOCK_K", "BLOCK_N")),
                   "moe_grad_w1": dict(grad_gate_up_ptr=("BLOCK_K", "BLOCK_M")),
                   "moe_grad_w2": dict(weighted_h_ptr=("BLOCK_K", "BLOCK_N"))}
    for element_size, cfg in experts_configs(capability):
        for dtype, tma in product(_TRITON_DTYPES[element_size], (False, True) if cfg.tma and capability == 90
                                  else (False,)):
            g, d = cfg.gate_up, cfg.down
            # gpt-oss's experts (`moe.experts.GPT_OSS`) in the 16-bit dtypes of its checkpoints: biases,
            # interleaved gate and up rows, the clamped SwiGLU, and weights stored transposed
            # (transformers' layout; unit stride along the output columns), on the pointer path.
            gpt_oss = element_size == 2 and not tma
            for activation, bias in [(a, False) for a in ACTIVATIONS] + ([("swiglu_oai", True)] if gpt_oss else []):
                # what is 1 at run time is a compile-time constant (Triton specialises it): the unit
                # stride along K of our layout, along N of gpt-oss's (whose gate and up rows interleave)
                strides = dict(stride_wn=1, INTERLEAVED=True) if bias else dict(stride_wk=1, INTERLEAVED=False)
                yield build(f"moe_gate_up {dtype} {activation}{' bias' if bias else ''} BLOCK_M={cfg.block_m} {g}"
                            + (" pdl" if cfg.pdl else ""),
                            gate_up_kernel,
                            dict(x_ptr=f"*{dtype}", w1_ptr=f"*{dtype}", b1_ptr=f"*{dtype}", h_ptr=f"*{dtype}",
                                 h_grads_ptr=f"*{dtype}", **layout),
                            dict(ACTIVATION=activation, BLOCK_M=cfg.block_m, BLOCK_N=g.block_n,
                                 BLOCK_K=g.block_k, GROUP_M=g.group_m, TMA=tma, HAS_BIAS=bias, PDL=cfg.pdl,
                                 **strides),
                            g.num_warps, g.num_stages,
                            aligned=("H", "I", "stride_xt", "stride_we", "stride_wk" if bias else "stride_wn"),
                            descriptors=tma and descriptors["moe_gate_up"])
            for bias in (False, True) if gpt_oss else (False,):
                strides = dict(stride_wn=1) if bias else dict(stride_wk=1)
                yield build(f"moe_down {dtype}{' bias' if bias else ''} BLOCK_M={cfg.block_m} {d}"
                            + (" pdl" if cfg.pdl else ""), down_kernel,
                            dict(h_ptr=f"*{dtype}", w2_ptr=f"*{dtype}", b2_ptr=f"*{dtype}", y_ptr=f"*{dtype}",
                                 weights_ptr="*fp32", **layout),
                            dict(BLOCK_M=cfg.block_m, BLOCK_N=d.block_n, BLOCK_K=d.block_k, GROUP_M=d.group_m, TMA=tma,
                                 HAS_BIAS=bias, PDL=cfg.pdl, **strides),
                            d.num_warps, d.num_stages,
                            aligned=("H", "I", "stride_we", "stride_wk" if bias else "stride_wn"),
                            descriptors=tma and descriptors["moe_down"])
            if cfg.gluon_down_stages and capability == 90 and not tma:
                yield _down_gluon_build(dtype, cfg)
    # (label, dtype, config, whether BLOCK_K divides the layout's BLOCK_M, tma, gpt-oss's layout,
    # x read in layout order); gathers: the dtypes of gather_rows_kernel's builds
    weight_grads, gathers = {}, {}
    for element_size, block_m, cfg in backward_configs(capability):
        for dtype, tma in product(_TRITON_DTYPES[element_size], (False, True) if cfg.tma and capability == 90
                                  else (False,)):
            g, x = cfg.grad_gate_up, cfg.grad_x
            if cfg.gluon_stages and capability == 90 and not tma:
                yield _grad_gate_up_gluon_build(dtype, block_m, cfg)
            if cfg.gluon_weight_grad_stages and capability == 90 and not tma:
                yield from _weight_grad_gluon_builds(dtype, cfg)
            # gpt-oss's experts, as for the forward: weights stored transposed (the unit stride along
            # their rows, N) and gate and up rows interleaved, on the pointer path; our layout's unit
            # stride along K.
            for gpt_oss in (False, True) if element_size == 2 and not tma else (False,):
                suffix = " transposed" if gpt_oss else ""
                strides = dict(stride_wn=1, INTERLEAVED=True) if gpt_oss else dict(stride_wi=1, INTERLEAVED=False)
                yield build(f"moe_grad_gate_up {dtype}{suffix} BLOCK_M={block_m} {g}", grad_gate_up_kernel,
                            dict(grad_out_ptr=f"*{dtype}", w2_ptr=f"*{dtype}", h_ptr=f"*{dtype}",
                                 h_grads_ptr=f"*{dtype}", weights_ptr="*fp32", grad_gate_up_ptr=f"*{dtype}",
                                 weighted_h_ptr=f"*{dtype}", row_tokens_ptr="*i32", grad_weights_ptr="*fp32",
                                 **layout),
                            dict(BLOCK_M=block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m, TMA=tma,
                                 **strides),
                            g.num_warps, g.num_stages,
                            aligned=("H", "I", "stride_gt", "stride_we", "stride_wi" if gpt_oss else "stride_wn"),
                            descriptors=tma and descriptors["moe_grad_gate_up"])
                strides = dict(stride_wn=1) if gpt_oss else dict(stride_wh=1)
                yield build(f"moe_grad_x {dtype}{suffix} BLOCK_M={block_m} {x}", grad_x_kernel,
                            dict(grad_gate_up_ptr=f"*{dtype}", w1_ptr=f"*{dtype}", grad_x_pairs_ptr=f"*{dtype}",
                                 **layout),
                            dict(BLOCK_M=block_m, BLOCK_N=x.block_n, BLOCK_K=x.block_k, GROUP_M=x.group_m, TMA=tma,
                                 **strides),
                            x.num_warps, x.num_stages,
                            aligned=("H", "I", "stride_we", "stride_wh" if gpt_oss else "stride_wn"),
                            descriptors=tma and descriptors["moe_grad_x"])
                aligned = {w: block_m % w.block_k == 0 for w in (cfg.grad_w1, cfg.grad_w2)}
                # grad_w1 with gather_x reads x's layout-order copy (X_ROWS), or gathers x where
                # that copy is not addressable
                for x_rows in (False, True) if cfg.gather_x and tma else (False,):
                    weight_grads[("moe_grad_w1", dtype, cfg.grad_w1, aligned[cfg.grad_w1], tma, gpt_oss, x_rows)] = None
                weight_grads[("moe_grad_w2", dtype, cfg.grad_w2, aligned[cfg.grad_w2], tma, gpt_oss, False)] = None
                if cfg.gather_x and tma:
                    gathers[dtype] = None
    for dtype in gathers:
        yield build(f"moe_gather_rows {dtype}", gather_rows_kernel,
                    dict(x_ptr=f"*{dtype}", row_tokens_ptr="*i32", x_rows_ptr=f"*{dtype}"),
                    dict(zip(("BLOCK_R", "BLOCK_H"), GATHER_ROWS_TILE)), GATHER_ROWS_WARPS, 1,
                    aligned=("H", "stride_xt"))
    for label, dtype, w, aligned, tma, gpt_oss, x_rows in weight_grads:
        # the gradient in its weight's layout: unit stride along its last dimension, or its rows
        constexprs = dict(BLOCK_M=w.block_m, BLOCK_N=w.block_n, BLOCK_K=w.block_k, GROUP_M=w.group_m,
                          ROWS_ALIGNED=aligned, TMA=tma, **(dict(stride_om=1) if gpt_oss else dict(stride_on=1)))
        name = f"{label} {dtype}{' transposed' if gpt_oss else ''} {w} rows_aligned={aligned}"
        out_strides = ("stride_oe", "stride_on" if gpt_oss else "stride_om")
        if label == "moe_grad_w1":
            yield build(name + (" x_rows" if x_rows else ""), grad_w1_kernel,
                        dict(grad_gate_up_ptr=f"*{dtype}", x_ptr=f"*{dtype}", grad_w1_ptr=f"*{dtype}",
                             row_tokens_ptr="*i32", expert_blocks_ptr="*i32"),
                        {**constexprs, "X_ROWS": x_rows}, w.num_warps, w.num_stages,
                        aligned=("H", "I", "stride_xt", *out_strides),
                        descriptors=tma and {**descriptors[label], **(dict(x_ptr=("BLOCK_K", "BLOCK_N")) if x_rows
                                                                       else {})})
        else:
            yield build(name, grad_w2_kernel,
                        dict(grad_out_ptr=f"*{dtype}", weighted_h_ptr=f"*{dtype}", grad_w2_ptr=f"*{dtype}",
                             row_tokens_ptr="*i32", expert_blocks_ptr="*i32"),
                        constexprs, w.num_warps, w.num_stages, aligned=("H", "I", "stride_gt", *out_strides),
                        descriptors=tma and descriptors[label])
    from ._kernels.fp8 import down_fp8_kernel, gate_up_fp8_kernel, quantize_groups_kernel

    for cfg in fp8_configs(capability):  # FP8 weights (fp8.py): sm89 and newer
        if cfg.gluon:
            yield from _fp8_gluon_builds(cfg)
            continue
        scales = dict(w1s_ptr="*fp32", hs_ptr="*fp32")
        for activation, block_scales in product(ACTIVATIONS, (True, False)):
            yield build(f"moe_fp8_gate_up {activation} block_scales={block_scales} {cfg}", gate_up_fp8_kernel,
                        dict(xq_ptr="*fp8e4nv", xs_ptr="*fp32", w1_ptr="*fp8e4nv", hq_ptr="*fp8e4nv", **scales,
                             **layout),
                        dict(ACTIVATION=activation, BLOCK_SCALES=block_scales, BLOCK_M=cfg.block_m,
                             GROUP_M=cfg.group_m, GROUP=FP8_GROUP, SWAP_AB=cfg.swap_ab, PDL=cfg.pdl),
                        cfg.gate_up_warps, cfg.num_stages, aligned=("H", "I", "stride_we", "stride_wn"))
        # An entry that splits the down GEMM's K runs it whole too (fp8_down_split)
        splits = dict.fromkeys((1, cfg.down_split_k))
        for dtype, block_scales, split in product(("fp16", "bf16"), (True, False), splits):
            runs = f" running split={split}" if cfg.down_split_k > 1 else ""
            yield build(f"moe_fp8_down {dtype} block_scales={block_scales}{runs} {cfg}", down_fp8_kernel,
                        dict(hq_ptr="*fp8e4nv", hs_ptr="*fp32", w2_ptr="*fp8e4nv", w2s_ptr="*fp32",
                             y_ptr="*fp32" if split > 1 else f"*{dtype}", weights_ptr="*fp32", **layout),
                        dict(BLOCK_SCALES=block_scales, BLOCK_M=cfg.block_m, BLOCK_N=cfg.down_block_n,
                             GROUP_M=cfg.group_m, GROUP=FP8_GROUP, SPLIT_K=split, SWAP_AB=cfg.swap_ab, PDL=cfg.pdl),
                        cfg.down_warps, cfg.num_stages, aligned=("H", "I", "stride_we", "stride_wn"))
    if capability >= 89:
        # beside the routing launch in a chain of programmatic dependents (an FP8 entry's pdl)
        fp8_chained = (False, True) if any(cfg.pdl for cfg in fp8_configs(capability)) else (False,)
        for dtype, pdl in product(("fp16", "bf16"), fp8_chained):
            yield build(f"moe_fp8_quantize {dtype}{' pdl' if pdl else ''}", quantize_groups_kernel,
                        dict(x_ptr=f"*{dtype}", q_ptr="*fp8e4nv", s_ptr="*fp32"),
                        dict(BLOCK_T=FP8_QUANTIZE_ROWS, GROUP=FP8_GROUP, PDL=pdl), 4, 1, aligned=("H", "stride_xt"))
    tiles = dict(E_PAD=MAX_EXPERTS, PAIRS=SORT_PAIRS, TILE_B=DISPATCH_ROWS)
    # the routing and combine launches of a chain of programmatic dependents (a table entry's pdl)
    chained = (False, True) if any(cfg.pdl for _, cfg in experts_configs(capability)) else (False,)
    for dtype in ("fp16", "bf16", "fp32"):
        for mode, pad, release in product(("none", "full", "one_token"), ROUTE_EXPERT_PADS, chained):
            yield build(f"moe_route logits={dtype} layout={mode} E_PAD={pad}{' release' if release else ''}",
                        route_kernel, dict(logits_ptr=f"*{dtype}", weights_ptr="*fp32", ids_ptr="*i32", **layout),
                        dict(K_PAD=MAX_TOP_K, ROWS=route_rows(mode, pad), LAYOUT=mode, RELEASE=release,
                             **{**tiles, "E_PAD": pad}),
                        route_warps(mode), DISPATCH_STAGES)
        for pad in ROUTE_EXPERT_PADS:
            yield build(f"moe_route_backward logits={dtype} E_PAD={pad}", route_backward_kernel,
                        dict(grad_weights_ptr="*fp32", logits_ptr=f"*{dtype}", weights_ptr="*fp32", ids_ptr="*i32",
                             grad_logits_ptr=f"*{dtype}"),
                        dict(E_PAD=pad, ROWS=route_backward_rows(pad)), DISPATCH_WARPS, DISPATCH_STAGES)
    yield build("moe_count", count_pairs_kernel, dict(ids_ptr="*i32", counts_ptr="*i32"),
                dict(E_PAD=MAX_EXPERTS, COUNT_TILE=COUNT_TILE), DISPATCH_WARPS, DISPATCH_STAGES)
    for count_here in (False, True):
        yield build(f"moe_align count_here={count_here}", align_pairs_kernel,
                    dict(ids_ptr="*i32", counts_ptr="*i32", **layout),
                    dict(COUNT_TILE=COUNT_TILE, TABLE_ROWS=DISPATCH_ROWS, COUNT_HERE=count_here, **tiles),
                    DISPATCH_WARPS, DISPATCH_STAGES)
    floats = ("fp16", "bf16", "fp32")
    # y in the output's dtype, or the fp32 partial rows of an FP8 down GEMM that splits K
    # (FP8Config.down_split_k)
    splits = sorted({cfg.down_split_k for cfg in fp8_configs(capability)} - {1})
    inputs = ([(dtype, dtype, 1) for dtype in floats]
              + [("fp32", dtype, n) for n in splits for dtype in ("fp16", "bf16")])
    for (y_dtype, dtype, n), pdl in product(inputs, chained):
        yield build(f"moe_combine {dtype}{f' partials {y_dtype} x{n}' if n > 1 else ''}{' pdl' if pdl else ''}",
                    combine_kernel, dict(y_ptr=f"*{y_dtype}", ids_ptr="*i32", out_ptr=f"*{dtype}"),
                    dict(SPLITS=n, BLOCK_T=COMBINE_BLOCK_T, BLOCK_H=COMBINE_BLOCK_H, PDL=pdl), COMBINE_WARPS,
                    COMBINE_STAGES, aligned=("H",))
    for dtype in floats:
        yield build(f"moe_gather_sum {dtype}", gather_sum_kernel,
                    dict(rows_ptr=f"*{dtype}", index_ptr="*i64", out_ptr=f"*{dtype}"),
                    dict(BLOCK_T=COMBINE_BLOCK_T, BLOCK_H=COMBINE_BLOCK_H), COMBINE_WARPS, COMBINE_STAGES,
                    aligned=("H",))


def _gluon_descriptor_type(dtype, rows, cols) -> str:
    """The signature type of a 16-bit Gluon kernel's descriptor argument in boxes of (rows, cols)
    (the shared-memory layout is part of it)."""
    from ..tma import gluon_box_layout
    return f"tensordesc<{dtype}[{rows},{cols}],{gluon_box_layout(rows, cols)!r}>"


def _down_gluon_build(dtype, cfg):
    """The Gluon down kernel of experts configuration `cfg` (sm90)."""
    from ._kernels import forward_gluon as fg
    from ._kernels.forward_gluon import down_gluon_kernel

    fn = down_gluon_kernel
    constexprs = dict(GROUP_M=cfg.down.group_m, NUM_STAGES=cfg.gluon_down_stages)
    signature = {name: "i32" for name in fn.arg_names}
    signature.update(desc_h=_gluon_descriptor_type(dtype, fg.TILE_M.value, fg.BLOCK_K.value),
                     desc_w2=_gluon_descriptor_type(dtype, fg.BLOCK_N.value, fg.BLOCK_K.value), y_ptr=f"*{dtype}",
                     weights_ptr="*fp32", sorted_pairs_ptr="*i32", block_expert_ptr="*i32", block_rows_ptr="*i32")
    signature.update({name: "constexpr" for name in constexprs})
    return KernelBuild(f"moe_down_gluon {dtype} BLOCK_M={cfg.block_m} stages={cfg.gluon_down_stages} "
                       f"GROUP_M={cfg.down.group_m}", fn, signature, constexprs, 4, 1, aligned=("y_ptr", "H"))


def _grad_gate_up_gluon_build(dtype, block_m, cfg):
    """The Gluon d [gate, up] kernel of backward configuration `cfg` (sm90): the shared-memory layouts
    of its descriptors are part of its signature."""
    from ._kernels import backward_gluon as bg
    from ._kernels.backward_gluon import grad_gate_up_gluon_kernel
    descriptor = functools.partial(_gluon_descriptor_type, dtype)

    fn = grad_gate_up_gluon_kernel
    epilogue = descriptor(bg.HALF_M.value, bg.EPILOGUE_N.value)
    constexprs = dict(GROUP_M=cfg.grad_gate_up.group_m, NUM_STAGES=cfg.gluon_stages)
    signature = {name: "i32" for name in fn.arg_names}
    signature.update(grad_out_ptr=f"*{dtype}", desc_w2=descriptor(bg.BLOCK_K.value, bg.BLOCK_N.value), desc_h=epilogue,
                     desc_hg=epilogue, desc_ggu=epilogue, grad_gate_up_ptr=f"*{dtype}", desc_wh=epilogue,
                     weights_ptr="*fp32", row_tokens_ptr="*i32", grad_weights_ptr="*fp32", sorted_pairs_ptr="*i32",
                     block_expert_ptr="*i32", block_rows_ptr="*i32")
    signature.update({name: "constexpr" for name in constexprs})
    return KernelBuild(f"moe_grad_gate_up_gluon {dtype} BLOCK_M={block_m} stages={cfg.gluon_stages} "
                       f"GROUP_M={cfg.grad_gate_up.group_m}", fn, signature, constexprs, 4, 1,
                       aligned=("grad_out_ptr", "grad_gate_up_ptr", "stride_gt", "I"))


def _weight_grad_gluon_builds(dtype, cfg):
    """The Gluon weight-gradient kernel of backward configuration `cfg` (sm90), for d w1 and d w2:
    BLOCK_M in its label is its output tiles' rows, as in the Triton weight gradients' (the layout's
    block is a runtime value, so entries of the same tiling share a build)."""
    from ._kernels import backward_gluon as bg
    from ._kernels.backward_gluon import weight_grad_gluon_kernel
    descriptor = functools.partial(_gluon_descriptor_type, dtype)

    fn = weight_grad_gluon_kernel
    for gathered_a, name in ((False, "grad_w1"), (True, "grad_w2")):
        if not cfg.gluon_weight_grad(name):
            continue
        constexprs = dict(GATHERED_A=gathered_a, GROUP_M=getattr(cfg, name).group_m,
                          NUM_STAGES=cfg.gluon_weight_grad(name))
        signature = {name: "i32" for name in fn.arg_names}
        dense_cols = bg.BLOCK_N.value if gathered_a else bg.HALF_M.value
        signature.update(gathered_ptr=f"*{dtype}", desc_dense=descriptor(bg.BLOCK_K.value, dense_cols),
                         desc_out=descriptor(bg.HALF_M.value, bg.BLOCK_N.value), row_tokens_ptr="*i32",
                         expert_blocks_ptr="*i32")
        signature.update({name: "constexpr" for name in constexprs})
        yield KernelBuild(f"moe_{name}_gluon {dtype} BLOCK_M={bg.TILE_M.value} stages={cfg.gluon_weight_grad(name)} "
                          f"GROUP_M={constexprs['GROUP_M']}", fn, signature, constexprs, 4, 1,
                          aligned=("gathered_ptr", "stride_g", "gathered_cols", "N"))


def _fp8_gluon_builds(cfg):
    """The Gluon FP8 GEMMs of `cfg` (sm90) and the copy of the quantised tokens into layout order
    they read: the shared-memory layouts of their descriptors are part of their signatures."""
    from ._kernels.fp8 import gather_rows_kernel
    from ._kernels.fp8_gluon import HALF, TILE_M, down_fp8_gluon_kernel, gate_up_fp8_gluon_kernel
    from .fp8 import gluon_box_layout

    def descriptor(rows, cols):
        return f"tensordesc<fp8e4nv[{rows},{cols}],{gluon_box_layout(rows, cols, False)!r}>"

    rows = TILE_M.value
    scales = f"tensordesc<fp32[1,{rows}],{gluon_box_layout(1, rows, True)!r}>"
    tiles = dict(desc_w=descriptor(HALF.value, FP8_GROUP), scales=scales, a=descriptor(rows, FP8_GROUP))

    def gluon_build(label, fn, pointers, constexprs):
        signature = {name: "i32" for name in fn.arg_names}
        signature.update(pointers)
        signature.update({name: "constexpr" for name in constexprs})
        return KernelBuild(f"{label} {cfg}", fn, signature, constexprs, 4, 1)

    for activation, block_scales in product(ACTIVATIONS, (True, False)):
        yield gluon_build(f"moe_fp8_gate_up_gluon {activation} block_scales={block_scales}", gate_up_fp8_gluon_kernel,
                          dict(desc_x=tiles["a"], desc_w1=tiles["desc_w"], desc_xs=tiles["scales"], w1s_ptr="*fp32",
                               hq_ptr="*fp8e4nv", hs_t_ptr="*fp32", block_expert_ptr="*i32"),
                          dict(ACTIVATION=activation, BLOCK_SCALES=block_scales, GROUP_M=cfg.group_m,
                               NUM_STAGES=cfg.num_stages))
    for dtype, block_scales in product(("fp16", "bf16"), (True, False)):
        yield gluon_build(f"moe_fp8_down_gluon {dtype} block_scales={block_scales}", down_fp8_gluon_kernel,
                          dict(desc_h=tiles["a"], desc_w2=tiles["desc_w"], desc_hs=tiles["scales"], w2s_ptr="*fp32",
                               y_ptr=f"*{dtype}", weights_ptr="*fp32", sorted_pairs_ptr="*i32",
                               block_expert_ptr="*i32", block_rows_ptr="*i32"),
                          dict(BLOCK_SCALES=block_scales, GROUP_M=cfg.group_m, NUM_STAGES=cfg.num_stages))
    signature = {name: "i32" for name in gather_rows_kernel.arg_names}
    constexprs = dict(BLOCK_M=rows, BLOCK_T=FP8_GATHER_ROWS, GROUP=FP8_GROUP)
    signature.update(xq_ptr="*u8", xs_ptr="*fp32", sorted_pairs_ptr="*i32", block_rows_ptr="*i32", q_ptr="*u8",
                     s_t_ptr="*fp32", **{name: "constexpr" for name in constexprs})
    yield KernelBuild("moe_fp8_gather_rows", gather_rows_kernel, signature, constexprs, 4, 1,
                      aligned=("xq_ptr", "q_ptr", "H"))
