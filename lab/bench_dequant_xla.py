"""How fast does XLA dequantize block-scaled operands to bf16? The dequantize-first route's conversion
(cudnn_moe_jax._dequant_first) beside the reference's formulation (reference.dequantize_a/_b + astype: a table
gather for e2m1, a stacked copy to unpack nibbles) and a plain bf16 copy of the output's size, on fc1's A (16384 x
7168) and B (8 x 4096 x 7168), device-timed (CUPTI span of CALLS calls on distinct inputs).

    python -m lab.bench_dequant_xla [--formats mxfp8,nvfp4,mxfp4]     # checkout root, GPU machine with torch

Prints per operand and variant: microseconds per call and TB/s (codes + scales read, bf16 written), and whether
the result equals the reference's bit for bit.
"""

from __future__ import annotations

import argparse

CALLS = 4
OPERANDS = {"A": (16384, 7168), "B": (8, 4096, 7168)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--formats", default="mxfp8,nvfp4,mxfp4")
    ap.add_argument("--rows-div", type=int, default=1, help="divide the operands' rows (a quick CPU run)")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cudnn_moe_jax import _dequant_first, formats, reference
    from cudnn_moe_jax._problem import GroupedGemmProblem
    from lab import device_timer

    timer, why = device_timer.cupti_timer()
    print(f"device {jax.devices()[0].device_kind}; {'CUPTI' if timer else 'host: ' + why}", flush=True)
    for fmt in args.formats.split(","):
        data, sf, vec = formats.BLOCK_FORMATS[fmt]
        for name, shape in OPERANDS.items():
            shape = shape[:-2] + (shape[-2] // args.rows_div, shape[-1])
            groups = shape[0] if len(shape) == 3 else 1
            rows, k = shape[-2], shape[-1]
            p = GroupedGemmProblem(op="quant", m=rows, n=rows, k=k, num_groups=groups, ab_dtype=data, sf_dtype=sf,
                                   sf_vec_size=vec)
            quant = jax.jit(lambda x: formats.to_block_scaled(x, data, sf, vec))
            sets = [quant(jax.random.normal(jax.random.PRNGKey(i), shape, jnp.float32)) for i in range(CALLS)]
            kw = dict(ab_dtype=data, sf_dtype=sf, sf_vec_size=vec)
            if name == "A":
                ref = lambda c, s: reference.dequantize_a(c, s, **kw).astype(jnp.bfloat16)  # noqa: E731
                new = lambda c, s: _dequant_first.dequantize_a(c, s, p)  # noqa: E731
            else:
                ref = lambda c, s: reference.dequantize_b(c, s, **kw).astype(jnp.bfloat16)  # noqa: E731
                new = lambda c, s: _dequant_first.dequantize_b(c, s, p)  # noqa: E731
            copy = lambda c, s: jnp.zeros(shape, jnp.bfloat16) + c.reshape(-1)[0].astype(jnp.bfloat16)  # noqa
            nbytes = sum(x.size * x.dtype.itemsize for x in sets[0]) + 2 * int(np.prod(shape))
            want = jax.jit(ref)(*sets[0])
            for label, fn in (("reference", ref), ("route", new), ("bf16 fill", copy)):
                prog = jax.jit(lambda flat, fn=fn: [fn(c, s) for c, s in flat])
                run = lambda prog=prog: jax.block_until_ready(prog(sets))  # noqa: E731
                run()
                times = [timer.time(run, CALLS) if timer else device_timer.host_time(run, CALLS) for _ in range(3)]
                t = min(x.device if x.device is not None else x.host for x in times)
                same = ""
                if label != "bf16 fill":
                    bits = lambda x: np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))  # noqa: E731
                    same = "bit-identical" if np.array_equal(bits(jax.jit(fn)(*sets[0])), bits(want)) else "DIFFERS"
                print(f"{fmt:6s} {name} {str(shape):18s} {label:10s} {t * 1e6:9.1f} us {nbytes / t / 1e12:6.2f} TB/s "
                      f"{same}", flush=True)


if __name__ == "__main__":
    main()
