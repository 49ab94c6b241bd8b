"""Run one kernel a few times for `ncu` (GPU machine): ours (an exported bench artifact), mx (an MXFP8 bench
artifact) or torch._grouped_mm.

    ncu --clock-control none --kernel-name regex:GroupedGemmSm90 --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight python3 benchmarks/profile_one.py ours bench_fc1_t256c21
    ncu ... python3 benchmarks/profile_one.py torch fc2
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
import harness  # noqa: E402

from cudnn_moe_jax.shapes import SHAPES  # noqa: E402

if __name__ == "__main__":
    kind, what = sys.argv[1], sys.argv[2]
    if kind == "mx":  # an MXFP8 benchmark artifact (mxbench_*), operands quantized from N(0,1) per 32
        import jax
        import jax.numpy as jnp

        from cudnn_moe_jax import formats

        harness.register()
        p = harness.manifest()["mxfp8_bench"][what]["problem"]
        m, n, k, L = p["m"], p["n"], p["k"], p["num_groups"]
        f = jax.jit(harness.load(what).call)
        a, sfa = formats.to_block_scaled(jax.random.normal(jax.random.PRNGKey(0), (m, k), jnp.float32), formats.E4M3)
        b, sfb = formats.to_block_scaled(jax.random.normal(jax.random.PRNGKey(1), (L, n, k), jnp.float32),
                                         formats.E4M3)
        args = (a, b, sfa, sfb, jnp.asarray(np.arange(1, L + 1) * (m // L), jnp.int32), jnp.ones((L,), jnp.float32),
                jnp.ones((m,), jnp.float32))
        if p["epilogue"]["generate_sfd"]:
            args += (jnp.ones((1,), jnp.float32),)
        for _ in range(4):
            jax.block_until_ready(f(*args))
    elif kind == "ours":
        import jax
        import jax.numpy as jnp

        harness.register()
        p = harness.manifest()["bench"][what]["problem"]
        m, n, k, L = p["m"], p["n"], p["k"], p["num_groups"]
        f = jax.jit(harness.load(what).call)
        a = jax.random.normal(jax.random.PRNGKey(0), (m, k), jnp.float32).astype(jnp.bfloat16)
        b = (jax.random.normal(jax.random.PRNGKey(1), (L, n, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        args = (a, b, jnp.asarray(np.arange(1, L + 1) * (m // L), jnp.int32), jnp.ones((L,), jnp.float32),
                jnp.ones((m,), jnp.float32))
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
