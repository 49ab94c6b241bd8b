"""cudnn_moe_jax.formats vs the independent numpy oracle (tests/np_formats.py): codes and scale bytes bit-exact."""

import doctest
import math
import re
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from cudnn_moe_jax import formats as F
import np_formats as O

FP8 = (F.E4M3, F.E5M2)
MBITS_EMIN = {F.E4M3: (3, -6), F.E5M2: (2, -14), F.E2M1: (1, 0)}


def u8(a):
    return np.asarray(a).view(np.uint8)


def assert_bits_equal(got, want, what=""):
    got, want = u8(got), u8(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bad = np.nonzero(got != want)
    assert bad[0].size == 0, f"{what}: {bad[0].size} mismatches, first at {[b[:5] for b in bad]}: " \
                             f"got {got[bad][:5]} want {want[bad][:5]}"


def f32_patterns(seed=0, n_random=64):
    """Every exponent x mantissas that put a tie (and tie +-1 ulp, odd/even kept bit) at every bit position."""
    rng = np.random.default_rng(seed)
    mants = [0, 1, 0x7FFFFF, 0x400000]
    for sh in range(23):
        for kept in (0, 1 << (sh + 1)) if sh < 22 else (0,):
            for d in (-1, 0, 1):
                mants.append(((1 << sh) + kept + d) & 0x7FFFFF)
    mants += list(rng.integers(0, 1 << 23, n_random))
    mants = np.unique(np.array(mants, np.uint32))
    bits = (np.arange(256, dtype=np.uint32)[:, None] << 23 | mants[None, :]).ravel()
    return np.concatenate([bits, bits | 0x80000000]).view(np.float32)


STATIC = {"decode": ("data_dtype",), "unpack_sf": ("rows", "n_kblocks", "num_groups"), "pack_sf_segments": ("vec",),
          "unpack_sf_segments": ("rows", "total_tokens", "vec"),
          "segment_token_scales": ("rows", "total_tokens", "vec", "token_major"), "quantize_rows": ("d_dtype", "sf_dtype", "vec"),
          "quantize_cols": ("d_dtype",), "dequantize": ("data_dtype", "sf_dtype", "vec"),
          "to_block_scaled": ("data_dtype", "sf_dtype", "vec"), "from_block_scaled": ("data_dtype", "sf_dtype", "vec")}


class _Jitted:
    """J.name = jax.jit(formats.name) with its dtype/shape arguments static (eager jnp dispatch is slow on CPU)."""

    def __getattr__(self, name):
        fn = jax.jit(getattr(F, name), static_argnames=STATIC.get(name, ()))
        setattr(self, name, fn)
        return fn


J = _Jitted()


# ------------------------------------------------------------------------------------------------------------------
# constants and element codecs
# ------------------------------------------------------------------------------------------------------------------

def test_constants():
    assert F.Q_MAX == {F.E4M3: 448.0, F.E5M2: 57344.0, F.E2M1: 6.0}
    for d in F.Q_MAX:
        assert F.rcp_limit(d) == float(np.float32(1) / np.float32(F.Q_MAX[d]))
    assert F.rcp_limit(F.E5M2) != 1 / 128
    for d in ("bfloat16", "float16", "float32"):
        assert F.rcp_limit(d) == 1.0


def test_e8m0_encode_all_classes():
    x = np.concatenate([f32_patterns(1),
                        np.float32([0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 2.0 ** -127, 2.0 ** -149,
                                    np.finfo(np.float32).max, np.finfo(np.float32).tiny])])
    got = J.e8m0_encode(x)
    assert_bits_equal(got, O.np_e8m0_encode(x), "e8m0")
    # hand-written spot values (docs/formats.md#rounding); pairs, not a dict: -0.0 and 0.0 are the same dict key
    spot = [(0.0, 0), (-0.0, 0), (-1.0, 0), (2.0 ** -127, 0), (float(np.nextafter(np.float32(2.0 ** -127), 1)), 1),
            (2.0 ** -126, 1), (1.0, 127), (float(np.nextafter(np.float32(1), 2)), 128), (1.5, 128), (3.0, 129),
            (2.0 ** 127, 254), (3e38, 254), (math.inf, 254), (math.nan, 255)]
    got = np.asarray(J.e8m0_encode(np.float32([v for v, _ in spot])))
    assert got.tolist() == [code for _, code in spot]


def test_e8m0_decode_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    got = np.asarray(J.e8m0_decode(codes))
    want = np.float32([math.ldexp(1.0, int(c) - 127) for c in codes[:255]])
    assert np.array_equal(got[:255], want) and np.isnan(got[255])
    assert got[0] == np.float32(2.0 ** -127) and got[0] > 0            # exact subnormal, not flushed
    # typed e8m0 input is bit-cast, not value-converted
    typed = jax.lax.bitcast_convert_type(jnp.asarray(codes), jnp.float8_e8m0fnu)
    assert np.array_equal(np.asarray(J.e8m0_decode(typed))[:255], want)


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_encode_bitexact(fmt):
    x = np.concatenate([f32_patterns(2),
                        np.float32([460, 464, 470, 480, 1e30, 57344, 60000, 61440, 65536, 3e38]),
                        -np.float32([460, 464, 470, 480, 1e30, 57344, 60000, 61440, 65536, 3e38])])
    enc = J.e4m3_encode if fmt == F.E4M3 else J.e5m2_encode
    got = enc(x)
    assert got.dtype == jnp.dtype(fmt)
    want = O.np_fp8_encode(x, fmt)
    assert_bits_equal(got, want, fmt)
    # saturation (XLA's plain convert would give NaN / inf here)
    q = F.Q_MAX[fmt]
    big = np.float32([np.inf, -np.inf, 1e30, -1e30, q * 1.2])
    assert np.array_equal(np.asarray(enc(big)).astype(np.float32), np.float32([q, -q, q, -q, q]))
    assert u8(enc(np.float32([np.nan, -np.nan]))).tolist() == [0x7F, 0x7F]


def test_fp8_grid_ties_and_subnormals():
    """Midpoints of consecutive grid values (normal and subnormal) round to the even neighbour."""
    for fmt in FP8:
        grid = np.arange(256, dtype=np.uint8).view(O._ML[fmt]).astype(np.float64)
        grid = np.unique(grid[np.isfinite(grid) & (grid >= 0)])
        mids = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
        assert np.array_equal(mids.astype(np.float64), (grid[1:] + grid[:-1]) / 2)   # exact in fp32
        enc = J.e4m3_encode if fmt == F.E4M3 else J.e5m2_encode
        for x in (mids, -mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf)):
            assert_bits_equal(enc(x), O.np_fp8_encode(x, fmt), fmt)
        bits = u8(enc(mids))
        assert np.all(bits % 2 == 0)                                  # ties to even mantissa


def test_e2m1_codec():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = np.float32(ties + [np.nextafter(np.float32(t), 0) for t in ties] + [np.nextafter(np.float32(t), 9) for t in ties]
                   + [0, -0.0, 6, 7, 1e9, np.inf, -np.inf, np.nan, 2.0 ** -140, -(2.0 ** -140)])
    x = np.concatenate([x, -x, f32_patterns(3, 16)])
    got = J.e2m1_encode(x)
    assert got.dtype == jnp.uint8
    assert_bits_equal(got, O.np_e2m1_encode(x), "e2m1")
    assert np.asarray(J.e2m1_encode(np.float32(ties))).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert np.asarray(J.e2m1_encode(np.float32([-0.0, -0.1, np.nan, -7]))).tolist() == [8, 8, 7, 15]
    codes = np.arange(16, dtype=np.uint8)
    assert np.array_equal(np.asarray(J.e2m1_decode(codes)), O.np_e2m1_decode(codes))
    assert np.asarray(J.e2m1_decode(codes))[:8].tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6]


def test_fp4_pack_nibble_order():
    codes = J.e2m1_encode(np.float32([1.0, -1.0]))
    assert u8(J.pack_fp4(codes)).tolist() == [0xA2]
    rng = np.random.default_rng(4)
    c = rng.integers(0, 16, (3, 5, 64), dtype=np.uint8)
    packed = J.pack_fp4(c)
    assert_bits_equal(packed, O.np_pack_fp4(c), "pack_fp4")
    assert_bits_equal(J.unpack_fp4(packed), c, "unpack_fp4")
    assert np.array_equal(np.asarray(J.decode(packed, F.E2M1)), O.np_decode(np.asarray(packed), O.E2M1))


def test_decode_all_dtypes():
    rng = np.random.default_rng(5)
    b = rng.integers(0, 256, (4, 64), dtype=np.uint8)
    for d in FP8:
        want = O.np_decode(b, d)
        for data in (b, b.view(O._ML[d])):
            got = np.asarray(J.decode(data, d))
            assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.asarray(J.decode(b, F.E8M0)), O.np_e8m0_decode(b), equal_nan=True)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    for d, npd in (("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16), ("float32", np.float32)):
        xd = x.astype(npd)
        assert np.array_equal(np.asarray(J.decode(xd, d)), xd.astype(np.float32))


# ------------------------------------------------------------------------------------------------------------------
# scale-factor layout
# ------------------------------------------------------------------------------------------------------------------

def test_worked_example():
    R, K, vec = 300, 416, 32
    shape = F.sf_physical_shape(R, K, vec)
    assert shape == (1, 3, 4, 32, 4, 4) and math.prod(shape) == 6144
    assert F.sf_offset(200, 9, 0, R, 13) == 3209 == O.np_sf_offset(200, 9, 0, R, 13)
    s = np.zeros((R, 13), np.uint8)
    s[200, 9] = 77
    flat = u8(J.pack_sf(s)).reshape(-1)
    assert flat.size == 6144 and np.nonzero(flat)[0].tolist() == [3209] and flat[3209] == 77


@pytest.mark.parametrize("L,R,nkb", [(1, 300, 13), (3, 128, 4), (2, 1, 1), (2, 257, 9)])
def test_pack_unpack_sf(L, R, nkb):
    rng = np.random.default_rng(L * 1000 + R)
    s = rng.integers(1, 256, (L, R, nkb), dtype=np.uint8)                    # never zero: padding must be the only 0
    phys = J.pack_sf(s)
    assert phys.shape == (L, -(-R // 128), -(-nkb // 4), 32, 4, 4) and phys.dtype == jnp.uint8
    assert_bits_equal(np.asarray(phys).reshape(-1), O.np_pack_sf(s), "pack_sf")
    unpack = J.unpack_sf
    assert_bits_equal(unpack(phys, rows=R, n_kblocks=nkb, num_groups=L), s, "unpack 6-D")
    assert_bits_equal(unpack(phys.reshape(-1), rows=R, n_kblocks=nkb, num_groups=L), s, "unpack flat")
    typed = jax.lax.bitcast_convert_type(phys, jnp.float8_e8m0fnu)
    assert_bits_equal(J.unpack_sf(typed, R, nkb, L), s, "unpack typed")
    assert_bits_equal(O.np_unpack_sf(O.np_pack_sf(s), R, nkb, L), s, "oracle round trip")
    if L == 1:
        assert_bits_equal(J.pack_sf(s[0]), phys, "2-D input")


def spec_segment_offset(n, m, start, T_g, N_out):
    """The segmented-layout offset written out in one formula (vec 32, T_g a multiple of 128; docs/formats.md)."""
    seg_base = 4 * -(-N_out // 128) * start
    mm = m - start
    return (seg_base + (n // 128) * (T_g // 128) * 512 + ((mm // 32) // 4) * 512
            + (n % 32) * 16 + ((n // 32) % 4) * 4 + (mm // 32) % 4)



DOCS_FORMATS = Path(__file__).resolve().parents[1] / "docs" / "formats.md"


def test_docs_formats_examples():
    """docs/formats.md: its worked examples hold (byte offsets asserted here) and its ```python snippets run as
    doctests, so the documented numbers cannot drift from the code."""
    # scale-factor layout: 200 rows, K = 640, vec 32 -> 20 k-blocks, Rb = 2, Kb = 5, 5120 bytes
    assert F.sf_physical_shape(200, 640, 32) == (1, 2, 5, 32, 4, 4)
    assert [F.sf_offset(165, 13, 0, 200, 20), F.sf_offset(37, 2, 0, 200, 20), F.sf_offset(165, 13, 1, 200, 20)] \
        == [4181, 86, 9301]
    assert O.np_sf_offset(165, 13, 0, 200, 20) == 4181 and O.np_sf_offset(37, 2, 0, 200, 20) == 86
    s = np.zeros((2, 200, 20), np.uint8)
    s[0, 165, 13], s[0, 37, 2], s[1, 165, 13] = 0x81, 0x7F, 0x42
    flat = u8(J.pack_sf(s)).reshape(-1)
    assert flat.size == 10240 and np.flatnonzero(flat).tolist() == [86, 4181, 9301]
    # segmented layout: SFD_col of N_out = 256, m = 1024, group ends 256 / 768 / 1024; column 130, k-block 9
    sc = np.zeros((256, 32), np.uint8)
    sc[130, 9] = 0x90
    seg = np.asarray(J.pack_sf_segments(sc, jnp.asarray([256, 768, 1024], jnp.int32), vec=32))
    assert seg.size == 8192 and np.flatnonzero(seg).tolist() == [4129]
    assert np.flatnonzero(u8(J.pack_sf(sc)).reshape(-1)).tolist() == [5153]
    assert spec_segment_offset(130, 288, 256, 512, 256) == 4129
    # the snippets themselves
    blocks = re.findall(r"```python\n(.*?)```", DOCS_FORMATS.read_text(), re.S)
    assert blocks, "docs/formats.md lost its examples"
    test = doctest.DocTestParser().get_doctest("\n".join(blocks), {}, "docs/formats.md", str(DOCS_FORMATS), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.failures == 0 and runner.tries >= 20, runner.summarize()

@pytest.mark.parametrize("R,T,vec,ends", [
    (300, 1024, 32, [256, 256, 768, 1024]),          # empty expert in the middle
    (200, 1000, 32, [0, 256, 256, 512]),             # empty first expert, tokens past ends[-1]
    (130, 400, 16, [64, 64, 192, 320, 400]),         # vec 16, last segment not a multiple of 4*vec
    (64, 352, 32, [128, 352]),                       # last segment 224 tokens (7 blocks)
])
def test_sf_segments(R, T, vec, ends):
    rng = np.random.default_rng(R + T)
    nt = -(-T // vec)
    s = rng.integers(1, 256, (R, nt), dtype=np.uint8)
    s_in = s.copy()
    s_in[:, -(-ends[-1] // vec):] = 0                                   # blocks in no segment
    ends_j = jnp.asarray(ends, jnp.int32)
    flat = np.asarray(J.pack_sf_segments(s, ends_j, vec=vec))
    assert flat.shape == ((-(-R // 128)) * 128 * (-(-nt // 4)) * 4,)
    assert_bits_equal(flat, O.np_pack_sf_segments(s, ends, vec), "segments vs oracle")
    back = J.unpack_sf_segments(flat, rows=R, ends=ends_j, total_tokens=T, vec=vec)
    assert_bits_equal(back, s_in, "segments round trip")
    assert_bits_equal(O.np_unpack_sf_segments(flat, R, ends, T, vec), s_in, "oracle unpack")
    starts = [0] + ends[:-1]
    for g, (a, b) in enumerate(zip(starts, ends)):
        if b == a:
            continue
        # each segment is the plain MMA-tiled layout of its own SF(R, T_g) block at rup(R,128)*start/vec
        base = -(-R // 128) * 128 * a // vec
        blk = np.asarray(J.pack_sf(s[:, a // vec:-(-b // vec)])).reshape(-1)
        if g == len(ends) - 1 or (b - a) % (4 * vec) == 0:
            assert_bits_equal(flat[base:base + blk.size], blk, f"segment {g}")
        if vec == 32 and (b - a) % 128 == 0:                             # the one-formula offset
            n, m = np.meshgrid(np.arange(R), np.arange(a, b, 32), indexing="ij")
            off = spec_segment_offset(n, m, a, b - a, R)
            assert np.array_equal(flat[off], s[n, m // 32])


@pytest.mark.parametrize("R,T,vec,ends", [
    (300, 1024, 32, [256, 256, 768, 1024]),          # aligned: the global k-blocks of unpack_sf_segments
    (130, 400, 16, [40, 40, 203, 330, 400]),         # starts inside blocks
    (64, 96, 32, [40, 96]),                          # segment 1 runs off the buffer end (those bytes read 0)
    (200, 1000, 32, [-3, 333, 9999, 2]),             # unsanitized ends; tokens past the last end
])
def test_segment_token_scales(R, T, vec, ends):
    """Token t of expert g: local block (t - start_g) // vec of segment g, read at the layout's byte (its own
    SF(R, T_g) at rup(R,128) * start_g // vec), 0 past the buffer and outside every expert."""
    rng = np.random.default_rng(R + T)
    flat = rng.integers(1, 256, (-(-R // 128)) * 128 * (-(-(-(-T // vec)) // 4)) * 4, dtype=np.uint8)
    got = np.asarray(J.segment_token_scales(flat, rows=R, ends=jnp.asarray(ends, jnp.int32), total_tokens=T,
                                             vec=vec))
    sane = np.maximum.accumulate(np.clip(ends, 0, T))
    want = np.zeros((R, T), np.uint8)
    rows_pad = -(-R // 128) * 128
    for st, en in zip(np.concatenate([[0], sane[:-1]]), sane):
        if en <= st:
            continue
        nb = -(-(en - st) // vec)
        for t in range(st, en):
            j = (t - st) // vec
            off = rows_pad * st // vec + np.array([F.sf_offset(r, j, 0, R, nb) for r in range(R)])
            want[:, t] = np.where(off < flat.size, flat[np.minimum(off, flat.size - 1)], 0)
    assert_bits_equal(got, want, "per-token segment scales")
    tok = J.segment_token_scales(flat, rows=R, ends=jnp.asarray(ends, jnp.int32), total_tokens=T, vec=vec,
                                 token_major=True)
    assert_bits_equal(np.asarray(tok), want, "per-token segment scales gathered for a token-major reader")
    if all(e % vec == 0 for e in sane):
        back = np.asarray(J.unpack_sf_segments(flat, rows=R, ends=jnp.asarray(ends, jnp.int32), total_tokens=T,
                                               vec=vec))
        inside = np.arange(T) < sane[-1]
        assert_bits_equal(got[:, inside], np.repeat(back, vec, axis=1)[:, :T][:, inside], "aligned = unpack")


def test_sf_segments_garbage_ends_stay_in_bounds():
    R, T, vec = 100, 512, 32
    s = np.random.default_rng(7).integers(1, 256, (R, T // vec), dtype=np.uint8)
    pack = J.pack_sf_segments
    unpack = J.unpack_sf_segments
    for ends in ([-5, 9999, 3, 700], [512, 0, 0, 256], [-1, -1], [96, 96, 160, 480]):   # last: overlapping segments
        e = jnp.asarray(ends, jnp.int32)
        flat = np.asarray(pack(s, e, vec=vec))
        assert flat.shape == (128 * 16,)
        sane = np.maximum.accumulate(np.clip(ends, 0, T))
        assert np.array_equal(flat, np.asarray(pack(s, jnp.asarray(sane, jnp.int32), vec=vec)))
        assert np.array_equal(flat, np.asarray(pack(s, e, vec=vec)))                # deterministic
        assert unpack(flat, rows=R, ends=e, total_tokens=T, vec=vec).shape == (R, T // vec)
    # overlap rule: byte p belongs to the last non-empty segment whose base <= p
    flat = np.asarray(pack(s, jnp.asarray([32, 32, 512], jnp.int32), vec=vec))
    seg1 = np.asarray(J.pack_sf(s[:, 1:])).reshape(-1)
    # segment 1 (start 32, not a multiple of 4*vec) does not fit: its footprint is cut at the buffer end
    assert_bits_equal(flat[128:], seg1[:flat.size - 128], "later segment wins")
    assert_bits_equal(flat[:128], O.np_pack_sf_segments(s, [32], vec)[:128], "earlier segment below")


# ------------------------------------------------------------------------------------------------------------------
# block quantization
# ------------------------------------------------------------------------------------------------------------------

def adversarial(rng, R, C, fmt, vec):
    """Wide dynamic range across blocks (2^-20..2^20), exact powers of two, grid ties, fp32 subnormals, zero / NaN /
    inf blocks, -0; never all zeros."""
    x = rng.standard_normal((R, C)).astype(np.float32)
    nb = -(-C // vec)
    blk_exp = rng.integers(-20, 21, (R, nb))
    x *= np.exp2(np.repeat(blk_exp, vec, axis=1)[:, :C]).astype(np.float32)
    grid = np.float32(F.Q_MAX[fmt]) * np.exp2(rng.integers(-20, 21, (R, C))).astype(np.float32)
    pick = rng.random((R, C))
    x = np.where(pick < 0.05, np.exp2(rng.integers(-20, 21, (R, C))).astype(np.float32) * rng.choice([-1, 1], (R, C)), x)
    if fmt == F.E2M1:
        mids = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) / 6
    else:
        g = np.arange(256, dtype=np.uint8).view(O._ML[fmt]).astype(np.float64)
        g = np.unique(g[np.isfinite(g) & (g >= 0)])
        mids = (((g[1:] + g[:-1]) / 2) / F.Q_MAX[fmt]).astype(np.float32)
    ties = grid * rng.choice(mids, (R, C)).astype(np.float32)
    x = np.where((pick >= 0.05) & (pick < 0.25), ties, x)
    # make the tie rows' block maxima exactly q_max * 2^k so their scale is a power of two
    x[::3, ::vec] = grid[::3, ::vec]
    x[1, :] *= np.float32(2.0 ** -140)                   # fp32 subnormal data (pv <= 2^-127 -> code 0x00)
    x[2, :vec] = 0                                        # zero block
    x[4, :] = 0                                           # zero row
    x[5, 3] = np.nan                                      # NaN block
    x[6, 1] = np.inf
    x[7, 2] = -np.inf
    x[8, :5] = -0.0
    x[9, :] = np.float32(2.0 ** -126) * rng.standard_normal(C).astype(np.float32)   # near the normal/subnormal edge
    return x


CASES = [(d, F.E8M0, 32) for d in (F.E4M3, F.E5M2, F.E2M1)] + [(F.E2M1, F.E8M0, 16), (F.E2M1, F.E4M3, 16),
                                                                 (F.E4M3, F.E4M3, 16)]


@pytest.mark.parametrize("norm_const", [None, 0.01, 3.0])
@pytest.mark.parametrize("d,sf,vec", CASES)
def test_quantize_rows_bitexact(d, sf, vec, norm_const):
    rng = np.random.default_rng(zlib.crc32(repr((d, sf, vec, norm_const)).encode()))
    R, C = 200, 200                                      # partial last block (200 = 6*32 + 8), R % 128 != 0
    x = adversarial(rng, R, C, d, vec)
    q = J.quantize_rows
    nc = None if norm_const is None else jnp.asarray([norm_const], jnp.float32)
    codes, s = q(x, d_dtype=d, sf_dtype=sf, vec=vec, norm_const=nc)
    want_codes, want_s = O.np_quantize_rows(x, d, sf, vec, norm_const)
    assert s.dtype == jnp.uint8 and s.shape == (R, -(-C // vec))
    assert codes.shape == ((R, C // 2) if d == F.E2M1 else (R, C))
    assert_bits_equal(s, want_s, "scales")
    assert_bits_equal(codes, want_codes, "codes")
    assert u8(s)[5, 0] == (255 if sf == F.E8M0 else 0x7F)           # NaN block -> NaN scale
    assert u8(s)[2, 0] == 0 and u8(s)[4].max() == 0                    # zero blocks -> 0x00


def test_flush_and_nonfinite_semantics():
    """The documented flush points make every backend agree (XLA:CPU flushes fp32 subnormals, XLA:GPU does not)."""
    x = np.zeros((2, 64), np.float32)
    x[0, :32] = np.float32(1e-40)                        # fp32 subnormal data: a zero block
    x[0, 32:] = np.float32(2.0 ** -120)                  # pv = 2^-120/448 < 2^-126 flushes: code 0x00, scale 2^127
    x[1, :32] = 1.0
    x[1, 0] = np.inf                                     # s = 0xFE; scale 2^-127 flushes to 0: inf*0 -> NaN
    x[1, 32:] = -2.0
    x[1, 33] = np.nan
    codes, s = J.quantize_rows(x, F.E4M3)
    assert u8(s).tolist() == [[0, 0], [254, 255]]
    c = u8(codes)
    assert c[0, :32].max() == 0 and np.all(c[0, 32:] == u8(J.e4m3_encode(np.float32(2.0 ** -120 * 2.0 ** 127))))
    assert c[1, 0] == 0x7F and c[1, 1] == 0
    codes4, _ = J.quantize_rows(x, F.E4M3, norm_const=4.0)     # scale 4 * 2^-127 is normal: inf saturates
    assert u8(codes4)[1, 0] == 0x7E
    deq = np.asarray(J.dequantize(codes, s, F.E4M3, F.E8M0, 32))
    assert np.isnan(deq[1, 32:]).all() and deq[0, 32] == np.float32(2.0 ** -120)   # 0x00 applied exactly


@pytest.mark.parametrize("norm_const", [None, 0.01])
@pytest.mark.parametrize("d", [F.E4M3, F.E5M2, F.E2M1])
def test_quantize_cols_bitexact(d, norm_const):
    rng = np.random.default_rng(11)
    R, C = 200, 136                                      # 200 = 6*32 + 8 rows: partial last row block
    x = adversarial(rng, C, R, d, 32).T.copy()           # adversarial along the columns' 32-row blocks
    q = J.quantize_cols
    codes, s = q(x, d_dtype=d, norm_const=norm_const)
    want_codes, want_s = O.np_quantize_cols(x, d, norm_const)
    assert s.shape == (C, -(-R // 32))
    assert_bits_equal(s, want_s, "col scales")
    assert_bits_equal(codes, want_codes, "col codes")
    # column quantization is row quantization of the transpose (e8m0, 32)
    codes_t, s_t = J.quantize_rows(x.T, d, F.E8M0, 32, norm_const)
    assert_bits_equal(s_t, s, "transpose rule")
    if d == F.E2M1:   # FP4 D_col is stored transposed, tokens packed (docs/formats.md#fp4-d-outputs)
        assert codes.shape == (C, R // 2)
        assert_bits_equal(codes_t, codes, "transpose rule codes")
    else:
        assert_bits_equal(np.asarray(codes_t).T, codes, "transpose rule codes")


@pytest.mark.parametrize("d,sf,vec", CASES)
def test_dequantize_error_bound(d, sf, vec):
    rng = np.random.default_rng(13)
    R, C = 130, 96
    x = rng.standard_normal((R, C)).astype(np.float32) * np.exp2(rng.integers(-20, 21, (R, 1))).astype(np.float32)
    codes, s = J.quantize_rows(x, d, sf, vec)
    deq = np.asarray(J.dequantize(codes, s, data_dtype=d, sf_dtype=sf, vec=vec))
    assert np.array_equal(deq, O.np_dequantize(np.asarray(codes), np.asarray(s), d, sf, vec).astype(np.float32))
    m, emin = MBITS_EMIN[d]
    sv = np.repeat(O.np_sf_decode(np.asarray(s), sf), vec, axis=1)[:, :C].astype(np.float64)
    amax = np.repeat(np.abs(x).reshape(R, C // vec, vec).max(-1), vec, axis=1)
    if sf == F.E8M0:
        # RCEIL: amax/q_max <= val(s) < 2*amax/q_max (nothing saturates)
        pv = amax * F.rcp_limit(d)
        assert np.all(sv >= pv * (1 - 2 ** -23)) and np.all(sv < 2 * pv * (1 + 2 ** -23))
        sat = 0.0
    else:
        sat = np.maximum(amax - F.Q_MAX[d] * sv, 0)     # e4m3 scale may round down: clipped at q_max
    bound = 2.0 ** -(m + 1) * np.abs(x) + sv * 2.0 ** (emin - m - 1) + sat + 1e-6 * np.abs(x)
    assert np.all(np.abs(deq - x) <= bound)
    # norm_const folds into the dequantized values (e8m0 scales: x spans 2^+-20, beyond an e4m3 scale's range)
    if sf != F.E8M0:
        return
    c2, s2 = J.quantize_rows(x, d, sf, vec, 4.0)
    deq2 = np.asarray(J.dequantize(c2, s2, d, sf, vec)) / 4.0
    assert np.allclose(deq2, x, rtol=0.3, atol=np.abs(x).max() * 0.2)


@pytest.mark.parametrize("d,sf,vec", [(F.E4M3, F.E8M0, 32), (F.E2M1, F.E4M3, 16), (F.E5M2, F.E8M0, 32)])
def test_block_scaled_convenience(d, sf, vec):
    rng = np.random.default_rng(17)
    to = J.to_block_scaled
    frm = J.from_block_scaled
    for shape in ((300, 416), (3, 130, 96)):
        x = rng.standard_normal(shape).astype(np.float32)
        codes, sf_phys = to(x, data_dtype=d, sf_dtype=sf, vec=vec)
        rows, k = shape[-2:]
        assert sf_phys.shape == F.sf_physical_shape(rows, k, vec, shape[0] if len(shape) == 3 else 1)
        want_codes, want_sf = O.np_to_block_scaled(x, d, sf, vec)
        assert_bits_equal(codes, want_codes, "codes")
        assert_bits_equal(np.asarray(sf_phys).reshape(-1), want_sf, "sf")
        back = np.asarray(frm(codes, sf_phys, data_dtype=d, sf_dtype=sf, vec=vec))
        assert back.shape == shape
        xs = x.reshape(-1, rows, k)
        ref = np.concatenate([O.np_dequantize(c, O.np_unpack_sf(want_sf, rows, -(-k // vec), xs.shape[0])[i],
                                              d, sf, vec)
                              for i, c in enumerate(np.asarray(want_codes).reshape(xs.shape[0], rows, -1))])
        assert np.array_equal(back.reshape(-1, k), ref.astype(np.float32))


def test_validation_errors():
    with pytest.raises(ValueError):
        F.quantize_rows(np.ones((4, 32), np.float32), "int8")
    with pytest.raises(ValueError):
        F.quantize_rows(np.ones((4, 32), np.float32), F.E4M3, F.E5M2)
    with pytest.raises(ValueError):
        F.quantize_rows(np.ones((4, 33), np.float32), F.E2M1)
    with pytest.raises(ValueError):
        F.unpack_sf(np.zeros(100, np.uint8), 128, 4)


def test_every_dtype_spelling_the_ops_accept_works_here():
    """formats and the public ops share one dtype normaliser: names, short aliases, jnp / numpy / ml_dtypes dtypes
    and scalar types all mean the same format, and a wrong one is reported under the function's own argument."""
    x = np.random.default_rng(3).standard_normal((128, 64)).astype(np.float32)
    want_codes, want_sf = F.to_block_scaled(x, F.E4M3)
    for spelling in ("float8_e4m3fn", "e4m3", jnp.float8_e4m3fn, jnp.dtype(jnp.float8_e4m3fn),
                     np.dtype(ml_dtypes.float8_e4m3fn), ml_dtypes.float8_e4m3fn):
        codes, sf = F.to_block_scaled(x, spelling, jnp.float8_e8m0fnu)
        assert_bits_equal(codes, want_codes, f"codes {spelling!r}")
        assert_bits_equal(sf, want_sf, f"sf {spelling!r}")
        back = F.from_block_scaled(codes, sf, spelling, "e8m0", 32)
        np.testing.assert_array_equal(np.asarray(back), np.asarray(F.from_block_scaled(codes, sf, F.E4M3, F.E8M0,
                                                                                       32)))
    codes, sf = F.to_block_scaled(x, jnp.float4_e2m1fn, jnp.float8_e4m3fn, 16)
    assert sf.dtype == jnp.float8_e4m3fn
    assert F.rcp_limit(jnp.float8_e5m2) == F.rcp_limit(F.E5M2) and F.rcp_limit(jnp.bfloat16) == 1.0
    with pytest.raises(ValueError) as info:
        F.to_block_scaled(x, jnp.bfloat16)
    assert "to_block_scaled: data_dtype" in str(info.value) and "float8_e4m3fn" in str(info.value)
    with pytest.raises(ValueError, match="to_block_scaled: sf_dtype"):
        F.to_block_scaled(x, F.E4M3, jnp.float8_e5m2)
    with pytest.raises(TypeError, match="decode: data_dtype: 'e9m9' is not a dtype"):
        F.decode(np.zeros(4, np.uint8), "e9m9")


# ------------------------------------------------------------------------------------------------------------------
# format names: a name fixes data dtype, scale dtype and vec; buffers must agree with the format they are read as
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(F.BLOCK_FORMATS))
def test_a_format_name_fixes_data_scale_dtype_and_vec(name):
    data, sf, vec = F.BLOCK_FORMATS[name]
    x = np.random.default_rng(23).standard_normal((2, 130, 160)).astype(np.float32) * 5
    codes, sf_phys = F.to_block_scaled(x, name)
    assert codes.dtype == (jnp.uint8 if data == F.E2M1 else jnp.dtype(data))
    assert sf_phys.dtype == (jnp.float8_e4m3fn if sf == F.E4M3 else jnp.uint8)
    assert sf_phys.shape == F.sf_physical_shape(130, 160, vec, 2)
    want_codes, want_sf = O.np_to_block_scaled(x, data, sf, vec)          # the float64 oracle, same format
    assert_bits_equal(codes, want_codes, "codes")
    assert_bits_equal(np.asarray(sf_phys).reshape(-1), want_sf, "sf")
    back = np.asarray(F.from_block_scaled(codes, sf_phys, name))
    s = O.np_unpack_sf(want_sf, 130, -(-160 // vec), 2)
    ref = np.stack([O.np_dequantize(c, s[i], data, sf, vec) for i, c in enumerate(np.asarray(want_codes))])
    assert np.array_equal(back, ref.astype(np.float32))
    # the same format spelled as dtypes (and upper case) is the same bytes
    assert_bits_equal(F.to_block_scaled(x, data, sf, vec)[1], sf_phys, "sf by dtypes")
    assert_bits_equal(F.to_block_scaled(x, name.upper())[0], codes, "codes by upper-case name")


def test_nvfp4_is_e4m3_scales_vec_16_not_mxfp4():
    """The first-user bug: 'nvfp4' used to be a data-dtype alias, so to_block_scaled(x, 'nvfp4') gave MXFP4
    (e8m0, vec 32) scales that an op called with sf_vec_size=16 misread without an error."""
    assert F.BLOCK_FORMATS["nvfp4"] == (F.E2M1, F.E4M3, 16)
    assert F.BLOCK_FORMATS["mxfp4"] == (F.E2M1, F.E8M0, 32)
    _, sf = F.to_block_scaled(np.ones((128, 64), np.float32), "nvfp4")
    assert sf.dtype == jnp.float8_e4m3fn


@pytest.mark.parametrize("args, fragment", [
    (("nvfp4", F.E8M0), "fixed by its name"),
    (("mxfp8", None, 16), "fixed by its name"),
    (("mxfp4", F.E4M3), "fixed by its name"),
    (("fp4",), "could be 'mxfp4'"),                                # a dtype alias, not a format
    ((F.E2M1, F.E8M0), "could be 'mxfp4'"),                        # e8m0 FP4: vec 16 or 32
    ((F.E4M3, None, 16), "is not a block-scaled format"),
    ((F.E4M3, F.E4M3), "is not a block-scaled format"),
    (("mxfp9",), "neither a block-scaled format"),
    ((jnp.bfloat16,), "neither a block-scaled format"),
])
def test_format_contradictions_and_ambiguities_are_errors(args, fragment):
    with pytest.raises(ValueError) as info:
        F.to_block_scaled(np.ones((128, 64), np.float32), *args)
    assert fragment in str(info.value) and "to_block_scaled" in str(info.value), str(info.value)


def test_from_block_scaled_rejects_buffers_of_another_format():
    x = np.random.default_rng(5).standard_normal((128, 128)).astype(np.float32)
    mx_codes, mx_sf = F.to_block_scaled(x, "mxfp4")
    nv_codes, nv_sf = F.to_block_scaled(x, "nvfp4")
    e8_codes, e8_sf = F.to_block_scaled(x, "nvfp4_e8m0")
    with pytest.raises(ValueError, match="float8_e4m3fn scales but sf_physical holds float8_e8m0fnu"):
        F.from_block_scaled(mx_codes, mx_sf, "nvfp4")
    with pytest.raises(ValueError, match="float8_e8m0fnu scales but sf_physical holds float8_e4m3fn"):
        F.from_block_scaled(nv_codes, nv_sf, "mxfp4")
    with pytest.raises(ValueError, match=r"the size of vec 16 scales \('nvfp4_e8m0'\?\)"):
        F.from_block_scaled(e8_codes, e8_sf, "mxfp4")               # K = 128 tells vec 16 from vec 32
    with pytest.raises(TypeError, match="stored as uint8"):
        F.from_block_scaled(F.to_block_scaled(x, "mxfp8")[0], mx_sf, "mxfp4")
    # a data dtype alone takes the scale dtype the buffer records
    np.testing.assert_array_equal(np.asarray(F.from_block_scaled(nv_codes, nv_sf, F.E2M1)),
                                  np.asarray(F.from_block_scaled(nv_codes, nv_sf, "nvfp4")))


def test_to_block_scaled_is_one_jitted_program_per_shape():
    """Eager jnp dispatch of the quantizer took 2-3 s per new shape; it runs as one jit (format static) instead:
    a new shape adds one cache entry, a repeated shape none."""
    before = F._to_block_scaled._cache_size()
    x = np.ones((384, 96), np.float32)
    F.to_block_scaled(x, "mxfp8")
    assert F._to_block_scaled._cache_size() == before + 1
    F.to_block_scaled(2 * x, "mxfp8")
    assert F._to_block_scaled._cache_size() == before + 1
