"""Run one kernel a few times for `ncu` (GPU machine, from the checkout's root): a lab benchmark kernel through the
primitive (lab/bench_kernels.py: `ours` a bf16 one, `mx` an MXFP8 one, `fmt` a block-scaled schedule of the format
comparison; operands quantized from N(0,1) in the problem's format; its module from the bundle), a public-op call
of the Hadamard benchmark (`had SHAPE/FORMAT/VARIANT`: benchmarks.bench_cases.hadamard_call, its bundle items
`hadamard_bundle_items`) or torch._grouped_mm on a named shape.

    ncu --clock-control none --kernel-name regex:^kernel_cutlass_kernel_ --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight python3 -m lab.profile_one ours fc1_t256c21
    ncu ... python3 -m lab.profile_one mx fc1_bf16d
    ncu ... python3 -m lab.profile_one fmt fc1_nvfp4_default
    ncu ... python3 -m lab.profile_one had small/nvfp4/h_d4_row4       # vs small/nvfp4/h_d4 (no RHT output)
    ncu ... python3 -m lab.profile_one torch fc2
    ncu ... python3 -m lab.profile_one ops "e128/wgrad w2 nvfp4"     # any row of bench_moe_ops ("wgrad": the same)
    ncu ... python3 -m lab.profile_one ops "small/dglu (fc2 dgrad)"  # (bf16 rows, BS_OPS and BS_WGRAD rows alike)
"""

from __future__ import annotations

import sys

import numpy as np

from cudnn_moe_jax.shapes import SHAPES


def kernel_args(problem):
    """Inputs of a benchmark kernel in its call order: bf16 (a, b, offsets, alpha, prob), MXFP8 (a, b, sfa, sfb,
    offsets, alpha, prob[, norm_const]); experts of equal size."""
    import jax
    import jax.numpy as jnp

    from cudnn_moe_jax import formats

    m, n, k, L = problem.m, problem.n, problem.k, problem.num_groups
    a = jax.random.normal(jax.random.PRNGKey(0), (m, k), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (L, n, k), jnp.float32)
    if problem.block_scaled:
        fmt = (problem.ab_dtype, problem.sf_dtype, problem.sf_vec_size)
        b, sfb = formats.to_block_scaled(b / np.sqrt(k), *fmt)
        if problem.a_dtype == "bfloat16":   # weight-only: bf16 A, no SFA
            head = (a.astype(jnp.bfloat16), b, sfb)
        else:
            a, sfa = formats.to_block_scaled(a, *fmt)
            head = (a, b, sfa, sfb)
    else:
        head = (a.astype(jnp.bfloat16), (b / np.sqrt(k)).astype(jnp.bfloat16))
    tail = (jnp.ones((1,), jnp.float32),) if problem.epilogue.generate_sfd else ()
    return head + (jnp.asarray(np.arange(1, L + 1) * (m // L), jnp.int32), jnp.ones((L,), jnp.float32),
                   jnp.ones((m,), jnp.float32)) + tail


def main(kind: str, what: str) -> None:
    if kind in ("ops", "wgrad"):   # SHAPE/ROW: any row of benchmarks/bench_moe_ops.py through the public op
        import jax

        import lab.bench_dequant_first  # noqa: F401  (adds e128, e128_a128 and the token sweep to the step shapes)
        from benchmarks import bench_moe_ops

        shape, row = what.split("/")
        if row in bench_moe_ops.BS_WGRAD:
            fn, _, _, inputs = bench_moe_ops._bs_wgrad(shape, row)
            f, args = jax.jit(fn), inputs(0)
        elif row in bench_moe_ops.BS_OPS:   # "fc2 quant nvfp4", "dglu mxfp8", ...
            fn, _, inputs = bench_moe_ops._bs_op(shape, row)
            f, args = jax.jit(fn), inputs(0)
        else:   # a bf16 row ("wgrad w2", "fc2 quant (fwd)", ...) on the benchmark's bf16 inputs
            f, args = jax.jit(bench_moe_ops._ops(shape)[1][row][0]), bench_moe_ops.bf16_inputs(shape, 0)
        for _ in range(4):
            jax.block_until_ready(f(*args))
        return
    if kind in ("ours", "mx", "fmt", "had"):
        import jax

        from lab import harness

        if kind == "had":
            from benchmarks import bench_cases

            shape, fmt, variant = what.split("/")
            f = jax.jit(bench_cases.hadamard_call(shape, variant, fmt))
            args = bench_cases.hadamard_sets(shape, fmt, 1)[0]
        else:
            from lab import bench_kernels
            from lab.forward_cases import kernel_fn

            if what.count("/") == 2:   # SHAPE/FORMAT/LABEL: a lab.bench_memory_bound case
                from lab import bench_memory_bound

                shape, fmt, label = what.split("/")
                problem = bench_kernels.format_problem(shape, fmt)
                config = None if label == "default" else bench_memory_bound._config(label, problem)
            else:
                problem, config = bench_kernels.case(what)
            f, args = kernel_fn(problem, config), kernel_args(problem)
        with harness.kernels_only():
            for _ in range(4):
                jax.block_until_ready(f(*args))
    else:
        import torch

        m, n, k, L = SHAPES[what]
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(L, n, k, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor(np.arange(1, L + 1) * (m // L), device="cuda", dtype=torch.int32)
        for _ in range(4):
            torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
