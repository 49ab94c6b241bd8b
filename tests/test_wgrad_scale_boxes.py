"""CPU check of where the block-scaled wgrad kernel finds its scales (kernels/sm90/mainloop_dequant_wgrad.py): per
stage the producer TMAs, for each 128-row block, one 1 KiB box of the flat segment buffer starting at
`scale_box_word` (the atoms of the two quads the stage's tokens can touch), and a converter reads byte block % 4 of
word `row_word(row)` of the box's slot (block // 4 - Q0). Simulated here on the host with the kernel's own address
functions, every (row, token) of every expert's stages must read the byte the reference reads
(`formats.segment_token_scales`): random buffer bytes, experts starting anywhere (inside 16-token groups, inside
scale blocks), empty experts, segments running past the buffer's end (the TMA reads zeros there)."""

from __future__ import annotations

import numpy as np
import pytest

from cudnn_moe_jax import formats

pytest.importorskip("cutlass")

TILE_K = 64


def _kernel_bytes(flat: np.ndarray, rows: int, ends: np.ndarray, tokens: int, vec: int) -> np.ndarray:
    """(rows, tokens) SF bytes as the kernel reads them (0 where a token is in no expert)."""
    from cudnn_moe_jax.kernels.sm90.mainloop_dequant_wgrad import (ATOM_WORDS, BOX_WORDS, SF_SLOTS, row_word,
                                                                  scale_box_word)

    words = np.frombuffer(flat.tobytes() + bytes(-len(flat) % 4), dtype="<u4")
    log_vec = vec.bit_length() - 1
    out = np.zeros((rows, tokens), np.uint8)
    start = 0
    for end in np.maximum.accumulate(np.clip(ends, 0, tokens)):
        end = int(end)
        if end <= start:
            continue
        last_block = (end - 1 - start) >> log_vec
        kb_n = (((end - start + vec - 1) >> log_vec) + 3) >> 2
        k_start = start // TILE_K * TILE_K
        for tb in range(k_start, end, TILE_K):
            q0 = min(max(tb - start, 0) >> log_vec, last_block) >> 2
            for rb in range((rows + 127) // 128):
                w0 = scale_box_word(rows, log_vec, start, rb, kb_n, q0)
                box = np.zeros(BOX_WORDS, "<u4")                   # TMA: zeros past the buffer
                got = words[w0:w0 + BOX_WORDS]
                box[:len(got)] = got
                box_bytes = box.view(np.uint8)
                for t in range(max(tb, start), min(tb + TILE_K, end)):
                    block = (t - start) >> log_vec
                    slot = (block >> 2) - q0
                    assert 0 <= slot < SF_SLOTS, (start, end, tb, t)
                    for r in range(rb * 128, min(rows, rb * 128 + 128)):
                        out[r, t] = box_bytes[(slot * ATOM_WORDS + row_word(r % 128)) * 4 + (block & 3)]
        start = end
    return out


@pytest.mark.parametrize("rows,vec", [(320, 32), (256, 16), (130, 32)])
def test_scale_boxes_read_the_reference_bytes(rows, vec):
    rng = np.random.default_rng(rows + vec)
    tokens = 1000
    # experts starting anywhere: inside 16-token groups and scale blocks, a run of empty ones, the last ending
    # short of T (tokens in no expert)
    ends = np.array([0, 37, 37, 200, 201, 520, 777, 990], np.int32)
    size = formats.sf_segment_bytes(rows, tokens, vec)
    flat = rng.integers(0, 256, size, dtype=np.uint8)
    want = np.asarray(formats.segment_token_scales(flat, rows, ends, tokens, vec))
    got = _kernel_bytes(flat, rows, ends, tokens, vec)
    assert (got == want).all(), np.argwhere(got != want)[:5]
