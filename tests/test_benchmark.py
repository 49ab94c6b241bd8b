"""The benchmark times the public ops: its whole flow (inputs, the public op beside ragged_dot, the spot check, the
table) on the CPU reference with tiny shapes, and the kernel bundle it needs on a GPU machine without the CuTe DSL
compiler covers exactly the kernels' problems."""

from __future__ import annotations

import json
import warnings

import pytest

from benchmarks import bench_cases
from benchmarks import bench_grouped_gemm as bench
from cudnn_moe_jax import _dequant_first, _lowering, _runtime, shapes


@pytest.fixture
def tiny(monkeypatch):
    """Two tiny named shapes (a GLU one with an empty expert and a quant one), one skewed routing, 2 calls a program."""
    monkeypatch.setitem(shapes.SHAPES, "tiny", shapes.GemmShape(512, 128, 64, 2))
    monkeypatch.setitem(shapes.FUSION, "tiny", ("glu", "swiglu"))
    monkeypatch.setitem(shapes.GROUP_SIZES, "tiny", (256, 0))
    monkeypatch.setitem(shapes.SHAPES, "tiny_fc2", shapes.GemmShape(512, 64, 128, 2))
    monkeypatch.setitem(shapes.FUSION, "tiny_fc2", ("quant", None))
    monkeypatch.setitem(shapes.GROUP_SIZES, "tiny_fc2", (256, 256))
    monkeypatch.setitem(shapes.ROUTINGS, "tiny_skewed", ("tiny", (0, 512)))
    for name, value in (("REPS", 1), ("ITERS", 2), ("SETS", 2)):
        monkeypatch.setattr(bench, name, value)


def test_benchmark_times_the_public_ops(tiny, tmp_path):
    bench.main(["--out", str(tmp_path), "--shapes", "tiny,tiny_fc2,tiny_skewed"])
    rows = {r["shape"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert set(rows) == {"tiny", "tiny_fc2", "tiny_skewed"}
    for name, row in rows.items():
        assert {"ours", "ours#2", "ragged_dot+jnp"} <= set(row["ms"]), name
        assert row["check"]["d_rel_err_vs_ragged"] < 1e-2 and row["check"]["rows_past_valid_m_zero"], row["check"]
    assert rows["tiny"]["valid_m"] == 256 and rows["tiny_skewed"]["valid_m"] == 512
    assert "c_rel_err_vs_ragged" in rows["tiny"]["check"] and "c_rel_err_vs_ragged" not in rows["tiny_fc2"]["check"]
    assert "| tiny |" in (tmp_path / "table.md").read_text()


def test_mxfp8_benchmark_times_the_public_ops(tiny, tmp_path):
    bench.main(["--mxfp8", "--out", str(tmp_path), "--shapes", "tiny,tiny_fc2"])
    rows = json.loads((tmp_path / "mxfp8_results.json").read_text())["results"]
    assert [r["shape"] for r in rows] == ["tiny", "tiny_fc2"]
    for row in rows:
        assert {"ours[bf16d]", "ours[fp8d]"} <= set(row["ms"]) and "fp8d_over_bf16d_pct" in row


def test_discrete_benchmark_times_stacked_and_discrete(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_cases, "DISCRETE_SHAPES", ("tiny",))
    bench.main(["--discrete", "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "discrete_results.json").read_text())["results"]
    assert {"ours[stacked]", "ours[discrete]"} == set(row["ms"]) and row["discrete_over_stacked"] > 0
    assert "| tiny |" in (tmp_path / "discrete_table.md").read_text()


def test_hadamard_benchmark_times_the_public_ops(tiny, tmp_path, monkeypatch):
    """--hadamard: every call of bench_cases.HADAMARD_VARIANTS beside the plain GLU, its time over the GLU's."""
    monkeypatch.setitem(shapes.SHAPES, "tiny_h", shapes.GemmShape(512, 256, 64, 2))
    monkeypatch.setitem(shapes.FUSION, "tiny_h", ("glu", "swiglu"))
    monkeypatch.setattr(bench_cases, "HADAMARD_SHAPES", ("tiny_h",))
    bench.main(["--hadamard", "bf16,nvfp4", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "hadamard_results.json").read_text())["results"]
    assert [r["shape"] for r in rows] == ["tiny_h/bf16", "tiny_h/nvfp4"]
    for row in rows:
        assert set(row["over_glu"]) == {f"ours[{v}]" for v in bench_cases.HADAMARD_VARIANTS}
    assert "h_d4_row4" in (tmp_path / "hadamard_table.md").read_text()


def test_unknown_shape_is_named():
    with pytest.raises(SystemExit, match="unknown shape 'fc3'"):
        bench.main(["--shapes", "fc3"])


def test_bundle_covers_every_benchmark_call_with_a_kernel(monkeypatch):
    """What `aot build --variants benchmarks.bench_cases:bundle_items` compiles: each call asks for one kernel
    module, of a problem the sm90 kernels implement (recorded here instead of compiled)."""
    asked = []

    def record(problem, input_names, config, in_avals, out_avals):
        asked.append((problem, tuple(input_names)))
        return None  # no kernel here: the call lowers to the reference (with a warning) and is not compiled

    monkeypatch.setattr(_lowering, "kernel_lowering", record)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for item in bench_cases.bundle_items():
            item()
    # every block-scaled format call twice: the public op's route and the other one (bench_cases.other_route)
    assert len(asked) == (3 * len(shapes.SHAPES) + (2 * len(bench_cases.FORMAT_LABELS) - 1)
                          * len(bench_cases.FORMAT_SHAPES)
                          + len(bench_cases.DISCRETE_SHAPES)
                          + len(bench_cases.HADAMARD_SHAPES) * len(bench_cases.HADAMARD_VARIANTS)
                          * len(bench_cases.HADAMARD_FORMATS))
    assert sum(p.discrete_weights for p, _ in asked) == len(bench_cases.DISCRETE_SHAPES)
    kernels = _runtime.kernels_package()
    known = set(shapes.SHAPES.values()) | {s for s, _, _ in bench_cases.MEMORY_BOUND.values()}
    for problem, names in asked:
        assert kernels.supports(problem) is None, problem
        assert (problem.m, problem.n, problem.k, problem.num_groups) in known
    assert {(p.ab_dtype, p.sf_dtype, p.sf_vec_size) for p, _ in asked if p.block_scaled} == set(
        bench_cases.BLOCK_FORMATS.values())
    assert {p.op for p, _ in asked} == {"quant", "glu", "glu_hadamard_quant"}
    fp8_d = [p for p, names in asked if p.epilogue.generate_sfd and p.epilogue.d_dtype != "float4_e2m1fn"]
    # the MXFP8 calls with FP8 D: on chip, or staged in the kernel where rows per expert pass the rule's bound
    routed = {p.m // p.num_groups >= _dequant_first.DEQUANT_FIRST_ROWS["fp8"] for p in fp8_d}
    assert len(fp8_d) == len(shapes.SHAPES) and routed == {True, False}
    assert all(p.staged == (p.m // p.num_groups >= _dequant_first.DEQUANT_FIRST_ROWS["fp8"]) for p in fp8_d)


def test_lab_configs_are_timed_beside_the_public_op(tiny, tmp_path):
    """--lab: the lab's other configurations of the shape (lab/bench_kernels.py, through the primitive; the
    reference here) run as kernel[label], --configs picking a subset, bf16 and MXFP8."""
    out = tmp_path / "out"
    bench.main(["--lab", "--configs", "t128c21,t256c22", "--out", str(out), "--shapes", "tiny"])
    (row,) = json.loads((out / "results.json").read_text())["results"]
    assert {"ours", "ours#2", "kernel[t128c21]", "kernel[t256c22]"} <= set(row["ms"])
    assert not {"kernel[t256c21]", "kernel[t256c21e1]"} & set(row["ms"])


def test_lab_kernels_cover_every_shape_and_bundle(monkeypatch):
    """lab/bench_kernels.py: a bf16 kernel per (shape, config), the MXFP8 table and the block-scaled format
    schedules, each a problem the sm90 kernels implement, named as run_device.sh's ncu steps name them; its bundle
    items lower one kernel each (recorded)."""
    from cudnn_moe_jax.kernels.sm90.config import default_config
    from lab import bench_kernels

    formats = bench_kernels.format_cases()
    assert {"fc1_nvfp4_default", "fc1_mxfp8_e1", "small_w_nvfp4_c10"} <= set(formats)
    assert "small_nvfp4_e1" not in formats   # = small's default schedule
    cases = {**bench_kernels.bf16_cases(), **bench_kernels.mxfp8_cases(), **formats}
    assert {"fc1_t256c21", "fc2_t256c21", "small_t256c21", "fc1_bf16d"} <= set(cases)
    assert len(cases) == (len(shapes.SHAPES) * len(bench_kernels.BENCH_CONFIGS) + len(bench_kernels.MXFP8_BENCH)
                          + len(formats))
    kernels = _runtime.kernels_package()
    for p, _ in cases.values():
        assert kernels.supports(p) is None, p
    asked = []
    monkeypatch.setattr(_lowering, "kernel_lowering",
                        lambda problem, names, config, *avals: asked.append(config or default_config(problem)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for item in bench_kernels.bundle_items():
            item()
    # one lowering per distinct (problem, config) (the MXFP8 table's fc1_bf16d / small_bf16d are the format cases'
    # MXFP8 defaults); config None: the problem's default schedule
    distinct = {(p, cfg) for p, cfg in cases.values()}
    assert len(asked) == len(distinct) == len(cases) - 2
    assert set(asked) == {cfg or default_config(p) for p, cfg in distinct}


def test_moe_ops_table_traces_every_op():
    """benchmarks/bench_moe_ops.py: every op of its table traces on the inputs its bundle items declare (the
    shapes and dtypes the GPU run feeds it), with the output shape the op defines."""
    import jax

    from benchmarks import bench_moe_ops

    m, ops, sizes, h, i = bench_moe_ops._ops("fc")
    avals = bench_moe_ops._avals("fc")
    assert len(avals) == 9 and len(ops) == 11
    widths = {"fc1 glu (fwd)": i, "fc2 quant (fwd)": h, "dglu (fc2 dgrad)": 2 * i, "dsrelu (fc2 dgrad)": i,
              "dglu e4m3 D (+SFD)": 2 * i, "fc1 dgrad quant": h}
    for name, (fn, flops) in ops.items():
        out = jax.eval_shape(fn, *avals)
        if name.startswith("wgrad"):
            assert out.shape == ((len(sizes), h, i) if "w2" in name else (len(sizes), 2 * i, h)), name
            assert out.dtype == ("float32" if "f32" in name else "bfloat16"), name
        else:
            assert out.shape == (m, widths[name]), name
        assert flops > 0
    for name in bench_moe_ops.BS_WGRAD:   # block-scaled wgrad rows: their own inputs (segments along the tokens)
        fn, bs_avals, flops, _ = bench_moe_ops._bs_wgrad("fc", name)
        out = jax.eval_shape(fn, *bs_avals)
        assert out.shape == ((len(sizes), h, i) if "w2" in name else (len(sizes), 2 * i, h)), name
        assert flops == 2.0 * sum(sizes) * out.shape[1] * out.shape[2]


def test_bench_moe_ops_pairs_each_backward_row_with_its_forward():
    """bench_moe_ops prints backward / forward per row (the backward target, >= 0.9x): each backward row against the
    forward GEMM of the same FLOPs and input format; rows whose forward was not timed are left out."""
    from benchmarks import bench_moe_ops as ops

    assert ops.forward_row("fc2 quant nvfp4") is None and ops.forward_row("fc1 glu (fwd)") is None
    expected = {"dglu (fc2 dgrad)": "fc2 quant (fwd)", "dsrelu (fc2 dgrad)": "fc2 quant (fwd)",
                "fc1 dgrad quant": "fc1 glu (fwd)", "wgrad w2": "fc2 quant (fwd)", "wgrad w1": "fc1 glu (fwd)",
                "dglu nvfp4": "fc2 quant nvfp4", "dglu mxfp8": "fc2 quant mxfp8",
                "wgrad w2 mxfp8 tok": "fc2 quant mxfp8", "wgrad w2 mxfp4": "fc2 quant mxfp4",
                "wgrad w1 nvfp4": "fc1 glu nvfp4", "wgrad w1 mxfp8 tok": "fc1 glu mxfp8"}
    for name, fwd in expected.items():
        assert ops.forward_row(name) == fwd, name
    for name in (*ops.BS_WGRAD, *ops.BS_OPS):
        fwd = ops.forward_row(name)
        assert fwd is None or fwd in ops.BS_OPS or fwd.endswith("(fwd)") or "mxfp4" in fwd, name
    rates = {"fc2 quant nvfp4": 400.0, "dglu nvfp4": 340.0, "wgrad w2 mxfp4": 350.0, "fc1 glu (fwd)": 500.0,
             "wgrad w1": 450.0}
    assert ops.backward_ratios(rates) == [("dglu nvfp4", "fc2 quant nvfp4", 0.85), ("wgrad w1", "fc1 glu (fwd)", 0.9)]
