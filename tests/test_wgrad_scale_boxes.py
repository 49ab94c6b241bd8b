"""CPU check of where the block-scaled wgrad kernel finds its scales (kernels/sm90/mainloop_dequant_wgrad.py): per
stage the producer TMAs, for each 128-row block of the tile (A's, then B's: `box_row_block`), one box of the flat
segment buffer into its slot of the stage's word table -- from `box_load_word`, which must be a 16-byte boundary
(the TMA's rule: an unaligned box start is an illegal instruction), the atoms `box_shift` words in -- and a
converter reads byte block % 4 of word `table_word(stage, idx, block, row_word(table row), operand)`. Replayed on
the host with the kernel's own functions and mainloop object, every (row, token) of every tile and stage must read
the byte the reference reads (`formats.segment_token_scales`): random buffer bytes, experts starting anywhere
(inside 16-token groups, inside scale blocks), empty experts, segments running past the buffer's end (the TMA reads
zeros there), tile_n 128 and 256, rows not a multiple of 128. Also the row-word shortcuts the converters take
(`pass_row_word`, adjacent rows 4 words apart)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cudnn_moe_jax import formats

pytest.importorskip("cutlass")

TILE_K = 64


def _mainloop(case: str, tile_n: int, m: int, n: int):
    from cudnn_moe_jax.kernels.sm90.config import Config
    from cudnn_moe_jax.kernels.sm90.mainloop_dequant_wgrad import mainloop_class
    from lab.compile_cases import BACKWARD

    problem = dataclasses.replace(BACKWARD[case], m=m, n=n)
    return mainloop_class(problem, Config(tile_n=tile_n, cluster_m=1))(128, tile_n, 3, m, n, 1, 1, None)


def _kernel_reads(ml, flat: dict, ends: np.ndarray, tokens: int, vec: int) -> dict:
    """{operand: (rows, tokens) SF bytes as the kernel's converters read them} (0 where a token is in no expert;
    a row is read by every tile holding it, and every read must agree)."""
    from cudnn_moe_jax.kernels.sm90.mainloop_dequant_wgrad import (BOX_LOAD_WORDS, BOX_STRIDE_WORDS, SF_SLOTS,
                                                                  TMA_ALIGN_WORDS, Stage, box_load_word,
                                                                  box_row_block, row_word)

    log_vec = vec.bit_length() - 1
    rows = (ml.m, ml.n)
    words = [np.frombuffer(flat[o].tobytes(), dtype="<u4") for o in (0, 1)]
    out = [np.zeros((r, tokens), np.int32) for r in rows]
    idx = 1                                            # the stage's slot in the table (its term in table_word)
    start = 0
    for end in np.maximum.accumulate(np.clip(ends, 0, tokens)).tolist():
        if end <= start:
            continue
        last_block = (end - 1 - start) >> log_vec
        kb_n = (((end - start + vec - 1) >> log_vec) + 3) >> 2
        for tb in range(start // TILE_K * TILE_K, end, TILE_K):
            q0 = min(max(tb - start, 0) >> log_vec, last_block) >> 2
            st = Stage(tb, start, q0, 0, TILE_K, last_block, False, False)
            for m_tile in range(ml.m // ml.tile_m):
                for n_tile in range(-(-ml.n // ml.tile_n)):
                    table = np.zeros((idx + 1) * ml.row_blocks * BOX_STRIDE_WORDS, "<u4")
                    for i in range(ml.row_blocks):        # the producer's boxes (TMA: zeros past the buffer)
                        operand, rb = box_row_block(i, ml.tile_m, ml.tile_n, m_tile, n_tile)
                        w0 = box_load_word(rows[operand], log_vec, start, rb, kb_n, q0)
                        assert w0 >= 0 and w0 % TMA_ALIGN_WORDS == 0, (operand, start, w0)
                        got = words[operand][w0:w0 + BOX_LOAD_WORDS]
                        at = (idx * ml.row_blocks + i) * BOX_STRIDE_WORDS
                        table[at:at + len(got)] = got
                    table_bytes = table.view(np.uint8)
                    for operand, first, count in ((0, m_tile * ml.tile_m, ml.tile_m),
                                                  (1, n_tile * ml.tile_n, ml.tile_n)):
                        trow = np.arange(count) + (0 if operand == 0 else ml.tile_m)
                        keep = first + np.arange(count) < rows[operand]     # rows past the operand: not stored
                        for t in range(max(tb, start), min(tb + TILE_K, end)):
                            block = (t - start) >> log_vec
                            assert 0 <= (block >> 2) - q0 < SF_SLOTS, (start, end, tb, t)
                            word = ml.table_word(st, idx, block, row_word(trow), operand)
                            got = table_bytes[word * 4 + (block & 3)].astype(np.int32)[keep]
                            r = first + np.arange(count)[keep]
                            seen = out[operand][r, t]
                            assert ((seen == 0) | (seen == got + 1)).all(), (operand, t)
                            out[operand][r, t] = got + 1
        start = end
    return {o: np.maximum(out[o] - 1, 0).astype(np.uint8) for o in (0, 1)}


@pytest.mark.parametrize("case,tile_n,m,n", [("wgrad_mxfp8_c1", 256, 384, 320), ("wgrad_nvfp4_gs_c1", 128, 256, 200),
                                             ("wgrad_mxfp8_c1", 128, 128, 130)])
def test_scale_boxes_read_the_reference_bytes(case, tile_n, m, n):
    ml = _mainloop(case, tile_n, m, n)
    vec = ml.FORMAT.vec
    rng = np.random.default_rng(m + n + vec)
    tokens = 1000
    # experts starting anywhere: inside 16-token groups and scale blocks, a run of empty ones, the last ending
    # short of T (tokens in no expert)
    ends = np.array([0, 37, 37, 200, 201, 520, 777, 990], np.int32)
    flat = {o: rng.integers(0, 256, formats.sf_segment_bytes(r, tokens, vec), dtype=np.uint8)
            for o, r in ((0, m), (1, n))}
    got = _kernel_reads(ml, flat, ends, tokens, vec)
    for o, r in ((0, m), (1, n)):
        want = np.asarray(formats.segment_token_scales(flat[o], r, ends, tokens, vec))
        assert (got[o] == want).all(), (o, np.argwhere(got[o] != want)[:5])


def test_scale_box_meets_the_tma_rules():
    """The box's other TMA constraints (the start's alignment is checked per box above): at most 256 elements of
    the 64-bit view, a whole number of 16-byte units, each slot's destination on a 128-byte boundary of the table
    (itself 128-byte aligned), slots large enough for the box, and the stage's TMA bytes."""
    from cudnn_moe_jax.kernels.sm90.mainloop_dequant_wgrad import (BOX_LOAD_WORDS, BOX_STRIDE_WORDS, BOX_WORDS,
                                                                  TMA_ALIGN_WORDS)

    assert BOX_LOAD_WORDS == BOX_WORDS + TMA_ALIGN_WORDS and TMA_ALIGN_WORDS * 4 == 16
    assert BOX_LOAD_WORDS % 2 == 0 and BOX_LOAD_WORDS // 2 <= 256 and BOX_LOAD_WORDS * 4 % 16 == 0
    assert BOX_STRIDE_WORDS >= BOX_LOAD_WORDS and BOX_STRIDE_WORDS * 4 % 128 == 0
    ml = _mainloop("wgrad_mxfp8_c1", 256, 384, 320)
    tx = ml.tx_bytes(None, ml.tile_m, ml.tile_n)
    assert tx == (ml.tile_m + ml.tile_n) * ml.FORMAT.row_bytes + ml.row_blocks * BOX_LOAD_WORDS * 4


def test_row_word_shortcuts():
    """The converters' cheaper forms of `row_word`: a pass's rows (row0 a multiple of 8: the warp-uniform word plus
    4 a row), two adjacent rows from an even one (`lane_pair_scales`), and that order's bank spread there: each of
    its two loads reaches 16 banks, two words each (2 wavefronts)."""
    from cudnn_moe_jax.kernels.sm90.mainloop_dequant_wgrad import row_word

    ml = _mainloop("wgrad_mxfp8_c1", 256, 384, 320)
    for operand, rows in ((0, ml.tile_m), (1, ml.tile_n)):
        off = 0 if operand == 0 else ml.tile_m
        for row0 in range(0, rows, 8):
            for lane in range(32):
                assert ml.pass_row_word(operand, row0, lane) == row_word(off + row0 + lane // 4)
    trows = np.arange(ml.tile_m + ml.tile_n)
    even = trows[::2]
    assert (row_word(even + 1) == row_word(even) + 4).all()
    for p in range(ml.tile_n // 8):                      # the token-major passes' lanes (convert_mn_pass)
        lane = np.arange(32)
        trow = ml.tile_m + (p >> 3) * 64 + (lane >> 3) * 16 + 2 * (lane & 7)
        swap = (lane >> 2) & 1
        for first in (row_word(trow) + 4 * swap, row_word(trow) + 4 - 4 * swap):
            banks = {}
            for w in first.tolist():
                banks.setdefault(w % 32, set()).add(w)
            assert len(banks) == 16 and max(len(v) for v in banks.values()) == 2, p
