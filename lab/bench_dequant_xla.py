"""How fast does XLA dequantize block-scaled operands to bf16? The dequantize-first route's conversion (the
reference's exact fp32 dequantization rounded to bf16 and written as uint32 pairs, `cudnn_moe_jax._dequant_first`)
beside the same values written as bf16 (2-byte stores), and two fills of the output's size (bf16, uint32 words), on
fc1's A (16384 x 7168) and B (8 x 4096 x 7168), device-timed (CUPTI span of CALLS calls on distinct inputs).

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
    from lab import device_timer

    timer, why = device_timer.cupti_timer()
    print(f"device {jax.devices()[0].device_kind}; {'CUPTI' if timer else 'host: ' + why}", flush=True)
    for fmt in args.formats.split(","):
        data, sf, vec = formats.BLOCK_FORMATS[fmt]
        for name, shape in OPERANDS.items():
            shape = shape[:-2] + (shape[-2] // args.rows_div, shape[-1])
            quant = jax.jit(lambda x: formats.to_block_scaled(x, data, sf, vec))
            sets = [quant(jax.random.normal(jax.random.PRNGKey(i), shape, jnp.float32)) for i in range(CALLS)]
            kw = dict(ab_dtype=data, sf_dtype=sf, sf_vec_size=vec)
            fn = reference.dequantize_a if name == "A" else reference.dequantize_b
            route = lambda c, s, fn=fn: _dequant_first._bf16(fn(c, s, **kw), "k")  # noqa: E731
            plain = lambda c, s, fn=fn: fn(c, s, **kw).astype(jnp.bfloat16)  # noqa: E731
            fill = lambda c, s: jnp.zeros(shape, jnp.bfloat16) + c.reshape(-1)[0].astype(jnp.bfloat16)  # noqa
            fill32 = lambda c, s: _from_words(jnp.zeros(shape[:-1] + (shape[-1] // 2,), jnp.uint32)  # noqa: E731
                                              + c.reshape(-1)[0].astype(jnp.uint32))
            nbytes = sum(x.size * x.dtype.itemsize for x in sets[0]) + 2 * int(np.prod(shape))
            want = jax.jit(plain)(*sets[0])
            for label, fn in (("route", route), ("bf16 stores", plain), ("bf16 fill", fill), ("u32 fill", fill32)):
                prog = jax.jit(lambda flat, fn=fn: [fn(c, s) for c, s in flat])
                run = lambda prog=prog: jax.block_until_ready(prog(sets))  # noqa: E731
                run()
                times = [timer.time(run, CALLS) if timer else device_timer.host_time(run, CALLS) for _ in range(3)]
                t = min(x.device if x.device is not None else x.host for x in times)
                same = ""
                if "fill" not in label:
                    bits = lambda x: np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))  # noqa: E731
                    same = "bit-identical" if np.array_equal(bits(jax.jit(fn)(*sets[0])), bits(want)) else "DIFFERS"
                print(f"{fmt:6s} {name} {str(shape):18s} {label:10s} {t * 1e6:9.1f} us {nbytes / t / 1e12:6.2f} TB/s "
                      f"{same}", flush=True)


def _from_words(w):
    """uint32 (..., K/2) -> the same bytes as bf16 (..., K)."""
    import jax
    import jax.numpy as jnp
    return jax.lax.bitcast_convert_type(w, jnp.bfloat16).reshape(w.shape[:-1] + (2 * w.shape[-1],))


if __name__ == "__main__":
    main()
