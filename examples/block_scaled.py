"""Block-scaled grouped GEMMs end to end: quantize with cudnn_moe_jax.formats, run an op, read the FP8 / FP4 outputs
back through formats, and compare with a float64 reference.

  MXFP8: tokens x (m, H) and expert weights w (L, 2I, H) quantized to MXFP8 (e4m3 values, one e8m0 scale per 32
         along H); grouped_gemm_glu (SwiGLU) writes D in FP8 with its row scales SFD_row and the column-quantized
         copy D_col with SFD_col; both are read back with formats.from_block_scaled.
  NVFP4: the same tensors quantized to NVFP4 (e2m1 values, one e4m3 scale per 16); grouped_gemm_glu_hadamard_quant
         writes D in NVFP4 (packed two per byte, e4m3 scales per 16 columns, global scale norm_const).

The reference is computed in float64 from the *dequantized* inputs, so the error printed (and checked against the
output format's rounding bound) is the op's own: fp32 accumulation plus the output quantization. The error against
the unquantized inputs (input quantization included) is printed beside it.

    python examples/block_scaled.py
    python examples/block_scaled.py --rows 2048 --experts 8 --hidden 512 --intermediate 256
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import cudnn_moe_jax as cmj
from cudnn_moe_jax import formats


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1024, help="routed rows m, a multiple of 256 (default 1024)")
    parser.add_argument("--experts", type=int, default=4, help="experts L; rows split evenly in 256s (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="H = K of the GEMM, a multiple of 32 (default 256)")
    parser.add_argument("--intermediate", type=int, default=128,
                        help="I: the GEMM has N = 2I outputs (gate, up); NVFP4 D needs I %% 128 == 0 (default 128)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def swiglu_reference(x, w, prob, offsets):
    """float64 D = prob * swiglu(x @ w[g].T) per expert group g; rows past the last group are 0. W's 2I rows
    interleave gate and up in 32-row blocks (docs/activations.md)."""
    x, w, prob = (np.asarray(v, np.float64) for v in (x, w, prob))
    d = np.zeros((x.shape[0], w.shape[1] // 2))
    for g, (start, end) in enumerate(zip([0, *offsets[:-1]], offsets)):
        c = (x[start:end] @ w[g].T).reshape(end - start, -1, 2, 32)     # (rows, blocks, gate | up, 32)
        gate, up = c[:, :, 0].reshape(end - start, -1), c[:, :, 1].reshape(end - start, -1)
        d[start:end] = prob[start:end, None] * up * gate / (1 + np.exp(-gate))
    return d


def compare(label, got, ref, ref_unquantized, bound) -> bool:
    """Print the errors of `got` relative to max |ref|; True if within `bound` (a fraction of max |ref|)."""
    scale = np.abs(ref).max()
    err = np.abs(np.asarray(got, np.float64) - ref).max() / scale
    total = np.sqrt(np.mean((np.asarray(got, np.float64) - ref_unquantized) ** 2)) / np.sqrt(np.mean(ref ** 2))
    ok = err <= bound
    print(f"  {label:<34} max |D - ref| = {err:.2e} x max|D| (bound {bound:.2e}: {'ok' if ok else 'EXCEEDED'}); "
          f"RMS error vs unquantized inputs {total:.2e}")
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    m, L, H, I = args.rows, args.experts, args.hidden, args.intermediate
    k_x, k_w, k_p = jax.random.split(jax.random.PRNGKey(args.seed), 3)
    x = jax.random.normal(k_x, (m, H))
    w = jax.random.normal(k_w, (L, 2 * I, H)) / H ** 0.5
    prob = jax.random.uniform(k_p, (m,))
    offsets = (256 * np.round(np.linspace(0, m // 256, L + 1)[1:])).astype(np.int32)   # group ends
    exact = swiglu_reference(x, w, prob, offsets)
    print(f"x ({m}, {H}), w ({L}, {2 * I}, {H}), padded_offsets {offsets.tolist()}; backend {jax.default_backend()}")
    ok = True

    # --- MXFP8 in, FP8 out ------------------------------------------------------------------------------------
    a, sfa = formats.to_block_scaled(x, "mxfp8")           # e4m3 codes (m, H), e8m0 scales as uint8 bits
    b, sfb = formats.to_block_scaled(w, "mxfp8")
    xq, wq = formats.from_block_scaled(a, sfa, "mxfp8"), formats.from_block_scaled(b, sfb, "mxfp8")
    ref = swiglu_reference(xq, wq, prob, offsets)
    out = cmj.grouped_gemm_glu(a, b, sfa, sfb, offsets, prob_tensor=prob, d_dtype="float8_e4m3fn",
                               norm_const_tensor=jnp.ones((1,)))   # norm_const 1: D = val(code) * val(scale)
    print(f"MXFP8: grouped_gemm_glu -> D {out.d_tensor.dtype} {out.d_tensor.shape}, SFD_row "
          f"{out.sfd_row_tensor.dtype} {out.sfd_row_tensor.shape}")
    d = formats.from_block_scaled(out.d_tensor, out.sfd_row_tensor, "mxfp8")
    # D_col is quantized down the columns: its scales are laid out as those of the transposed matrix.
    d_col = formats.from_block_scaled(out.d_col_tensor.T, out.sfd_col_tensor, "mxfp8").T
    e4m3_bound = 2.0 ** -4 * 1.01              # 3 mantissa bits: half an ulp is 2^-4 of the value (+ fp32 rounding)
    ok &= compare("D (row scales)", d, ref, exact, e4m3_bound)
    ok &= compare("D_col (column scales)", d_col, ref, exact, e4m3_bound)

    # --- NVFP4 in, NVFP4 out ------------------------------------------------------------------------------------
    a, sfa = formats.to_block_scaled(x, "nvfp4")           # packed e2m1 (m, H/2) uint8, e4m3 scales, vec 16
    b, sfb = formats.to_block_scaled(w, "nvfp4")
    xq, wq = formats.from_block_scaled(a, sfa, "nvfp4"), formats.from_block_scaled(b, sfb, "nvfp4")
    ref = swiglu_reference(xq, wq, prob, offsets)
    # NVFP4's global scale: D is stored as D * norm_const. Values of order 1 keep the e4m3 block scales in range
    # with norm_const 1; the usual choice for other magnitudes is 448 * 6 / amax(D).
    norm_const = 1.0
    out = cmj.grouped_gemm_glu_hadamard_quant(a, b, sfa, sfb, offsets, prob_tensor=prob, d_dtype="nvfp4",
                                              norm_const_tensor=jnp.full((1,), norm_const))
    print(f"NVFP4: grouped_gemm_glu_hadamard_quant -> D {out.d_tensor.dtype} {out.d_tensor.shape} (packed), sfd "
          f"{out.sfd_tensor.dtype} {out.sfd_tensor.shape}")
    d = formats.from_block_scaled(out.d_tensor, out.sfd_tensor, "nvfp4") / norm_const
    # e2m1 {0, .5, 1, 1.5, 2, 3, 4, 6} with the block max at 6: the widest gap (4 to 6) gives at most 1/6 of the
    # block max, plus the e4m3 rounding of the scale.
    ok &= compare("D (NVFP4)", d, ref, exact, 1 / 6 * (1 + 2.0 ** -3))
    print("all errors within the formats' bounds" if ok else "an error EXCEEDED its bound")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
