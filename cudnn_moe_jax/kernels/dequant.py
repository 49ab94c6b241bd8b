"""Exact dequantization of block-scaled operands to bf16 on chip (the converters of mainloop_dequant).

Every FP8 / FP4 value times its block scale is exact in bf16 (a code has at most 4 significant bits, an e4m3 scale
4, an e8m0 scale is a power of two, and bf16 has fp32's exponent range), so `bf16(val(x) * val(s))` fed to a bf16
wgmma with fp32 accumulation computes the reference's products exactly (docs/numerics.md); only results below
bf16's normal range (|v * s| < 2^-126, where a code times its scale can need more than bf16's 7 subnormal bits)
round, where the reference on the CPU flushes them to zero and on the GPU keeps fp32 subnormals.

Conversion of a code to bf16 is a bit placement, no table and no cvt (sm_90 has no e2m1 cvt, and the F2FP
conversions issue at a quarter of the integer rate):
  e4m3  s.eeee.mmm  -> sign at bf16 bit 15, the 7 magnitude bits at bits 10..4: the bf16 value is v * 2^-120
        (its exponent field is the e4m3 one, bias 127 instead of 7; e4m3 subnormals land on bf16 subnormals with
        the same factor, so zeros and subnormals are exact too);
  e5m2  s.eeeee.mm  -> magnitude at bits 11..5: v * 2^-112;
  e2m1  s.ee.m      -> magnitude at bits 8..6: v * 2^-126.
Then two `mul.rn.bf16x2`: by 2^K (exact, restores v) and by the block scale (exact, or one rounding below 2^-126).
A single multiply by 2^K * scale would overflow bf16 for large scales (e8m0 codes above 134 for e4m3).

Specials: the placement turns e4m3's NaN (0x7F) and e5m2's inf / NaN (exponent 31) into finite numbers.
  e4m3: a NaN code places as +-480 (the finite maximum is 448), so after the first multiply d = v * NAN_PROBE
        overflows to +-inf exactly for NaN codes, and the scale is applied as fma(v, scale, d - d): d - d is NaN
        there and +0 elsewhere (only the sign of a zero product changes, which no sum sees). Floating-point pipe
        work, next to an integer pipe that the placement already loads;
  e5m2: inf must stay inf, so the specials are flagged per byte (`(b & 0x7C) + 4` sets bit 7 exactly for them)
        and their bf16 exponent field forced to all ones: inf -> inf (mantissa 0), NaN -> NaN, with the sign.
e2m1 has no specials. Scales: e8m0 0x00 is 2^-127 (the bf16 subnormal 0x0040), 0xFF NaN; an e4m3 scale decodes
like e4m3 data.

Pairs: a converter works on a *group* of 16 consecutive K elements of one row (16 bytes of FP8, 8 of FP4) and
returns 8 bf16x2 words ("pairs" p = 0..7). FP8 pair p holds elements (2p, 2p + 1); FP4 pair p holds elements
(8 (p // 4) + p % 4, that + 4) -- nibbles k and k + 4 of one 32-bit word, which one integer multiply places
(`_fp4_pair`). `pair_k` is the map; operands A and B of one GEMM use the same one, so their K order agrees.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm

E4M3, E5M2, E2M1, E8M0 = "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "float8_e8m0fnu"
DATA_FORMATS = (E4M3, E5M2, E2M1)
GROUP = 16          # K elements per converter group
PAIRS = GROUP // 2  # bf16x2 words per group
# per data format: exponent bias shift K (bf16 value = v * 2^-K), bf16 bits kept from the placed code
# (sign + magnitude, per half), the shift that places the byte, the special-value flag's (mask, increment)
_FP8 = {
    E4M3: dict(bias=120, keep=0x87F087F0, shift=4),
    E5M2: dict(bias=112, keep=0x8FE08FE0, shift=5, flag=(0x7C7C7C7C, 0x04040404)),
}
# bf16 1.1015625 * 2^119: 448 times it is finite, 480 times it rounds to inf (e4m3 NaN detection, above)
NAN_PROBE = 0x7B0D7B0D
E2M1_BIAS = 126
E2M1_KEEP = 0x81C081C0
# prmt selectors (result byte i <- nibble i; nibble bit 3 replicates the selected byte's sign bit; bytes 4-7 are
# the second operand, 0 here): bytes (b_2h, b_2h+1) of a word as [sx b1, b1, sx b0, b0] ...
_SEL_PAIR = (0x9180, 0xB3A2)
# ... and the special flags as 0xFF00 per flagged element ([sx f1, 0, sx f0, 0])
_SEL_FLAG = (0x9484, 0xB4A4)


def bytes_per_group(data_dtype: str) -> int:
    return GROUP // 2 if data_dtype == E2M1 else GROUP


def pair_k(data_dtype: str, p: int, e: int) -> int:
    """K offset inside a group of element e (0: low half, 1: high half) of pair p."""
    if data_dtype == E2M1:
        return 8 * (p // 4) + p % 4 + 4 * e
    return 2 * p + e


def bias_bits(data_dtype: str) -> int:
    """bf16x2 bits of 2^K (both halves): what turns a placed code back into its value."""
    bias = E2M1_BIAS if data_dtype == E2M1 else _FP8[data_dtype]["bias"]
    half = (127 + bias) << 7
    return half | (half << 16)


# ------------------------------------------------------------------------------------------------ PTX helpers


def _i32(x: int) -> Int32:
    """A 32-bit pattern as a signed Int32 constant."""
    return Int32(x - (1 << 32) if x >= 1 << 31 else x)


def _asm(code: str, *args) -> Int32:
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Int32(a).ir_value() for a in args], code, "=r" + ",r" * len(args),
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def prmt(a: Int32, sel: cutlass.Constexpr) -> Int32:
    """Byte permute of `a` (and zero bytes) by the constant selector `sel`."""
    return _asm(f"prmt.b32 $0, $1, 0, {sel:#x};", a)


@cute.jit
def prmt2(a: Int32, b: Int32, sel: cutlass.Constexpr) -> Int32:
    """Byte permute of (b:a) (bytes 4-7 from b) by the constant selector `sel`."""
    return _asm(f"prmt.b32 $0, $1, $2, {sel:#x};", a, b)


@cute.jit
def prmt_dynamic(a: Int32, b: Int32, sel: Int32) -> Int32:
    """Byte permute of (b:a) by the selector in register `sel`."""
    return _asm("prmt.b32 $0, $1, $2, $3;", a, b, sel)


@cute.jit
def mul_bf16x2(a: Int32, b: Int32) -> Int32:
    """Both bf16 halves of a times those of b, rounded to nearest even (subnormals kept)."""
    return _asm("mul.rn.bf16x2 $0, $1, $2;", a, b)


@cute.jit
def fma_bf16x2(a: Int32, b: Int32, c: Int32) -> Int32:
    return _asm("fma.rn.bf16x2 $0, $1, $2, $3;", a, b, c)


@cute.jit
def sub_bf16x2(a: Int32, b: Int32) -> Int32:
    return _asm("sub.rn.bf16x2 $0, $1, $2;", a, b)


@cute.jit
def bitselect(mask: cutlass.Constexpr, a: Int32, b: Int32) -> Int32:
    """(a & mask) | (b & ~mask) in one LOP3 (ptxas does not merge the two constants itself)."""
    return _asm(f"lop3.b32 $0, $1, $2, {mask:#x}, 0xe4;", a, b)


@cute.jit
def splat_bf16(half: Int32) -> Int32:
    """bf16 bits in the low half -> the same value in both halves."""
    return _asm("prmt.b32 $0, $1, 0, 0x1010;", half)


def void_asm(code: str, constraints: str, *args) -> None:
    llvm.inline_asm(None, [a.ir_value() for a in args], code, constraints, has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def st_global_v2(addr: Int64, a: Int32, b: Int32):
    void_asm("st.global.v2.b32 [$0], {$1, $2};", "l,r,r", Int64(addr), Int32(a), Int32(b))


@cute.jit
def ld_global_words(addr: Int64, n: cutlass.Constexpr, coherent: cutlass.Constexpr = False):
    """n (2 or 4) 32-bit words at a 8 / 16-byte aligned global address: through the read-only path, or with
    `coherent` the plain one (a buffer the kernel also writes: the wgrad's old W)."""
    i32 = Int32.mlir_type
    outs = ", ".join(f"${i}" for i in range(n))
    path = "" if coherent else ".nc"
    res = llvm.inline_asm(llvm.StructType.get_literal([i32] * n), [Int64(addr).ir_value()],
                          f"ld.global{path}.v{n}.b32 {{{outs}}}, [${n}];", ",".join(["=r"] * n) + ",l",
                          has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Int32(llvm.extractvalue(i32, res, [k])) for k in range(n)]


@cute.jit
def st_global_v4(addr: Int64, w: list):
    void_asm("st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", Int64(addr), *[Int32(x) for x in w])


@cute.jit
def st_shared_v4(addr: Int32, w: list):
    """One 16-byte shared-memory store of four words at the shared address `addr` (16-byte aligned)."""
    void_asm("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", Int32(addr), *[Int32(x) for x in w])



# ------------------------------------------------------------------------------------------------ fp16 A


@cute.jit
def bf16x2_to_f16x2(w: Int32) -> Int32:
    """Two bf16 values (a word) as fp16: exact for the products of codes and scales `formats.exact_in_float16`
    admits (the weights beside an fp16 A); NaN stays NaN."""
    return _asm("{\n.reg .b32 lo, hi;\nshl.b32 lo, $1, 16;\nand.b32 hi, $1, 0xffff0000;\n"
                "cvt.rn.f16x2.f32 $0, hi, lo;\n}", w)


@cute.jit
def f16_f32_bits(w: Int32, high: cutlass.Constexpr) -> Int32:
    """fp32 bits of the fp16 in the low (high=False) or high half of w (exact)."""
    half = "h" if high else "l"
    return _asm("{\n.reg .b16 l, h;\n.reg .f32 f;\nmov.b32 {l, h}, $1;\n"
                f"cvt.f32.f16 f, {half};\nmov.b32 $0, f;\n}}", w)


@cute.jit
def split_f16x2(w: Int32):
    """fp16x2 w -> (hi, lo) bf16x2 with hi + lo = w exactly per half: hi keeps the top 8 significant bits
    (round toward zero: the upper half of the fp32 bits; a NaN stays NaN, inf inf), lo the rest (at most 3
    significant bits, exact in bf16). An infinite value's lo (inf - inf) becomes 2^16, finite, so hi * b + lo * b
    is inf like the value's product (min.f32 returns the non-NaN operand)."""
    f0, f1 = f16_f32_bits(w, False), f16_f32_bits(w, True)
    hi = _asm("cvt.rz.bf16x2.f32 $0, $2, $1;", f0, f1)
    lo = _asm("{\n.reg .b32 g0, g1;\n.reg .f32 r0, r1;\n"
              "and.b32 g0, $1, 0xFFFF0000;\nand.b32 g1, $2, 0xFFFF0000;\n"
              "sub.rn.f32 r0, $1, g0;\nsub.rn.f32 r1, $2, g1;\n"
              "min.f32 r0, r0, 0f47800000;\nmin.f32 r1, r1, 0f47800000;\n"
              "cvt.rn.bf16x2.f32 $0, r1, r0;\n}", f0, f1)
    return hi, lo


# ------------------------------------------------------------------------------------------------ scales


@cute.jit
def e8m0_bf16(e: Int32) -> Int32:
    """bf16 bits of 2^(e - 127) for an e8m0 code e (0..255): 0x00 -> 2^-127 (subnormal 0x0040), 0xFF -> NaN."""
    nan_or_tiny = ((e + Int32(1)) & Int32(0x100)) >> 2                      # 0x40 for e = 255
    tiny = Int32(cutlass.select_(e == Int32(0), Int32(0x40), Int32(0)))
    return (e << 7) | nan_or_tiny | tiny


@cute.jit
def e8m0_bf16x2(e: Int32) -> Int32:
    """e8m0_bf16 of the two codes in the low bytes of each 16-bit half of e (no carries cross the halves)."""
    nan = ((e + Int32(0x00010001)) & Int32(0x01000100)) >> 2                  # 0x40 where the code is 255
    tiny = (~(e + Int32(0x00FF00FF)) & Int32(0x01000100)) >> 2                # 0x40 where it is 0
    return (e << 7) | nan | tiny


@cute.jit
def e4m3_bf16(c: Int32) -> Int32:
    """bf16 bits of val(c) for an e4m3 code c (0..255; NaN 0x7F / 0xFF -> NaN), exact."""
    placed = ((c & Int32(0x7F)) << 4) | ((c & Int32(0x80)) << 8)           # val * 2^-120
    placed = Int32(cutlass.select_((c & Int32(0x7F)) == Int32(0x7F), Int32(0x7FC0), placed))
    return mul_bf16x2(placed, _i32(bias_bits(E4M3))) & Int32(0xFFFF)


@cute.jit
def scale_bf16x2(code: Int32, sf_dtype: cutlass.Constexpr, valid: cutlass.Boolean) -> Int32:
    """The block scale of an SF byte as bf16 in both halves; 0.0 where `valid` is false (K past K, rows past N:
    their data is zero-filled and their SF bytes are padding, which must not turn 0 into NaN)."""
    half = e8m0_bf16(code) if const_expr(sf_dtype == E8M0) else e4m3_bf16(code)
    return Int32(cutlass.select_(valid, splat_bf16(half), Int32(0)))


# ------------------------------------------------------------------------------------------------ data


@cute.jit
def fp8_pair(w: Int32, data_dtype: cutlass.Constexpr, h: cutlass.Constexpr) -> Int32:
    """Codes 2h, 2h + 1 of a word -> bf16x2 of v * 2^-K; e5m2 specials forced."""
    f = _FP8[data_dtype]
    placed = (prmt(w, _SEL_PAIR[h]) << f["shift"]) & _i32(f["keep"])
    if const_expr(data_dtype == E5M2):
        mask, inc = f["flag"]
        flags = (w & Int32(mask)) + Int32(inc)           # bit 7 of byte i: code i is inf / NaN (no carries out)
        placed = bitselect(f["keep"], placed, prmt(flags, _SEL_FLAG[h]))
    return placed


@cute.jit
def _fp4_pair(w: Int32, k: cutlass.Constexpr) -> Int32:
    """Nibbles k and k + 4 of w (elements k, k + 4) -> bf16x2 of v * 2^-126: the nibble's magnitude moves to bits
    8..6 and its sign to bit 15 by one multiply (two shifted copies that do not overlap), then a mask."""
    src = w if const_expr(k < 2) else w >> 8
    lo = k % 2
    nib = src & Int32(0x00F000F0 if lo else 0x000F000F)
    return (nib * Int32(0x104 if lo else 0x1040)) & _i32(E2M1_KEEP)


@cute.jit
def placed_pair(words, data_dtype: cutlass.Constexpr, p: cutlass.Constexpr) -> Int32:
    """Pair p of a group's code words placed as bf16x2 of v * 2^-K (`fp8_pair`, `_fp4_pair`)."""
    if const_expr(data_dtype == E2M1):
        return _fp4_pair(words[p // 4], p % 4)
    return fp8_pair(words[p // 2], data_dtype, p % 2)


@cute.jit
def folded_scales2(codes2: Int32, data_dtype: cutlass.Constexpr, sf_dtype: cutlass.Constexpr):
    """Two SF codes (the low byte of each 16-bit half) -> (bf16x2 of scale * 2^K per half, where K is the data
    format's placement bias (`bias_bits`); nonzero where a half is not finite). A placed pair times a finite folded
    scale is val(code) * scale in one multiply, exactly as `scale_pair`'s two (scale * 2^K has at most 4
    significant bits and is normal, so the product is the one rounding of v * scale); a scale >= 2^(128 - K) -- or
    a NaN scale -- overflows it and needs `scale_pair`. e8m0: 2^(e - 127 + K), an add to the exponent field (e + K
    must stay below 255); e4m3: placed as in `e4m3_bf16`, then times 2^K * 2^120 in two exact steps (a NaN code
    places as 480 and overflows)."""
    bias = E2M1_BIAS if const_expr(data_dtype == E2M1) else _FP8[data_dtype]["bias"]
    if const_expr(sf_dtype == E8M0):
        s2 = codes2 * Int32(128) + _i32((bias << 7) * 0x10001)
        return s2, (codes2 + Int32((bias + 1) * 0x10001)) & Int32(0x01000100)
    placed = ((codes2 << 4) & Int32(0x07F007F0)) | ((codes2 << 8) & _i32(0x80008000))    # scale * 2^-120
    step = (120 + bias) // 2
    s2 = mul_bf16x2(mul_bf16x2(placed, _pow2x2(step)), _pow2x2(120 + bias - step))
    return s2, ((s2 & Int32(0x7F807F80)) + Int32(0x00800080)) & _i32(0x80008000)    # exponent field all ones


def _pow2x2(e: int) -> Int32:
    """bf16x2 bits of 2^e in both halves."""
    return _i32(((127 + e) << 7) * 0x10001)


@cute.jit
def convert_group(words, data_dtype: cutlass.Constexpr, scale2, store, nan_by_group: cutlass.Constexpr = False):
    """One group: its 32-bit words (FP8: 4, FP4: 2) and the block scale (bf16x2) -> its 8 bf16x2 pairs (module
    docstring), val(code) * scale each, handed to `store(p, pair)` as they are made (few live registers: the
    producer warpgroup's threads have 40). `scale2` may be a function of the pair (p -> bf16x2): the two halves of
    a pair then take their own scales (a group over two scale blocks; the pair of two rows of a token-major
    operand). `nan_by_group` (e4m3, one scale): a NaN code makes the whole group NaN (`group_nan_scale`) instead
    of only its element -- for a caller whose group is part of one row of an operand that every K of one output
    row (A) or column (B) sums, where one NaN makes that whole row or column NaN anyway."""
    by_group = const_expr(nan_by_group and data_dtype == E4M3 and not callable(scale2))
    if const_expr(by_group):
        scale2 = group_nan_scale(words, scale2)
    for p in cutlass.range_constexpr(PAIRS):
        x = placed_pair(words, data_dtype, p)
        if const_expr(by_group):
            store(p, mul_bf16x2(mul_bf16x2(x, _i32(bias_bits(data_dtype))), scale2))
        else:
            store(p, scale_pair(x, data_dtype, scale2(p) if const_expr(callable(scale2)) else scale2))


@cute.jit
def convert_group_folded(words, data_dtype: cutlass.Constexpr, code: Int32, sf_dtype: cutlass.Constexpr,
                         valid: cutlass.Boolean, store):
    """`convert_group` of an FP8 group with its SF code (NaN by group; 0.0 where not `valid`) in one multiply a pair
    by the folded scale (`folded_scales2`) where that is finite, else -- its overflow flag set (scale >= 2^(128 -
    K), a NaN scale) or a NaN code in the group (`e4m3_nan_bits`, one test with the flag) -- in the two multiplies:
    a per-lane branch, uniform in practice."""
    folded, bad = folded_scales2(code, data_dtype, sf_dtype)      # (code: the low half's; the high half's 0)
    if const_expr(data_dtype == E4M3):
        bad = bad | e4m3_nan_bits(words)                           # a NaN code: the exact path, NaN by group
    if bad == Int32(0):
        scale2 = Int32(cutlass.select_(valid, prmt(folded, 0x1010), Int32(0)))
        for p in cutlass.range_constexpr(PAIRS):
            store(p, mul_bf16x2(placed_pair(words, data_dtype, p), scale2))
    else:
        convert_group(words, data_dtype, scale_bf16x2(code, sf_dtype, valid), store, True)


@cute.jit
def e4m3_nan_bits(words) -> Int32:
    """Nonzero exactly where an e4m3 code of the 32-bit `words` is NaN (0x7F / 0xFF): a byte plus one flips its bit 7
    where its magnitude is 0x7F, or where a carry from a lower byte -- itself NaN (0xFF) -- reaches it, so the
    verdict for a word is exact; one add and one LOP3 (`flags | (w + 1s) ^ w`) a word."""
    flags = Int32(0)
    for w in words:
        flags = flags | ((w + Int32(0x01010101)) ^ w)
    return flags & _i32(0x80808080)


@cute.jit
def group_nan_scale(words, scale2: Int32) -> Int32:
    """`scale2`, or NaN where any e4m3 code of the group's words is NaN (`e4m3_nan_bits`), so the pairs need no
    per-element probe (2 of their 4 floating-point operations; the placed NaN code is finite, +-480, and times a
    NaN scale NaN)."""
    return Int32(cutlass.select_(e4m3_nan_bits(words) != Int32(0), Int32(0x7FC07FC0), scale2))


@cute.jit
def scale_pair(x: Int32, data_dtype: cutlass.Constexpr, scale2: Int32) -> Int32:
    """A placed pair (bf16x2 of v * 2^-K, `fp8_pair` / `_fp4_pair`) -> val(code) * scale per half (e4m3 NaN codes
    -> NaN)."""
    v = mul_bf16x2(x, _i32(bias_bits(data_dtype)))
    if const_expr(data_dtype == E4M3):
        probe = mul_bf16x2(v, Int32(NAN_PROBE))
        return fma_bf16x2(v, scale2, sub_bf16x2(probe, probe))
    return mul_bf16x2(v, scale2)
