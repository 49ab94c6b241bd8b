"""Weight-gradient cases (grouped_gemm_wgrad through the public op) of the GPU suite (tests/gpu/test_wgrad_gpu.py:
the runs and every check against the float64 oracle; also accumulate_on_output / global scales and block-scaled
A / B: BS_CASES), and the bundle items that record their kernel modules on the CPU machine (each module is
recorded at T = 2000 only: it serves every T):

    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle --variants lab.wgrad_cases:bundle_items
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import cudnn_moe_jax as cmj
from cudnn_moe_jax import aot
from cudnn_moe_jax.limits import values_per_byte

from . import harness

NW, T, L = 320, 2000, 5   # A (MW, T), B (NW, T) -> W (L, MW, NW); T % 8 == 0
PATTERNS = {
    "a64": (384, 640, 1024, 1600, 1984),            # every range starts on a 64-token tile; 1984.. in no expert
    "a8": (304, 640, 1024, 1600, 1984),             # starts on 8 tokens (16 bytes), ends inside k-tiles
    "unaligned": (300, 333, 1024, 1500, 2000),      # ends inside k-tiles, one 33-token expert
    "empty_and_tail": (0, 640, 640, 1900, 1900),    # experts 0, 2, 4 empty; tokens 1900.. in no expert
    "unsanitized": (700, 300, 9999, -5, 2000),      # -> 700, 700, 2000, 2000, 2000
}

# (name, ab dtype, wgrad dtype, MW, token-major operands): MW 384 runs 1x1 clusters, 512 2x1
CASES = [("c1_bf16", "bfloat16", "bfloat16", 384, False), ("c2_bf16_f32", "bfloat16", "float32", 512, False),
         ("c2_bf16_tokmajor", "bfloat16", "bfloat16", 512, True), ("c1_f16_tokmajor", "float16", "float16", 384, True)]


def inputs(case, pattern: str = "unaligned", seed: int = 0):
    _, ab, _, mw, token_major = case
    ka, kb = jax.random.split(jax.random.PRNGKey(seed))
    a, b = jax.random.normal(ka, (mw, T)).astype(ab), jax.random.normal(kb, (NW, T)).astype(ab)
    if token_major:  # the activations as a training step holds them: (T, rows)
        return dict(a_tok=a.T, b_tok=b.T, offsets=jnp.asarray(PATTERNS[pattern], jnp.int32))
    return dict(a=a, b=b, offsets=jnp.asarray(PATTERNS[pattern], jnp.int32))


def operands(case, x):
    """(A (MW, T), B (NW, T)) as the op sees them."""
    return (x["a_tok"].T, x["b_tok"].T) if case[4] else (x["a"], x["b"])


def call(case, x):
    a, b = operands(case, x)
    majors = dict(a_major="m", b_major="n") if case[4] else {}
    return cmj.grouped_gemm_wgrad(a, b, x["offsets"], wgrad_dtype=case[2], **majors)


# accumulate_on_output / global scales: (name, ab dtype, W dtype, MW, token-major, global scales, accumulate). The
# GPU test runs each at both token counts of T_VALUES on the one module recorded at T.
ACCUM_CASES = [("acc_c1_bf16_gs", "bfloat16", "bfloat16", 384, False, True, True),
               ("acc_c2_f32_tokmajor", "bfloat16", "float32", 512, True, False, True),
               ("gs_c2_f16", "float16", "float16", 512, False, True, False)]
T_VALUES = (T, 1024)


def accum_inputs(case, pattern: str = "empty_and_tail", tokens: int = T, old: str = "random", seed: int = 0):
    """Inputs with `tokens` tokens (the pattern's offsets clip to it); old W random normal, or all NaN ("nan")."""
    _, ab, wd, mw, token_major, gs, acc = case
    ka, kb, kw, kg = jax.random.split(jax.random.PRNGKey(seed), 4)
    a, b = jax.random.normal(ka, (mw, tokens)).astype(ab), jax.random.normal(kb, (NW, tokens)).astype(ab)
    x = {"a_tok": a.T, "b_tok": b.T} if token_major else {"a": a, "b": b}
    x["offsets"] = jnp.asarray(PATTERNS[pattern], jnp.int32)
    if gs:  # negative scales on a computed expert (1) and an empty one (4, empty in both patterns: adds -0.0)
        g = jax.random.uniform(kg, (2, L), jnp.float32, 0.25, 4.0)
        x["gsa"], x["gsb"] = g[0].at[1].multiply(-1.0).at[4].multiply(-1.0), g[1]
    if acc:
        w = jax.random.normal(kw, (L, mw, NW), jnp.float32) * 8.0
        x["w"] = (jnp.full_like(w, jnp.nan) if old == "nan" else w).astype(wd)
    return x


def accum_call(case, x):
    a, b = operands(case, x)
    majors = {"a_major": "m", "b_major": "n"} if case[4] else {}
    acc = case[6]
    return cmj.grouped_gemm_wgrad(a, b, x["offsets"], global_scale_a=x.get("gsa"), global_scale_b=x.get("gsb"),
                                  wgrad_tensor=x.get("w"), accumulate_on_output=acc,
                                  wgrad_dtype=None if acc else case[2], **majors)


def bundle_items():
    return (aot.lowering_items(CASES, inputs, call) + aot.lowering_items(ACCUM_CASES, accum_inputs, accum_call)
            + bs_bundle_items() + held_bundle_items())


# ------------------------------------------------------------------------------------------------ block-scaled
# wgrad with block-scaled A / B (issue 19 item 3: the dequantizing K-grouped kernel, mainloop_dequant_wgrad.py):
# scales in per-expert segments (docs/formats.md#segmented-layout). The SF buffers are random scale bytes all
# through, so every byte a segment reads (also of overlapping segments of unaligned offsets) is pinned; A / B
# random codes. (name, format, W dtype, MW, token-major, global scales, accumulate): MW 384 runs 1x1 clusters,
# 512 2x1; token-major = a_major="m", b_major="n" (FP4: through a transpose). T = 2000 (FP4 2016): a 16 (32)-token
# tail k-tile.
E4M3, E5M2, E2M1, E8M0 = "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "float8_e8m0fnu"
BS_FORMATS = {"mxfp8": (E4M3, E8M0, 32), "mxfp8e5": (E5M2, E8M0, 32), "mxfp4": (E2M1, E8M0, 32),
              "nvfp4": (E2M1, E4M3, 16), "nvfp4e8": (E2M1, E8M0, 16)}
BS_CASES = [("bs_mxfp8_c1", "mxfp8", "bfloat16", 384, False, False, False),
            ("bs_mxfp8e5_c2_f32_acc", "mxfp8e5", "float32", 512, False, False, True),
            ("bs_mxfp4_c2", "mxfp4", "bfloat16", 512, False, False, False),
            ("bs_nvfp4_c1_gs", "nvfp4", "bfloat16", 384, False, True, False),
            ("bs_nvfp4e8_c1_acc", "nvfp4e8", "bfloat16", 384, False, True, True),
            ("bs_mxfp8_tok_c2", "mxfp8", "bfloat16", 512, True, False, False),
            ("bs_mxfp8e5_tok_c1_gs_acc", "mxfp8e5", "float32", 384, True, True, True),
            # packed FP4 stored token-major: read token-contiguous after XLA's transpose (config.read_problem)
            ("bs_mxfp4_tok_c1", "mxfp4", "bfloat16", 384, True, False, False)]
# (pattern, input mode) of each case's GPU runs. "exact": codes on a coarse grid (FP8: k/8 (e4m3), k/4 (e5m2) in
# [-2, 2]; FP4: any code), scales in {1, 2}, global scales in {1, 2}: every product and partial sum is exact in
# fp32, so W must equal the correctly rounded exact result bit for bit (issue 19 item 6), but for the sums of
# 2^-127-scaled products alone (SF bytes past the buffer: tests/gpu/wgrad_checks.py). "adversarial": any finite
# code (subnormals included), e8m0 scales 2^-20..2^20, e4m3 scales over their whole range. "specials":
# adversarial plus NaN codes (FP4: a NaN scale) of expert 1 and of tokens in no expert, a NaN scale of a B block,
# e5m2 +-inf codes: NaN / inf land exactly where the oracle's do, and nowhere else.
BS_RUNS = (("unaligned", "exact"), ("empty_and_tail", "adversarial"), ("a8", "specials"),
           ("unsanitized", "exact"), ("a64", "adversarial"))


def bs_tokens(case) -> int:
    return T + 16 if BS_FORMATS[case[1]][0] == E2M1 else T


def _bs_codes(rng, shape, data, mode):
    import ml_dtypes
    import numpy as np

    if data == E2M1:   # two random nibbles a byte (packed along the tokens)
        return rng.integers(0, 256, (shape[0], shape[1] // 2), dtype=np.uint8)
    if mode == "exact":
        step = 8 if data == E4M3 else 4
        return (rng.integers(-2 * step, 2 * step + 1, shape) / step).astype(
            ml_dtypes.float8_e4m3fn if data == E4M3 else ml_dtypes.float8_e5m2)
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    special = (codes & 0x7F) == 0x7F if data == E4M3 else (codes & 0x7C) == 0x7C
    codes = np.where(special, codes & 0x3F, codes).astype(np.uint8)    # every finite code, no NaN / inf
    return codes.view(ml_dtypes.float8_e4m3fn if data == E4M3 else ml_dtypes.float8_e5m2)


def _bs_scales(rng, size, sf, mode):
    import numpy as np

    if mode == "exact":
        return np.where(rng.random(size) < 0.5, *((0x38, 0x40) if sf == E4M3 else (127, 128))).astype(np.uint8)
    if sf == E4M3:
        return rng.integers(0x01, 0x7F, size, dtype=np.uint8)         # every positive finite code
    return rng.integers(107, 148, size, dtype=np.uint8)               # 2^-20 .. 2^20


def sanitized_token_ends(offsets, tokens: int):
    """The experts' token ends as the op sanitizes them (clipped to [0, tokens], non-decreasing; numpy)."""
    import numpy as np

    return np.maximum.accumulate(np.clip(np.asarray(offsets), 0, tokens))


def bs_sf_byte(rows, tokens, vec, offsets, e, r, j):
    """Byte of row r, local block j of expert e's segment (docs/formats.md#segmented-layout)."""
    from cudnn_moe_jax import formats

    ends = sanitized_token_ends(offsets, tokens).tolist()
    start, end = ([0] + ends)[e], ends[e]
    base = -(-rows // 128) * 128 * start // vec
    return base + formats.sf_offset(r, j, 0, rows, -(-(end - start) // vec))


def bs_run_inputs(case, pattern: str, mode: str, tokens=None) -> dict:
    """The inputs of one suite run: `bs_inputs` seeded by (case, pattern, mode); `tokens`: only the first `tokens`
    tokens (A / B and the SF segment buffers as the op's shape rule wants them at that count)."""
    import zlib

    from cudnn_moe_jax.formats import sf_segment_bytes

    name, fmt, _, mw = case[:4]
    x = bs_inputs(case, pattern, mode, seed=zlib.crc32(f"{name}/{pattern}/{mode}".encode()) % 1000)
    if tokens is None:
        return x
    data, _, vec = BS_FORMATS[fmt]
    per = values_per_byte(data)
    cut = {"a": (slice(None), slice(0, tokens // per)), "b": (slice(None), slice(0, tokens // per)),
           "a_tok": (slice(0, tokens // per),), "b_tok": (slice(0, tokens // per),)}
    x = {k: v[cut[k]] if k in cut else v for k, v in x.items()}
    x["sfa"] = x["sfa"][:sf_segment_bytes(mw, tokens, vec)]
    x["sfb"] = x["sfb"][:sf_segment_bytes(NW, tokens, vec)]
    return x


def bs_inputs(case, pattern: str = "unaligned", mode: str = "exact", seed: int = 0):
    import ml_dtypes
    import numpy as np

    from cudnn_moe_jax.formats import sf_segment_bytes

    _, fmt, wd, mw, token_major, gs, acc = case
    data, sf, vec = BS_FORMATS[fmt]
    tokens = bs_tokens(case)
    rng = np.random.default_rng(seed)
    a, b = _bs_codes(rng, (mw, tokens), data, mode), _bs_codes(rng, (NW, tokens), data, mode)
    sfa = _bs_scales(rng, sf_segment_bytes(mw, tokens, vec), sf, mode)
    sfb = _bs_scales(rng, sf_segment_bytes(NW, tokens, vec), sf, mode)
    offsets = np.asarray(PATTERNS[pattern], np.int32)
    if mode == "specials":
        nan_sf = 0x7F if sf == E4M3 else 0xFF
        if data == E2M1:      # no NaN code: a NaN scale of A row 3 in expert 1
            sfa[bs_sf_byte(mw, tokens, vec, offsets, 1, 3, 0)] = nan_sf
        else:                 # NaN codes: A row 3 in expert 1 (its first token); row 5 / column 9 in no expert
            first = int(sanitized_token_ends(offsets, tokens)[0])
            a.view(np.uint8)[3, first] = 0x7F
            a.view(np.uint8)[5, tokens - 4] = 0x7F
            b.view(np.uint8)[9, tokens - 3] = 0xFF
        sfb[bs_sf_byte(NW, tokens, vec, offsets, 2, 7, 1)] = nan_sf     # B row 7 (W column 7) of expert 2
        # a padding row of the segment (B row NW + 7: W column past n_w, never stored; kernels that load whole SF
        # atoms read it)
        sfb[bs_sf_byte(NW, tokens, vec, offsets, 2, NW + 7, 0)] = nan_sf
        if data == E5M2:      # +inf / -inf codes in expert 3
            end2 = int(sanitized_token_ends(offsets, tokens)[2])
            b.view(np.uint8)[100, end2] = 0x7C
            b.view(np.uint8)[101, end2 + 1] = 0xFC
    x = {"a_tok": a.T, "b_tok": b.T} if token_major else {"a": a, "b": b}
    x.update(offsets=offsets, sfa=sfa.view(ml_dtypes.float8_e4m3fn) if sf == E4M3 else sfa,
             sfb=sfb.view(ml_dtypes.float8_e4m3fn) if sf == E4M3 else sfb)
    if gs:
        g = rng.choice([1.0, 2.0], (2, L)) if mode == "exact" else rng.uniform(0.25, 4.0, (2, L))
        x["gsa"], x["gsb"] = g[0].astype(np.float32), g[1].astype(np.float32)
    if acc:
        x["w"] = (rng.standard_normal((L, mw, NW)) * (8.0 if mode == "exact" else 1e6)).astype(np.float32).astype(
            ml_dtypes.bfloat16 if wd == "bfloat16" else wd)
    return {k: jnp.asarray(v) for k, v in x.items()}


def bs_call(case, x):
    _, fmt, wd, _, token_major, _, acc = case
    majors = {"a_major": "m", "b_major": "n"} if token_major else {}
    return cmj.grouped_gemm_wgrad(*operands(case, x), x["offsets"], x["sfa"], x["sfb"],
                                  global_scale_a=x.get("gsa"), global_scale_b=x.get("gsb"), wgrad_tensor=x.get("w"),
                                  accumulate_on_output=acc, wgrad_dtype=None if acc else wd,
                                  sf_vec_size=BS_FORMATS[fmt][2], **majors)


def bs_bundle_items():
    """BS_CASES lowered on every route of a block-scaled call (lab.harness.block_scaled_route): the on-chip kernel,
    which tests/gpu/test_wgrad_gpu.py checks whatever the lowering's rule picks for the suite's token counts, XLA's
    conversion then the bf16 kernel (its `dequantized_first` test), and the staged kernel (its `staged` test)."""
    return [harness.on_route(route, item) for route in (*harness.BLOCK_SCALED_ROUTES, "staged")
            for item in aot.lowering_items(BS_CASES, bs_inputs, bs_call)]


# The staged FP4 wgrad with its converters held (mainloop_staged_wgrad.lead_chunks): 16 experts x 256 tokens (8 chunks
# of 512) and W 2048 x 2048 make 2048 tiles, so on any Hopper the lead is one chunk and most conversion jobs wait for
# the GEMM's frontier (BS_CASES' lead exceeds their chunk count: no job of theirs ever waits). Exact inputs: W bit for
# bit.
HELD_EXPERTS, HELD_EXPERT_TOKENS, HELD_ROWS = 16, 256, 2048
HELD_CASE = ("held_nvfp4_gs", "nvfp4", "bfloat16", HELD_ROWS, False, True, False)


def held_inputs(case=HELD_CASE, seed: int = 0) -> dict:
    import ml_dtypes
    import numpy as np

    from cudnn_moe_jax.formats import sf_segment_bytes

    data, sf, vec = BS_FORMATS[case[1]]
    tokens = HELD_EXPERTS * HELD_EXPERT_TOKENS
    rng = np.random.default_rng(seed)
    a, b = (_bs_codes(rng, (HELD_ROWS, tokens), data, "exact") for _ in range(2))
    sfa, sfb = (_bs_scales(rng, sf_segment_bytes(HELD_ROWS, tokens, vec), sf, "exact") for _ in range(2))
    if sf == E4M3:
        sfa, sfb = sfa.view(ml_dtypes.float8_e4m3fn), sfb.view(ml_dtypes.float8_e4m3fn)
    offsets = np.arange(1, HELD_EXPERTS + 1, dtype=np.int32) * HELD_EXPERT_TOKENS
    gsa, gsb = rng.choice([1.0, 2.0], (2, HELD_EXPERTS)).astype(np.float32)
    x = dict(a=a, b=b, offsets=offsets, sfa=sfa, sfb=sfb, gsa=gsa, gsb=gsb)
    return {k: jnp.asarray(v) for k, v in x.items()}


def held_bundle_items():
    return [harness.on_route("staged", item) for item in aot.lowering_items([HELD_CASE], held_inputs, bs_call)]
