"""Lab kernel variants timed beside the product's kernels (never used by `cudnn_moe_jax`): kernel classes that
differ from the product's in one mechanism, exported by tools/gpu/build_artifacts.py (`kernel_class` of a bench
entry) and timed by `benchmarks/bench_grouped_gemm.py --mxfp8 --artifacts` as `kernel[NAME]`.

`unsplit_kernel_class(problem)`: the dequantizing mainloop without the cluster-split B conversion (both CTAs of a
2x1 cluster convert the whole multicast B stage, the behaviour before issue 19's change), for before / after
timings in one run.
"""

from __future__ import annotations


def unsplit_kernel_class(problem):
    """The product's kernel class of `problem` with a dequantizing mainloop that never splits B's conversion."""
    from cudnn_moe_jax.kernels.sm90.kernel import kernel_class_for
    from cudnn_moe_jax.kernels.sm90.mainloop_dequant import DequantMainloop

    base = kernel_class_for(problem)

    class Unsplit(base):
        def mainloop_class_for(self, problem):
            cls = super().mainloop_class_for(problem)
            if not issubclass(cls, DequantMainloop):
                return cls
            return type(cls.__name__ + "_unsplit", (cls,),
                        {"splits_b": staticmethod(lambda problem, config: False)})

        @property
        def cache_key(self):   # the product kernel's key names the same (problem, config): keep them apart
            return super().cache_key + ("unsplit",)

    Unsplit.__name__ = base.__name__ + "Unsplit"
    return Unsplit


KERNEL_CLASSES = {"unsplit": unsplit_kernel_class}
