"""CPU checks of the dequantizing mainloop's cluster-split B conversion (kernels/sm90/mainloop_dequant.py, module
docstring): where B is multicast to a 2-CTA cluster along M, each CTA's stage workers convert half of B's rows and
bulk-copy them into the other CTA's bf16 stage (the consumer warps convert and copy some passes too)
(`cp.async.bulk.shared::cluster.shared::cta ... complete_tx`, SASS `UBLKCP.S.S`), warp 1 expects the other CTA's
bytes on the stage's worker barrier (an arrive-less tx expect, SASS `SYNCS.ARRIVE.TRANS64.RED.A0TR`); no GPU-scope
fence appears (no `MEMBAR.ALL.GPU`: the copy is async-proxy and signals the barrier itself; discrete weights have
the descriptors' own), no local memory, the HGMMAs stay unserialized. Off (no bulk copy) where B is not multicast
(1x1 clusters). The K-grouped block-scaled wgrad splits too (a 2-CTA cluster holds two W row tiles of one expert),
token-contiguous or token-major, with A converted in registers. ~10 s a module on 2 cores; skipped without the
CuTe DSL compiler."""

from __future__ import annotations

import dataclasses
import re

import pytest

from cudnn_moe_jax._problem import Epilogue, GroupedGemmProblem
from cudnn_moe_jax.kernels.sm90 import config as sm90_config

E8M0 = "float8_e8m0fnu"
FORMATS = {"mxfp8": ("float8_e4m3fn", E8M0, 32), "nvfp4": ("float4_e2m1fn", "float8_e4m3fn", 16)}
SWIGLU = Epilogue(act="swiglu", c_dtype="bfloat16", d_dtype="bfloat16", compute_amax=True)


def _problem(fmt: str, **kw) -> GroupedGemmProblem:
    data, sf, vec = FORMATS[fmt]
    return GroupedGemmProblem(op=kw.pop("op", "glu"), m=2048, n=512, k=256, num_groups=4, ab_dtype=data,
                              sf_dtype=sf, sf_vec_size=vec, epilogue=kw.pop("epilogue", SWIGLU), **kw)


def _sass(problem, config=None) -> str:
    from lab import sass as lab_sass

    try:
        return lab_sass.sass_of(lab_sass.compile_module(problem, config))
    except lab_sass.CompilerUnavailable as e:
        pytest.skip(str(e))


def _kernel(problem, config=None):
    pytest.importorskip("cutlass")
    from lab.sass import CompilerUnavailable, cutlass_sm90

    try:
        cutlass_sm90()
    except CompilerUnavailable as e:
        pytest.skip(str(e))
    from cudnn_moe_jax.kernels.sm90.kernel import GroupedGemmSm90

    return GroupedGemmSm90(problem, config)


def test_split_rule():
    """On with the default 2x1 cluster (B multicast), off with 1x1 / 1x2 clusters and where tile lists would pair two
    experts' tiles (m_aligned below the 256-row block); in the block-scaled wgrad on with a 2x1 cluster and A in
    registers, token-contiguous or token-major."""
    from cudnn_moe_jax.kernels.sm90.mainloop_dequant import DequantMainloop

    p = _problem("mxfp8")
    assert DequantMainloop.splits_b(p, sm90_config.default_config(p))
    assert not DequantMainloop.splits_b(p, sm90_config.Config(cluster_m=1))
    assert not DequantMainloop.splits_b(p, sm90_config.Config(cluster_m=1, cluster_n=2))
    assert DequantMainloop.splits_b(p, sm90_config.Config(cluster_m=2, cluster_n=2))
    assert not DequantMainloop.splits_b(dataclasses.replace(p, m_aligned=128), sm90_config.Config())
    assert _kernel(p).mainloop.split_b
    assert _kernel(dataclasses.replace(p, discrete_weights=True)).mainloop.split_b
    assert _kernel(_wgrad()).mainloop.split_b
    assert _kernel(_wgrad(a_major="m", b_major="n")).mainloop.split_b
    assert not _kernel(_wgrad(m=384)).mainloop.split_b                         # 1x1 clusters (m_w % 256)
    assert not _kernel(_wgrad(), sm90_config.Config(dequant_a="workers")).mainloop.split_b


def _wgrad(**kw) -> GroupedGemmProblem:
    """A block-scaled (MXFP8) wgrad: W rows 512 run 2x1 clusters, 384 1x1."""
    return GroupedGemmProblem(op="wgrad", m=kw.pop("m", 512), n=320, k=2048, num_groups=5, ab_dtype="float8_e4m3fn",
                              sf_dtype=E8M0, sf_vec_size=32, wgrad_dtype="bfloat16", **kw)


def _check_split(sass: str, split: bool, gpu_fences: bool = False, copy_sites: int = 3 + 2) -> None:
    """gpu_fences: the kernel has GPU-scope fences of its own (discrete weights: the expert descriptors' tensormap
    fences); copy_sites: the bulk-copy sites expected with the split (None: any number but 0)."""
    assert "HGMMA" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass), "local-memory spills in the kernel"
    hgmma = re.findall(r"HGMMA\.\S+ [^;]*;", sass)
    assert sum("gsb0" in h for h in hgmma) < len(hgmma), "wgmma serialized: every HGMMA ends a group"
    copies = re.findall(r"UBLKCP\.S\.S\b", sass)
    expects = re.findall(r"SYNCS\.ARRIVE\.TRANS64\.RED\.A0TR\b", sass)
    if split:
        # one bulk-copy site per stage worker (lanes issue their passes' copies in one waterfall loop) and per
        # stage of the consumers' two-stage k-loop (their B passes: Config.consumer_b_passes; k = 256 is 4 k-tiles,
        # no odd stage), and one tx expect (warp 1) on the worker barrier
        if copy_sites is None:
            assert copies, "no shared::cluster bulk copy in the split kernel"
        else:
            assert len(copies) == copy_sites, f"expected {copy_sites} bulk copy sites, got {len(copies)}"
        assert len(expects) == 1, f"expected one arrive-less tx expect (warp 1), got {len(expects)}"
        assert gpu_fences or "MEMBAR.ALL.GPU" not in sass, "a GPU-scope fence in the split kernel"
    else:
        assert not copies and not expects


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "mxfp8_weight_only", "nvfp4_discrete", "dswiglu_nvfp4"])
def test_split_kernel_copies_half_of_b_to_the_other_cta(name):
    fmt = name.split("_")[-1] if name.startswith("d") else name.split("_")[0]
    kw = {"mxfp8_weight_only": dict(a_dtype="bfloat16"), "nvfp4_discrete": dict(discrete_weights=True),
          "dswiglu_nvfp4": dict(op="dglu", epilogue=Epilogue(act="dswiglu", c_dtype="bfloat16", d_dtype="bfloat16",
                                                            compute_amax=True, dbias_dtype="float32"))}.get(name, {})
    problem = _problem(fmt, **kw)
    assert sm90_config.supports(problem) is None
    _check_split(_sass(problem), True, gpu_fences=problem.discrete_weights)


def test_no_split_without_multicast():
    _check_split(_sass(_problem("mxfp8"), sm90_config.Config(cluster_m=1)), False)


def test_consumer_passes_split_b_rows():
    """The consumer warps take B's first Config.consumer_b_passes passes (default: 8 of a CTA's 16 with the split;
    without it 24 of 32, all 32 for FP4 data with a block-scaled A), the stage workers the rest; 0 leaves every
    pass to the workers; the worker barrier counts one arrival per converting consumer warp."""
    from cudnn_moe_jax.kernels.sm90.mainloop_dequant import CONSUMER_WARPS, WORKERS

    for fmt, cfg, consumer, split in (("nvfp4", None, 8, True), ("nvfp4", sm90_config.Config(cluster_m=1), 32, False),
                                      ("mxfp8", sm90_config.Config(cluster_m=1), 24, False),
                                      ("nvfp4", sm90_config.Config(cluster_m=1, consumer_b_passes=16), 16, False),
                                      ("nvfp4", sm90_config.Config(consumer_b_passes=0), 0, True),
                                      ("nvfp4", sm90_config.Config(consumer_b_passes=12), 12, True),
                                      ("nvfp4", sm90_config.Config(consumer_b_passes=3), 3, True)):
        p = _problem(fmt)
        ml = _kernel(p, cfg).mainloop
        assert (ml.consumer_b, ml.split_b) == (consumer, split)
        b_passes = (128 if split else 256) // 8
        rows = [r for w in WORKERS for _, r in ml._units()[w[0] - 1::len(WORKERS)]]
        assert sorted(rows) == list(range(8 * consumer, 8 * b_passes, 8))
        assert ml.stage_arrivals() == 32 * len(WORKERS) + min(consumer, CONSUMER_WARPS)


def test_wgrad_consumer_passes():
    """The block-scaled wgrad with A in registers: the consumers take half of the CTA's B passes (8 of 16 with the
    split, 16 of 32 with 1x1 clusters), token-major operands (passes of 64 rows x 8 tokens) 12 of 16 with the split
    (RESULTS run 81); none with A converted by the workers."""
    assert _kernel(_wgrad()).mainloop.consumer_b == 8
    assert _kernel(_wgrad(m=384)).mainloop.consumer_b == 16
    assert _kernel(_wgrad(), sm90_config.Config(consumer_b_passes=12)).mainloop.consumer_b == 12
    assert _kernel(_wgrad(a_major="m", b_major="n")).mainloop.consumer_b == 12
    assert _kernel(_wgrad(m=384, a_major="m", b_major="n")).mainloop.consumer_b == 16
    assert _kernel(_wgrad(), sm90_config.Config(dequant_a="workers")).mainloop.consumer_b == 0


@pytest.mark.parametrize("majors", [{}, dict(a_major="m", b_major="n")], ids=["token_contiguous", "token_major"])
def test_wgrad_split_kernel(majors):
    """The split block-scaled wgrad: bulk copies to the other CTA, one tx expect (warp 1), no GPU-scope fence, no
    local memory, HGMMAs unserialized."""
    _check_split(_sass(_wgrad(**majors)), True, copy_sites=None)


def test_token_major_pass_is_one_contiguous_kib():
    """A token-major B pass (64 rows x 8 tokens, `convert_mn_pass`) writes exactly the 1 KiB that the cluster split
    copies to the other CTA (`b_pass_bytes`): every pass of the tile, both halves of each lane's 16 rows."""
    from cudnn_moe_jax.kernels.sm90.mainloop_dequant import ROWS_PER_PASS, TILE_K
    from cudnn_moe_jax.kernels.sm90.mainloop_dequant_wgrad import MN_CORE_WORDS, mn_bf16_word

    ml = _kernel(_wgrad(a_major="m", b_major="n")).mainloop
    rows = ml.tile_n
    for idx in (0, 2):
        covered = set()
        for p in range(rows // ROWS_PER_PASS):
            written = set()
            for lane in range(32):
                r0 = (p >> 3) * 64 + (lane >> 3) * 16
                t = (p & 7) * 8 + (lane & 7)
                for half in range(2):
                    word = mn_bf16_word(rows, idx, r0, t) + half * MN_CORE_WORDS
                    written |= {4 * word + b for b in range(16)}
            start = ml.b_pass_bytes(idx, p * ROWS_PER_PASS)
            assert written == set(range(start, start + ROWS_PER_PASS * 2 * TILE_K)), p
            covered |= written
        assert covered == set(range(idx * rows * TILE_K * 2, (idx + 1) * rows * TILE_K * 2))


def test_hoisted_consumer_stage():
    """Where the consumer warps convert all of B (1 x 1 clusters, FP4 data beside a block-scaled or 16-bit A, by
    default; not an fp16 A split in two) a lane converts one B row's stage: its loads -- the row's 32 code bytes in
    two 16-byte loads, its SF word, the thread's two A groups (codes and SF bytes) -- all come before the stage's
    first shared-memory store (ptxas keeps a load behind an earlier store), B's pairs leave in 16-byte stores (8 a
    stage, on either path), a warp vote per operand picks the folded-scale path, and the narrow stage is released
    once converted (`releases_early`). FP8 data and the default elsewhere keep passes and release after the
    wgmmas. FP8 weights beside a bf16 A keep passes but get every one of them and the early release; so does any
    problem given every pass explicitly. No local memory, HGMMAs unserialized."""
    one = sm90_config.Config(cluster_m=1)
    for p in (_problem("nvfp4"), _problem("nvfp4", a_dtype="bfloat16"), _problem("nvfp4", a_dtype="float16")):
        ml = _kernel(p, one).mainloop
        assert ml.consumer_b == 32 and ml.hoisted() and ml.releases_early()
    mxfp4_f16 = dataclasses.replace(_problem("nvfp4", a_dtype="float16"), sf_dtype=E8M0, sf_vec_size=32)
    for p in (_problem("mxfp8"), mxfp4_f16):   # FP8 data beside a block-scaled A; an fp16 A split in two (MXFP4)
        ml = _kernel(p, one).mainloop
        assert ml.consumer_b == 24 and not ml.hoisted() and not ml.releases_early()
    # FP8 weights (128-row groups, the default config: 1 x 1, one epilogue buffer): every pass, released early
    w_mxfp8 = _problem("mxfp8", a_dtype="bfloat16", m_aligned=128)
    ml = _kernel(w_mxfp8).mainloop
    assert ml.consumer_b == 32 and not ml.hoisted() and ml.stages >= 3 and ml.releases_early()
    two = _kernel(w_mxfp8, one).mainloop   # two stages (two epilogue buffers): no early release, 24 passes
    assert two.stages == 2 and two.consumer_b == 24 and not two.releases_early()
    ml = _kernel(_problem("mxfp8"), sm90_config.Config(cluster_m=1, consumer_b_passes=32)).mainloop
    assert not ml.hoisted() and ml.releases_early()
    _check_split(_sass(w_mxfp8), False)
    assert not _kernel(_problem("nvfp4")).mainloop.hoisted()                      # split B: 8 of 16
    assert not _kernel(_wgrad(m=384), sm90_config.Config(consumer_b_passes=32)).mainloop.hoisted()
    sass = _sass(_problem("nvfp4"), one)
    _check_split(sass, False)
    consumer = sass[sass.index("TRY_ALLOC"):]
    ops = re.findall(r"\b((?:LDS|STS)(?:\.\S+)?)\s", consumer)
    first_store = next(i for i, op in enumerate(ops) if op.startswith("STS"))
    loads = ops[:first_store]
    assert loads.count("LDS.128") == 2 and len(loads) >= 2 + 1 + 2 * 2, f"loads before the first store: {loads}"
    assert ops.count("STS.128") >= 2 * 2 * 8, "B's pairs do not leave in 16-byte stores"   # 2 stages x 2 paths
    assert consumer.count("VOTE.ALL") >= 2 * 2, "no warp vote per operand and stage"
    # a bf16 A (weight-only): its plain loads, then B's row; one vote (B's) a stage
    sass = _sass(_problem("nvfp4", a_dtype="bfloat16"), one)
    _check_split(sass, False)
    consumer = sass[sass.index("TRY_ALLOC"):]
    assert consumer.count("STS.128") >= 2 * 2 * 8 and consumer.count("VOTE.ALL") >= 2
