"""The attention kernels' builds: every specialisation the dispatchers of `forward.py` and
`backward.py` can launch, as `KernelBuild`s that `target_compile` compiles for sm80, sm86, sm89
and sm90 (the CPU test checks each fits its target). The tables they enumerate are in
`configs.py`.

The options a call can turn on (causal, softcap, variable lengths; sliding windows are runtime
arguments) are constexprs that change no tile: each configuration compiles plain and with all
of them on, which bounds the rest. Compiling every subset of the options for every
configuration and target once found none asking for more shared memory than all of them
together, so the other combinations are left out of the check to keep it fast. A v head dim of
its own (MLA, `configs.VALUE_HEAD_DIM_BLOCKS`) compiles with every option on.
"""
from __future__ import annotations

from itertools import product

from ..dependent_launch import pdl_compiles
from ..float8 import FP8_MIN_CAPABILITY
from ..kernel_build import KernelBuild
from .configs import (DECODE_COMBINE_SPLITS, DECODE_COMBINE_WARPS, GLUON_FP8_FORWARD, HOPPER_FORWARD, PREPROCESS_WARPS,
                      VALUE_HEAD_DIM_BLOCKS, BackwardConfig, backward_configs, decode_aligns_pages, decode_configs,
                      dkdv_maxnreg, forward_configs, gluon_forward_configs, gluon_forward_tiles, gluon_separate_output,
                      preprocess_block_m)


def _value_blocks(block_d: int):
    """(v's padded head dim, option variants) of the builds for q/k head dim block_d: its own with
    every variant; an MLA v head dim with the last (every option on) only."""
    yield block_d, None
    if block_d in VALUE_HEAD_DIM_BLOCKS:
        yield VALUE_HEAD_DIM_BLOCKS[block_d], -1


def _padded_head_dim(block_d: int, block_dv: int) -> int:
    """The q/k head dim the Gluon builds compile for: DeepSeek's 192 in the 256 tiles of its MLA pair,
    whose scores sum 64-column slices (`forward_gluon._scores`); the tile's own width otherwise."""
    return 192 if (block_d, block_dv) == (256, 128) else block_d


def _dims_label(block_d: int, block_dv: int) -> str:
    return f"D={block_d}" if block_dv == block_d else f"D={block_d}/{block_dv}"


def shipped_builds(capability: int):
    from ._kernels.forward import attention_forward_kernel

    ptr = {1: "*fp8e4nv", 2: "*fp16", 4: "*fp32"}
    # Each config compiles plain, and with every option on (module docstring). FP8 (one-byte)
    # entries: the FP8 path, its output bf16.
    variants = ((False, False, False), (True, True, True))
    for (element_size, block_d, cfg), (block_dv, last) in ((c, v) for c in forward_configs(capability)
                                                           for v in _value_blocks(c[1])):
        for causal, softcap, varlen in variants[last:] if last else variants:
            sig = {name: "i32" for name in attention_forward_kernel.arg_names}
            sig.update(Q=ptr[element_size], K=ptr[element_size], V=ptr[element_size],
                       O="*bf16" if element_size == 1 else ptr[element_size], LSE="*fp32", CU_SEQLENS_Q="*i32",
                       CU_SEQLENS_K="*i32", SEQUENCE_ORDER="*i32", DESCALE="*fp32", scale_log2="fp32",
                       softcap_scale="fp32", softcap_log2="fp32")
            constexprs = dict(HEAD_DIM=block_d, BLOCK_D=block_d, HEAD_DIM_V=block_dv, BLOCK_DV=block_dv,
                              BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal, SOFTCAP=softcap, VARLEN=varlen,
                              WRITE_LSE=True, FP8=element_size == 1)
            sig.update({name: "constexpr" for name in constexprs})
            options = "".join(f" {name}" for name, on in (("softcap", softcap), ("varlen", varlen)) if on)
            yield KernelBuild(
                label=f"attention_forward fp{8 * element_size} {_dims_label(block_d, block_dv)} causal={causal}"
                      f"{options} {cfg}",
                fn=attention_forward_kernel, signature=sig, constexprs=constexprs,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                aligned=("Q", "K", "V", "O", "LSE", "stride_qb", "stride_qh", "stride_qm", "stride_kb",
                         "stride_kh", "stride_kn", "stride_vb", "stride_vh", "stride_vn", "stride_ob",
                         "stride_oh", "stride_om"))
    yield from _hopper_builds(capability)
    yield from _backward_builds(capability)
    yield from _decode_builds(capability)


def _decode_builds(capability: int):
    """The KV-cache kernels' builds: the split kernel per configuration, plain (a contiguous cache,
    an int length, partials for the combine kernel) and with every option on (paged, softcap, a
    lengths tensor, one split writing the output and lse); where FP8 runs (sm89 and newer), the
    16-bit configurations again on FP8 caches, per-head descales with the plain options and
    per-token ones with every option; the combine and append kernels per dtype and head dim. Where
    the combine launches as a programmatic dependent (sm90), the split kernel and it with PDL on."""
    from ._kernels.decode import (HEAD_SCALES, NO_SCALES, TOKEN_SCALES,
                                  attention_decode_combine_kernel, attention_decode_split_kernel,
                                  kv_cache_append_kernel)

    ptr = {2: "*fp16", 4: "*fp32"}
    fp8 = capability >= FP8_MIN_CAPABILITY
    pdl = pdl_compiles(capability)
    plain = [(False, False, NO_SCALES.value), (True, True, NO_SCALES.value)]
    fp8_caches = [(False, False, HEAD_SCALES.value), (True, True, TOKEN_SCALES.value)]
    builds = [(element_size, block_d, cfg, plain) for element_size, block_d, cfg in decode_configs(None, capability)]
    if fp8:
        builds += [(2, block_d, cfg, fp8_caches) for element_size, block_d, cfg in decode_configs(1)
                   if element_size == 2]
    for element_size, block_d, cfg, variants in builds:
        for paged, softcap, scales in variants:
            # page-aligned key blocks where the dispatcher may take them, the per-key path elsewhere
            aligned_pages = paged and decode_aligns_pages(capability, 1 if scales else element_size)
            cache = "*fp8e4nv" if scales else ptr[element_size]
            sig = {name: "i32" for name in attention_decode_split_kernel.arg_names}
            sig.update(Q=ptr[element_size], K=cache, V=cache, O_PART="*fp32",
                       LSE_PART="*fp32", OUT=ptr[element_size], LSE="*fp32", CACHE_SEQLENS="*i32", CACHE_LEFTPAD="*i32",
                       BLOCK_TABLE="*i32", K_SCALE="*fp32", V_SCALE="*fp32", scale_log2="fp32", softcap_scale="fp32",
                       softcap_log2="fp32")
            constexprs = dict(HEAD_DIM=block_d, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                              PAGE_SIZE=16 if paged else 0, SOFTCAP=softcap, LENGTHS_TENSOR=paged, SINGLE=paged,
                              WRITE_LSE=paged, SCALES=scales, PDL=pdl, ALIGNED_PAGES=aligned_pages)
            sig.update({name: "constexpr" for name in constexprs})
            cache_label = f" fp8 cache scales={scales}" if scales else ""
            yield KernelBuild(label=f"attention_decode_split fp{8 * element_size}{cache_label} D={block_d} "
                                    f"paged={paged} {cfg}",
                              fn=attention_decode_split_kernel, signature=sig, constexprs=constexprs,
                              num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                              aligned=("Q", "K", "V", "O_PART", "LSE_PART", "stride_qb", "stride_qm", "stride_qh",
                                       "stride_kb", "stride_kn", "stride_kh", "stride_vb", "stride_vn", "stride_vh"))
    for element_size, block_d in product((2, 4), (16, 32, 64, 128, 256)):
        sig = {name: "i32" for name in attention_decode_combine_kernel.arg_names}
        sig.update(O_PART="*fp32", LSE_PART="*fp32", OUT=ptr[element_size], LSE="*fp32")
        constexprs = dict(HEAD_DIM=block_d, BLOCK_D=block_d, BLOCK_S=DECODE_COMBINE_SPLITS, WRITE_LSE=True, PDL=pdl)
        sig.update({name: "constexpr" for name in constexprs})
        yield KernelBuild(label=f"attention_decode_combine fp{8 * element_size} D={block_d}",
                          fn=attention_decode_combine_kernel, signature=sig, constexprs=constexprs,
                          num_warps=DECODE_COMBINE_WARPS,
                          num_stages=1, aligned=("O_PART", "LSE_PART", "OUT"))
        for scales in (NO_SCALES.value, TOKEN_SCALES.value) if fp8 else (NO_SCALES.value,):
            sig = {name: "i32" for name in kv_cache_append_kernel.arg_names}
            sig.update(NEW=ptr[element_size], CACHE="*fp8e4nv" if scales else ptr[element_size], CACHE_SEQLENS="*i32",
                       BLOCK_TABLE="*i32", SCALE="*fp32")
            constexprs = dict(HEAD_DIM=block_d, BLOCK_D=block_d, PAGE_SIZE=16, LENGTHS_TENSOR=True, SCALES=scales)
            sig.update({name: "constexpr" for name in constexprs})
            yield KernelBuild(label=f"kv_cache_append fp{8 * element_size}{' fp8 cache' if scales else ''} "
                                    f"D={block_d}", fn=kv_cache_append_kernel, signature=sig, constexprs=constexprs,
                              num_warps=1, num_stages=1, aligned=("NEW", "CACHE"))


def _hopper_builds(capability: int):
    """The Hopper forward's builds (sm90 only), plain and with causal and softcap on."""
    if capability != 90:
        return
    from ._kernels.forward_hopper import attention_forward_hopper_kernel

    variants = ((False, False), (True, True))
    for (block_d, cfg), (block_dv, last) in ((c, v) for c in HOPPER_FORWARD.items() for v in _value_blocks(c[0])):
        for causal, softcap in variants[last:] if last else variants:
            sig = {name: "i32" for name in attention_forward_hopper_kernel.arg_names}
            for name, rows, cols in (("desc_q", cfg.block_m, block_d), ("desc_k", cfg.block_n, block_d),
                                     ("desc_v", cfg.block_n, block_dv), ("desc_o", cfg.block_m, block_dv)):
                sig[name] = f"tensordesc<fp16[1,1,{rows},{cols}]>"
            sig.update(LSE="*fp32", scale_log2="fp32", softcap_scale="fp32", softcap_log2="fp32")
            constexprs = dict(BLOCK_D=block_d, BLOCK_DV=block_dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                              CAUSAL=causal, SOFTCAP=softcap, WRITE_LSE=True)
            sig.update({name: "constexpr" for name in constexprs})
            yield KernelBuild(label=f"attention_forward_hopper fp16 {_dims_label(block_d, block_dv)} causal={causal} "
                                    f"softcap={softcap} {cfg}", fn=attention_forward_hopper_kernel, signature=sig,
                              constexprs=constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                              aligned=("LSE",))
    yield from _gluon_builds()


def _gluon_builds():
    """The Gluon forward's builds (sm90 only), plain and causal, in both 16-bit types: the shared
    memory layouts of its descriptors are part of its signature."""
    from triton.experimental.gluon import language as gl

    from ._kernels.forward_gluon import attention_forward_gluon_kernel

    variants = ((False, True, ("fp16", gl.float16)), (True, True, ("bf16", gl.bfloat16)),
                (True, False, ("bf16", gl.bfloat16)))
    for (block_d, cfg), (block_dv, last) in ((c, v) for c in gluon_forward_configs() for v in _value_blocks(c[0])):
        if block_dv != block_d and not gluon_separate_output(cfg, block_d, block_dv):
            continue  # v's own width needs O's own buffers (`configs.hopper_forward_config`)
        rows, consumers = gluon_forward_tiles(cfg)
        for causal, persistent, (name, dtype) in variants[last:] if last else variants:
            sig = {n: "i32" for n in attention_forward_gluon_kernel.arg_names}
            for arg, tile_rows, cols in (("desc_q", rows, block_d), ("desc_k", cfg.block_n, block_d),
                                         ("desc_v", cfg.block_n, block_dv), ("desc_o", rows, block_dv)):
                layout = gl.NVMMASharedLayout.get_default_for([1, 1, tile_rows, cols], dtype)
                sig[arg] = f"tensordesc<{name}[1,1,{tile_rows},{cols}],{layout!r}>"
            sig.update(LSE="*fp32", DESCALE="*fp32", scale_log2="fp32")
            head_dim = _padded_head_dim(block_d, block_dv)
            constexprs = dict(BLOCK_M=rows, BLOCK_N=cfg.block_n, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_DV=block_dv,
                              NUM_STAGES=cfg.num_stages, CAUSAL=causal, WRITE_LSE=True, NUM_CONSUMERS=consumers,
                              SEPARATE_O=gluon_separate_output(cfg, block_d, block_dv), PERSISTENT=persistent,
                              FP8=False)
            sig.update({n: "constexpr" for n in constexprs})
            yield KernelBuild(label=f"attention_forward_gluon {name} {_dims_label(block_d, block_dv)} causal={causal} "
                                    f"persistent={persistent} {cfg}",
                              fn=attention_forward_gluon_kernel, signature=sig, constexprs=constexprs,
                              num_warps=cfg.num_warps, num_stages=1, aligned=("LSE",))
    yield from _gluon_fp8_builds()


def _gluon_fp8_builds():
    """The Gluon forward's FP8 builds (`configs.GLUON_FP8_FORWARD`), plain and causal: e4m3 Q, K
    and V^T tiles (head_dim x keys), bf16 O; and the copy of V they read, per head dim."""
    from triton.experimental.gluon import language as gl

    from ._kernels.forward_gluon import attention_forward_gluon_kernel

    def descriptor(name, dtype, rows, cols):
        layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], dtype)
        return f"tensordesc<{name}[1,1,{rows},{cols}],{layout!r}>"

    from ._kernels.value_tiles import fp8_value_tiles_kernel
    from .fp8 import VALUE_TILE_KEYS

    for block_d, (plain, masked) in GLUON_FP8_FORWARD.items():
        sig = {n: "i32" for n in fp8_value_tiles_kernel.arg_names}
        constexprs = dict(HEAD_DIM=block_d, BLOCK_D=block_d, BLOCK_S=VALUE_TILE_KEYS)
        sig.update(V="*u8", OUT="*u8", **{n: "constexpr" for n in constexprs})
        yield KernelBuild(label=f"attention_fp8_value_tiles D={block_d}", fn=fp8_value_tiles_kernel, signature=sig,
                          constexprs=constexprs, num_warps=4, num_stages=1, aligned=("OUT", "padded"))
        variants = [(cfg, False, True) for _, cfg in plain]
        variants += [(cfg, True, persistent) for _, cfg in masked for persistent in (True, False)]
        for cfg, causal, persistent in variants:
            rows, consumers = gluon_forward_tiles(cfg)
            sig = {n: "i32" for n in attention_forward_gluon_kernel.arg_names}
            sig.update(desc_q=descriptor("fp8e4nv", gl.float8e4nv, rows, block_d),
                       desc_k=descriptor("fp8e4nv", gl.float8e4nv, cfg.block_n, block_d),
                       desc_v=descriptor("fp8e4nv", gl.float8e4nv, block_d, cfg.block_n),
                       desc_o=descriptor("bf16", gl.bfloat16, rows, block_d), LSE="*fp32", DESCALE="*fp32",
                       scale_log2="fp32")
            constexprs = dict(BLOCK_M=rows, BLOCK_N=cfg.block_n, HEAD_DIM=block_d, BLOCK_D=block_d, BLOCK_DV=block_d,
                              NUM_STAGES=cfg.num_stages, CAUSAL=causal, WRITE_LSE=True, NUM_CONSUMERS=consumers,
                              SEPARATE_O=True, PERSISTENT=persistent, FP8=True)
            sig.update({n: "constexpr" for n in constexprs})
            yield KernelBuild(label=f"attention_forward_gluon fp8 D={block_d} causal={causal} persistent={persistent} "
                                    f"{cfg}", fn=attention_forward_gluon_kernel, signature=sig,
                              constexprs=constexprs, num_warps=cfg.num_warps, num_stages=1, aligned=("LSE", "DESCALE"))


def _backward_builds(capability: int):
    from ._kernels import backward

    ptr = {2: "*fp16", 4: "*fp32"}

    value_tensors = ("V", "DO", "DV", "O")  # tiles of v's head dim (block_dv)

    def build(kernel, label, element_size, block_d, pointers, constexprs, num_warps, num_stages, tiles=None,
              maxnreg=None, block_dv=None):
        """`tiles` (TMA builds): the tensor arguments that are descriptors, with their tile rows.
        `block_dv`: v's padded head dim where it differs (MLA)."""
        block_dv = block_dv or block_d
        sig = {arg: "i32" for arg in kernel.arg_names}
        sig.update({arg: ptr[element_size] for arg in pointers})
        if tiles:
            sig.update({arg: f"tensordesc<fp16[1,1,{rows},{block_dv if arg in value_tensors else block_d}]>"
                        for arg, rows in tiles.items()})
            pointers = [a for a in pointers if a not in tiles]
            label += " tma"
        sig.update({arg: "*fp32" for arg in ("LSE", "DELTA", "LSE_LOG2") if arg in sig})
        sig.update({arg: "*i32" for arg in ("CU_SEQLENS_Q", "CU_SEQLENS_K", "SEQUENCE_ORDER") if arg in sig})
        sig.update({arg: "fp32" for arg in ("softmax_scale", "scale_log2", "softcap_scale", "softcap_log2")
                    if arg in sig})
        dims = dict(HEAD_DIM=block_d, BLOCK_D=block_d)
        if "HEAD_DIM_V" in kernel.arg_names:
            dims.update(HEAD_DIM_V=block_dv, BLOCK_DV=block_dv)
        constexprs = dict(**dims, **constexprs)
        sig.update({arg: "constexpr" for arg in constexprs})
        aligned = [a for a in kernel.arg_names
                   if a in pointers or a in ("LSE", "DELTA", "LSE_LOG2") or a.startswith("stride_")]
        options = "".join(f" {name}" for name in ("softcap", "varlen") if constexprs.get(name.upper()))
        return KernelBuild(label=f"{label} fp{8 * element_size} {_dims_label(block_d, block_dv)}{options}", fn=kernel,
                           signature=sig,
                           constexprs=constexprs, num_warps=num_warps, num_stages=num_stages,
                           aligned=tuple(aligned), maxnreg=maxnreg)

    for element_size, block_d, cfg in backward_configs(capability):
        if cfg.gluon:
            yield from _gluon_backward_builds(block_d, cfg)
            continue
        rows = preprocess_block_m(block_d)
        yield build(backward.attention_backward_preprocess_kernel,
                    f"attention_backward_preprocess BLOCK_M={rows} warps={PREPROCESS_WARPS}", element_size, block_d,
                    ("O", "DO"), dict(BLOCK_M=rows), PREPROCESS_WARPS, 1)
        # Plain, and with both options on (module docstring): softcap adds a tanh per score and a
        # factor on dS, variable lengths a few scalar loads. The dQ kernel computes delta (its
        # other mode, loading it, does less). The TMA builds too where the entry asks for them
        # on sm90 (their pointer builds serve the calls TMA cannot address).
        all_options = (dict(SOFTCAP=False, VARLEN=False), dict(SOFTCAP=True, VARLEN=True))
        loads = (False, True) if cfg.tma and capability == 90 and element_size == 2 else (False,)
        for tma, (block_dv, last) in product(loads, _value_blocks(block_d)):
            for options in all_options[last:] if last else all_options:
                yield from _triton_backward_builds(build, backward, element_size, block_d, block_dv, cfg, tma,
                                                   options)


def _triton_backward_builds(build, backward, element_size, block_d, block_dv, cfg, tma, options):
    """The Triton dK/dV and dQ kernels' builds for one configuration, head dims and options."""
    def stored(**tiles):  # packed batches store gradients through pointers
        return {} if options["VARLEN"] else tiles

    dkdv, dq = cfg.dkdv, cfg.dq
    yield build(backward.attention_backward_dkdv_kernel, f"attention_backward_dkdv {dkdv}", element_size,
                block_d, ("Q", "K", "V", "DO", "DK", "DV"),
                dict(BLOCK_M=dkdv.block_m, BLOCK_N=dkdv.block_n, TMA=tma, **options),
                dkdv.num_warps, dkdv.num_stages,
                tiles=tma and dict(Q=dkdv.block_m, DO=dkdv.block_m, K=dkdv.block_n, V=dkdv.block_n,
                                   **stored(DK=dkdv.block_n, DV=dkdv.block_n)),
                maxnreg=dkdv_maxnreg(dkdv, tma, options["SOFTCAP"], options["VARLEN"]), block_dv=block_dv)
    yield build(backward.attention_backward_dq_kernel, f"attention_backward_dq {dq}", element_size,
                block_d, ("Q", "K", "V", "DO", "O", "DQ"),
                dict(BLOCK_M=dq.block_m, BLOCK_N=dq.block_n, TMA=tma, DELTA_HERE=True, **options),
                dq.num_warps, dq.num_stages,
                tiles=tma and dict(Q=dq.block_m, DO=dq.block_m, K=dq.block_n, V=dq.block_n,
                                   **stored(DQ=dq.block_m)), block_dv=block_dv)


def _gluon_backward_builds(block_d: int, cfg: BackwardConfig):
    """The Gluon backward kernels' builds (sm90) for one configuration, fp16 and bf16 (an MLA v head
    dim: bf16): the shared memory layouts of the descriptors are part of the signature."""
    from triton.experimental.gluon import language as gl

    from ._kernels.backward_gluon import attention_backward_dkdv_gluon_kernel, attention_backward_dq_gluon_kernel

    def descriptor(dtype, rows, cols):
        layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, cols], dtype)
        name = {gl.float16: "fp16", gl.bfloat16: "bf16"}[dtype]
        return f"tensordesc<{name}[1,1,{rows},{cols}],{layout!r}>"

    dtypes = (("fp16", gl.float16), ("bf16", gl.bfloat16))
    for block_dv, last in _value_blocks(block_d):
        dims = _dims_label(block_d, block_dv)
        head_dim = _padded_head_dim(block_d, block_dv)
        for name, dtype in dtypes[last:] if last else dtypes:
            dkdv, dq = cfg.dkdv, cfg.dq
            kernel = attention_backward_dkdv_gluon_kernel
            sig = {n: "i32" for n in kernel.arg_names}
            tiles = dict(desc_q=(dkdv.block_m, block_d), desc_do=(dkdv.block_m, block_dv),
                         desc_k=(dkdv.block_n, block_d), desc_v=(dkdv.block_n, block_dv),
                         desc_dk=(dkdv.block_n, block_d), desc_dv=(dkdv.block_n, block_dv))
            sig.update({arg: descriptor(dtype, *tile) for arg, tile in tiles.items()})
            sig.update(LSE="*fp32", DELTA="*fp32", softmax_scale="fp32", scale_log2="fp32")
            constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=dkdv.block_m, BLOCK_N=dkdv.block_n, BLOCK_D=block_d,
                              BLOCK_DV=block_dv, NUM_STAGES=dkdv.num_stages)
            sig.update({n: "constexpr" for n in constexprs})
            yield KernelBuild(label=f"attention_backward_dkdv_gluon {name} {dims} {dkdv}", fn=kernel,
                              signature=sig, constexprs=constexprs, num_warps=dkdv.num_warps, num_stages=1,
                              aligned=("LSE", "DELTA"))
            kernel = attention_backward_dq_gluon_kernel
            sig = {n: "i32" for n in kernel.arg_names}
            tiles = dict(desc_q=(dq.block_m, block_d), desc_do=(dq.block_m, block_dv), desc_dq=(dq.block_m, block_d),
                         desc_k=(dq.block_n, block_d), desc_v=(dq.block_n, block_dv))
            sig.update({arg: descriptor(dtype, *tile) for arg, tile in tiles.items()})
            sig.update(O=f"*{name}", LSE="*fp32", DELTA="*fp32", softmax_scale="fp32", scale_log2="fp32")
            constexprs = dict(HEAD_DIM=head_dim, HEAD_DIM_V=block_dv, BLOCK_M=dq.block_m, BLOCK_N=dq.block_n,
                              BLOCK_D=block_d, BLOCK_DV=block_dv, NUM_STAGES=dq.num_stages, DELTA_HERE=True)
            sig.update({n: "constexpr" for n in constexprs})
            yield KernelBuild(label=f"attention_backward_dq_gluon {name} {dims} {dq}", fn=kernel, signature=sig,
                              constexprs=constexprs, num_warps=dq.num_warps, num_stages=1,
                              aligned=("O", "LSE", "DELTA"))
