"""Lab: are the racecheck hazards of the block-scaled wgrad's scale-word table racecheck's, or the kernel's?

Since RESULTS run 57 `compute-sanitizer --tool racecheck` reports hazards in the dequantizing wgrad kernel
(mainloop_dequant_wgrad.py), every one between the producer lanes' `cp.async` writes of a stage's scale-word table
and the converters' LDS reads of it (today only in the token-major cases). The reads follow the stage's full-barrier
wait, which each writing lane's `cp.async.mbarrier.arrive.noinc` completes once its copies landed -- an arrival
racecheck may not model. This build replaces that arrival, and nothing else, by the synchronous form: each lane
waits for its own copies (`cp.async.wait_all`: commit, wait for 0 groups) and then arrives on the same barrier with a
plain `mbarrier.arrive` (one arrival each, as .noinc counts). If racecheck is silent on this kernel and reports the
same pairs on the product's, the product's ordering is the same and the reports are the tool's.

Build (CPU; the module keys are the product's, so the bundle must hold only these modules, and `--no-cache` keeps the
module cache from serving the product's bytes or storing these under the product's keys):
    python -m cudnn_moe_jax.aot build --arch sm_90a --out .bundle_race --no-cache \\
        --variants lab.race_probe:bundle_items
Run (GPU, beside a .bundle of `lab.wgrad_cases` for the product's side): `OUT=... bash tools/gpu/run_all.sh
race_probe`.
"""

from __future__ import annotations

# (case, pattern, input mode) of tests/gpu/test_wgrad_gpu.py's block-scaled test: a token-contiguous control and the
# two token-major cases the reports come from
RUNS = (("bs_mxfp8_c1", "unaligned", "exact"), ("bs_mxfp8_tok_c2", "unaligned", "exact"),
        ("bs_mxfp8e5_tok_c1_gs_acc", "a8", "specials"))


def pytest_filter() -> str:
    """The `pytest -k` expression selecting RUNS (tools/gpu/run_all.sh race_probe)."""
    return ("test_blockscaled_wgrad_matches_float64 and ("
            + " or ".join("-".join(r) for r in RUNS) + ")")


def patch() -> None:
    """In this build process only: the scale-word copies' arrival as wait-then-arrive (module docstring)."""
    import cutlass.cute as cute

    if getattr(cute.arch.cp_async_mbarrier_arrive_noinc, "lab_patched", False):
        return

    def waited_arrive(bar, **kw):
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.mbarrier_arrive(bar)

    waited_arrive.lab_patched = True
    cute.arch.cp_async_mbarrier_arrive_noinc = waited_arrive


def bundle_items() -> list:
    """The on-chip route's wgrad modules of CASES, compiled with `patch()` applied."""
    from cudnn_moe_jax import aot

    from . import harness
    from . import wgrad_cases as wc

    patch()
    cases = [c for c in wc.BS_CASES if c[0] in {r[0] for r in RUNS}]
    return [harness.on_route("on-chip", item) for item in aot.lowering_items(cases, wc.bs_inputs, wc.bs_call)]
