"""FP8 output quantization device functions (docs/formats.md#row-quantization, #column-quantization, #rounding), bit-exact with
`cudnn_moe_jax.formats.quantize_rows` / `quantize_cols` (e8m0 scales, vec 32).

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
rcp_limit is formats.rcp_limit(d_dtype): float32(1/448) for e4m3, float32(1/57344) for e5m2 (docs/formats.md#quantization).

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
def quantize_cols(rVal: cute.Tensor, rQ: cute.Tensor, sColMax: cute.Tensor, warp: Int32, lane: Int32,
                  rcp_limit: cutlass.Constexpr, norm_const: Float32):
    """rQ <- column-quantized rVal (32-row blocks = this warp and its partner warp ^ 1; call after the barrier
    that follows `column_partial_max`). Lane c computes the code and scale of subtile column c once (both warps
    of the pair do); each thread takes its 8 columns' scales by shuffle. Returns the e8m0 code of column `lane`."""
    m = cutlass.max(sColMax[(lane, warp)], sColMax[(lane, warp ^ 1)])
    code, scale = block_code_scale(flush_bits(m), rcp_limit, norm_const)
    base = 2 * (lane % 4)
    rY = cute.make_rmem_tensor(rVal.shape, Float32)
    for slot in cutlass.range_constexpr(8):
        s = cute.arch.shuffle_sync(scale, base + slot_col(slot))
        for i in cutlass.range_constexpr(FRAG):
            if const_expr(col_slot(i) == slot):
                rY[i] = mul_ftz(rVal[i], s)
    rQ.store(rY.load().to(rQ.element_type))
    return code

