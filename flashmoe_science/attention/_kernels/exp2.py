"""exp2 split between the special-function unit and the FMA pipes.

At head dim 64 a forward key block costs the tensor cores as many cycles as its exponentials
cost the SM's special-function unit (MUFU: 16 exp2 a clock per SM against 4096 bf16 FLOPs a
clock; a 64 x 128 block is 2 x 64 x 128 x 64 x 2 FLOPs and 8192 exp2, 512 clocks each), so the
softmax and the matrix products contend for the same time. FlashAttention-4 moves part of the
exponentials to the FMA pipes, which the softmax leaves mostly idle. `exp2_split(x, EXP_POLY)`
computes EXP_POLY of every four elements that way (0: all on the MUFU, `tl.math.exp2`):

    t = max(x, -126)                 the exponent field below must not underflow
    n = t + 1.5 * 2**23, rounded down   floor(t) lands in n's low mantissa bits
    f = t - (n - 1.5 * 2**23)        the fraction, in [0, 1)
    2**f ~ c0 + f (c1 + f (c2 + f c3))  (`EXP2_POLY`, three FMAs)
    result bits = bits(2**f) + (bits(n) << 23)   adds floor(t) to the exponent field

Nine instructions (and register moves, which cost nothing), none on the MUFU. The cubic is the
minimax fit of 2**f on [0, 1) in relative error (Lawson's iteration on 20001 points): 7.5e-5,
and 1.5e-4 at most over the whole range with float32 rounding (`tests/test_attention_exp2.py`
runs these instructions), far below bf16's 3.9e-3 half-ulp. Only for blocks whose scores are
all finite and at most 0 after the row maximum is subtracted (the unmasked blocks of the
forward): -inf (masked scores) gives 2**-126, not 0, which would give rows that see no key a
nonzero sum.

Inline PTX: GPU only, never under the interpreter (EXP_POLY = 0 there).
"""
import struct

import triton
import triton.language as tl

# 2**f on [0, 1) ~ EXP2_POLY[0] + EXP2_POLY[1] f + EXP2_POLY[2] f**2 + EXP2_POLY[3] f**3.
EXP2_POLY = (0.99992514, 0.695834, 0.22606707, 0.07802403)
EXP2_POLY_FLOOR = -126.0
_MAGIC = 1.5 * 2**23


def _f32(value: float) -> str:
    """The PTX float32 literal ("0f" and eight hex digits) of `value` rounded to float32."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


def exp2_split_asm(poly: int) -> str:
    """PTX for four exp2 (inputs $4..$7, outputs $0..$3): the first 4 - poly on the MUFU
    (`ex2.approx.ftz.f32`, what tl.math.exp2 lowers to), the last `poly` by the polynomial."""
    if not 1 <= poly <= 4:
        raise ValueError(f"poly must be 1..4 of every four exponentials, got {poly}")
    c0, c1, c2, c3 = (_f32(c) for c in EXP2_POLY)
    lines = ["{", ".reg .f32 t, n, f, p;", ".reg .b32 e, q;"]
    lines += [f"ex2.approx.ftz.f32 ${i}, ${i + 4};" for i in range(4 - poly)]
    for i in range(4 - poly, 4):
        lines += [f"max.f32 t, ${i + 4}, {_f32(EXP2_POLY_FLOOR)};",
                  f"add.rm.f32 n, t, {_f32(_MAGIC)};",
                  f"sub.f32 f, n, {_f32(_MAGIC)};",
                  "sub.f32 f, t, f;",
                  f"fma.rn.f32 p, f, {c3}, {c2};",
                  f"fma.rn.f32 p, p, f, {c1};",
                  f"fma.rn.f32 p, p, f, {c0};",
                  "mov.b32 e, n;",
                  "shl.b32 e, e, 23;",
                  "mov.b32 q, p;",
                  "add.s32 q, q, e;",
                  f"mov.b32 ${i}, q;"]
    lines.append("}")
    return "\n".join(lines)


_ASM_1 = tl.constexpr(exp2_split_asm(1))
_ASM_2 = tl.constexpr(exp2_split_asm(2))
_ASM_3 = tl.constexpr(exp2_split_asm(3))
_CONSTRAINTS = tl.constexpr("=f,=f,=f,=f,f,f,f,f")


@triton.jit
def exp2_split(x, EXP_POLY: tl.constexpr):
    """exp2 of float32 x, EXP_POLY (0 to 3) of every four elements by the polynomial (module
    docstring; x finite and <= 0 wherever EXP_POLY > 0)."""
    if EXP_POLY == 0:
        return tl.math.exp2(x)
    elif EXP_POLY == 1:
        return tl.inline_asm_elementwise(_ASM_1, _CONSTRAINTS, [x], dtype=tl.float32, is_pure=True, pack=4)
    elif EXP_POLY == 2:
        return tl.inline_asm_elementwise(_ASM_2, _CONSTRAINTS, [x], dtype=tl.float32, is_pure=True, pack=4)
    else:
        tl.static_assert(EXP_POLY == 3, "EXP_POLY: 0 to 3 of every four exponentials")
        return tl.inline_asm_elementwise(_ASM_3, _CONSTRAINTS, [x], dtype=tl.float32, is_pure=True, pack=4)
