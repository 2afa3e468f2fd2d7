"""Attention kernel configurations: the one table of block sizes, warps and stages.

A configuration is picked from the device family (`DeviceInfo.arch_family`), the element size,
the padded head dimension and how much parallel work the call has. Families differ by how much
shared memory one block may take: Hopper (sm90) 227 KB, A100-class (sm80) 163 KB, and the 99 KB
parts (sm86, sm89). The K and V tiles of every pipeline stage live in shared memory, so the
99 KB parts get narrower key blocks or fewer stages at large head dims.

The backward has its own table (`BACKWARD`, read by `backward_config`): its dK/dV kernel keeps
K and V resident and streams Q and dO, its dQ kernel keeps Q and dO resident and streams K and V,
and both hold two fp32 accumulators or tiles of BLOCK x D, so its blocks are smaller than the
forward's at the same head dim.

`forward_configs` and `backward_configs` enumerate every configuration the dispatchers can pick;
`builds.py` turns them into the kernel builds the CPU test compiles for sm80, sm86, sm89 and sm90.
"""
from __future__ import annotations

from dataclasses import dataclass

from itertools import product

from ..device import DeviceInfo


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape, warps and pipeline stages of one kernel. maxnreg (the backward's dK/dV kernel
    only, see `dkdv_maxnreg`): a launch bound on registers a thread, so that more programs share
    an SM; None leaves the compiler's choice."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: int | None = None

    def __str__(self) -> str:
        regs = f" maxnreg={self.maxnreg}" if self.maxnreg else ""
        return f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} warps={self.num_warps} stages={self.num_stages}{regs}"


def head_dim_block(head_dim: int) -> int:
    """The head dimension padded to the power of two a tile holds (masked beyond head_dim)."""
    return max(16, 1 << (head_dim - 1).bit_length())


# Calls whose v head dim differs from q's and k's (MLA) take the tables' entry for the larger padded
# head dim, so their q/k or v tiles are narrower than that entry's build: no more shared memory and
# no more registers. The compile-and-fit check (builds.py) also compiles the pairs DeepSeek's
# models use, by padded q/k head dim: 192 / 128 (prefill and training of V2, V3) pads to 256 / 128;
# 128 / 64 and 96 / 64 to 128 / 64.
VALUE_HEAD_DIM_BLOCKS = {256: 128, 128: 64}


C = AttentionConfig
# fp32 products run 3xTF32 by default (`device.fp32_dot_precision`), which holds each operand
# twice: one table for every family, its tiles the largest a compile-only search found within
# tests/test_configs_fit.py's spill limit (`BACKWARD`'s comment says more).
_FP32_FORWARD = {16: (C(128, 32, 8, 2), C(128, 32, 8, 2)),
                 32: (C(128, 32, 8, 2), C(128, 32, 8, 2)),
                 64: (C(128, 32, 8, 2), C(128, 32, 8, 2)),
                 128: (C(32, 16, 4, 2), C(32, 16, 4, 2)),
                 256: (C(16, 16, 4, 1), C(16, 16, 4, 1))}
# FORWARD[family][element bytes][padded head dim] -> (config for long queries, config when the
# call has too few query blocks to fill the GPU with BLOCK_M = 128).
FORWARD = {
    # Measured on an H200 (benchmarks/results/attention_sweep.json, S = 4096, bf16): at D <= 64
    # two 4-warp programs per SM beat one 8-warp program; at D >= 128 BLOCK_M = 128 with 8 warps
    # (two warpgroups issuing wgmma) wins, with BLOCK_N = 64 so Q plus pipelined K/V tiles fit.
    90: {
        2: {16: (C(64, 64, 4, 3), C(64, 64, 4, 3)),
            32: (C(64, 64, 4, 3), C(64, 64, 4, 3)),
            64: (C(64, 64, 4, 3), C(64, 64, 4, 3)),
            128: (C(128, 64, 8, 3), C(64, 64, 4, 3)),
            256: (C(128, 64, 8, 2), C(64, 32, 4, 2))},
        4: _FP32_FORWARD},
    80: {
        2: {16: (C(128, 64, 4, 3), C(64, 64, 4, 3)),
            32: (C(128, 64, 4, 3), C(64, 64, 4, 3)),
            64: (C(128, 64, 4, 3), C(64, 64, 4, 3)),
            128: (C(128, 64, 8, 3), C(64, 64, 4, 3)),
            256: (C(64, 64, 8, 2), C(64, 32, 8, 2))},
        4: _FP32_FORWARD},
    89: {
        2: {16: (C(128, 64, 4, 3), C(64, 64, 4, 3)),
            32: (C(128, 64, 4, 3), C(64, 64, 4, 3)),
            64: (C(128, 64, 4, 3), C(64, 64, 4, 3)),
            128: (C(128, 32, 8, 3), C(64, 32, 4, 3)),
            256: (C(64, 32, 8, 2), C(32, 32, 4, 2))},
        4: _FP32_FORWARD},
}
# FP8 (e4m3, one byte) takes the 16-bit tiles, whose tiles of half the bytes fit wherever those do:
# sm89 (the generic kernel's FP8 path) and sm90 below the Gluon kernel's sizes; sm80 and sm86 have
# no FP8 tensor cores (its entry serves Triton's interpreter, which picks configs as an A100). An
# FP8 product sums at least 32 along K, so head dims start at FP8_MIN_HEAD_DIM.
FP8_MIN_HEAD_DIM = 32
for _family in FORWARD.values():
    _family[1] = {block_d: pair for block_d, pair in _family[2].items() if block_d >= FP8_MIN_HEAD_DIM}
del C, _family


# The Hopper forward (TMA descriptors, `forward.launch_tma`) for 16-bit inputs, by padded head
# dim, from H100 sweeps (benchmarks/results/attention_hopper_sweep.json, bf16): D = 128 four-warp
# 64 x 64 tiles, two programs an SM (549 against 515 TFLOP/s for 128 x 64 at S = 4096); D = 64
# eight-warp 128 x 64, three stages (421 against the generic kernel's 383 at S = 2048); D = 256
# from an H200 sweep (491 against 485).
HOPPER_FORWARD = {64: AttentionConfig(128, 64, 8, 3), 128: AttentionConfig(64, 64, 4, 3),
                  256: AttentionConfig(128, 64, 8, 2)}
# The Gluon forward (`_kernels/forward_gluon.py`: warp-specialised, a producer warp and two or
# three consumer warpgroups of 64 query rows sharing each K/V tile, the softmax of one key block
# overlapping the P V product of the one before) replaces the Triton kernel above where it was
# measured faster: GLUON_FORWARD[padded head dim] = (unmasked, masked) lists of (minimum keys,
# config); the last entry whose minimum the call's key count reaches runs, none: the Triton kernel.
# Masked = a causal flag or a window. Non-causal calls run it persistent (one program per SM
# walking the tiles), causal calls persistent up to GLUON_PERSISTENT_MAX_CAUSAL_KEYS keys and one
# program per tile above (the hardware then deals the uneven tiles out as SMs free up).
# Measured on an H100 (bf16, 16k tokens, Hq * D = 2048; attention_hopper_sweep_gluon*.json), the
# Gluon kernel against the Triton entry above at S = 4096: D = 128 651 against 502 TFLOP/s (causal
# from 1024 keys: at 512 the Triton kernel's 64-row tiles win, 243 against 229); D = 256 ahead at
# every length (738 against 478 at S = 16384); D = 64 two consumers below 2048 keys and three
# from there (465 against 433), causal from 2048 keys (368 against 355 at 2048; the two tie at
# 1024, where the Triton kernel stays). Softcapped calls stay on the Triton kernel (the Gluon
# kernel has no softcap). Moving part of the exponentials to the FMA pipes with a polynomial was
# slower in nearly every case (448 against 510 at D = 64, S = 16384).
GLUON_FORWARD = {
    64: ([(0, AttentionConfig(128, 128, 4, 2)), (2048, AttentionConfig(192, 128, 4, 2))],
         [(2048, AttentionConfig(128, 128, 4, 2)), (8192, AttentionConfig(192, 128, 4, 2))]),
    128: ([(0, AttentionConfig(128, 128, 4, 2))], [(1024, AttentionConfig(128, 128, 4, 2))]),
    256: ([(0, AttentionConfig(128, 64, 4, 2))], [(0, AttentionConfig(128, 64, 4, 2))]),
}
GLUON_PERSISTENT_MAX_CAUSAL_KEYS = 4096
# The Gluon forward's FP8 builds (`_kernels/forward_gluon.py` with FP8: e4m3 Q, K and V^T tiles,
# 16-bit O through buffers of its own), by padded head dim (q's, k's and v's alike), as
# GLUON_FORWARD: (unmasked, masked) lists of (from this many keys, config). H100 sweep at S = 4096
# and 16384 (benchmarks/results/attention_fp8_sweep.json): two consumers of 64 rows against
# 128-key blocks at D = 128 (four stages: 675 against 625 TFLOP/s for two, non-causal S = 16384),
# 64-key blocks at D = 256 (938 against 350 for 128), three consumers slower at D = 128. At D = 64,
# with P carried in fp16 (`forward_gluon.FP8_P16_CARRY_MAX_D`), three consumers lead unmasked at
# every length and causal at 16384 keys (H200, benchmarks/results/attention_fp8_p_carry/
# attention_fp8_sweep.json: 611 against 536 TFLOP/s non-causal and 558 against 502 causal at
# S = 16384, 498 against 460 non-causal at 2048; causal 364 against 277 at 2048).
GLUON_FP8_FORWARD = {
    64: ([(0, AttentionConfig(192, 128, 4, 2))],
         [(0, AttentionConfig(128, 128, 4, 2)), (8192, AttentionConfig(192, 128, 4, 2))]),
    128: ([(0, AttentionConfig(128, 128, 4, 4))], [(0, AttentionConfig(128, 128, 4, 4))]),
    256: ([(0, AttentionConfig(128, 64, 4, 2))], [(0, AttentionConfig(128, 64, 4, 2))]),
}


def gluon_forward_config(block_d: int, masked: bool, seqlen_k: int, table=None) -> AttentionConfig | None:
    """The Gluon forward's configuration for a call (`GLUON_FORWARD`, or `table` such as
    GLUON_FP8_FORWARD), or None where the Triton kernel runs."""
    chosen = None
    for min_keys, cfg in (GLUON_FORWARD if table is None else table).get(block_d, ([], []))[masked]:
        if seqlen_k >= min_keys:
            chosen = cfg
    return chosen


def gluon_forward_configs(table=None):
    """Every (padded head dim, config) of `GLUON_FORWARD` (or `table`)."""
    return dict.fromkeys((block_d, cfg) for block_d, lists in (GLUON_FORWARD if table is None else table).items()
                         for entries in lists for _, cfg in entries)


def gluon_persistent(causal: bool, seqlen_k: int) -> bool:
    """Whether the Gluon forward runs persistent (`GLUON_FORWARD`'s comment)."""
    return not causal or seqlen_k <= GLUON_PERSISTENT_MAX_CAUSAL_KEYS


def gluon_forward_tiles(config: AttentionConfig) -> tuple[int, int]:
    """The Gluon forward's (query rows per consumer, consumers) for `config`: 16 rows per warp of a
    four-warp consumer (config.num_warps), config.block_m rows per program."""
    rows = 16 * config.num_warps
    return rows, config.block_m // rows


# The Gluon forward's tile order (`forward_gluon._tile_coordinates`) takes the causal tiles of a
# program-per-tile grid in sections of (batch, head) pairs whose K and V fit in this much of the
# L2 cache (50 MB on an H100) and, within a section, heaviest first (at S = 8192 causal, D = 128:
# 638 against 561 TFLOP/s head by head; D = 256: 644 against 604); the other calls keep the query
# blocks of one head together (persistent causal calls: sections cost up to 30%).
GLUON_L2_SECTION_BYTES = 32 << 20


def gluon_forward_section(group_size: int, seqlen_k: int, block_d: int, element_size: int,
                          sectioned: bool) -> int:
    """How many (batch, query head) pairs one section of the Gluon forward's tile order holds: where
    `sectioned` (causal, one program per tile), as many as share GLUON_L2_SECTION_BYTES of K and V
    (a group's query heads share them); else 1."""
    if not sectioned:
        return 1
    per_head = 2 * seqlen_k * block_d * element_size
    return max(1, GLUON_L2_SECTION_BYTES * group_size // per_head)


def gluon_separate_output(config: AttentionConfig, block_d: int, block_dv: int | None = None) -> bool:
    """Whether the Gluon forward's 16-bit output tiles get buffers of their own (so the next tile's
    Q loads while a tile's last products run) or reuse Q's: they do where Q, O and the K/V stages
    fit in Hopper's 227 KB of shared memory (with 1 KB to spare for barriers). Q and K tiles are
    block_d wide, O and V tiles block_dv (v's padded head dim; default block_d)."""
    block_dv = block_dv or block_d
    elements = (config.block_m + config.num_stages * config.block_n) * (block_d + block_dv)
    return 2 * elements <= 226 * 1024


# Below this many FLOPs the generic kernel runs: building four tensor descriptors costs host time
# that a short kernel cannot hide.
HOPPER_MIN_FLOPS = 2e10


def hopper_forward_config(device: DeviceInfo, element_size: int, head_dim: int, flops: float, softcap: bool = False,
                          masked: bool = True, seqlen_k: int = 0, head_dim_v: int | None = None):
    """The Hopper forward for a dense call: (gluon, config), whether the Gluon kernel runs and its
    configuration, or None where the generic kernel runs. `masked`: the call is causal or has a
    window. A v head dim other than q's and k's (MLA) takes the entry of the larger padded head
    dim."""
    if device.capability != 90 or device.arch_family != 90 or element_size > 2 or flops < HOPPER_MIN_FLOPS:
        return None
    block_d = head_dim_block(max(head_dim, head_dim_v or 0))
    if element_size == 1:  # FP8: the Gluon kernel at one head dim for q, k and v; else the generic one
        fp8 = gluon_forward_config(block_d, masked, seqlen_k, GLUON_FP8_FORWARD)
        same_dims = head_dim_v in (None, head_dim)
        return (True, fp8) if fp8 is not None and not softcap and same_dims and head_dim % 16 == 0 else None
    gluon = None if softcap else gluon_forward_config(block_d, masked, seqlen_k)
    if gluon is not None and head_dim_v is not None and head_dim_block(head_dim_v) != head_dim_block(head_dim):
        # v's own width: O needs buffers of its own (the kernel cannot reuse Q's)
        gluon = gluon if gluon_separate_output(gluon, head_dim_block(head_dim), head_dim_block(head_dim_v)) else None
    if gluon is not None:
        return True, gluon
    cfg = HOPPER_FORWARD.get(block_d)
    return None if cfg is None else (False, cfg)


def forward_config(device: DeviceInfo, element_size: int, head_dim: int, seqlen_q: int,
                   batch_heads: int, packed: bool = False) -> AttentionConfig:
    """The forward configuration for a call on `device`."""
    family = FORWARD[device.arch_family][element_size][head_dim_block(head_dim)]
    long_cfg, short_cfg = family
    # With few query blocks, halving BLOCK_M doubles the programs in flight; below that, the
    # short config also wastes less work on padding rows (decode: Sq = 1). Packed batches on
    # Hopper take it too: their sequences are mostly shorter than the grid's longest, so each
    # program's loop is short and two programs per SM hide each other's prologue and epilogue
    # (H100, the varlen benchmark's batch at D = 128, causal: 0.29 against 0.32 ms).
    programs = -(-seqlen_q // long_cfg.block_m) * batch_heads
    short_loops = packed and device.arch_family == 90 and head_dim_block(head_dim) <= 128
    if seqlen_q <= short_cfg.block_m or programs < device.sm_count or short_loops:
        return short_cfg
    return long_cfg


def forward_configs(capability: int):
    """Every (element size, padded head dim, config) the forward dispatcher can pick."""
    from ..device import SHARED_MEMORY_PER_BLOCK

    probe = DeviceInfo("", capability, 1, SHARED_MEMORY_PER_BLOCK[capability], 0)
    for element_size, by_dim in FORWARD[probe.arch_family].items():
        if element_size == 1 and capability < 89:  # no FP8 tensor cores
            continue
        for block_d, pair in by_dim.items():
            for cfg in dict.fromkeys(pair):
                yield element_size, block_d, cfg


@dataclass(frozen=True)
class BackwardConfig:
    """The two main backward kernels' configurations.

    dkdv: the dK/dV kernel; block_n keys per program (K, V and the fp32 dK, dV accumulators stay
        on chip), block_m query rows per step (Q and dO stream through `num_stages` buffers).
    dq: the dQ kernel; block_m query rows per program (Q, dO and the fp32 dQ accumulator stay on
        chip), block_n keys per step (K and V stream).
    tma: the kernels move their Q, K, V, dO tiles in and their gradient tiles out through tensor
        descriptors (the tensor memory accelerator, sm90) instead of pointer loads and stores: the
        same products in the same order, so the same bits. Dense 16-bit calls whose tensors TMA can
        address take it (`descriptors.supports_backward`); others run the pointer kernels with the same tiles.
    gluon: with tma, dense calls without softcap run the Gluon kernels instead
        (`_kernels/backward_gluon.py`: asynchronous wgmma, FlashAttention-3's overlap of the
        exponentials with the products); the resident block is 16 rows per warp. Packed or
        softcapped calls run the Triton kernels with the same tiles.
    """

    dkdv: AttentionConfig
    dq: AttentionConfig
    tma: bool = False
    gluon: bool = False

    def __str__(self) -> str:
        loads = " gluon" if self.gluon else " tma" if self.tma else ""
        return f"dkdv({self.dkdv}) dq({self.dq}){loads}"


B = BackwardConfig
C = AttentionConfig
# BACKWARD[family][element bytes][padded head dim]. Registers bound the blocks more than shared
# memory: a dK/dV program holds two fp32 accumulators of block_n x D plus the fp32 score tiles
# S^T and dP^T of block_n x block_m, a dQ program one accumulator of block_m x D plus S and dP.
# On Hopper, 8 warps (two warpgroups for wgmma) with 128 resident keys at D = 128, four-warp
# 64 x 64 tiles at D = 64, 64 resident keys at D = 256. Checked with `ptxas -v` and the SASS:
# the 16-bit entries spill no register inside a loop on any family, except the dK/dV kernel at
# D = 256 on Hopper (424 bytes: measured faster than the 32-row-step tile, which spills 92). fp32
# runs 3xTF32 products by default (`device.fp32_dot_precision`), which hold each operand twice in
# registers: its entries (forward and backward) are the largest tiles of a compile-only search
# that keep every build's spills within tests/test_configs_fit.py's SPILL_LIMIT, except at D = 256,
# where even 16 x 16 tiles spill 0.7-1.5 KB a thread; fp32 is there for correctness, not speed.
# Its backward tiles run four warps: on an H100, Triton 3.6's 3xTF32 products on eight warps
# over a 16-wide tile faulted (dK/dV 16 x 64) or returned wrong dq (dQ 64 x 16, softcap on). Shared
# memory holds the resident pair (K, V or Q, dO) plus one streamed pair per stage, which is
# what limits the 99 KB parts. The Hopper 16-bit entries move their tiles through tensor
# descriptors (`tma`), the same bits as pointer loads and faster on an H100 (S = 4096, D = 64:
# 357 against 334 TFLOP/s), with fewer registers and spills.
_FP32_BACKWARD = {16: B(C(16, 32, 4, 2), C(32, 16, 4, 2)),
                  32: B(C(16, 32, 4, 2), C(32, 16, 4, 2)),
                  64: B(C(16, 32, 4, 2), C(32, 16, 4, 2)),
                  128: B(C(16, 16, 4, 2), C(16, 16, 4, 2)),
                  256: B(C(16, 16, 4, 1), C(16, 16, 4, 1))}
BACKWARD = {
    90: {
        # D = 16: a four-warp dQ kernel; ptxas crashed (SIGSEGV) compiling the eight-warp one
        # for a packed batch of one one-token sequence (Hq 2, Hkv 1, fp16).
        2: {16: B(C(64, 128, 8, 3), C(128, 64, 4, 3)),
            32: B(C(64, 128, 8, 3), C(128, 64, 8, 3)),
            # H100 sweep, S = 4096 (benchmarks/results/attention_backward_sweep.json): D = 64
            # four-warp 64 x 64 tiles (4.87 -> 4.29 ms), D = 256 64 resident keys and 128
            # resident rows (8.82 -> 7.79 ms). The D = 64 dK/dV kernel runs under 168 registers
            # a thread (`dkdv_maxnreg`): three programs an SM instead of two, 5 to 8% faster.
            64: B(C(64, 64, 4, 2, maxnreg=168), C(64, 64, 4, 3), tma=True),
            128: B(C(64, 128, 8, 3), C(128, 64, 8, 3), tma=True),
            256: B(C(64, 64, 8, 2), C(128, 32, 8, 2), tma=True)},
        4: _FP32_BACKWARD},
    80: {
        2: {16: B(C(32, 128, 4, 3), C(128, 32, 4, 3)),
            32: B(C(32, 128, 4, 3), C(128, 32, 4, 3)),
            64: B(C(64, 64, 4, 3), C(128, 32, 4, 3)),
            128: B(C(64, 64, 8, 3), C(128, 64, 8, 3)),
            256: B(C(32, 64, 8, 2), C(64, 32, 8, 3))},
        4: _FP32_BACKWARD},
    89: {
        2: {16: B(C(32, 64, 4, 3), C(64, 64, 4, 3)),
            32: B(C(32, 64, 4, 3), C(64, 64, 4, 3)),
            64: B(C(32, 64, 4, 3), C(64, 64, 4, 3)),
            128: B(C(32, 64, 4, 3), C(64, 32, 4, 3)),
            256: B(C(16, 32, 4, 2), C(32, 16, 4, 2))},
        4: _FP32_BACKWARD},
}
del B, C


# Packed causal batches replace the table's entry with these, by [family][element bytes][padded
# head dim]: with sequences of 64 to 2048 tokens, a large share of the blocks sits on a diagonal,
# and smaller tiles waste less of it (H100, the varlen benchmark's batch at D = 128: 0.95
# against 1.08 ms; non-causal, where the tiles tie, keeps the table's).
PACKED_CAUSAL_BACKWARD = {
    90: {2: {128: BackwardConfig(AttentionConfig(32, 64, 4, 3), AttentionConfig(64, 32, 4, 3), tma=True)}},
}


# The Gluon backward (`_kernels/backward_gluon.py`: asynchronous wgmma, the exponentials and dS of
# one block computed while the tensor cores run the products of another) for dense calls without
# softcap on sm90, by padded head dim. H100 sweep at S = 4096, bf16, the backward alone
# (benchmarks/results/attention_backward_sweep_gluon.json), against the Triton kernels' table
# entry: D = 128 465 against 419 TFLOP/s (causal 425 against 375), one warpgroup on 64 x 64 tiles
# for both kernels (two programs per SM); D = 256 412 against 225 (causal 386 against 219), the
# dK/dV kernel's 64 keys split by columns between two warpgroups (no register spills, where the
# Triton kernel spilled 256 bytes) and a one-warpgroup dQ kernel. At D = 64 the best of 35 Gluon
# candidates ties the Triton kernels, which stay: 375 against 385 TFLOP/s, causal 355 against 347
# (H100, benchmarks/results/attention_backward_sweep_gluon_d64.json); with the Triton dK/dV
# kernel's register bound (BACKWARD) they lead by 5 to 8% (the same bound made the Gluon one spill
# and run 11 to 17% slower).
GLUON_BACKWARD = {128: BackwardConfig(AttentionConfig(64, 64, 4, 2), AttentionConfig(64, 64, 4, 2), tma=True,
                                      gluon=True),
                  256: BackwardConfig(AttentionConfig(64, 64, 8, 2), AttentionConfig(64, 64, 4, 2), tma=True,
                                      gluon=True)}


def gluon_backward_config(device: DeviceInfo, element_size: int, head_dim: int) -> BackwardConfig | None:
    """The Gluon backward's configuration for a dense call without softcap, or None where the Triton
    kernels run (not sm90, not 16-bit, or a head dim the Gluon kernels were not measured faster at)."""
    if device.capability != 90 or device.arch_family != 90 or element_size != 2:
        return None
    return GLUON_BACKWARD.get(head_dim_block(head_dim))


def backward_config(device: DeviceInfo, element_size: int, head_dim: int,
                    packed_causal: bool = False) -> BackwardConfig:
    """The backward configuration for a call on `device`."""
    block_d = head_dim_block(head_dim)
    if packed_causal:
        cfg = PACKED_CAUSAL_BACKWARD.get(device.arch_family, {}).get(element_size, {}).get(block_d)
        if cfg is not None:
            return cfg
    return BACKWARD[device.arch_family][element_size][block_d]


def preprocess_block_m(block_d: int) -> int:
    """Query rows per program of the backward preprocess (delta = rowsum(dO * O)): a tile of
    4096 elements per tensor, 32 per thread with 4 warps; the kernel only streams memory."""
    return max(16, 4096 // block_d)


PREPROCESS_WARPS = 4


def backward_configs(capability: int):
    """Every (element size, padded head dim, config) the backward dispatcher can pick."""
    from ..device import SHARED_MEMORY_PER_BLOCK

    family = DeviceInfo("", capability, 1, SHARED_MEMORY_PER_BLOCK[capability], 0).arch_family
    for table in (BACKWARD, PACKED_CAUSAL_BACKWARD):
        for element_size, by_dim in table.get(family, {}).items():
            for block_d, cfg in by_dim.items():
                yield element_size, block_d, cfg
    if capability == 90:
        for block_d, cfg in GLUON_BACKWARD.items():
            yield 2, block_d, cfg


def dkdv_maxnreg(dkdv: AttentionConfig, tma: bool, softcap: bool, varlen: bool) -> int | None:
    """The launch register bound of a Triton dK/dV kernel build: the config's `maxnreg` for the
    dense build that moves its tiles through descriptors without softcap, the one it was measured
    on; None for the others, whose softcap terms, pointer arithmetic and packed-sequence bounds
    take more registers (ptxas: 233 to 255 a thread at D = 64 unbounded) and would spill
    hundreds of bytes under it."""
    return dkdv.maxnreg if tma and not softcap and not varlen else None


# The KV-cache kernels (`_kernels/decode.py`), by element bytes: BLOCK_N keys per step, warps and
# stages; BLOCK_M, the tile's query rows (Sq times the GQA group), is the smallest power of two
# from 16 holding them, up to DECODE_MAX_BLOCK_M (fp32 32, and 16 above head dim 128: 3xTF32
# products hold each operand twice; 32 x 256 needed 102400 bytes of shared memory, over the
# 99 KB parts' limit; 16-bit 64, and 32 above head dim 128: the 64 x 256 tile writing its output
# directly (one split) spilled 268-300 bytes on sm80-sm89). BLOCK_N keeps each step's K and V
# tiles near the D = 128 tiles' bytes: a padded head dim above 128 halves it, one of 64 or less
# doubles it. H100 sweeps, bf16, GPU time per call in CUDA graphs
# (benchmarks/results/attention_decode_sweep.json, attention_decode_sweep_d64.json): at D = 128,
# 64 keys, 4 warps, 2 stages within 4% of the fastest of 34 tiles from one sequence of 64k keys
# to 128 sequences of 2k, paged and MHA included (87 to 98% of the copy bandwidth where bound by
# it); at D = 64, 128 keys within 6% (B 32, Sk 4k: 108 us against 102 for 256 keys and one
# split); no other tile is fastest in more than two cases. An FP8 cache (1-byte K and V, read
# into q's dtype) takes one stage more (DECODE_FP8_CACHE_EXTRA_STAGES): half the bytes a step must
# keep more steps in flight (H100, bf16 q, eager calls: B 32, Sk 8k, D 128 240 us against 302 for
# 2 stages; B 64, Sk 4k, D 64 146 against 163).
DECODE = {2: AttentionConfig(64, 64, 4, 2), 4: AttentionConfig(32, 32, 4, 2)}
DECODE_FP8_CACHE_EXTRA_STAGES = 1
# At a head dim of 64 or less (the doubled key block, three programs an SM on Hopper), a grid that
# overflows one resident wave by at most half of one leaves a tail of few programs streaming the
# last caches; the table's undoubled block (six an SM) fits it in one wave. H100, bf16, Hq 32,
# Hkv 8, D 64, one split, GPU time per call in CUDA graphs, 128 against 64 keys a block,
# contiguous / pages of 16: B 56, Sk 4k (1.13 waves) 171 / 218 against 163 / 178 us; B 64 (1.29)
# 188 / 229 against 182 / 193; B 64, Sk 1k 50.6 / 59.3 against 48.4 / 52.7; B 64, Sk 32k 1474 /
# 1719 against 1396 / 1483. Where the doubled block fits one wave (B 40 and 48: 0.81, 0.97) or
# takes two or more (B 96: 1.94, B 128: 2.59) it is as fast or faster, paged by up to 20%
# (B 96: 283 against 353).
DECODE_TAIL_WAVES = 1.5
# At D = 128 (16-bit q and cache, contiguous, one tile of at most 16 query rows), while the
# (sequence, KV head) tiles leave SMs idle, so that split-KV spreads each sequence over them and a
# call is bound more by latency than by bandwidth, 32 keys a block on two warps in three stages
# beat the table's tile: the fastest of 24 tiles in 9 of 12 such cases of the decode sweeps
# (attention_decode_sweep_short.json, _hkv4.json), and in one H100 run against the table's tile
# with its own split count (benchmarks/results/before_after_decode_tile/) 0.92-0.98x the time in
# 11 of 12 cases, 1.02x at one sequence of 1k keys. In pages of 16 it measured 17% slower (8
# sequences of 8k): paged caches keep the table's tile.
DECODE_LATENCY_TILE = AttentionConfig(16, 32, 2, 3)
# At most DECODE_FEW_SEQUENCE_HEADS such tiles (one sequence of 4 or 8 KV heads) take 64 keys on
# four warps in three stages instead, split so that about one program runs per SM (DECODE_FEW_WAVES),
# while the splits stay within DECODE_FEW_MAX_SPLIT_KEYS (bound by latency, not bandwidth). H200,
# bf16, Hq 32, per layer of 32-layer CUDA graphs (benchmarks/results/decode_regimes/), one
# sequence, Hkv 4: 4k keys 9.46 us against the latency tile's 10.22 (cuDNN 9.54), 8k 11.54 against
# 12.09, 16k 15.58 against 16.15; Hkv 8: 1k 7.33 against 7.48, 4k 10.83 against 10.76, 8k 14.93
# against 14.79. With 32 or 64 tiles it was 2-5% slower than the latency tile, and with splits of
# 2k keys (32k, Hkv 8) 47.1 against 38.4: one program an SM keeps too few bytes in flight.
# Measured on Hopper only: other GPUs keep the latency tile.
DECODE_FEW_SEQUENCE_HEADS = 8
DECODE_FEW_TILE = AttentionConfig(16, 64, 4, 3)
DECODE_FEW_WAVES = 1
DECODE_FEW_MAX_SPLIT_KEYS = 512
# On Hopper, a 16-bit call on a contiguous cache at D = 128 or 64 (one tile of at most 16 rows)
# streams K and V at the copy bandwidth with tiles that keep enough bytes in flight per SM: 128
# keys in three stages (two blocks, 128 KB, in flight; one program an SM), or 64 keys in three
# stages for two programs an SM (DECODE_STREAM_TILES; D = 64 doubles the keys, so a step's bytes
# stay D = 128's). Tiles filling DECODE_STREAM_FILL of the SMs to two an SM run one split, no
# combine; fewer tiles split for about a program an SM where each split keeps
# DECODE_STREAM_MIN_SPLIT_KEYS (shorter ones pay the deep pipeline's start for little). The
# table's tile keeps two stages, 64 KB in flight per SM at two programs, and its split counts add
# the combine kernel (4.5 us at B 32, Sk 4k, Hkv 4). H200, bf16, Hq 32, per layer of 32-layer CUDA
# graphs (benchmarks/results/decode_regimes/), before -> with them (cuDNN), Sk 4k unless given:
# - one split, D 128: Hkv 4, B 32 70.2 -> 64.0 us (63.5), B 32 Sk 1k 25.5 -> 19.9 (19.5), B 32
#   Sk 16k 251 -> 239 (238), B 64 Sk 2k 73.1 -> 64.4 (64.1); Hkv 8, B 12 56.9 -> 51.0 (50.0), B 20
#   88.8 -> 88.2 (81.0), B 24 101.7 -> 95.7 (99.5), B 32 141.6 -> 123.1 (122.6); D 64, Hkv 8, B 16
#   43.0 -> 34.7 (37.9), B 32 74.8 -> 64.3 (62.8);
# - splits, Hkv 8: D 128, B 1, Sk 64k 71.3 -> 68.0 (68.1), Sk 32k -> 38.3 (38.1); D 64, B 1,
#   Sk 128k 77.8 -> 69.2 (67.9), Sk 32k 25.7 -> 23.9 (22.4); B 8, Sk 4k 25.5 -> 23.8 (21.5), Sk 8k
#   42.6 -> 38.8 (36.2); D 128, B 8 (64 tiles, 2 splits of 2k keys) 38.1 -> 38.5 (37.3).
# At four tiles an SM (B 64, Hkv 8) the table's tile matched cuDNN (241.7 us against 241.1).
# Measured on Hopper only, so other GPUs keep the tiles they had (the one-program tile's 136 KB of
# shared memory is more than sm86 and sm89 have).
DECODE_STREAM_TILES = (AttentionConfig(16, 128, 4, 3), AttentionConfig(16, 64, 4, 3))
DECODE_STREAM_FILL = 0.7
DECODE_STREAM_MIN_SPLIT_KEYS = 2048
# A paged cache's key block loads its page ids before its keys. Per key, with the page and slot
# computed from each key's position, the split kernel's loop issues 1.75x the instructions of a
# contiguous cache's (sm90 SASS, 64 keys) and Triton pipelines the loads whose addresses come from
# a load in the same iteration only half as deep, so such calls aim at more programs per SM
# (DECODE_PAGED_WAVES against DECODE_WAVES). H200, bf16, D 128, pages of 16, per layer of 32-layer
# CUDA graphs: B 32, Sk 4k, Hkv 8 (256 tiles): 1 split 189.8 us, 2 splits 137.3; Hkv 4 (128 tiles):
# 2 splits 102.5, 3 splits 83.1; pages of 256 alike (180.8 against 135.3).
DECODE_PAGED_WAVES = 3
# On Hopper, a key block that starts on a page bound (no leftpad; page size a multiple or a
# divisor of the block) takes its page ids from the block's first key and loads them a block
# ahead (the split kernel's ALIGNED_PAGES): the loop's instructions come within 1.1-1.3x the
# contiguous cache's and its K and V loads pipeline as deep. Paged calls then take the contiguous
# call's stream and few-tile schedules, and where more than two tiles an SM leave those,
# DECODE_PAGED_BUSY_TILE (128 keys in three stages, one split). Per layer of 32-layer CUDA graphs,
# H200, bf16, Hq 32 (benchmarks/results/decode_regimes/paged_aligned_ab.json), time over the
# contiguous cache's, pages of 16 / 256, per-key path and DECODE_PAGED_WAVES -> this: B 1, Sk 64k,
# Hkv 8, D 128 1.18 / 1.15 -> 1.06 / 1.02; B 8, Sk 4k 1.19 / 1.17 -> 1.08 / 1.05; B 32, Sk 4k,
# Hkv 4 1.28 / 1.25 -> 1.11 / 1.01; Hkv 8 1.11 / 1.09 -> 1.02 / 1.01; B 64 1.04 / 1.02 -> 1.10 /
# 1.01; D 64, B 32 1.36 / 1.32 -> 1.06 / 1.00; B 128, Sk 1k 1.23 / 1.18 -> 1.08 / 1.01; B 1, Sk 128k
# 1.53 / 1.48 -> 1.11 / 1.03. The aligned loads in two stages hold a second K/V buffer: where the
# grid has more than DECODE_ALIGNED_PAGES_TWO_STAGE_WAVES programs an SM that costs residency (B 32,
# Hkv 8, two splits of 64 keys, 512 programs: 1.34x against the per-key path's 1.11x), so such
# calls keep the per-key path, as do FP8 and fp32 caches (unmeasured). A block over more than
# DECODE_PAGED_MAX_BLOCK_PAGES pages loads a page id per key again: D 64's one-program stream tile
# (256 keys) in pages of 16 measured 1.22x (B 8, Sk 8k) and 1.24x (B 1, Sk 128k) against 1.07x and
# 1.11x for DECODE_PAGED_BUSY_TILE at DECODE_PAGED_WAVES, which such calls take. Measured on Hopper
# only: other GPUs keep the per-key path.
DECODE_PAGED_BUSY_TILE = AttentionConfig(16, 128, 4, 3)
DECODE_PAGED_MAX_BLOCK_PAGES = 8
DECODE_ALIGNED_PAGES_TWO_STAGE_WAVES = 3
DECODE_MAX_BLOCK_M = {2: 64, 4: 32}
# The combine kernel: one program per row, the splits' partials DECODE_COMBINE_SPLITS at a time
# ([16, 256] fp32 over four warps: 32 registers a thread), so one long sequence's many splits are
# read by many programs in few loads rather than one after another.
DECODE_COMBINE_SPLITS = 16
DECODE_COMBINE_WARPS = 4
# Split-KV aims at DECODE_WAVES programs per SM. While the (batch, KV head, row block) tiles
# alone leave SMs idle, a split may be one key block: one short sequence is bound by latency, and
# many short splits beat few long ones. Once the tiles fill the SMs, each split keeps at least
# DECODE_MIN_SPLIT_BLOCKS blocks, or the combine kernel costs more than the balance gains. H100,
# bf16, 16 layers in a CUDA graph (split counts 1 to 64): B 1, Sk 1k, D 64: 8 splits 7.1 us, 2
# splits 11.9; B 1, Sk 4k, D 128: 32 splits 13.1, 16 14.8; B 32, Sk 1k, D 128: 1 split 49.4, 2
# splits 56.3. The sweep's split phase (attention_decode_sweep.json) times each case's fastest
# tile, not the table's: with 32 keys and 2 warps, 256 tiles want two splits (B 32, Sk 4k: 197
# us against 223 for one), with the table's tile one (below).
DECODE_WAVES = 2
DECODE_MIN_SPLIT_BLOCKS = 16
# The split count is DECODE_WAVES * SMs / tiles rounded up, unless the fraction above the whole
# number is at most 1 / DECODE_SPLIT_SLACK_PARTS: a split that would add only that share of the
# programs costs more (its partials, the combine) than it balances. H100, bf16, GPU time per
# call in CUDA graphs with the table's tile, Hq 32: B 32, Sk 4k, Hkv 8 (256 tiles, 1.03 splits
# wanted): 1 split 183 us (cuDNN 184), 2 splits 193; at D = 64 101 against 108; B 8, Sk 8k, Hkv
# 32 (256 tiles): 1 split 354, 2 364; B 24, Sk 4k (192 tiles, 1.38): 2 splits 146.5, 1 151.8;
# B 16 (128 tiles, 2.06): 2 splits 103.0, 3 103.3; B 8, Sk 8k (64 tiles, 4.13): 4 splits 102.3,
# 5 102.3. Over 14 such cases the count is the fastest of 1, 2, 3, 4, 6 and 8 or within 2%.
DECODE_SPLIT_SLACK_PARTS = 4
DECODE_MAX_SPLITS = 128  # the most key ranges a sequence's cache is cut into
# Dense calls whose query rows per KV head (Sq x group) fit one decode tile, against at least this
# many keys (and 8 per query), take the KV-cache kernels (`forward.ForwardPlan`): one program per
# (batch, head, query block) would leave most SMs idle and read each group's K and V once per head.
DECODE_MIN_KEYS = 512


def takes_decode(element_size: int, seqlen_q: int, group_size: int, seqlen_k: int) -> bool:
    """Whether a dense forward call runs the KV-cache kernels (split-KV, GQA packing)."""
    return (seqlen_q * group_size <= DECODE_MAX_BLOCK_M[element_size] and seqlen_k >= DECODE_MIN_KEYS
            and seqlen_k >= 8 * seqlen_q)


def decode_config(device: DeviceInfo | None, element_size: int, block_d: int, rows: int,
                  cache_element_size: int | None = None, sequence_heads: int = 0,
                  capacity: int = 0, page_size: int = 0) -> AttentionConfig:
    """The KV-cache split kernel's configuration for `rows` query rows per (batch, KV head), q of
    `element_size` bytes, the cache of `cache_element_size` (q's when None; 1 for FP8): the tile
    of `decode_schedule`, or without a device or the call's shapes the table's."""
    if device is None or not sequence_heads:
        return _decode_table(element_size, block_d, rows, cache_element_size)
    return decode_schedule(device, element_size, block_d, rows, cache_element_size, sequence_heads, capacity,
                           page_size)[0]


def _decode_table(element_size: int, block_d: int, rows: int, cache_element_size: int | None) -> AttentionConfig:
    """DECODE's tile for `rows` query rows at padded head dim `block_d`: a row block of 16 to the
    element size's limit, the key block scaled to keep D = 128's bytes, FP8 caches a stage more."""
    base = DECODE[element_size]
    limit = DECODE_MAX_BLOCK_M[element_size] if block_d <= 128 else 16 if element_size == 4 else 32
    block_m = min(limit, max(16, 1 << max(rows - 1, 0).bit_length()))
    block_n = base.block_n * 2 if block_d <= 64 else base.block_n if block_d <= 128 else base.block_n // 2
    stages = base.num_stages + (DECODE_FP8_CACHE_EXTRA_STAGES if cache_element_size == 1 else 0)
    return AttentionConfig(block_m, block_n, base.num_warps, stages)


def decode_schedule(device: DeviceInfo, element_size: int, block_d: int, rows: int,
                    cache_element_size: int | None, sequence_heads: int, capacity: int, page_size: int,
                    config: AttentionConfig | None = None) -> tuple[AttentionConfig, int]:
    """(tile, split count) for a call of `rows` query rows per (batch, KV head) on `device`,
    given its `sequence_heads` (batch x KV heads), cache `capacity` and layout (`page_size`
    tokens a page, 0 for a contiguous cache);
    `config` replaces the tile (the tuning sweeps), the split count staying the regime's. A
    16-bit call on a contiguous cache, one tile of at most 16 rows:
    - at D = 128 or 64 on Hopper: DECODE_STREAM_TILES, one program a tile an SM or two (one
      split), or splits for about a program an SM while each split keeps
      DECODE_STREAM_MIN_SPLIT_KEYS, where the programs fill DECODE_STREAM_FILL of the SMs;
    - else at D = 128, with fewer tiles than SMs: DECODE_FEW_TILE (on Hopper, at most
      DECODE_FEW_SEQUENCE_HEADS tiles, splits of at most DECODE_FEW_MAX_SPLIT_KEYS) or
      DECODE_LATENCY_TILE.
    At D = 64 or less the table's doubled key block stays only where its programs do not just
    overflow one resident wave (DECODE_TAIL_WAVES). Paged calls on Hopper take the stream and
    few-tile regimes too where a key block spans at most DECODE_PAGED_MAX_BLOCK_PAGES pages, and
    DECODE_PAGED_BUSY_TILE at more than two tiles an SM or more pages a block; elsewhere they aim
    at DECODE_PAGED_WAVES programs an SM, the others at DECODE_WAVES."""
    table = _decode_table(element_size, block_d, rows, cache_element_size)
    tiles = max(sequence_heads, 1) * -(-rows // table.block_m)

    def run(tile: AttentionConfig, splits: int) -> tuple[AttentionConfig, int]:
        return config or tile, splits

    if element_size != 2 or cache_element_size not in (None, element_size):
        return run(table, decode_splits(device, tiles, capacity, table.block_n))
    paged = page_size > 0
    waves = DECODE_PAGED_WAVES if paged else DECODE_WAVES
    hopper = device.arch_family == 90
    if table.block_m == 16 and (not paged or hopper):
        per_sm = -(-tiles // device.sm_count)
        streams = block_d in (64, 128) and hopper and per_sm <= len(DECODE_STREAM_TILES)
        tile = decode_stream_tile(min(per_sm, len(DECODE_STREAM_TILES)), block_d)
        many_pages = paged and tile.block_n > DECODE_PAGED_MAX_BLOCK_PAGES * page_size
        if streams and not many_pages:
            splits = max(min(device.sm_count // tiles, DECODE_MAX_SPLITS), 1)
            if tiles * splits >= DECODE_STREAM_FILL * device.sm_count and (
                    splits == 1 or decode_split_length(capacity, splits, tile.block_n) >= DECODE_STREAM_MIN_SPLIT_KEYS):
                return run(tile, splits)
        if block_d in (64, 128) and hopper and paged and (not streams or many_pages):
            return run(DECODE_PAGED_BUSY_TILE,
                       decode_splits(device, tiles, capacity, DECODE_PAGED_BUSY_TILE.block_n, waves))
        if block_d == 128 and tiles <= DECODE_FEW_SEQUENCE_HEADS and hopper:
            splits = decode_splits(device, tiles, capacity, DECODE_FEW_TILE.block_n, DECODE_FEW_WAVES)
            if decode_split_length(capacity, splits, DECODE_FEW_TILE.block_n) <= DECODE_FEW_MAX_SPLIT_KEYS:
                return run(DECODE_FEW_TILE, splits)
        if block_d == 128 and tiles < device.sm_count and not paged:
            return run(DECODE_LATENCY_TILE, decode_splits(device, tiles, capacity, DECODE_LATENCY_TILE.block_n, waves))
    tile = table
    if block_d <= 64:  # the doubled key block, or the table's where it fits a tail into one wave
        narrow = AttentionConfig(table.block_m, DECODE[2].block_n, table.num_warps, table.num_stages)
        if 1 < _decode_waves(device, table, element_size, block_d, tiles, capacity, waves) <= DECODE_TAIL_WAVES and \
                _decode_waves(device, narrow, element_size, block_d, tiles, capacity, waves) <= 1:
            tile = narrow
    return run(tile, decode_splits(device, tiles, capacity, tile.block_n, waves))


def decode_aligned_pages(device: DeviceInfo, cfg: AttentionConfig, page_size: int, cache_element_size: int,
                         programs: int) -> bool:
    """Whether a paged call (pages of `page_size` tokens, no leftpad) with tile `cfg`, a cache of
    `cache_element_size` bytes and a grid of `programs` takes the split kernel's page-aligned key
    blocks (DECODE_PAGED_BUSY_TILE's note; measured for 16-bit caches only)."""
    fits = page_size > 0 and (page_size % cfg.block_n == 0 or cfg.block_n % page_size == 0)
    return fits and decode_aligns_pages(device.arch_family, cache_element_size) and (
        cfg.num_stages >= 3 or programs <= DECODE_ALIGNED_PAGES_TWO_STAGE_WAVES * device.sm_count)


def decode_aligns_pages(arch_family: int, cache_element_size: int) -> bool:
    """Whether GPUs of `arch_family` may take page-aligned key blocks for caches of
    `cache_element_size` bytes (where they were measured: Hopper, 16-bit caches)."""
    return arch_family == 90 and cache_element_size == 2


def decode_stream_tile(tiles_per_sm: int, block_d: int) -> AttentionConfig:
    """DECODE_STREAM_TILES' tile for calls of up to `tiles_per_sm` (sequence, KV head) tiles an SM
    at padded head dim `block_d` (64: twice the keys of 128's)."""
    tile = DECODE_STREAM_TILES[tiles_per_sm - 1]
    return AttentionConfig(tile.block_m, tile.block_n * 128 // block_d, tile.num_warps, tile.num_stages)


def decode_split_length(capacity: int, splits: int, block_n: int) -> int:
    """Keys a split covers when `splits` cut a cache of `capacity` tokens: whole key blocks."""
    return -(-(-(-max(capacity, 1) // splits)) // block_n) * block_n


def _decode_waves(device: DeviceInfo, cfg: AttentionConfig, element_size: int, block_d: int, tiles: int,
                  capacity: int, waves: int) -> float:
    """How many waves of resident programs the split kernel's grid takes on `device`: its
    programs (tiles times the split count for `waves`) over the SMs times the programs an SM's
    shared memory holds (the pipeline's K and V tiles, num_stages buffers on Hopper and one fewer
    elsewhere, and the query tile)."""
    buffers = cfg.num_stages if device.arch_family == 90 else max(cfg.num_stages - 1, 1)
    smem = element_size * block_d * (2 * cfg.block_n * buffers + cfg.block_m)
    per_sm = max(device.shared_memory_per_block // smem, 1)
    programs = tiles * decode_splits(device, tiles, capacity, cfg.block_n, waves)
    return programs / (device.sm_count * per_sm)


def decode_splits(device: DeviceInfo, tiles: int, capacity: int, block_n: int, waves: int = DECODE_WAVES) -> int:
    """How many key ranges split-KV cuts each sequence's cache of `capacity` tokens into: enough
    programs for `waves` per SM over `tiles` (batch x KV heads x row blocks), rounded down where
    the last split would add at most 1 / DECODE_SPLIT_SLACK_PARTS of `tiles`' programs, each range
    at least one key block while the tiles leave SMs idle, DECODE_MIN_SPLIT_BLOCKS once they do
    not."""
    tiles = max(tiles, 1)
    target = waves * device.sm_count
    wanted = -(-(DECODE_SPLIT_SLACK_PARTS * target - tiles) // (DECODE_SPLIT_SLACK_PARTS * tiles))
    least = 1 if tiles < device.sm_count else DECODE_MIN_SPLIT_BLOCKS
    return max(1, min(wanted, -(-capacity // block_n) // least, DECODE_MAX_SPLITS))


def decode_configs(cache_element_size: int | None = None, capability: int | None = None):
    """Every (q's element size, padded head dim, config) the KV-cache dispatcher can pick, once
    each, for caches of q's dtype (None) or of `cache_element_size` bytes, on a GPU of
    `capability` (None: those every GPU can pick)."""
    return list(dict.fromkeys(_decode_configs(cache_element_size, capability)))


def _decode_configs(cache_element_size: int | None, capability: int | None):
    for element_size, block_d in product((2, 4), (16, 32, 64, 128, 256)):
        for rows in (16, 32, 64):
            cfg = decode_config(None, element_size, block_d, rows, cache_element_size)
            if cfg.block_m == rows:
                yield element_size, block_d, cfg
                if element_size != 2 or cache_element_size is not None:
                    continue
                if block_d <= 64:  # the one-wave key block
                    yield element_size, block_d, AttentionConfig(rows, DECODE[2].block_n, cfg.num_warps,
                                                                 cfg.num_stages)
                if block_d == 128 and rows == 16:
                    yield from ((element_size, block_d, tile) for tile in (DECODE_LATENCY_TILE, DECODE_FEW_TILE))
                if block_d in (64, 128) and rows == 16 and capability == 90:
                    yield from ((element_size, block_d, decode_stream_tile(per_sm, block_d))
                                for per_sm in range(1, len(DECODE_STREAM_TILES) + 1))

