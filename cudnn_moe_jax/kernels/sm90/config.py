"""Kernel configuration (tile, cluster, stages) and the support predicate of the sm90 grouped GEMM.

Pure Python (no cutlass import): the JAX layer may call `supports` / `default_config` on any machine.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from cudnn_moe_jax import activations
from cudnn_moe_jax._problem import DGRAD_OPS
from cudnn_moe_jax.operands import STAGED_CHUNK_K, half_dtype, has_exact_half, staged_a_in_registers
from cudnn_moe_jax.limits import (FLOAT_OUT_DTYPES, FORWARD_D_DTYPES, FP4, FP8_DTYPES, GROUP_ALIGN, HALF_DTYPES,
                                  MAX_GROUPS, OUT_DTYPES, QUANT_D_DTYPES, SF_GROUP_ALIGN, k_align)

SUPPORTED_OPS = ("quant", "srelu", "glu", "glu_hadamard_quant", "dglu", "dsrelu", "wgrad")
FORWARD_ACTS = tuple(activations.TABLE)  # the forward activations (glu_hadamard_quant takes any)
DGRAD_ACTS = {op: tuple(a.derivative for a in activations.TABLE.values() if a.backward_op == op)
              for op in ("dglu", "dsrelu")}
GLU_ACTS = activations.GLU_NAMES
# block-scaled inputs (data dtype, SF dtype, vec): dequantized exactly to bf16 on chip (mainloop_dequant), or with
# Config(mxfp8_wgmma=True) MXFP8 through the FP8-wgmma mainloop (mainloop_mxfp8)
BLOCK_FORMATS = tuple((d, "float8_e8m0fnu", 32) for d in FP8_DTYPES) + (
    ("float4_e2m1fn", "float8_e8m0fnu", 32), ("float4_e2m1fn", "float8_e8m0fnu", 16),
    ("float4_e2m1fn", "float8_e4m3fn", 16))
SMEM_CAPACITY = 232448  # sm_90 opt-in dynamic shared memory per CTA (227 KiB)
H200_SMS = 132
# 4-CTA clusters (2 x 2) co-resident on an H200: 24 run at once, 32 do not (the rest ran as a second wave of the
# persistent grid at half speed)
H200_4CTA_CLUSTERS = 24


@dataclasses.dataclass(frozen=True)
class Config:
    """Static schedule of one compiled kernel.

    tile_n: 128 or 256 (tile_m is 128: two consumer warpgroups of 64 rows, "cooperative");
    cluster_m: CTAs per cluster along M sharing (multicasting) the B tile, 1 or 2;
    cluster_n: CTAs per cluster along N sharing (multicasting) the A tile, 1 or 2;
    ab_stages: A/B shared-memory pipeline depth (None: as many as fit);
    epi_stages: epilogue shared-memory buffers per output (TMA-store overlap), 1, 2, 4 or 8 (None: the kernel
      class's `epi_stage_candidates`: 2, or 4 for a wgrad from 16-bit operands); A/B stages take the
      rest of shared memory (3 for GLU with a 16-bit C, else 4);
    group_m: M blocks per raster swizzle group (L2 reuse);
    dequant_a: block-scaled inputs: where A is converted to bf16 -- "registers": by the consumer warps into the
      register operand of an RS wgmma (B by the producer warpgroup's stage workers, or staged), "workers": by the
      stage workers into a bf16 shared-memory stage like B (SS wgmma), "workspace" (staged problems): once, by the
      converter warps, into a bf16 workspace like B (default_config: `operands.staged_a_in_registers`);
    mxfp8_wgmma: MXFP8 inputs through the FP8-wgmma mainloop (mainloop_mxfp8; tile_n 128) instead of exact
      dequantization to bf16 (mainloop_dequant, the default). Opt-in: the FP8 wgmma does not sum a 32-K block's
      products at fp32 precision (docs/numerics.md);
    consumer_b_passes: block-scaled inputs with A converted in registers: 8-row passes of B (of this CTA's half
      where the 2-CTA cluster splits B's conversion) the 8 consumer warps convert per stage beside the stage
      workers, warp w passes w, w + 8, ... (mainloop_dequant); None: 8 with the split, else 24 (FP4 data beside a
      block-scaled or 16-bit A, and FP8 data beside a bf16 A with at least 3 A/B stages: all 32; K-grouped: 16).
      All 32 at 1 x 1 clusters: the narrow stage is released once converted; FP4 data: a B row a lane;
    mx_n_parts: with mxfp8_wgmma: run each 32-K block's data and scale wgmmas per column part (1, 2 or 4 parts of
      the 128-column tile) so a part is folded while the others compute (Mxfp8Mainloop.mma_tile_parts);
    num_sms: persistent grid size (CTAs); 132 on H100/H200 SXM. 2 x 2 clusters use at most H200_4CTA_CLUSTERS
      of them (gemm.GroupedGemmSm90Base.max_clusters).
    """

    tile_m: int = 128
    tile_n: int = 256
    cluster_m: int = 2
    cluster_n: int = 1
    ab_stages: Optional[int] = None
    epi_stages: Optional[int] = None
    group_m: int = 8
    num_sms: int = H200_SMS
    dequant_a: str = "registers"
    mxfp8_wgmma: bool = False
    mx_n_parts: int = 1
    consumer_b_passes: Optional[int] = None

    def __post_init__(self):
        if self.tile_m != 128:
            raise ValueError("tile_m must be 128")
        if self.tile_n not in (128, 256):
            raise ValueError("tile_n must be 128 or 256")
        if self.cluster_m not in (1, 2):
            raise ValueError("cluster_m must be 1 or 2")
        if self.cluster_n not in (1, 2):
            raise ValueError("cluster_n must be 1 or 2")
        if self.epi_stages not in (None, 1, 2, 4, 8):
            raise ValueError("epi_stages must be None, 1, 2, 4 or 8")
        if self.consumer_b_passes is not None and not 0 <= self.consumer_b_passes <= 32:
            raise ValueError("consumer_b_passes must be None or 0..32")
        if self.mx_n_parts not in (1, 2, 4):
            raise ValueError("mx_n_parts must be 1, 2 or 4")
        if self.group_m < 1:
            raise ValueError("group_m must be >= 1")
        if self.dequant_a not in ("registers", "workers", "workspace"):
            raise ValueError("dequant_a must be 'registers', 'workers' or 'workspace'")
        if self.mxfp8_wgmma and self.tile_n != 128:
            raise ValueError("mxfp8_wgmma runs 128 x 128 tiles (tile_n=128)")


def _staged_reason(problem) -> Optional[str]:
    """Why a staged problem (operands converted once in the kernel: mainloop_staged) is not implemented, or None."""
    if not problem.block_scaled or not has_exact_half(problem):
        return ("staged conversion takes block-scaled B with a block-scaled or bf16 A, or an fp16 A beside weights "
                "fp16 holds exactly (NVFP4)")
    if problem.op == "wgrad":
        gathered = problem.a_rows is not None or problem.b_rows is not None
        majors = (problem.a_major, problem.b_major)
        if gathered or majors not in (("k", "k"), ("m", "n")) or (majors == ("m", "n") and problem.ab_dtype == FP4):
            return ("the staged wgrad reads ungathered A and B, both token-contiguous (cuDNN's layout) or, FP8, "
                    "both token-major")
        return None
    if (problem.op not in ("quant", "srelu", "glu") + DGRAD_OPS or problem.discrete_weights
            or problem.a_rows is not None):
        return ("staged conversion is implemented for the forward, dgrad and wgrad ops on stacked weights and "
                "ungathered A")
    if (problem.a_major, problem.b_major) != ("k", "k") or problem.m_aligned % 128:
        return "staged conversion needs K-major A and B and m_aligned % 128 == 0"
    if problem.k > 128 * STAGED_CHUNK_K:
        return f"staged conversion flags A's chunks in an (m, 1) column: K <= {128 * STAGED_CHUNK_K}"
    return None


def supports(problem) -> Optional[str]:
    """None if `GroupedGemmSm90` implements `problem`, else the reason it does not."""
    epi = problem.epilogue
    if problem.op not in SUPPORTED_OPS:
        return f"op {problem.op!r} is not implemented by the sm90 kernel (only {SUPPORTED_OPS})"
    if problem.a_dtype is not None and (not problem.block_scaled or problem.a_dtype not in HALF_DTYPES):
        return (f"A {problem.a_dtype} beside B {problem.ab_dtype}: only a bf16 / fp16 A with block-scaled B "
                "(weight-only quantization) is implemented")
    if problem.block_scaled:
        if (problem.ab_dtype, problem.sf_dtype, problem.sf_vec_size) not in BLOCK_FORMATS:
            return (f"block-scaled {problem.ab_dtype!r} with {problem.sf_dtype!r}/{problem.sf_vec_size}: not one of "
                    f"the formats {BLOCK_FORMATS}")
    elif problem.ab_dtype not in HALF_DTYPES:
        return f"A/B dtype {problem.ab_dtype!r} not in {HALF_DTYPES}"
    if problem.staged:
        reason = _staged_reason(problem)
        if reason is not None:
            return reason
    if problem.discrete_weights and problem.op == "wgrad":
        return "wgrad has no per-expert weight operand (discrete weights are B of the M-grouped ops)"
    if problem.op != "wgrad" and problem.a_major != "k":
        return "an M-major A is implemented for wgrad only"
    if (problem.a_rows is not None or problem.b_rows is not None) and (
            problem.block_scaled or problem.op == "glu_hadamard_quant"):
        return "gathered rows / tokens (a_index, b_index) are implemented for bf16 / fp16 operands"
    if problem.op == "wgrad" and ((problem.a_rows is not None and problem.a_major != "m")
                                  or (problem.b_rows is not None and problem.b_major != "n")):
        return "wgrad gathers token-major operands only (a_index with a_major='m', b_index with b_major='n')"
    if problem.op != "wgrad":
        reason = _alignment_support(problem)
        if reason is not None:
            return reason
    reason = _block_scaled_majors_reason(problem)
    if reason is not None:
        return reason
    if problem.op in DGRAD_ACTS:
        return _dgrad_support(problem)
    if problem.op == "wgrad":
        return _wgrad_support(problem)
    if problem.op == "glu_hadamard_quant":
        reason = _hadamard_outputs_reason(problem)
        if reason is not None:
            return reason
    elif epi.rht or epi.has_hadamard:
        return f"{problem.op} has no Hadamard output"
    elif epi.generate_sfd != (epi.d_dtype in QUANT_D_DTYPES) or (epi.discrete_col_sfd and not epi.generate_sfd):
        return "FP8 / FP4 D comes with SFD_row/D_col/SFD_col (generate_sfd) and only then discrete_col_sfd"
    elif epi.d_dtype not in FORWARD_D_DTYPES:
        return f"d_dtype {epi.d_dtype!r} not in {FORWARD_D_DTYPES}"
    elif epi.generate_sfd and problem.n_out % (32 if epi.d_dtype == FP4 else 16):
        return "FP8 / FP4 D needs N_out % 16 / 32 == 0 (16-byte rows)"
    if problem.op == "quant":
        if epi.act is not None:
            return "quant takes no activation"
        if epi.c_dtype is not None:
            return "quant has no C output"
    elif problem.op == "srelu":
        if epi.act not in (None, "srelu"):
            return f"srelu op with act {epi.act!r}"
    elif problem.op == "glu":
        if epi.act not in GLU_ACTS:
            return f"glu act must be one of {GLU_ACTS}, got {epi.act!r}"
    if epi.is_glu and problem.n % 64:
        return "GLU needs N % 64 == 0"
    if epi.c_dtype is not None and epi.c_dtype not in OUT_DTYPES:
        return f"c_dtype {epi.c_dtype!r} not in {OUT_DTYPES}"
    if epi.has_bias and epi.bias_dtype not in FLOAT_OUT_DTYPES:
        return f"bias_dtype {epi.bias_dtype!r} not in {FLOAT_OUT_DTYPES}"
    if not 1 <= problem.num_groups <= MAX_GROUPS:
        return f"num_groups must be in [1, {MAX_GROUPS}]"
    if problem.k % 8 or problem.n % 8 or problem.n_out % 8:
        return "N, N_out and K must be multiples of 8 (16-byte TMA rows)"
    return _block_k_reason(problem)


def _hadamard_outputs_reason(problem) -> Optional[str]:
    """glu_hadamard_quant (hadamard.py): a forward activation of the table; C 16/32-bit; D bf16 or NVFP4; the
    Hadamard output none, rowwise (bf16 / NVFP4) or colwise (NVFP4); NVFP4 outputs need N_out % 128 == 0."""
    epi = problem.epilogue
    if epi.act not in FORWARD_ACTS:
        return f"glu_hadamard_quant act {epi.act!r} not in {FORWARD_ACTS}"
    if epi.c_dtype not in FLOAT_OUT_DTYPES:
        return f"glu_hadamard_quant c_dtype {epi.c_dtype!r} not in {FLOAT_OUT_DTYPES}"
    if epi.d_dtype not in ("bfloat16", FP4) or epi.generate_sfd or epi.discrete_col_sfd:
        return f"glu_hadamard_quant D is bf16 or NVFP4 (with sfd), not {epi.d_dtype!r}"
    if epi.rht not in (None, "rowwise", "colwise") or (epi.rht is None and (epi.rht_dtype or epi.has_hadamard)):
        return f"glu_hadamard_quant rht {epi.rht!r} with rht_dtype {epi.rht_dtype!r}"
    if epi.rht is not None and epi.rht_dtype not in (("bfloat16", FP4) if epi.rht == "rowwise" else (FP4,)):
        return f"glu_hadamard_quant {epi.rht} output dtype {epi.rht_dtype!r}"
    if problem.n_out % (128 if FP4 in (epi.d_dtype, epi.rht_dtype) else 16):
        return "glu_hadamard_quant needs N_out % 16 == 0 (N_out % 128 == 0 with an NVFP4 output)"
    return None


def _block_k_reason(problem) -> Optional[str]:
    if problem.block_scaled and problem.k % (32 if problem.ab_dtype == "float4_e2m1fn" else 16):
        return "block-scaled operands need 16-byte TMA rows (K % 16 == 0, packed FP4 K % 32 == 0)"
    return None


def _alignment_support(problem) -> Optional[str]:
    """M-grouped ops: m a multiple of m_aligned (any power of two up to 256: below 128 the schedule clips tiles at
    group ends, kernels/scheduler.py); scale factors along M (MXFP8 A: 128-row SFA atoms loaded per tile; FP8 D:
    SFD in 128-row atoms, D_col in 32-row blocks) need whole 128-row tiles inside one group."""
    # (a symbolic m, a module's for every m, is m_aligned * m_blocks by construction)
    if isinstance(problem.m, int) and problem.m % problem.m_aligned:
        return f"m must be a multiple of m_aligned={problem.m_aligned}"
    if problem.m_aligned % SF_GROUP_ALIGN and (problem.block_scaled or problem.epilogue.generate_sfd):
        return (f"m_aligned={problem.m_aligned}: block-scaled inputs and FP8 D need group ends on multiples of "
                f"{SF_GROUP_ALIGN} (scale-factor atoms along M)")
    return None


def _dgrad_support(problem) -> Optional[str]:
    """The backward epilogue (dgrad.py): bf16/fp16 or block-scaled dY and weight (the forward's mainloops), C
    16/32-bit or FP8 (e4m3 / e5m2), D_row 16/32-bit or FP8 (with SFD_row, D_col, SFD_col: epilogue_fp8d, both
    SFD_col layouts)."""
    epi = problem.epilogue
    if epi.act not in DGRAD_ACTS[problem.op]:
        return f"{problem.op} act {epi.act!r} not in {DGRAD_ACTS[problem.op]}"
    if epi.d_dtype not in OUT_DTYPES:
        return f"{problem.op}: D_row dtype {epi.d_dtype!r} not in {OUT_DTYPES}"
    if epi.generate_sfd != (epi.d_dtype in FP8_DTYPES) or (epi.discrete_col_sfd and not epi.generate_sfd):
        return "FP8 D_row comes with SFD_row/D_col/SFD_col (generate_sfd) and only then discrete_col_sfd"
    if epi.c_dtype not in OUT_DTYPES:  # FP8: the forward's satfinite cast, widened to fp32 exactly before beta * C
        return f"{problem.op}: saved C dtype {epi.c_dtype!r} not in {OUT_DTYPES}"
    if not 1 <= problem.num_groups <= MAX_GROUPS:
        return f"num_groups must be in [1, {MAX_GROUPS}]"
    if problem.k % 8 or problem.n % 32:
        return "K must be a multiple of 8 and N (the dgrad output width per gate/up half) of 32"
    return _block_k_reason(problem)


def read_problem(problem):
    """`problem` with the operand majors the kernels read it in (the lowering calls this before `supports`): its
    own where a kernel reads that memory order directly; else K-major, which XLA then provides by transposing the
    operand (a copy of its FP8 / FP4 bytes) -- a kernel call instead of the reference. The dequantizing mainloop
    reads block-scaled B K-major only (an N-major block-scaled B would need N-major converter passes), and the
    block-scaled wgrad reads both operands token-contiguous or, FP8 with n_w % 16 == 0, both token-major; packed
    FP4 stored token-major, one operand of each kind, or token-major B rows of other than 16 bytes are read after
    such a copy."""
    if _block_scaled_majors_reason(problem) is None:
        return problem
    return dataclasses.replace(problem, a_major="k", b_major="k")


def _block_scaled_majors_reason(problem) -> Optional[str]:
    """Why no kernel reads the block-scaled operands of `problem` in their hinted majors, or None (`supports`
    refuses these; `read_problem` maps them to K-major)."""
    if not problem.block_scaled:
        return None
    if problem.op != "wgrad":
        if problem.b_major != "k":
            return "an N-major B needs bf16/fp16 operands (FP8 wgmma reads K-major tiles only)"
        return None
    majors = (problem.a_major, problem.b_major)
    if majors not in (("k", "k"), ("m", "n")):
        return ("block-scaled wgrad reads A and B both token-contiguous (a_major='k', b_major='k') or both "
                "token-major (a_major='m', b_major='n')")
    if majors == ("m", "n") and problem.ab_dtype not in FP8_DTYPES:
        return "packed FP4 wgrad operands are token-contiguous only (their bytes pack two tokens)"
    if majors == ("m", "n") and problem.n % 16:
        return "token-major FP8 wgrad needs n_w % 16 == 0 (16-byte rows of B's (T, n_w) storage)"
    return None


def _wgrad_support(problem) -> Optional[str]:
    """The K-grouped weight gradient (scheduler.K_GROUPED): A (m_w, T), B (n_w, T), W 16/32-bit; global scales
    (alpha = gsa[e] * gsb[e]) and accumulate_on_output (W += ..., in place) included. T is dynamic (the problem's k
    may be symbolic: `_runtime.symbolic_t()`). bf16/fp16 A / B in any majors; block-scaled A / B (per-expert SF
    segments, the dequantizing mainloop) both token-contiguous (cuDNN's layout) or, FP8, both token-major
    (`a_major="m"`, `b_major="n"`: dY / D_col as a training step stores them)."""
    if not problem.block_scaled and problem.ab_dtype not in HALF_DTYPES:
        return f"wgrad with {problem.ab_dtype} inputs: A/B must be bf16/fp16 or block-scaled"
    if problem.wgrad_dtype not in FLOAT_OUT_DTYPES:
        return f"wgrad_dtype {problem.wgrad_dtype!r} not in {FLOAT_OUT_DTYPES}"
    if not 1 <= problem.num_groups <= MAX_GROUPS:
        return f"num_groups must be in [1, {MAX_GROUPS}]"
    if problem.m % 128:
        return "wgrad needs m_w % 128 == 0 (an output tile must not straddle two experts' W rows)"
    if problem.k % k_align(problem.ab_dtype) or problem.n % 8:
        return (f"wgrad needs T % {k_align(problem.ab_dtype)} == 0 and n_w % 8 == 0 (16-byte TMA rows of "
                f"{problem.ab_dtype})")
    return None


def default_config(problem) -> Config:
    """Measured choice (H200, benchmarks/RESULTS.md): 128x256 tiles, 2x1 cluster multicasting B, 2 epilogue
    buffers (GLU with a 16-bit C then has 3 A/B stages, everything else 4), except GLU with >= 64 experts: one.

    Measured alternatives: no cluster -12% (fc1); 2x2 clusters -45% with 33 clusters (only ~24 are co-resident),
    -30% with the cap of 24 (547 vs 779 TFLOP/s on fc1; per SM no better); 1x2 -5..10%; one epilogue buffer (4 A/B
    stages for GLU) -12% on fc1, +9% on `small`; tile 128x128 -5% on fc1/fc2; swizzle group 4/8/16 within noise;
    one barrier per epilogue step -8..13%. ncu, one launch: fc1 1.25 ms (torch CUTLASS 1.24), fc2 645 us (652),
    small 192 us (171, DRAM-bound).
    Block-scaled inputs (dequantized to bf16 on chip) run the bf16 schedule. The opt-in FP8-wgmma MXFP8 mainloop
    (`MXFP8_WGMMA`) runs 128 x 128 tiles (acc + the data and scale-product partials, 3 x 64 registers, leave no
    room for 256); measured there (fc1 TFLOP/s): cluster 2x1 597-600 vs 1x1 591; the block's wgmmas in two 64-column
    parts 624-631 vs 592-600 whole (fc2 572 vs 545), in four parts 473 (shared-memory bound); 4 A/B stages 607 vs
    617, 2x2 clusters per SM no better (626 from 24 clusters on 96 SMs); raster group 4 / 16 603 / 602, 1x2 cluster
    602 vs 615.
    """
    if problem.staged:   # the 16-bit kernel's schedule on the converted operands, without tile lists (a tile's rows
        # are one expert's: the chunk flags are per 128-row tile)
        config = default_config(dataclasses.replace(problem, ab_dtype=half_dtype(problem), sf_dtype=None,
                                                    sf_vec_size=None, a_dtype=None, staged=False))
        # a block-scaled A: in the consumers' registers (mainloop_staged.StagedBMainloop) or once into a workspace
        config = dataclasses.replace(config, dequant_a="registers" if staged_a_in_registers(problem) else "workspace")
        return dataclasses.replace(config, cluster_m=1) if _block_scaled_pairs_groups(problem) else config
    if (problem.op == "glu" and problem.block_scaled and problem.a_dtype == "bfloat16"
            and problem.ab_dtype in FP8_DTYPES):
        # weight-only FP8: the bf16 A stage beside the FP8 B and its bf16 stage leaves 2 A/B stages next to two
        # epilogue buffers, 3 next to one: fc1 (on chip) 297 -> 486, e128_fc1 310 -> 442 TFLOP/s (RESULTS run 94)
        return Config(epi_stages=1, cluster_m=1 if _block_scaled_pairs_groups(problem) else 2)
    if _block_scaled_pairs_groups(problem):
        # ends on odd multiples of 128 would pair two groups in a 2-CTA block, and the block-scaled mainloops
        # multicast B (and its scales) unconditionally: 1x1 clusters (FP8-wgmma MXFP8 on fc1: 591 vs 597-600 TFLOP/s)
        return Config(cluster_m=1)
    if problem.op == "wgrad" and problem.b_rows is not None:
        # a gathered operand is not multicast: a gathered B pairs two N tiles (A multicast), unless A is gathered too
        return Config(cluster_m=1, cluster_n=1 if problem.a_rows is not None else 2)
    if problem.op == "wgrad" and problem.m % 256:
        return Config(cluster_m=1)  # a 2-CTA cluster pairs two M tiles of one expert's W
    if (problem.op == "glu" and problem.block_scaled and problem.ab_dtype == FP4 and problem.a_dtype is None
            and problem.epilogue.c_dtype not in FP8_DTYPES):
        # FP4 A and B with a 16 / 32-bit C: one epilogue buffer leaves room for a 4th A/B stage, which the
        # conversion uses: NVFP4 fc1 550-551 vs 523-525 TFLOP/s (RESULTS runs 53-54; weight-only, MXFP8: no gain)
        return Config(epi_stages=1)
    if problem.op == "glu" and problem.epilogue.c_dtype in HALF_DTYPES and problem.num_groups >= 64:
        # many experts (few rows each): B streams from DRAM, so 4 A/B stages (one epilogue buffer) beat 3 stages
        # with two: `small` (64 experts) 593 vs 546 and 571 vs 535 TFLOP/s (two runs); with 8 experts -3..-12%
        return Config(epi_stages=1)
    return Config()


# the FP8-wgmma MXFP8 mainloop's measured schedule (opt-in: Config.mxfp8_wgmma)
MXFP8_WGMMA = Config(tile_n=128, cluster_m=2, mx_n_parts=2, mxfp8_wgmma=True)


def _block_scaled_pairs_groups(problem) -> bool:
    """Block-scaled inputs or FP4 D with ends not on 256-row blocks: a 2-CTA cluster along M would pair two groups
    (tile lists), which their loads (SF atoms multicast with B) and stores (FP4 D / D_col boxes) do not follow; such
    problems run 1-CTA clusters (default_config)."""
    return (problem.block_scaled or problem.epilogue.d_dtype == FP4) and problem.m_aligned % GROUP_ALIGN != 0


def config_from_hints(problem, mma_tiler_mn=None, cluster_shape_mn=None) -> Config:
    """cuDNN's static `mma_tiler_mn` / `cluster_shape_mn` keywords as a Hopper config.

    They are Blackwell tile shapes, so they are hints here: tile N (128/256) and cluster dims (1/2) carry over;
    tile M is always 128 per consumer pair on sm90 (a 256-row cuDNN tile is two of ours).
    """
    config = default_config(problem)
    changes = {}
    if mma_tiler_mn is not None and mma_tiler_mn[1] in (128, 256):
        changes["tile_n"] = mma_tiler_mn[1]
    if cluster_shape_mn is not None:
        cluster_m, cluster_n = cluster_shape_mn
        if cluster_m in (1, 2) and (cluster_m == 1 or not _block_scaled_pairs_groups(problem)):
            changes["cluster_m"] = cluster_m
        if cluster_n in (1, 2) and (cluster_n == 1 or problem.a_rows is None):   # gathered A: not multicast
            changes["cluster_n"] = cluster_n
    return dataclasses.replace(config, **changes)
