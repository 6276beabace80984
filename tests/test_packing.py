"""Tests for stepquant.codecs.packing: the byte layout of docs/format.md, pinned by hand-written golden words,
and exact pack -> unpack round trips over awkward shapes and mixed bit widths (hypothesis)."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stepquant.codecs.base import Grid, QState
from stepquant.codecs.packing import (
    PLANE_WIDTHS,
    PackedLayout,
    PackedState,
    canonicalize,
    pack,
    plane_bit_offsets,
    plane_widths,
    plane_words,
    row_words,
    unpack,
)


def u32(words: list[int]) -> list[int]:
    return [w & 0xFFFFFFFF for w in words]


def slot_words(packed: PackedState, slot: int = 0) -> list[int]:
    return u32(packed.codes[slot].tolist())


def fp16(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float16)


def fp16_from_bits(patterns: list[int]) -> torch.Tensor:
    signed = [p - 0x10000 if p >= 0x8000 else p for p in patterns]
    return torch.tensor(signed, dtype=torch.int16).view(torch.float16)


def make_qstate(codes, bits, row_scale, col_scale=None, pivots=None, grid=Grid.MIDTREAD) -> QState:
    return QState(
        codes=torch.tensor(codes, dtype=torch.uint8),
        bits=torch.tensor(bits, dtype=torch.int8),
        row_scale=row_scale,
        col_scale=col_scale,
        pivots=pivots,
        grid=grid,
    )


def assert_qstate_bits_equal(got: QState, want: QState) -> None:
    assert got.grid is want.grid
    assert torch.equal(got.bits.cpu().to(torch.int8), want.bits.cpu().to(torch.int8))
    assert got.codes.dtype == torch.uint8 and torch.equal(got.codes.cpu(), want.codes.cpu())
    for name in ("row_scale", "col_scale", "pivots"):
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), name
        if g is not None:
            assert g.dtype == torch.float16, name
            assert torch.equal(g.cpu().view(torch.int16), w.cpu().view(torch.int16)), name


# ---------------------------------------------------------------- plane decomposition (format.md table)

@pytest.mark.parametrize(
    "bits, widths, offsets",
    [(2, (2,), (0,)), (3, (2, 1), (0, 2)), (4, (4,), (0,)), (5, (4, 1), (0, 4)), (6, (4, 2), (0, 4)),
     (7, (4, 2, 1), (0, 4, 6)), (8, (8,), (0,)), (16, (16,), (0,))],
    ids=lambda x: str(x),
)
def test_plane_widths_are_the_binary_decomposition_widest_first(bits, widths, offsets):
    assert plane_widths(bits) == widths
    assert plane_bit_offsets(bits) == offsets
    assert sum(widths) == bits


@pytest.mark.parametrize("bits", [0, 1, 9, 15, 17, 32, -3])
def test_plane_widths_rejects_unpackable_widths(bits):
    with pytest.raises(ValueError, match="allowed are 2..8 and 16"):
        plane_widths(bits)


def test_plane_widths_rejects_non_int():
    with pytest.raises(TypeError, match="bits must be an int"):
        plane_widths(6.0)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8, 16])
def test_row_of_128_values_takes_4b_words(bits):
    assert row_words(bits, 128) == 4 * bits  # 64 words for a pivot row


@pytest.mark.parametrize("value_dim", [1, 2, 15, 16, 17, 31, 32, 33, 100, 127, 130])
@pytest.mark.parametrize("bits", [2, 3, 5, 6, 7, 8, 16])
def test_row_words_is_the_sum_of_ceil_per_plane(bits, value_dim):
    expected = sum(math.ceil(value_dim / (32 // w)) for w in plane_widths(bits))
    assert row_words(bits, value_dim) == expected


def test_plane_words_rejects_bad_input():
    with pytest.raises(ValueError, match="not a plane width"):
        plane_words(3, 8)
    with pytest.raises(ValueError, match="value_dim must be >= 1"):
        plane_words(2, 0)


# ---------------------------------------------------------------- golden words and bytes, computed by hand

def test_golden_k2_v4_three_bit_and_six_bit_rows():
    # row 0, 3 bits = planes [2, 1]: codes 5=0b101, 2=0b010, 7=0b111, 0
    #   2-bit plane (code bits 0-1): 1, 2, 3, 0 -> 1 | 2<<2 | 3<<4 | 0<<6 = 0x39
    #   1-bit plane (code bit 2):    1, 0, 1, 0 -> 1 | 1<<2               = 0x05
    # row 1, 6 bits = planes [4, 2]: codes 63=0b111111, 10=0b001010, 33=0b100001, 44=0b101100
    #   4-bit plane (bits 0-3): 15, 10, 1, 12 -> 15 | 10<<4 | 1<<8 | 12<<12 = 0xC1AF
    #   2-bit plane (bits 4-5):  3,  0, 2,  2 -> 3 | 0<<2 | 2<<4 | 2<<6     = 0xA3
    q = make_qstate(
        codes=[[[[5, 2, 7, 0], [63, 10, 33, 44]]]],
        bits=[[3, 6]],
        row_scale=fp16([1.0, -2.0]).view(1, 1, 2),
        col_scale=fp16([0.5, 1.0, 2.0, 0.25]).view(1, 1, 4),
    )
    packed = pack(q)
    assert slot_words(packed) == [0x39, 0x05, 0xC1AF, 0xA3]
    assert packed.codes.numpy().astype("<i4").tobytes() == bytes.fromhex(
        "39000000" "05000000" "afc10000" "a3000000"
    )
    assert packed.row_scale.numpy().astype("<f2").tobytes() == bytes.fromhex("003c" "00c0")
    assert packed.col_scale.numpy().astype("<f2").tobytes() == bytes.fromhex("0038" "003c" "0040" "0034")
    layout = packed.layout
    assert layout.words_per_slot == 4
    assert layout.row_word_offset.tolist() == [0, 2]
    assert layout.row_words.tolist() == [2, 2]
    assert layout.bytes_per_slot == 4 * 4 + 2 * 1 * (2 + 4) == 28
    assert layout.analytical_bytes == 28
    assert_qstate_bits_equal(unpack(packed), q)


def test_golden_seven_bit_row_has_three_planes():
    # 7 bits = planes [4, 2, 1]; codes 127, 0, 85=0b1010101, 42=0b0101010, 1
    #   4-bit plane: 15, 0, 5, 10, 1 -> 0xF | 5<<8 | 10<<12 | 1<<16 = 0x1A50F
    #   2-bit plane:  3, 0, 1,  2, 0 -> 3 | 1<<4 | 2<<6             = 0x93
    #   1-bit plane:  1, 0, 1,  0, 0 -> 1 | 1<<2                    = 0x5
    q = make_qstate(codes=[[[[127, 0, 85, 42, 1]]]], bits=[[7]], row_scale=fp16([1.0]).view(1, 1, 1))
    packed = pack(q)
    assert slot_words(packed) == [0x1A50F, 0x93, 0x5]
    assert packed.col_scale is None
    assert packed.layout.plane_word_offset.tolist() == [[-1, -1, 0, 1, 2]]  # widths 16, 8, 4, 2, 1
    assert packed.layout.bytes_per_slot == 4 * 3 + 2 * 1 * 1
    assert_qstate_bits_equal(unpack(packed), q)


def test_golden_eight_bit_row_and_full_words():
    # row 0: 8 bits, 4 values per word: 0x12, 0x34, 0x56, 0x78, 0x9A -> 0x78563412, then 0x0000009A
    # row 1: 2 bits, 16 values per word; 17 codes of 3 fill word 0 (0xFFFFFFFF, int32 -1) and 2 bits of word 1
    codes = torch.zeros(1, 1, 2, 17, dtype=torch.uint8)
    codes[0, 0, 0, :5] = torch.tensor([0x12, 0x34, 0x56, 0x78, 0x9A])
    codes[0, 0, 1, :] = 3
    q = QState(codes, torch.tensor([[8, 2]], dtype=torch.int8), fp16([1.0, 1.0]).view(1, 1, 2), None, None)
    packed = pack(q)
    # row 0 takes ceil(17/4) = 5 words, row 1 ceil(17/16) = 2 words
    assert slot_words(packed) == [0x78563412, 0x9A, 0, 0, 0, 0xFFFFFFFF, 0x3]
    assert packed.codes[0, 5].item() == -1
    assert_qstate_bits_equal(unpack(packed), q)


def test_golden_three_bit_row_pads_the_last_word_of_each_plane():
    # V = 33 codes of 7: 2-bit plane takes ceil(33/16) = 3 words, 1-bit plane ceil(33/32) = 2 words
    q = QState(torch.full((1, 1, 1, 33), 7, dtype=torch.uint8), torch.tensor([[3]], dtype=torch.int8),
               fp16([1.0]).view(1, 1, 1), None, None)
    packed = pack(q)
    assert slot_words(packed) == [0xFFFFFFFF, 0xFFFFFFFF, 0x3, 0xFFFFFFFF, 0x1]
    assert_qstate_bits_equal(unpack(packed), q)


def test_pivot_row_stores_the_raw_fp16_bit_pattern():
    # pivot row values 1.0 (0x3C00), -0.0 (0x8000), +inf (0x7C00), 65504 (0x7BFF):
    # two per word, the lower-index value in the low half
    values = fp16_from_bits([0x3C00, 0x8000, 0x7C00, 0x7BFF])
    pivots = torch.zeros(1, 1, 2, 4, dtype=torch.float16)
    pivots[0, 0, 0] = values
    q = make_qstate(codes=[[[[0, 0, 0, 0], [1, 2, 3, 0]]]], bits=[[16, 2]],
                    row_scale=fp16([7.0, 0.5]).view(1, 1, 2), col_scale=fp16([1, 1, 1, 1]).view(1, 1, 4),
                    pivots=pivots)
    packed = pack(q)
    assert slot_words(packed) == [0x80003C00, 0x7BFF7C00, 1 | 2 << 2 | 3 << 4]
    # a KDA pivot row keeps its row-scale slot (7.0) in its head's vector
    assert packed.row_scale.view(torch.int16).tolist() == [[[0x4700, 0x3800]]]
    out = unpack(packed)
    assert out.pivots[0, 0, 0].view(torch.int16).tolist() == fp16_from_bits(
        [0x3C00, 0x8000, 0x7C00, 0x7BFF]).view(torch.int16).tolist()
    assert_qstate_bits_equal(out, q)


def test_pivot_nan_payloads_survive():
    patterns = [0x7E01, 0xFE55, 0x7C01, 0x0001]  # quiet / negative / signalling NaN payloads, a subnormal
    pivots = fp16_from_bits(patterns).view(1, 1, 1, 4)
    q = make_qstate(codes=[[[[9, 9, 9, 9]]]], bits=[[16]], row_scale=fp16([1.0]).view(1, 1, 1), pivots=pivots)
    packed = pack(q)
    assert slot_words(packed) == [0xFE557E01, 0x00017C01]
    assert [p & 0xFFFF for p in unpack(packed).pivots.view(torch.int16).flatten().tolist()] == patterns


def test_whole_pivot_head_carries_no_scale_slots():
    # head 0 is a GDN pivot head (all rows 16), head 1 an integer head at 4 bits; K = 2, V = 4
    n, h, k, v = 2, 2, 2, 4
    bits = torch.tensor([[16, 16], [4, 4]], dtype=torch.int8)
    codes = torch.randint(0, 16, (n, h, k, v), dtype=torch.uint8)
    pivots = torch.randn(n, h, k, v).half()
    row_scale = torch.rand(n, h, k).half() + 0.5
    col_scale = torch.rand(n, h, v).half() + 0.5
    q = QState(codes, bits, row_scale, col_scale, pivots)
    packed = pack(q)
    layout = packed.layout
    assert layout.scaled_heads == (1,)
    assert layout.head_scale_slot.tolist() == [-1, 0]
    assert layout.words_per_slot == 2 * 2 + 2 * 1  # two pivot rows of ceil(4/2) words, two 4-bit rows of 1
    assert layout.bytes_per_slot == 4 * 6 + 2 * 1 * (k + v)
    assert layout.analytical_bytes == 4 * 6 + 2 * 2 * (k + v)
    assert packed.row_scale.shape == (n, 1, k) and packed.col_scale.shape == (n, 1, v)
    assert torch.equal(packed.row_scale, row_scale[:, 1:])
    out = unpack(packed)
    assert_qstate_bits_equal(out, canonicalize(q))
    assert torch.equal(out.row_scale[:, 0], torch.ones(n, k, dtype=torch.float16))  # the codecs' fill value
    assert torch.equal(out.col_scale[:, 0], torch.ones(n, v, dtype=torch.float16))
    assert torch.equal(out.dequantize(), q.dequantize())


def test_qwen_layer_layout_at_6_bits():
    layout = PackedLayout(torch.full((48, 128), 6, dtype=torch.int8), 128)
    assert layout.words_per_slot == 48 * 128 * 24
    assert layout.bytes_per_slot == layout.analytical_bytes == 48 * 128 * 96 + 2 * 48 * 256 == 614_400
    assert layout.row_word_offset[:3].tolist() == [0, 24, 48]
    assert layout.plane_word_offset[1].tolist() == [-1, -1, 24, 40, -1]


# ---------------------------------------------------------------- property tests: exact round trip

BIT_MODES = ("uniform-heads", "mixed-rows", "mixed-rows-with-pivots", "pivot-heads", "all-pivot")
INTEGER_BITS = torch.arange(2, 9)


def random_bits(mode: str, h: int, k: int, gen: torch.Generator) -> torch.Tensor:
    pick = lambda choices, shape: choices[torch.randint(len(choices), shape, generator=gen)]
    if mode == "uniform-heads":
        return pick(INTEGER_BITS, (h, 1)).expand(h, k).clone().to(torch.int8)
    if mode == "mixed-rows":
        return pick(INTEGER_BITS, (h, k)).to(torch.int8)
    if mode == "mixed-rows-with-pivots":
        return pick(torch.tensor([2, 3, 4, 5, 6, 7, 8, 16]), (h, k)).to(torch.int8)
    if mode == "pivot-heads":
        per_head = pick(torch.tensor([3, 5, 6, 16]), (h, 1)).expand(h, k).clone()
        per_head[0] = 16  # at least one whole pivot head
        return per_head.to(torch.int8)
    return torch.full((h, k), 16, dtype=torch.int8)


def random_qstate(n, h, k, v, bits, with_col_scale, grid, gen, finite=False) -> QState:
    limit = (1 << bits.to(torch.int64).clamp(max=8))[None, :, :, None]  # [1, H, K, 1]
    codes = (torch.randint(0, 1 << 20, (n, h, k, v), generator=gen) % limit).to(torch.uint8)
    is_pivot = (bits == 16)[None, :, :, None]
    # codes of pivot rows are garbage the format does not keep
    codes = torch.where(is_pivot, torch.randint(0, 256, codes.shape, generator=gen).to(torch.uint8), codes)

    def fp16_patterns(shape):
        if finite:
            return (torch.randn(shape, generator=gen) * 3).half()
        return torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16).view(torch.float16)

    row_scale = fp16_patterns((n, h, k))
    col_scale = fp16_patterns((n, h, v)) if with_col_scale else None
    needs_pivots = bool(is_pivot.any()) or bool(torch.rand((), generator=gen) < 0.5)
    pivots = fp16_patterns((n, h, k, v)) if needs_pivots else None
    return QState(codes, bits, row_scale, col_scale, pivots, grid)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 3),
    h=st.integers(1, 4),
    k=st.sampled_from([1, 2, 3, 7, 16, 31, 32, 33, 64, 100, 127, 128, 130]) | st.integers(1, 130),
    v=st.sampled_from([1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 64, 100, 127, 128, 130]) | st.integers(1, 130),
    mode=st.sampled_from(BIT_MODES),
    with_col_scale=st.booleans(),
    grid=st.sampled_from(list(Grid)),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_round_trip_is_exact(n, h, k, v, mode, with_col_scale, grid, seed):
    gen = torch.Generator().manual_seed(seed)
    bits = random_bits(mode, h, k, gen)
    q = random_qstate(n, h, k, v, bits, with_col_scale, grid, gen)
    packed = pack(q)
    layout = packed.layout
    expected_words = sum(row_words(b, v) for b in bits.flatten().tolist())
    assert layout.words_per_slot == expected_words == packed.codes.shape[1]
    scaled = [i for i in range(h) if (bits[i] != 16).any()]
    assert layout.scaled_heads == tuple(scaled)
    scale_values = (k + v) if with_col_scale else k
    assert layout.bytes_per_slot == 4 * expected_words + 2 * len(scaled) * scale_values
    assert layout.analytical_bytes == 4 * expected_words + 2 * h * scale_values
    assert_qstate_bits_equal(unpack(packed), canonicalize(q))
    assert_qstate_bits_equal(unpack(pack(unpack(packed))), canonicalize(q))  # idempotent


@settings(max_examples=25, deadline=None)
@given(
    h=st.integers(1, 4), k=st.integers(1, 40), v=st.integers(1, 70),
    mode=st.sampled_from(BIT_MODES), seed=st.integers(0, 2**31 - 1),
)
def test_offsets_point_at_each_plane_of_each_row(h, k, v, mode, seed):
    bits = random_bits(mode, h, k, torch.Generator().manual_seed(seed))
    layout = PackedLayout(bits, v)
    start = 0
    for r, b in enumerate(bits.flatten().tolist()):
        assert layout.row_word_offset[r].item() == start
        assert layout.row_words[r].item() == row_words(b, v)
        word = start
        for p, width in enumerate(PLANE_WIDTHS):
            if width in plane_widths(b):
                assert layout.plane_word_offset[r, p].item() == word
                word += plane_words(width, v)
            else:
                assert layout.plane_word_offset[r, p].item() == -1
        start += row_words(b, v)
    assert layout.words_per_slot == start


def test_every_code_bit_lands_in_its_own_place():
    # Single-bit probes: setting code bit t of value j in a row must set exactly one bit of one word.
    for b in (2, 3, 5, 6, 7, 8):
        v = 37
        for j in (0, 1, 15, 16, 31, 32, 36):
            for t in range(b):
                codes = torch.zeros(1, 1, 1, v, dtype=torch.uint8)
                codes[0, 0, 0, j] = 1 << t
                words = slot_words(pack(one_row(b, v, codes)))
                # the plane holding code bit t, and the bit inside that plane
                widths, offsets = plane_widths(b), plane_bit_offsets(b)
                p = max(i for i, o in enumerate(offsets) if o <= t)
                w, per = widths[p], 32 // widths[p]
                word = sum(plane_words(x, v) for x in widths[:p]) + j // per
                expected = [0] * len(words)
                expected[word] = 1 << ((j % per) * w + (t - offsets[p]))
                assert words == expected, (b, j, t)


@pytest.mark.parametrize("grid", list(Grid), ids=lambda g: g.value)
def test_unpacked_state_dequantizes_to_the_same_values(grid):
    gen = torch.Generator().manual_seed(0)
    bits = random_bits("mixed-rows-with-pivots", 3, 19, gen)
    bits[1] = 16  # and one whole pivot head
    q = random_qstate(2, 3, 19, 45, bits, True, grid, gen, finite=True)
    assert torch.equal(unpack(pack(q)).dequantize(), q.dequantize())


def test_pack_reuses_a_given_layout():
    gen = torch.Generator().manual_seed(1)
    bits = random_bits("mixed-rows", 2, 5, gen)
    q = random_qstate(2, 2, 5, 9, bits, True, Grid.MIDTREAD, gen)
    layout = PackedLayout(bits, 9)
    assert pack(q, layout).layout is layout
    with pytest.raises(ValueError, match="layout does not match q"):
        pack(q, PackedLayout(bits, 10))
    with pytest.raises(ValueError, match="layout does not match q"):
        pack(q, PackedLayout(bits, 9, has_col_scale=False))
    other_bits = bits.clone()
    other_bits[0, 0] = 16 if other_bits[0, 0] != 16 else 2
    with pytest.raises(ValueError, match="layout does not match q"):
        pack(q, PackedLayout(other_bits, 9))


# ---------------------------------------------------------------- bad input

def one_row(bits=3, v=4, codes=None) -> QState:
    codes = torch.zeros(1, 1, 1, v, dtype=torch.uint8) if codes is None else codes
    return QState(codes, torch.tensor([[bits]], dtype=torch.int8), fp16([1.0]).view(1, 1, 1), None, None)


@pytest.mark.parametrize("bad", [0, 1, 9, 12, 17], ids=lambda b: f"{b}b")
def test_layout_rejects_unsupported_widths(bad):
    with pytest.raises(ValueError, match=r"bits holds unsupported widths \[" + str(bad)):
        PackedLayout(torch.tensor([[6, bad]], dtype=torch.int8), 8)


@pytest.mark.parametrize(
    "bits, value_dim, error, match",
    [
        (torch.tensor([[6.0]]), 8, TypeError, "integer dtype"),
        ([[6]], 8, TypeError, "torch.Tensor of shape"),
        (torch.tensor([6, 6]), 8, ValueError, r"shape \[H, K\]"),
        (torch.zeros(2, 0, dtype=torch.int8), 8, ValueError, r"shape \[H, K\]"),
        (torch.tensor([[6]]), 0, ValueError, "value_dim must be >= 1"),
        (torch.tensor([[6]]), 8.0, TypeError, "value_dim must be a positive int"),
    ],
    ids=["float-bits", "list-bits", "1d-bits", "empty-bits", "zero-V", "float-V"],
)
def test_layout_rejects_bad_arguments(bits, value_dim, error, match):
    with pytest.raises(error, match=match):
        PackedLayout(bits, value_dim)


def test_pack_rejects_codes_that_do_not_fit_their_row():
    codes = torch.tensor([[[[1, 8, 0, 0]]]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"q.codes\[0, 0, 0, 1\] = 8 does not fit the row's 3 bits"):
        pack(one_row(3, codes=codes))


def test_pack_rejects_missing_pivots_and_bad_dtypes():
    q = one_row(16)
    with pytest.raises(ValueError, match="pivot rows but q.pivots is None"):
        pack(q)
    q = QState(torch.zeros(1, 1, 1, 4, dtype=torch.int32), torch.tensor([[3]], dtype=torch.int8),
               fp16([1.0]).view(1, 1, 1), None, None)
    with pytest.raises(TypeError, match=r"q.codes must be a uint8 tensor \[N, H, K, V\]"):
        pack(q)
    q = QState(torch.zeros(1, 1, 1, 4, dtype=torch.uint8), torch.tensor([[3]], dtype=torch.int8),
               torch.ones(1, 1, 1), None, None)
    with pytest.raises(TypeError, match="q.row_scale must have dtype torch.float16"):
        pack(q)
    q = QState(torch.zeros(1, 1, 1, 4, dtype=torch.uint8), torch.tensor([[3]], dtype=torch.int8),
               fp16([1.0]).view(1, 1, 1), fp16([1.0, 1.0]).view(1, 1, 2), None)
    with pytest.raises(ValueError, match=r"q.col_scale must have shape \(1, 1, 4\)"):
        pack(q)
    with pytest.raises(TypeError, match="q must be a QState"):
        pack(torch.zeros(1, 1, 1, 4))


def test_packed_state_validates_its_buffers():
    packed = pack(one_row(3))
    with pytest.raises(ValueError, match=r"codes must have shape \[N, 2\]"):
        PackedState(torch.zeros(1, 3, dtype=torch.int32), packed.row_scale, None, packed.layout)
    with pytest.raises(TypeError, match="codes must have dtype torch.int32"):
        PackedState(torch.zeros(1, 2, dtype=torch.int64), packed.row_scale, None, packed.layout)
    with pytest.raises(ValueError, match="layout has no column scales"):
        PackedState(packed.codes, packed.row_scale, torch.ones(1, 1, 4).half(), packed.layout)
    with pytest.raises(TypeError, match="unpack|packed must be a PackedState"):
        unpack(one_row(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_bit_for_bit():
    gen = torch.Generator().manual_seed(3)
    bits = random_bits("mixed-rows-with-pivots", 4, 128, gen)
    q = random_qstate(3, 4, 128, 128, bits, True, Grid.MIDTREAD, gen)
    q_cuda = QState(*(t.cuda() if t is not None else None
                      for t in (q.codes, q.bits, q.row_scale, q.col_scale, q.pivots)), q.grid)
    packed_cpu, packed_cuda = pack(q), pack(q_cuda)
    assert packed_cuda.codes.is_cuda
    assert torch.equal(packed_cuda.codes.cpu(), packed_cpu.codes)
    assert_qstate_bits_equal(unpack(packed_cuda), canonicalize(q))


def test_struct_view_of_words_is_little_endian():
    # the int32 words are the slot's bytes read as little-endian 32-bit integers
    packed = pack(one_row(8, codes=torch.tensor([[[[0x12, 0x34, 0x56, 0x78]]]], dtype=torch.uint8)))
    raw = packed.codes.numpy().astype("<i4").tobytes()
    assert raw == bytes([0x12, 0x34, 0x56, 0x78])
    assert struct.unpack("<I", raw)[0] == 0x78563412
