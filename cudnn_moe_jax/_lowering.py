"""The grouped GEMM's CUDA lowering onto a CuTe DSL kernel module: the primitive's side of the runtime.

`kernel_lowering(problem, input_names, config, in_avals, out_avals)` -> lowering `(ctx, *args) -> results` with the
module already in hand (`_modules.get_module`), or raises KernelUnavailable. It checks `supports`, resolves the
config and computes the fingerprint once each. The operands, their order and what the launch writes come from the
operand table (`cudnn_moe_jax.operands`); a binding whose names are not the table's is a ValueError. Output zero-init
is the kernel's.

Kernel side (`cudnn_moe_jax.kernels.sm90`; its import is pure Python): `supports(problem) -> None | reason`,
`default_config(problem)`, `config_from_hints`, `default_variants()`; `GroupedGemmSm90(problem, config)` (imports
cutlass) with `launch` the `@cute.jit` launcher, and `cutlass_call_kwargs(kernel)` (input_spec, output_spec, ...).

One module per problem, whatever the token count: the kernels take m dynamic, and a grouped-GEMM module is
compiled, keyed and recorded for the symbolic m `symbolic_m(m_aligned)` (= 256*m_blocks by default), never for the
call's m; the K-grouped wgrad likewise for the symbolic token count `symbolic_t()` (= 8*t_blocks for 16-bit data,
its k). A gathered A (problem.a_rows: A (a_rows, K) read through `a_index`) has a second dynamic extent, its row
count, kept symbolic the same way (`symbolic_a_rows`). (Compiled for a concrete m, the device code is the same but
the host object's symbol names mangle the shapes, so its bytes would differ per m.) The avals (m or T symbolic) are
recorded beside the module and checked; a call's avals must be exactly them at its m (T).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

from . import _compile, _modules, operands
from ._compile import DEFAULT_ARCH, KernelUnavailable
from ._ffi import sds
from .limits import GROUP_ALIGN, k_align


@functools.lru_cache(maxsize=1)
def kernels_package():
    """The sm90 kernel package. Its own import is pure Python: `supports`, `default_config`, `default_variants`
    need no cutlass."""
    try:
        from .kernels import sm90
    except ImportError as e:
        raise KernelUnavailable(f"cannot import the sm90 kernels: {e}") from e
    return sm90


def read_problem(problem):
    """The problem as the kernels read it (`supports` and the module use it): the kernel package's operand majors
    (`kernels.sm90.config.read_problem`); unchanged where the kernel sources are not importable."""
    try:
        package = kernels_package()
    except KernelUnavailable:
        return problem
    return package.read_problem(problem)


def _check_supported(problem) -> None:
    verdict = kernels_package().supports(problem)  # None (or True): implemented; else the reason
    if verdict is not None and verdict is not True:
        raise KernelUnavailable(f"the sm90 kernels do not cover this {problem.op} problem: {verdict}")


def symbolic_m(m_aligned: int = GROUP_ALIGN):
    """The row count every grouped-GEMM module of alignment `m_aligned` is compiled, keyed and recorded for: the
    jax.export symbolic dimension `256*m_blocks` by default (the kernels take m dynamic, m % m_aligned == 0; for
    256 its multiples of 128 simplify exactly). One object per alignment: symbolic dimensions of separate scopes
    never compare equal."""
    return _symbolic_m(int(m_aligned))


@functools.lru_cache(maxsize=None)
def _symbolic_m(m_aligned: int):
    import jax

    (m,) = jax.export.symbolic_shape(f"{m_aligned}*m_blocks" if m_aligned > 1 else "m_blocks")
    return m


def symbolic_a_rows(m_aligned: int = GROUP_ALIGN):
    """The row count of a gathered A (`problem.a_rows`) every module of alignment `m_aligned` is compiled, keyed and
    recorded for: the symbolic dimension `a_rows` (any value). It shares the scope of `symbolic_m(m_aligned)`: a
    module's avals hold both, and dimensions of separate scopes never compare or combine."""
    return _symbolic_named("a_rows", symbolic_m(m_aligned))


def symbolic_source_tokens(field: str, ab_dtype: str = "bfloat16"):
    """The token count of wgrad's gathered A / B (`field` "a_rows" / "b_rows"): a symbolic dimension of that name in
    the scope of `symbolic_t(ab_dtype)`."""
    return _symbolic_named(field, symbolic_t(ab_dtype))


@functools.lru_cache(maxsize=None)
def _symbolic_named(name: str, scope_of):
    import jax

    (dim,) = jax.export.symbolic_shape(name, scope=scope_of.scope)
    return dim


def symbolic_t(ab_dtype: str = "bfloat16"):
    """The token count every wgrad module is compiled, keyed and recorded for: `8*t_blocks` for 16-bit operands
    (FP8 `16*t_blocks`, packed FP4 `32*t_blocks`: 16-byte rows; the kernel reads T from A's shape; every T the op
    accepts is a multiple of `limits.k_align(ab_dtype)`). One object per alignment."""
    return _symbolic_tokens(k_align(ab_dtype))


@functools.lru_cache(maxsize=None)
def _symbolic_tokens(align: int):
    import jax

    (t,) = jax.export.symbolic_shape(f"{align}*t_blocks")
    return t


def canonical_problem(problem):
    """`problem` with its dynamic extents symbolic: what identifies its module. M-grouped ops: m (`symbolic_m()`),
    and a gathered A's row count a_rows (`symbolic_a_rows()`); wgrad: the token count k (`symbolic_t(ab_dtype)`;
    its m, the weight rows, is static)."""
    if problem.op == "wgrad":
        gathered = {f: symbolic_source_tokens(f, problem.ab_dtype) for f in ("a_rows", "b_rows")
                    if getattr(problem, f) is not None}
        return dataclasses.replace(problem, k=symbolic_t(problem.ab_dtype), **gathered)
    gathered = {} if problem.a_rows is None else {"a_rows": symbolic_a_rows(problem.m_aligned)}
    return dataclasses.replace(problem, m=symbolic_m(problem.m_aligned), **gathered)


def _present_outputs(problem) -> tuple:
    import jax

    return tuple(jax.ShapeDtypeStruct(*v) for v in operands.output_specs(problem).values() if v is not None)


def launch_avals(problem, config) -> tuple[tuple, Optional[Callable]]:
    """(what the kernel launch writes for `problem` (m concrete or symbolic), `finish` or None): the operand table's
    launch outputs, i.e. the op's outputs except those the kernel writes as per-tile partial sums (their shapes
    follow the config), which `finish(launch outputs, {input name: array})` reduces to the op's outputs."""
    import jax

    launch = operands.launch_outputs(problem, config)
    if any(b.shape is None for b in launch):
        raise KernelUnavailable(f"the {problem.op} launch writes partial sums whose shape needs the kernel config")
    return tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in launch), operands.finish(problem)


def grouped_gemm_avals(problem, config, input_names: Sequence[str], in_avals: Sequence[Any],
                       out_avals: Optional[Sequence[Any]] = None) -> tuple[tuple, tuple]:
    """(in, out) avals of the module of this call, m (wgrad: T) symbolic, once the call's avals are checked to be
    exactly those at m = problem.m (T = problem.k) (the axes of `operands.dynamic_axes`; the launch outputs of
    `launch_avals`, None: those); a gathered A's rows likewise at a_rows = problem.a_rows (`operands.gathered_axes`).
    Every other dimension and dtype is kept, so the recorded avals still pin it.
    ValueError if `input_names` are not the operand table's; KernelUnavailable if the avals do not fit."""
    operands.check_input_names(problem, input_names)
    canon, ins = canonical_problem(problem), []
    field, axes = operands.dynamic_axes(problem)
    extent, sym = getattr(problem, field), getattr(canon, field)
    gathered = operands.gathered_axes(problem)
    for name, a in zip(input_names, in_avals):
        a = sds(a)
        if a is not None and name in axes:
            axis, per = axes[name]
            size = operands.axis_extent(per, extent)
            if len(a.shape) <= axis or a.shape[axis] != size:
                what = f"{field}/{per}" if isinstance(per, int) else f"its size at {field}"
                raise KernelUnavailable(f"input {name} {a.shape}: axis {axis} must be {what} = {size} for "
                                        f"{field} = {extent}")
            a = operands.with_axis_size(a, axis, operands.axis_extent(per, sym))
        elif a is not None and name in gathered:
            axis, rows = gathered[name]
            if len(a.shape) <= axis or a.shape[axis] != getattr(problem, rows):
                raise KernelUnavailable(f"input {name} {a.shape}: axis {axis} must be {rows} = "
                                        f"{getattr(problem, rows)}")
            a = operands.with_axis_size(a, axis, getattr(canon, rows))
        ins.append(a)
    want = launch_avals(problem, config)[0]
    got = want if out_avals is None else tuple(sds(a) for a in out_avals)
    if got != want:
        raise KernelUnavailable(f"output avals {got} are not what the {problem.op} launch writes, {want}")
    return tuple(ins), launch_avals(canon, config)[0]


def resolve_config(problem, config):
    """None -> the kernel package's `default_config(problem)` (so None and the explicit default share a module);
    a `(mma_tiler_mn, cluster_shape_mn)` pair of cuDNN hints (from the public ops) -> `config_from_hints`.
    The kernel package sees the problem with m symbolic: a module, hence its config, is the same for every m."""
    if isinstance(config, tuple):
        return kernels_package().config_from_hints(canonical_problem(problem), *config)
    if config is not None:
        return config
    try:
        return kernels_package().default_config(canonical_problem(problem))
    except (KernelUnavailable, AttributeError):
        return None


def _grouped_gemm_fingerprint(canon, input_names: tuple, config, arch: str) -> str:
    return _modules.fingerprint("grouped_gemm", canon, input_names, config, arch, _modules.kernels_source_digest(),
                                _compile.cutlass_dsl_version())


def grouped_gemm_fingerprint(problem, input_names: Sequence[str], config, arch: str = DEFAULT_ARCH) -> str:
    """The module's fingerprint: m is not in it (one module serves every m)."""
    return _grouped_gemm_fingerprint(canonical_problem(problem), tuple(input_names), resolve_config(problem, config),
                                     arch)


def _checked_config(problem, config):
    """`supports` (where the kernel sources are) then the resolved config: once per call."""
    try:
        kernels_package()
    except KernelUnavailable:
        pass  # no kernel sources here: a bundle or the module cache may still hold the module
    else:
        _check_supported(problem)
    return resolve_config(problem, config)


def _spec(problem, config, names: tuple, in_avals, out_avals, arch: str) -> _modules.KernelSpec:
    canon = canonical_problem(problem)
    ins, outs = grouped_gemm_avals(problem, config, names, in_avals, out_avals)

    def build():  # the kernel is built for m symbolic: nothing in a module can depend on the m first asked for
        _compile.import_cutlass(arch)
        package = kernels_package()
        kernel = package.GroupedGemmSm90(canon, config)
        return kernel.launch, package.cutlass_call_kwargs(kernel)

    return _modules.KernelSpec(f"grouped_gemm/{problem.op}", _grouped_gemm_fingerprint(canon, names, config, arch),
                               ins, outs, build, arch,
                               meta={"problem": canon, "config": config, "input_names": list(names)})


def grouped_gemm_spec(problem, config, input_names: Sequence[str], in_avals: Sequence[Any],
                      out_avals: Optional[Sequence[Any]] = None, arch: str = DEFAULT_ARCH) -> _modules.KernelSpec:
    """The KernelSpec of one launch: `out_avals` are what it writes (`launch_avals`; None: those)."""
    problem = read_problem(problem)
    return _spec(problem, _checked_config(problem, config), tuple(input_names), in_avals, out_avals, arch)


def kernel_lowering(problem, input_names: Sequence[str], config, in_avals: Sequence[Any], out_avals: Sequence[Any],
                    arch: str = DEFAULT_ARCH):
    """A CUDA lowering `(ctx, *args) -> results` for this call (`out_avals`: the op's outputs), its module already
    found or compiled, so any failure raises here, where the primitive falls back (KernelUnavailable when there is
    no module). `supports`, the config and the fingerprint are computed once each."""
    problem = read_problem(problem)
    names, config = tuple(input_names), _checked_config(problem, config)
    if tuple(sds(a) for a in out_avals) != _present_outputs(problem):
        raise KernelUnavailable(f"output avals {out_avals} are not the {problem.op} problem's")
    launch, finish = launch_avals(problem, config)  # backward ops: partial sums, reduced by `finish` in fixed order
    mod = _modules.get_module(_spec(problem, config, names, in_avals, launch, arch))

    def lower(ctx, *args):
        from jax.interpreters import mlir

        def run(*xs):
            outs = mod(xs, launch)
            return outs if finish is None else finish(outs, dict(zip(names, xs)))

        return mlir.lower_fun(run, multiple_results=True)(ctx, *args)

    return lower
