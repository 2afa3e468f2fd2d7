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
    """Tile shape, warps and pipeline stages of one kernel. exp_poly (the Hopper forwards only):
    how many of every four exponentials of the unmasked key blocks run on the FMA pipes instead
    of the special-function unit (`_kernels/exp2.py`). maxnreg (the backward's dK/dV kernel
    only, see `dkdv_maxnreg`): a launch bound on registers a thread, so that more programs share
    an SM; None leaves the compiler's choice."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    exp_poly: int = 0
    maxnreg: int | None = None

    def __str__(self) -> str:
        poly = f" exp_poly={self.exp_poly}" if self.exp_poly else ""
        regs = f" maxnreg={self.maxnreg}" if self.maxnreg else ""
        return (f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} warps={self.num_warps} stages={self.num_stages}"
                f"{poly}{regs}")


def head_dim_block(head_dim: int) -> int:
    """The head dimension padded to the power of two a tile holds (masked beyond head_dim)."""
    return max(16, 1 << (head_dim - 1).bit_length())


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
del C


# The Hopper forward (TMA descriptors, `attention/hopper.py`) for 16-bit inputs, by padded head
# dim. D = 128, measured on an H100 (benchmarks/results/attention_hopper_sweep.json, bf16, S = 1024
# to 16384): four-warp 64 x 64 tiles, two programs per SM, beat one eight-warp 128 x 64 program
# everywhere, by 14-20% at S = 1024 and 3-9% at S = 4096 and 16384 (549 against 515 TFLOP/s at
# S = 4096, 500 against 459 causal), and by 10% on causal windows of 1024 at S = 16384
# (attention_hopper_sweep_window1024.json). D = 256 from an H200 sweep (491 against the generic
# kernel's 485 TFLOP/s at S = 4096). D = 64 from an interleaved A/B on an H100 (three repeats per
# side, S = 1024 to 16384, causal and not): eight-warp 128 x 64 tiles with three stages beat the
# generic kernel's 64 x 64 by 6-11% in every case (S = 2048: 421 against 383 TFLOP/s, causal 348
# against 323; the benchmark's attention_fwd.json then went from 364 to 412 at S = 2048); in the
# same A/B the benchmark's transformer-block training step went from 3.87 to 3.69 ms. 64 x 128
# four-warp tiles were as fast at S >= 4096 and slower on short causal calls.
# Triton 3.6's warp specialisation fails to compile this loop at four warps and gains at most 2%
# at eight, so WARP_SPECIALIZE stays off.
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
# H100, bf16, 16k tokens, Hq * D = 2048, S = 512 ... 16384, a one-off interleaved A/B of the
# schedules (figures in issue 7's closing note), TFLOP/s, against the Triton entry above:
# - D = 128, 128 x 128: 477 / 589 / 651 / 630 / 623 / 659 against 370 / 467 / 502 / 522 / 513 / 522
#   unmasked; causal from S = 1024: 367 / 518 / 566 / 638 / 606 against 354 / 436 / 478 / 503 / 567.
#   At S = 512 causal the Triton kernel's 64-row tiles win (243 against 229).
# - D = 256, 128 x 64: 474 ... 738 against 332 ... 478; causal 301 ... 716 against 220 ... 494.
# - D = 64: two consumers (128 x 128) below 2048 keys, three (192 x 128) from there, unmasked:
#   352 / 404 / 465 / 471 / 507 / 505 against 327 / 392 / 433 / 422 / 428 / 429. Causal from 8192
#   keys 192 x 128 (443 / 520 against 408 / 426); from 2048 keys two consumers (128 x 128,
#   persistent): at 4096, 3-4% ahead in three H100 measurements (412 against 398; 403 against 346 in
#   benchmarks/results/attention_hopper_sweep_gluon_exp_poly.json; 406 against 391 in an interleaved
#   A/B, three rounds a side); at 2048, 368 against 355 once both kernels masked the diagonal
#   blocks with one compare a score (benchmarks/results/attention_hopper_sweep_gluon_d64_masks.json,
#   whose 192 x 128 rows ran a build that spilled, since fixed; 349 against 354 before). At 1024
#   the two tie (284 against 287) and the Triton kernel stays.
# Softcapped calls stay on the Triton kernel (the Gluon kernel has no softcap). Every entry keeps
# exp_poly = 0: moving a quarter or half of the exponentials to the FMA pipes
# (`_kernels/exp2.py`) was slower in nearly every case of the sweep above (192 x 128 at S = 16384:
# 448 and 421 against 510 unmasked): at D = 64 the softmax is bound by instruction issue, not
# by the MUFU, and the polynomial adds nine instructions for each exponential it takes over.
GLUON_FORWARD = {
    64: ([(0, AttentionConfig(128, 128, 4, 2)), (2048, AttentionConfig(192, 128, 4, 2))],
         [(2048, AttentionConfig(128, 128, 4, 2)), (8192, AttentionConfig(192, 128, 4, 2))]),
    128: ([(0, AttentionConfig(128, 128, 4, 2))], [(1024, AttentionConfig(128, 128, 4, 2))]),
    256: ([(0, AttentionConfig(128, 64, 4, 2))], [(0, AttentionConfig(128, 64, 4, 2))]),
}
GLUON_PERSISTENT_MAX_CAUSAL_KEYS = 4096


def gluon_forward_config(block_d: int, masked: bool, seqlen_k: int) -> AttentionConfig | None:
    """The Gluon forward's configuration for a call (`GLUON_FORWARD`), or None where the Triton
    kernel runs."""
    chosen = None
    for min_keys, cfg in GLUON_FORWARD.get(block_d, ([], []))[masked]:
        if seqlen_k >= min_keys:
            chosen = cfg
    return chosen


def gluon_forward_configs():
    """Every (padded head dim, config) of `GLUON_FORWARD`."""
    return dict.fromkeys((block_d, cfg) for block_d, lists in GLUON_FORWARD.items()
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


def gluon_separate_output(config: AttentionConfig, block_d: int) -> bool:
    """Whether the Gluon forward's 16-bit output tiles get buffers of their own (so the next tile's
    Q loads while a tile's last products run) or reuse Q's: they do where Q, O and the K/V stages
    fit in Hopper's 227 KB of shared memory (with 1 KB to spare for barriers)."""
    rows = 2 * config.block_m + 2 * config.num_stages * config.block_n
    return 2 * rows * block_d <= 226 * 1024


# Below this many FLOPs the generic kernel runs: building four tensor descriptors costs host time
# that a short kernel cannot hide.
HOPPER_MIN_FLOPS = 2e10


def hopper_forward_config(device: DeviceInfo, element_size: int, head_dim: int, flops: float, softcap: bool = False,
                          masked: bool = True, seqlen_k: int = 0):
    """The Hopper forward for a dense call: (gluon, config), whether the Gluon kernel runs and its
    configuration, or None where the generic kernel runs. `masked`: the call is causal or has a
    window."""
    if device.capability != 90 or device.arch_family != 90 or element_size != 2 or flops < HOPPER_MIN_FLOPS:
        return None
    block_d = head_dim_block(head_dim)
    gluon = None if softcap else gluon_forward_config(block_d, masked, seqlen_k)
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
    # (a one-off A/B on an H100, the benchmark's batch of 64 to 2048 tokens at D = 128: 0.47
    # against 0.49 ms, causal 0.29 against 0.32 ms).
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
    dq_path: how dQ is computed. "kernel", the dQ kernel; "atomic", the dK/dV kernel adds each
        block's dQ rows into an fp32 accumulator with atomic adds; "tma", the same with whole-tile
        TMA reduce-adds (sm90, falling back to "atomic" where TMA cannot address the accumulator).
        The dispatch tables hold "kernel" only, so gradients are bitwise reproducible as the public
        functions promise: the fused paths sum in a varying order, and were measured slower (the
        kernels' module docstrings). They remain candidates of the backward sweep; with gluon,
        "tma" is the fused Gluon kernel (`fused`).
    tma: the kernels move their Q, K, V, dO tiles in and their gradient tiles out through tensor
        descriptors (the tensor memory accelerator, sm90) instead of pointer loads and stores: the
        same products in the same order, so the same bits. Dense 16-bit calls whose tensors TMA can
        address take it (`hopper.supports`); others run the pointer kernels with the same tiles.
    gluon: with tma, dense calls without softcap run the Gluon kernels instead
        (`_kernels/backward_gluon.py`: asynchronous wgmma, FlashAttention-3's overlap of the
        exponentials with the products); the resident block is 16 rows per warp. Packed or
        softcapped calls run the Triton kernels with the same tiles.
    """

    dkdv: AttentionConfig
    dq: AttentionConfig
    dq_path: str = "kernel"
    tma: bool = False
    gluon: bool = False

    @property
    def fused(self) -> bool:
        """Whether the Gluon dK/dV kernel adds dQ itself (dq_path "tma" with gluon): no dQ kernel."""
        return self.gluon and self.dq_path == "tma"

    def __str__(self) -> str:
        loads = " gluon" if self.gluon else " tma" if self.tma else ""
        if self.dq_path != "kernel":
            return f"dkdv({self.dkdv}) dq {self.dq_path}{loads}"
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
# descriptors (`tma`): a one-off A/B on an H100 with these tiles, pointer loads against TMA, same
# bits, S = 4096 (16384 where named): D = 64 334 -> 357 TFLOP/s, D = 128 392 -> 402 (causal at
# 16384: 397 -> 419), D = 256 218 -> 227, a causal window of 1024 at 16384 289 -> 303; ptxas
# reports fewer registers (the D = 128 dQ kernel 206 -> 172) and fewer spills (the D = 256 dK/dV
# kernel 424 -> 256 bytes).
_FP32_BACKWARD = {16: B(C(16, 32, 4, 2), C(32, 16, 4, 2)),
                  32: B(C(16, 32, 4, 2), C(32, 16, 4, 2)),
                  64: B(C(16, 32, 4, 2), C(32, 16, 4, 2)),
                  128: B(C(16, 16, 4, 2), C(16, 16, 4, 2)),
                  256: B(C(16, 16, 4, 1), C(16, 16, 4, 1))}
BACKWARD = {
    90: {
        2: {16: B(C(64, 128, 8, 3), C(128, 64, 8, 3)),
            32: B(C(64, 128, 8, 3), C(128, 64, 8, 3)),
            # H100 sweep, S = 4096 (benchmarks/results/attention_backward_sweep.json): at D = 64,
            # four-warp 64 x 64 tiles for both kernels (each alone: 4.87 -> 4.29 and 4.37 ms);
            # at D = 256, 64 resident keys and 128 resident rows with 32-row steps (each alone:
            # 8.82 -> 7.79 and 7.65 ms). D = 128 was already the best candidate.
            # The D = 64 dK/dV kernel runs under a bound of 168 registers a thread
            # (`dkdv_maxnreg`): three programs an SM instead of two (unbounded it takes 235). With
            # two pipeline stages rather than three it spills 76 bytes rather than 228 and ran
            # faster. H100, bf16, the backward alone, bitwise the same gradients, interleaved
            # rounds (figures in issue 3's closing note): 5 to 8% faster than the unbounded
            # three-stage kernel from S = 2048 to 16384, causal or not.
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
# and smaller tiles waste less of it (a one-off A/B on an H100, the benchmark's batch at D = 128:
# 0.95 against 1.08 ms; non-causal, where the tiles tie, keeps the table's). With the packed
# forward's tiles, the varlen benchmark's causal forward+backward went from 1.39 to 1.28 ms
# (benchmarks/results/attention_varlen_window_fwd_bwd.json).
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
# (H100, benchmarks/results/attention_backward_sweep_gluon_d64.json); since the Triton dK/dV
# kernel's register bound (BACKWARD) they lead by 5 to 8%, and the same bound on the Gluon dK/dV
# kernel (a 108-byte spill) made it 11 to 17% slower than unbounded (one-off H100 A/B).
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


def dq_paths(family: int) -> tuple[str, ...]:
    """The `BackwardConfig.dq_path` values a device family can run."""
    return ("kernel", "atomic", "tma") if family == 90 else ("kernel", "atomic")


def backward_candidates(family: int, element_size: int, block_d: int, paths=None):
    """Backward configurations worth timing for a padded head dim on a device family.

    For the "kernel" dQ path the two kernels run one after the other and are tuned
    independently: the candidates are the table's configuration with its dK/dV kernel replaced
    by each alternative, then with its dQ kernel replaced. Alternatives span the resident block
    (64, 128), the streamed block (32, 64, 128), 4 or 8 warps and 2 or 3 stages, keeping those
    whose shared memory (the resident pair plus one streamed pair per stage) fits and whose fp32
    tiles (accumulators and the two score tiles) stay at or below 192 registers per thread. At
    D = 256, where those limits leave few of them, blocks of 32 (resident) and 16 (streamed) rows
    are tried as well. For the fused paths ("atomic", "tma": the dK/dV kernel adds dQ itself) the
    candidates are the dK/dV alternatives that fit a streamed fp32 dQ tile more, in shared memory
    (staged for the reduce) and in registers (up to 256 per thread: these kernels trade a few
    spills for a kernel less). `paths` limits the dQ paths (default: all of `dq_paths(family)`);
    the table's configuration always comes first, and every candidate moves its tiles as the
    table's does (`tma`).
    """
    from itertools import product

    from ..device import SHARED_MEMORY_PER_BLOCK

    base = BACKWARD[family][element_size][block_d]
    budget = SHARED_MEMORY_PER_BLOCK[family] - 8 * 1024  # room for the compiler's conversion scratch
    if block_d >= 256:
        resident_blocks, streamed_blocks = (32, 64, 128), (16, 32, 64, 128)
    else:
        resident_blocks, streamed_blocks = (64, 128), (32, 64, 128)

    def alternatives(accumulators: int, fused: bool = False):
        for resident, streamed, warps, stages in product(resident_blocks, streamed_blocks, (4, 8), (2, 3)):
            smem = element_size * block_d * 2 * (resident + streamed * stages)
            tile_regs = resident * (accumulators * block_d + 2 * streamed) // (32 * warps)
            if fused:
                smem += 4 * streamed * block_d
                tile_regs += streamed * block_d // (32 * warps)
            if smem <= budget and tile_regs <= (256 if fused else 192):
                yield resident, streamed, warps, stages

    paths = dq_paths(family) if paths is None else paths
    yield base
    if "kernel" in paths:
        for keys, rows, warps, stages in alternatives(accumulators=2):
            cfg = AttentionConfig(rows, keys, warps, stages)
            if cfg != base.dkdv:
                yield BackwardConfig(cfg, base.dq, tma=base.tma)
        for rows, keys, warps, stages in alternatives(accumulators=1):
            cfg = AttentionConfig(rows, keys, warps, stages)
            if cfg != base.dq:
                yield BackwardConfig(base.dkdv, cfg, tma=base.tma)
    for path in paths:
        if path != "kernel":
            for keys, rows, warps, stages in alternatives(accumulators=2, fused=True):
                yield BackwardConfig(AttentionConfig(rows, keys, warps, stages), base.dq, path, base.tma)


def gluon_backward_candidates(block_d: int):
    """Gluon backward configurations worth timing at a padded head dim (16-bit, sm90): the
    starting point, then one kernel varied at a time. The resident block is one warpgroup's 64
    rows, two warpgroups' 128, or 64 rows split between two warpgroups by columns (8 warps);
    streamed blocks of 32, 64 or 128 rows in 2 or 3 stages. Kept are those whose shared memory
    (the resident pair, one streamed pair per stage, room for layout conversions) fits an H100
    and whose fp32 tiles per thread (a warpgroup's share of the accumulators and of the two
    score tiles) stay at or below 192 registers, which compile without spilling."""
    from ..device import SHARED_MEMORY_PER_BLOCK

    budget = SHARED_MEMORY_PER_BLOCK[90] - 8 * 1024

    def fits(resident, streamed, warps, stages, accumulators):
        column_split = warps * 16 // resident  # warpgroups sharing one 64-row block by columns
        regs = 64 * (accumulators * block_d + 2 * streamed) // (128 * column_split)
        return 4 * block_d * (resident + streamed * stages) <= budget and regs <= 192

    def variants(accumulators):
        for (resident, warps), streamed, stages in product(((64, 4), (64, 8), (128, 8)), (32, 64, 128), (2, 3)):
            if fits(resident, streamed, warps, stages, accumulators):
                yield resident, streamed, warps, stages

    if block_d <= 128:
        base = BackwardConfig(AttentionConfig(64, 64, 4, 2), AttentionConfig(64, 64, 4, 2), tma=True, gluon=True)
    else:
        base = BackwardConfig(AttentionConfig(64, 64, 8, 2), AttentionConfig(128, 32, 8, 2), tma=True, gluon=True)
    yield base
    for resident, streamed, warps, stages in variants(accumulators=2):
        dkdv = AttentionConfig(streamed, resident, warps, stages)
        if dkdv != base.dkdv:
            yield BackwardConfig(dkdv, base.dq, tma=True, gluon=True)
    for resident, streamed, warps, stages in variants(accumulators=1):
        dq = AttentionConfig(resident, streamed, warps, stages)
        if dq != base.dq:
            yield BackwardConfig(base.dkdv, dq, tma=True, gluon=True)


def _fused_backward_shared(block_d: int, dkdv: AttentionConfig) -> int:
    """Shared memory of a fused Gluon backward program, in bytes: K and V, Q and dO per stage, two
    dS^T tiles and two fp32 dQ tiles."""
    keys, rows = dkdv.block_n, dkdv.block_m
    return 4 * block_d * (keys + rows * dkdv.num_stages) + 4 * keys * rows + 8 * rows * block_d


def gluon_fused_backward_candidates(block_d: int) -> list[BackwardConfig]:
    """Fused Gluon backward configurations (`BackwardConfig.fused`, `_kernels/backward_fused.py`)
    worth timing at a padded head dim of at most 128 (16-bit, sm90): 128 resident keys on two
    warpgroups or 64 on one, 64 or 128 streamed query rows (at most 16 per warp: the dQ product
    splits them between the warps), 2 or 3 stages. Kept are those whose shared memory fits an H100
    and whose fp32 tiles per thread (a warpgroup's share of dK, dV, S^T, dP^T and dQ) stay at or
    below 256 registers. The dq field repeats dkdv: there is no dQ kernel."""
    from ..device import SHARED_MEMORY_PER_BLOCK

    budget = SHARED_MEMORY_PER_BLOCK[90] - 2 * 1024
    found = []
    for (keys, warps), rows, stages in product(((128, 8), (64, 4)), (64, 128), (2, 3)):
        cfg = AttentionConfig(rows, keys, warps, stages)
        regs = block_d + rows + rows * block_d // (32 * warps)
        if rows <= 16 * warps and _fused_backward_shared(block_d, cfg) <= budget and regs <= 256:
            found.append(BackwardConfig(cfg, cfg, "tma", tma=True, gluon=True))
    return found


def fused_backward_maxnreg(block_d: int, dkdv: AttentionConfig) -> int | None:
    """The launch register bound of the fused Gluon backward (`maxnreg`; None: the compiler's).
    A one-warpgroup program (4 consumer warps; the loader and reduce warps are padded to a second
    warpgroup) whose shared memory leaves room for a second program on an H100 SM (D = 64) asks
    for 128 registers a thread, so that two programs share the SM; its consumers then raise theirs
    to 232 with setmaxnreg. Without the bound every thread gets 255 and one program runs per SM:
    on an H100 at D = 64, S = 4096, 241 against 357 TFLOP/s (one-off, this kernel, the sweep's
    shapes). At D = 128 the bound would only make it spill."""
    if dkdv.num_warps == 4 and 2 * (_fused_backward_shared(block_d, dkdv) + 2 * 1024) <= 228 * 1024:
        return 128
    return None


def dkdv_maxnreg(dkdv: AttentionConfig, tma: bool, softcap: bool, varlen: bool) -> int | None:
    """The launch register bound of a Triton dK/dV kernel build: the config's `maxnreg` for the
    dense build that moves its tiles through descriptors without softcap, the one it was measured
    on; None for the others, whose softcap terms, pointer arithmetic and packed-sequence bounds
    take more registers (ptxas: 233 to 255 a thread at D = 64 unbounded) and would spill
    hundreds of bytes under it."""
    return dkdv.maxnreg if tma and not softcap and not varlen else None

