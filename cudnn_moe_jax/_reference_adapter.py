"""Maps a `GroupedGemmProblem` + canonical inputs onto the matching `reference` function call."""

from __future__ import annotations

from . import reference
from ._problem import GroupedGemmProblem


def _format(p: GroupedGemmProblem) -> dict:
    return dict(ab_dtype=p.ab_dtype, sf_dtype=p.sf_dtype, sf_vec_size=p.sf_vec_size)


def _gemm_inputs(x: dict) -> dict:
    return dict(a=x["a"], b=x["b"], sfa=x.get("sfa"), sfb=x.get("sfb"), padded_offsets=x["padded_offsets"],
                alpha=x["alpha"], prob=x.get("prob"))


def run(p: GroupedGemmProblem, x: dict) -> dict:
    e = p.epilogue
    if p.op == "wgrad":   # gathered A / B tokens: the op on the gathered token columns, by definition
        for name in ("a", "b"):
            if getattr(p, f"{name}_rows") is not None:
                x = dict(x, **{name: reference.gather_rows(x[name].T, x[f"{name}_index"]).T})
    elif p.a_rows is not None:   # gathered A: the op on the gathered rows, by definition
        x = dict(x, a=reference.gather_rows(x["a"], x["a_index"]))
    if p.op == "wgrad":
        return reference.grouped_gemm_wgrad(
            x["a"], x["b"], x["padded_offsets"], x.get("sfa"), x.get("sfb"), x.get("global_scale_a"),
            x.get("global_scale_b"), x.get("wgrad"), wgrad_dtype=p.wgrad_dtype, **_format(p))
    quant_out = dict(d_dtype=e.d_dtype, compute_amax=e.compute_amax, m_aligned=p.m_aligned)
    if p.op == "quant":
        return reference.grouped_gemm_quant(**_gemm_inputs(x), bias=x.get("bias"), norm_const=x.get("norm_const"),
                                            discrete_col_sfd=e.discrete_col_sfd, **quant_out, **_format(p))
    if p.op == "srelu":
        return reference.grouped_gemm_srelu(**_gemm_inputs(x), bias=x.get("bias"), norm_const=x.get("norm_const"),
                                            c_dtype=e.c_dtype, tanh_clamp_scale=e.tanh_clamp_scale,
                                            discrete_col_sfd=e.discrete_col_sfd, **quant_out, **_format(p))
    if p.op == "glu":
        return reference.grouped_gemm_glu(**_gemm_inputs(x), bias=x.get("bias"), norm_const=x.get("norm_const"),
                                          act_func=e.act, c_dtype=e.c_dtype, glu_limit=e.glu_limit,
                                          glu_alpha=e.glu_alpha, discrete_col_sfd=e.discrete_col_sfd,
                                          **quant_out, **_format(p))
    if p.op == "glu_hadamard_quant":
        return reference.grouped_gemm_glu_hadamard_quant(
            **_gemm_inputs(x), bias=x.get("bias"), norm_const=x.get("norm_const"),
            rht_norm_const=x.get("rht_norm_const"), hadamard=x.get("hadamard"), act_func=e.act,
            c_dtype=e.c_dtype, rht=e.rht, rht_dtype=e.rht_dtype, glu_limit=e.glu_limit, glu_alpha=e.glu_alpha,
            tanh_clamp_scale=e.tanh_clamp_scale, **quant_out, **_format(p))
    backward = dict(c=x["c"], beta=x["beta"], norm_const=x.get("norm_const"), dbias_dtype=e.dbias_dtype,
                    discrete_col_sfd=e.discrete_col_sfd, **quant_out, **_format(p))
    if p.op == "dglu":
        return reference.grouped_gemm_dglu(**_gemm_inputs(x), act_func=e.act, glu_limit=e.glu_limit,
                                           glu_alpha=e.glu_alpha, **backward)
    if p.op == "dsrelu":
        return reference.grouped_gemm_dsrelu(**_gemm_inputs(x), tanh_clamp_scale=e.tanh_clamp_scale, **backward)
    raise NotImplementedError(f"no reference for op {p.op!r}")
