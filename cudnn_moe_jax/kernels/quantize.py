"""Output quantization device functions (docs/formats.md#row-quantization, #column-quantization, #fp4-d-outputs,
#nvfp4, #rounding), bit-exact with `cudnn_moe_jax.formats.quantize_rows` / `quantize_cols`: FP8 and FP4 (MXFP4) D
with e8m0 scales, vec 32, and NVFP4 (e2m1 with e4m3 scales, vec 16).

Per block of 32 values (a row's 32 columns, or a column's 32 rows):
  amax   max |x| taken on the bit patterns of |x| (integer max: NaN (0x7fc00000) beats +inf, as the spec's
         NaN-propagating max), x flushed: fp32 subnormals count as 0 (formats flushes its input);
  pv     (amax * rcp_limit) * norm_const, each product flushed to zero when subnormal (`mul.ftz`, formats' fixed
         flush points), in this operand order (docs/formats.md#row-quantization);
  s      e8m0 RCEIL by the closed form of docs/formats.md#rounding on the bits of pv: 0 -> 0x00, NaN -> 0xFF,
         min(E + (M != 0), 254) otherwise (inf and huge -> 0xFE);
  scale  norm_const * 2^(127 - s) as an exact power-of-two product (2^-127 applied as 2^-126 * 0.5), flushed,
         clamped to FLT_MAX; NaN for s = 0xFF;
  q      RNE-satfinite FP8 of x * scale (`F2FP.SATFINITE`, x flushed).
rcp_limit is formats.rcp_limit(d_dtype): float32(1/448) for e4m3, float32(1/57344) for e5m2, float32(1/6) for e2m1
(docs/formats.md#quantization).

FP4 (e2m1) data: the same blocks, codes by `e2m1_code` (sm_90 has no e2m1 cvt), packed two a byte. NVFP4 blocks
(vec 16, `nvfp4_code_scale`) have e4m3 scales: s = RNE-satfinite e4m3 of pv, scale = min(norm_const * rcp.rn(val(s)),
FLT_MAX) (the correctly rounded reciprocal, as formats' table), NaN for s = 0x7F.

Fragment helpers work on the sm90 epilogue's per-thread D fragment of one 128 x 32 subtile: 16 values, flat index
`i = v0 + 2*v1 + 4*v2 + 8*v3` at (row + 8*v1, col + v0 + 8*v2 + 16*v3) where the thread's base row is
`16*warp + lane//4` (+64 for the second warpgroup) and its base column `2*(lane % 4)` (checked at trace time by
`check_fragment_layout`). So a row's 32 columns live in the 4 lanes of a quad (8 values each) and a column's 16
rows of a warp in the 8 lanes `lane % 4 == c`; a 32-row column block spans warps 2b and 2b+1. |x| bits are taken
once per value (row and column maxima share them) and flushed once per block maximum; a column block's code and
scale are computed once per lane (lane c: column c) and shuffled to the threads holding that column.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm

FLT_MAX_BITS = 0x7F7FFFFF
FRAGMENT_LAYOUTS = (  # printed coordinate layouts of the D fragment (stmatrix / universal-copy partitions)
    "(((2,2,2),1),1,2):(((1@1,8@0,8@1),0),0,16@1)",
    "((1,(2,2,2)),1,2):((0,(1@1,8@0,8@1)),0,16@1)",
)
FRAG = 16  # values per thread per 128 x 32 subtile
NVFP4_RCP_LIMIT = float.fromhex("0x1.555556p-3")   # formats.rcp_limit(e2m1) = float32(1 / 6)


def check_fragment_layout(coords) -> None:
    """Trace time: the quantizers assume the fragment layout documented above."""
    text = str(coords.layout).replace(" ", "")
    if text not in FRAGMENT_LAYOUTS:
        raise NotImplementedError(f"FP8 output quantization: unexpected epilogue fragment layout {text}")


def row_of(i: int) -> int:
    """0/1: which of the thread's two rows flat index i is on."""
    return (i // 2) % 2


def col_slot(i: int) -> int:
    """0..7: which of the thread's 8 columns flat index i is in (col = base + 2*(slot//2 % 2)*4 ...)."""
    return (i % 2) + 2 * (i // 4)


def first_row(warp, lane):
    """The thread's first fragment row in the 128-row subtile (its second is + 8; warp 0..7 of the consumer
    warpgroups): the layout documented above."""
    return 64 * (warp // 4) + 16 * (warp % 4) + lane // 4


def slot_col(slot: int) -> int:
    """Column offset (from the thread's base column) of column slot `slot`."""
    v0, v2, v3 = slot % 2, (slot // 2) % 2, slot // 4
    return v0 + 8 * v2 + 16 * v3


@cute.jit
def opaque(x: Int32) -> Int32:
    """x through an asm the compiler may not move or merge (keeps values derived from x inside their loop)."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Int32(x).ir_value()], "mov.b32 $0, $1;", "=r,r", has_side_effects=True,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def fresh(x: Int32, zero_addr: Int32) -> Int32:
    """x + the word at shared address `zero_addr` (which holds 0), read `ld.volatile`: unlike `opaque`, whose mov
    ptxas sees through (it merges every copy of one x), each call is a new value that ptxas must recompute from,
    so values derived from it are not shared, and held, between calls."""
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Int32(x).ir_value(), Int32(zero_addr).ir_value()],
        "{\n.reg .u32 t;\nld.volatile.shared.u32 t, [$2];\nadd.u32 $0, $1, t;\n}", "=r,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def _asm_f32(code: str, *args) -> Float32:
    return Float32(llvm.inline_asm(
        Float32.mlir_type, [Float32(a).ir_value() for a in args], code, "=f" + ",f" * len(args),
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def _asm_i32(code: str, *args) -> Int32:
    return Int32(llvm.inline_asm(
        Int32.mlir_type, [Int32(a).ir_value() for a in args], code, "=r" + ",r" * len(args),
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def add_rn(a: Float32, b: Float32) -> Float32:
    """a + b rounded on its own: an explicit `.rn` keeps ptxas from contracting it with the product feeding it into
    one FFMA (measured: alpha * acc + old W became FFMA), so the result is fl(fl(a) + b)."""
    return _asm_f32("add.rn.f32 $0, $1, $2;", a, b)


@cute.jit
def mul_ftz(a: Float32, b: Float32) -> Float32:
    return Float32(llvm.inline_asm(
        Float32.mlir_type, [Float32(a).ir_value(), Float32(b).ir_value()],
        "mul.ftz.f32 $0, $1, $2;", "=f,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def abs_raw(x: Float32) -> Int32:
    """Bits of |x| (not flushed: block maxima are flushed once, `flush_bits`)."""
    return x.bitcast(Int32) & Int32(0x7FFFFFFF)


@cute.jit
def flush_bits(b: Int32) -> Int32:
    """|x| bits with fp32 subnormals as 0. Monotone, so the flushed max of a block is the flush of its max."""
    return Int32(cutlass.select_(b < Int32(0x00800000), Int32(0), b))


@cute.jit
def e8m0_rceil(pv: Float32) -> Int32:
    """e8m0 code of pv >= 0 (flushed: 0 or >= 2^-126, inf, NaN), round toward +inf, saturating at 0xFE."""
    b = pv.bitcast(Int32)
    e = (b >> 23) & Int32(0xFF)
    code = e + Int32(cutlass.select_((b & Int32(0x7FFFFF)) != Int32(0), Int32(1), Int32(0)))
    code = cutlass.min(code, Int32(254))
    return Int32(cutlass.select_(b > Int32(0x7F800000), Int32(255), code))


@cute.jit
def e8m0_scale(code: Int32, norm_const: Float32) -> Float32:
    """min(norm_const * 2^(127 - code), FLT_MAX) exactly (formats._mul_exp2 + clamp); NaN for code 255."""
    hi = (cutlass.max(Int32(254) - code, Int32(1)) << 23).bitcast(Float32)   # 2^max(127-code, -126)
    lo = Float32(cutlass.select_(code == Int32(254), Float32(0.5), Float32(1.0)))
    s = mul_ftz(mul_ftz(norm_const, hi), lo)
    s = cute.arch.fmin(s, Int32(FLT_MAX_BITS).bitcast(Float32))
    return Float32(cutlass.select_(code == Int32(255), Int32(0x7FC00000).bitcast(Float32), s))


@cute.jit
def block_code_scale(amax_bits: Int32, rcp_limit: cutlass.Constexpr, norm_const: Float32):
    """(e8m0 code, scale) of one block from the bits of its amax."""
    pv = mul_ftz(mul_ftz(amax_bits.bitcast(Float32), Float32(rcp_limit)), norm_const)
    code = e8m0_rceil(pv)
    return code, e8m0_scale(code, norm_const)


@cute.jit
def quad_max(v: Int32) -> Int32:
    """Max over the 4 lanes of a quad (the lanes holding one row)."""
    v = cutlass.max(v, cute.arch.shuffle_sync_bfly(v, offset=1))
    return cutlass.max(v, cute.arch.shuffle_sync_bfly(v, offset=2))


@cute.jit
def quantize_rows(rVal: cute.Tensor, rAbs: list, rQ: cute.Tensor, rcp_limit: cutlass.Constexpr,
                  norm_const: Float32):
    """rQ (FP8, 16) <- row-quantized rVal (f32, 16); rAbs: `abs_raw` of each value. Returns the e8m0 codes of the
    thread's two rows."""
    codes = []
    scales = []
    for r in cutlass.range_constexpr(2):
        m = Int32(0)
        for i in cutlass.range_constexpr(FRAG):
            if const_expr(row_of(i) == r):
                m = cutlass.max(m, rAbs[i])
        code, scale = block_code_scale(flush_bits(quad_max(m)), rcp_limit, norm_const)
        codes.append(code)
        scales.append(scale)
    rY = cute.make_rmem_tensor(rVal.shape, Float32)
    for i in cutlass.range_constexpr(FRAG):
        rY[i] = mul_ftz(rVal[i], scales[row_of(i)])
    rQ.store(rY.load().to(rQ.element_type))
    return codes[0], codes[1]


@cute.jit
def column_partial_max(rAbs: list, sColMax: cute.Tensor, warp: Int32, lane: Int32):
    """Per column of the subtile: max |x| bits (unflushed) over this warp's 16 rows -> sColMax[(col, warp)].
    A reduce-scatter over the 8 lanes t + 4q that hold the same 8 columns (slots): each round keeps half of the
    remaining slots and takes the partner's other half (7 shuffles in all), so lane t + 4q ends with the max of
    its slot q and stores it."""
    m = []
    for slot in cutlass.range_constexpr(8):
        v = Int32(0)
        for i in cutlass.range_constexpr(FRAG):
            if const_expr(col_slot(i) == slot):
                v = cutlass.max(v, rAbs[i])
        m.append(v)
    q = lane // 4
    for bit, xor in ((4, 16), (2, 8), (1, 4)):  # q's bits 2, 1, 0 = lane bits 4, 3, 2
        n = len(m) // 2
        upper = (q & Int32(bit)) != Int32(0)  # this lane keeps the upper half of the remaining slots
        kept = []
        for j in cutlass.range_constexpr(n):
            give = Int32(cutlass.select_(upper, m[j], m[j + n]))
            mine = Int32(cutlass.select_(upper, m[j + n], m[j]))
            kept.append(cutlass.max(mine, cute.arch.shuffle_sync_bfly(give, offset=xor)))
        m = kept
    # slot q's column offset (slot_col): v0 + 8 v2 + 16 v3 for q = v0 + 2 v2 + 4 v3
    sColMax[(2 * (lane % 4) + (q & Int32(1)) + 4 * (q & Int32(6)), warp)] = m[0]


@cute.jit
def col_scaled(rVal: cute.Tensor, sColMax: cute.Tensor, warp: Int32, lane: Int32, rcp_limit: cutlass.Constexpr,
               norm_const: Float32):
    """rVal times its column scales (32-row blocks = this warp and its partner warp ^ 1; call after the barrier
    that follows `column_partial_max`). Lane c computes the code and scale of subtile column c once (both warps
    of the pair do); each thread takes its 8 columns' scales by shuffle. Returns (the e8m0 code of column `lane`,
    the scaled values)."""
    m = cutlass.max(sColMax[(lane, warp)], sColMax[(lane, warp ^ 1)])
    code, scale = block_code_scale(flush_bits(m), rcp_limit, norm_const)
    base = 2 * (lane % 4)
    rY = cute.make_rmem_tensor(rVal.shape, Float32)
    for slot in cutlass.range_constexpr(8):
        s = cute.arch.shuffle_sync(scale, base + slot_col(slot))
        for i in cutlass.range_constexpr(FRAG):
            if const_expr(col_slot(i) == slot):
                rY[i] = mul_ftz(rVal[i], s)
    return code, rY


@cute.jit
def quantize_cols(rVal: cute.Tensor, rQ: cute.Tensor, sColMax: cute.Tensor, warp: Int32, lane: Int32,
                  rcp_limit: cutlass.Constexpr, norm_const: Float32):
    """rQ <- column-quantized rVal (`col_scaled`, FP8). Returns the e8m0 code of column `lane`."""
    code, rY = col_scaled(rVal, sColMax, warp, lane, rcp_limit, norm_const)
    rQ.store(rY.load().to(rQ.element_type))
    return code



# ---------------------------------------------------------------------------------------------------- FP4 (e2m1)
# Codes by one RNE fp32 addition: a = min(|y|, 8) plus C = 2^(22 + max(e, 0)) (e: a's exponent) rounds a to the e2m1
# grid's spacing in its binade (0.5 below 2, 1 in [2, 4), 2 in [4, 8)); the sum's bits minus C's count the steps, and
# the code is the step count plus 2 max(e, 0) (8 and above saturate to 7). C = 2^max(e, 0) * 2^22: the sum is one fma.
_E2M1_ONE = 0x3F800000
_E2M1_C_OFFSET = 22 << 23             # bits of C - bits of 2^max(e, 0)


@cute.jit
def e2m1_code(y: Float32) -> Int32:
    """RNE-satfinite e2m1 nibble of y (formats.e2m1_encode): magnitude code 0..7 (above; saturating at 7 = 6.0, inf
    too), sign bit 8 (-0 and negatives rounding to 0 keep it); NaN -> 7."""
    b = y.bitcast(Int32)
    a = _asm_f32("{\n.reg .f32 t;\nabs.f32 t, $1;\nmin.f32 $0, t, 0f41000000;\n}", y)   # min(|y|, 8); NaN -> 8
    e_bits = cutlass.max(a.bitcast(Int32) & Int32(0x7F800000), Int32(_E2M1_ONE))       # 2^max(e, 0)
    total = _asm_f32("fma.rn.f32 $0, $1, 0f4A800000, $2;", e_bits.bitcast(Float32), a)   # C + a, rounded once
    steps = total.bitcast(Int32) - e_bits
    mag = cutlass.min(steps + (e_bits >> 22) - Int32(_E2M1_C_OFFSET + (_E2M1_ONE >> 22)), Int32(7))
    return Int32(cutlass.select_(y != y, Int32(7), mag | ((b >> 28) & Int32(8))))


@cute.jit
def e4m3_code(pv: Float32) -> Int32:
    """RNE-satfinite e4m3 code of pv >= 0 (cvt.rn.satfinite, both halves of the pair from pv); NaN -> 0x7F."""
    code = Int32(llvm.inline_asm(
        Int32.mlir_type, [Float32(pv).ir_value()],
        "{\n.reg .b16 t;\ncvt.rn.satfinite.e4m3x2.f32 t, $1, $1;\ncvt.u32.u16 $0, t;\n}", "=r,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)) & Int32(0xFF)
    return Int32(cutlass.select_(pv.bitcast(Int32) > Int32(0x7F800000), Int32(0x7F), code))


@cute.jit
def e4m3_value(code: Int32) -> Float32:
    """val(code) of an e4m3 code (exact through fp16; both bytes of the pair hold the code)."""
    return Float32(llvm.inline_asm(
        Float32.mlir_type, [Int32(code * Int32(0x101)).ir_value()],
        "{\n.reg .b16 c, lo, hi;\n.reg .b32 h;\ncvt.u16.u32 c, $1;\ncvt.rn.f16x2.e4m3x2 h, c;\n"
        "mov.b32 {lo, hi}, h;\ncvt.f32.f16 $0, lo;\n}", "=f,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def nvfp4_code_scale(amax_bits: Int32, norm_const: Float32):
    """(e4m3 code, scale) of an NVFP4 block from the bits of its (flushed) amax (formats._scaled_rows, e4m3)."""
    pv = mul_ftz(mul_ftz(amax_bits.bitcast(Float32), Float32(NVFP4_RCP_LIMIT)), norm_const)
    code = e4m3_code(pv)
    recip = _asm_f32("rcp.rn.f32 $0, $1;", e4m3_value(code))                 # 1 / 0 = inf -> FLT_MAX below
    s = cute.arch.fmin(mul_ftz(norm_const, recip), Int32(FLT_MAX_BITS).bitcast(Float32))
    return code, Float32(cutlass.select_(code == Int32(0x7F), Int32(0x7FC00000).bitcast(Float32), s))


def frag_v(i: int):
    """(v0, v1, v2, v3) of fragment index i = v0 + 2 v1 + 4 v2 + 8 v3: column v0 + 8 v2 + 16 v3, row + 8 v1."""
    return i % 2, (i // 2) % 2, (i // 4) % 2, i // 8


@cute.jit
def row_block_codes(rVal: cute.Tensor, rAbs: list, vec: cutlass.Constexpr, sf_e4m3: cutlass.Constexpr,
                    rcp_limit: cutlass.Constexpr, norm_const: Float32):
    """Row quantization of a subtile's 16 values (rAbs: their `abs_raw`) into e2m1 nibbles: blocks of `vec` columns
    (32: a row of the subtile, e8m0 scales; 16: its halves v3 = 0 / 1, e4m3 scales (NVFP4) when `sf_e4m3`).
    Returns (nibbles[16], codes[row][block]) with the scale codes of the thread's two rows."""
    nblk = 32 // vec
    codes = [[None] * nblk, [None] * nblk]
    scales = [[None] * nblk, [None] * nblk]
    for r in cutlass.range_constexpr(2):
        for blk in cutlass.range_constexpr(nblk):
            m = Int32(0)
            for i in cutlass.range_constexpr(FRAG):
                if const_expr(row_of(i) == r and (nblk == 1 or frag_v(i)[3] == blk)):
                    m = cutlass.max(m, rAbs[i])
            m = flush_bits(quad_max(m))
            if const_expr(sf_e4m3):
                codes[r][blk], scales[r][blk] = nvfp4_code_scale(m, norm_const)
            else:
                codes[r][blk], scales[r][blk] = block_code_scale(m, rcp_limit, norm_const)
    nib = [e2m1_code(mul_ftz(rVal[i], scales[row_of(i)][frag_v(i)[3] if nblk == 2 else 0])) for i in range(FRAG)]
    return nib, codes


@cute.jit
def row_words(nib: list, lane: Int32):
    """The packed bytes of the thread's two rows, 4 consecutive ones a word: lane q of a quad gets byte columns
    4q..4q+3 of the row's 16 bytes (the subtile's 32 columns). Per row the thread's own 4 bytes (pairs v0 = 0 / 1
    of columns 2q + 8 v2 + 16 v3) sit at byte columns q + 4 (v2 + 2 v3); a 4 x 4 byte transpose over the quad (two
    butterfly rounds: shuffle, select, byte permute) brings them in place."""
    out = []
    for r in cutlass.range_constexpr(2):
        w = Int32(0)
        for i in cutlass.range_constexpr(FRAG):
            v0, v1, v2, v3 = frag_v(i)
            if const_expr(v1 == r):
                w = w | (nib[i] << (8 * (v2 + 2 * v3) + 4 * v0))
        # round 1 (lanes q ^ 1): keep the bytes whose index bit 0 equals the lane's, take the partner's others;
        # round 2 (q ^ 2): the same on 16-bit halves (byte index bit 1)
        for xor, sels in ((1, (0x6240, 0x3715)), (2, (0x5410, 0x3276))):
            partner = cute.arch.shuffle_sync_bfly(w, offset=xor)
            sel = Int32(cutlass.select_((lane & Int32(xor)) != Int32(0), Int32(sels[1]), Int32(sels[0])))
            w = _asm_i32("prmt.b32 $0, $1, $2, $3;", w, partner, sel)
        out.append(w)
    return out


@cute.jit
def col_token_bytes(nib: list, lane: Int32):
    """D_col of FP4 is transposed and packed along the tokens (docs/formats.md#fp4-d-outputs): the column codes of
    the thread's rows r0 (v1 = 0) and r0 + 8 (v1 = 1) and of lane ^ 4 (rows r0 +- 1) form two token pairs per
    column. An even-row lane keeps pair (r0, r0 + 1), an odd-row lane pair (r0 + 7, r0 + 8); each sends the other
    its 8 nibbles of the other row by one shuffle. Returns the 8 bytes, column slot order (`col_slot`)."""
    own = [Int32(0), Int32(0)]
    for i in cutlass.range_constexpr(FRAG):
        own[row_of(i)] = own[row_of(i)] | (nib[i] << (4 * col_slot(i)))
    odd = (lane & Int32(4)) != Int32(0)
    got = cute.arch.shuffle_sync_bfly(Int32(cutlass.select_(odd, own[0], own[1])), offset=4)
    lo = Int32(cutlass.select_(odd, got, own[0]))       # the pair's even token: low nibble
    hi = Int32(cutlass.select_(odd, own[1], got))
    return [((lo >> (4 * s)) & Int32(0xF)) | (((hi >> (4 * s)) & Int32(0xF)) << 4) for s in range(8)]
