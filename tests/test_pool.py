"""Tests for stepquant.pool and the layer format it is built from: slot lifecycle, tensor-parallel sharding,
exact byte accounting, and the kernels' tables of a layer."""

from __future__ import annotations

import pytest
import torch

from stepquant.accounting import Mixer, ModelShape, plan_bytes
from stepquant.codecs import LayerFormat
from stepquant.codecs.base import PIVOT_BITS
from stepquant.codecs.dual_axis import DualAxisConfig
from stepquant.codecs.packing import pack, unpack
from stepquant.pool import PackedLayer, PackedStatePool


def gdn_plan(heads=4, key_dim=16, bits=(5, 6, 7, 8), pivot_head=True, seed=0) -> LayerFormat:
    table = torch.tensor(bits * heads)[:heads, None].expand(heads, key_dim).clone().to(torch.int8)
    if pivot_head:
        table[-1] = PIVOT_BITS
    w = torch.rand(heads, key_dim, generator=torch.Generator().manual_seed(seed)) + 0.5
    return LayerFormat(table, w)


def kda_plan(heads=4, key_dim=16, seed=1) -> LayerFormat:
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(4, 9, (heads, key_dim), generator=gen).to(torch.int8)
    table[1, 3] = PIVOT_BITS
    return LayerFormat(table, None, "dual_axis", DualAxisConfig(refit_iters=0))


def test_alloc_free_reuse_zeroes_slots():
    pool = PackedStatePool([gdn_plan(), kda_plan()], num_slots=3, value_dim=32)
    first = pool.alloc(2)
    assert first == [0, 1] and pool.num_free == 1
    for layer in pool.layers:
        for t in layer.tensors():
            t[first] = 7  # a request writes its state
    pool.free(first[0])
    assert pool.alloc() == [2]  # the slot freed longest ago comes first: a stale id stays free longest
    again = pool.alloc()
    assert again == [0]
    for layer in pool.layers:
        assert all(not t[0].any() for t in layer.tensors()), "a reused slot must come back zeroed"
        assert all(bool((t[1] == 7).all()) for t in layer.tensors()), "other slots are untouched"
    # a zeroed slot decodes to the zero state
    zero = unpack(pool.layers[0].gather([0])).dequantize()
    assert not zero.any()


def test_exhaustion_and_double_free_raise():
    pool = PackedStatePool([gdn_plan()], num_slots=2, value_dim=16)
    slots = pool.alloc(2)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.alloc()
    pool.free(slots)
    with pytest.raises(ValueError, match="double free"):
        pool.free(slots[0])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([5])
    with pytest.raises(ValueError, match="positive int"):
        pool.alloc(0)


def test_bytes_held_match_accounting():
    plans = [gdn_plan(heads=8, key_dim=32), gdn_plan(heads=8, key_dim=32, bits=(4,), pivot_head=False)]
    pool = PackedStatePool(plans, num_slots=5, value_dim=128)
    shape = ModelShape("toy", Mixer.GDN, linear_layers=2, heads=8, key_dim=32, value_dim=128)
    accounted = plan_bytes([p.bits for p in plans], shape).serving_bytes
    assert pool.bytes_per_slot == accounted
    assert pool.bytes_held == 5 * accounted
    allocated = sum(t.numel() * t.element_size() for layer in pool.layers for t in layer.tensors())
    assert allocated == pool.bytes_held  # no hidden padding
    # rowwise absmax has no column scales
    absmax = PackedLayer(LayerFormat(plans[1].bits, None, "absmax"), 2, 128)
    assert absmax.pages.col_scale is None
    assert absmax.bytes_per_slot == plan_bytes([plans[1].bits], shape.__class__(
        "toy1", Mixer.GDN, 1, 8, 32, 128), has_col_scale=False).serving_bytes


def test_tensor_parallel_shards_heads():
    plan = kda_plan(heads=4)
    shards = [PackedStatePool([plan], 2, 16, tp_rank=r, tp_size=2) for r in range(2)]
    for rank, pool in enumerate(shards):
        layer = pool.layers[0]
        assert layer.num_heads == 2
        assert torch.equal(layer.format.bits, plan.bits[2 * rank: 2 * rank + 2])
    total = sum(pool.bytes_per_slot for pool in shards)
    whole = PackedStatePool([plan], 2, 16).bytes_per_slot
    assert total == whole  # scale slots go with their heads
    with pytest.raises(ValueError, match="split evenly"):
        PackedStatePool([plan], 2, 16, tp_rank=0, tp_size=3)
    with pytest.raises(ValueError, match="rank"):
        plan.shard(2, 2)


def test_gather_scatter_round_trip_and_tables():
    plan = gdn_plan()
    layer = PackedLayer(plan, 3, 24)
    x = torch.randn(2, 4, 16, 24)
    encoded = plan.codec().encode(x)
    layer.scatter([2, 0], pack(encoded, layer.layout))
    back = unpack(layer.gather([2, 0]))
    torch.testing.assert_close(back.dequantize(), encoded.dequantize(), rtol=0, atol=0)
    assert not layer.pages.codes[1].any()
    # tables the kernel reads
    assert layer.tables.row_bits.dtype == torch.int32 and layer.tables.row_bits.numel() == 4 * 16
    assert layer.tables.planes == 16 | 4 | 2 | 1  # heads 5 = 4+1, 6 = 4+2, 7 = 4+2+1 and an FP16 pivot head
    assert float(layer.tables.row_gain[-1]) == 0.0 and float(layer.tables.row_w2[-1]) == 0.0  # pivot rows
    with pytest.raises(IndexError):
        layer.gather([3])


def test_the_cpu_decode_path_uses_the_formats_codec(monkeypatch):
    # one codec per layer, built once: the torch reference does not build (and validate) one per token
    from stepquant.codecs.mixed import MixedCodec
    from stepquant.kernels.decode import naive_pack_states, naive_packed_decode

    layer = PackedLayer(kda_plan(), 2, 16)
    naive_pack_states(layer, torch.tensor([0, 1], dtype=torch.int32), torch.randn(2, 4, 16, 16))
    monkeypatch.setattr(MixedCodec, "__post_init__", lambda self: pytest.fail("a MixedCodec was validated"))
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 16, generator=gen), torch.randn(2, 4, 16, generator=gen)
    v, g, beta = torch.randn(2, 4, 16, generator=gen), -torch.rand(2, 4, generator=gen), torch.rand(2, 4)
    for _ in range(2):
        naive_packed_decode(layer, torch.tensor([1, 0], dtype=torch.int32), q, k, v, g, beta)


def test_an_engines_own_pages_drive_the_kernels():
    # the kernels take tables + pages + slots: pages allocated outside the pool (more slots, another
    # order) decode exactly as the pool's layer does
    from stepquant.kernels.decode import decode_step, decode_step_packed, pack, pack_states
    from stepquant.kernels.tables import FormatTables, Pages, check_pages

    fmt = kda_plan()
    layer = PackedLayer(fmt, 2, 16)
    tables = FormatTables(fmt, 16)
    pages = Pages(torch.zeros(5, tables.words_per_slot, dtype=torch.int32),
                  torch.zeros(5, tables.num_scaled_heads, 16, dtype=torch.float16),
                  torch.zeros(5, tables.num_scaled_heads, 16, dtype=torch.float16))
    states = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    pack_states(layer, torch.tensor([0, 1], dtype=torch.int32), states)
    pack(tables, pages, torch.tensor([4, 2], dtype=torch.int32), states)
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 2, 16, generator=gen), torch.randn(2, 2, 16, generator=gen)
    v, g, beta = torch.randn(2, 4, 16, generator=gen), -torch.rand(2, 4, 16, generator=gen), torch.rand(2, 4)
    y = decode_step_packed(layer, torch.tensor([0, 1], dtype=torch.int32), q, k, v, g, beta)
    y_own = decode_step(tables, pages, torch.tensor([4, 2], dtype=torch.int32), q, k, v, g, beta)
    assert torch.equal(y, y_own)
    for ours, theirs in zip(layer.tensors(), pages.tensors(), strict=True):
        assert torch.equal(ours, theirs[[4, 2]]) and not theirs[[0, 1, 3]].any()
    assert tables.head_groups and tables.planes == 16 | 8 | 4 | 2 | 1  # rows of 4..8 bits and a pivot
    with pytest.raises(ValueError, match=r"pages.codes must be torch.int32 \[5, "):
        check_pages(tables, Pages(pages.codes[:, 1:].contiguous(), pages.row_scale, pages.col_scale))
    with pytest.raises(ValueError, match="column scales"):
        check_pages(tables, Pages(pages.codes, pages.row_scale))
    assert Pages.empty(FormatTables(LayerFormat(fmt.bits, None, "absmax"), 16), 3).col_scale is None


# ---------------------------------------------------------------- slot ids (kernels.tables.check_slots)

def _token(rows: int, heads: int = 4, key_dim: int = 16, value_dim: int = 16, seed: int = 4):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(rows, 2, key_dim, generator=gen), torch.randn(rows, 2, key_dim, generator=gen)
    v = torch.randn(rows, heads, value_dim, generator=gen)
    return q, k, v, -torch.rand(rows, heads, key_dim, generator=gen), torch.rand(rows, heads, generator=gen)


def _backends():
    from stepquant.kernels.decode import cuda, fused_decode, naive_decode

    return {"torch": naive_decode, "triton": fused_decode, "cuda": cuda.decode}


BAD_SLOTS = [
    (torch.tensor([0, 1]), TypeError, "int32 tensor"),
    (torch.tensor([[0, 1]], dtype=torch.int32), TypeError, "int32 tensor"),
    (torch.tensor([0, -2], dtype=torch.int32), ValueError, r"-1 \(skip the row\) or in \[0, 3\), got \[-2\]"),
    (torch.tensor([3, 0], dtype=torch.int32), ValueError, r"in \[0, 3\), got \[3\]"),
    (torch.tensor([1, 1], dtype=torch.int32), ValueError, r"slots \[1\] are named by more than one"),
    (torch.tensor([0, 1, 2], dtype=torch.int32), ValueError, "N=3 \\(len\\(slots\\)\\)"),
]


@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
@pytest.mark.parametrize("slots, error, message", BAD_SLOTS,
                         ids=["int64", "2-d", "minus-2", "too-large", "duplicate", "wrong-length"])
def test_every_kernel_refuses_bad_slot_ids_before_touching_a_slot(backend, slots, error, message):
    layer = PackedLayer(kda_plan(), 3, 16)
    before = [t.clone() for t in layer.tensors()]
    with pytest.raises(error, match=message):
        _backends()[backend](layer.tables, layer.pages, slots, *_token(2))
    assert all(torch.equal(a, b) for a, b in zip(before, layer.tensors(), strict=True))


def test_minus_one_is_the_only_skip_value_and_the_boundary_pack_checks_too():
    from stepquant.kernels.decode import decode_step_packed, pack_states

    layer = PackedLayer(kda_plan(), 3, 16)
    pack_states(layer, torch.tensor([2, -1], dtype=torch.int32), torch.randn(2, 4, 16, 16))
    assert layer.pages.codes[2].any() and not layer.pages.codes[:2].any()
    y = decode_step_packed(layer, torch.tensor([-1, 0], dtype=torch.int32), *_token(2))
    assert not y[0].any()  # the skipped row's output stays zero
    with pytest.raises(ValueError, match="named by more than one batch row"):
        pack_states(layer, torch.tensor([2, 2], dtype=torch.int32), torch.randn(2, 4, 16, 16))
    with pytest.raises(ValueError, match=r"v must have shape"):  # the CPU path checks shapes too
        q, k, v, g, beta = _token(2)
        decode_step_packed(layer, torch.tensor([0, 1], dtype=torch.int32), q, k, v[:, :3], g, beta)


def test_a_freed_slot_is_refused_and_a_stale_id_stays_free_longest():
    from stepquant.kernels.decode import decode_step_packed, pack_states

    pool = PackedStatePool([kda_plan(), kda_plan(seed=2)], num_slots=3, value_dim=16)
    ids = pool.alloc(2)
    slots = pool.slot_tensor(ids)
    for layer in pool.layers:
        pack_states(layer, slots, torch.randn(2, 4, 16, 16))
        decode_step_packed(layer, slots, *_token(2))  # checked once, then served from the memo
    with pytest.raises(ValueError, match=r"slots \[2\] are not allocated"):
        decode_step_packed(pool.layers[0], pool.slot_tensor([0, 2]), *_token(2))  # never handed out
    pool.free(ids[1])
    for layer in pool.layers:  # the same tensor is checked again: the pool's in_use mask changed
        with pytest.raises(ValueError, match=r"slots \[1\] are not allocated \(freed"):
            decode_step_packed(layer, slots, *_token(2))
        with pytest.raises(ValueError, match="not allocated"):
            pack_states(layer, slots, torch.randn(2, 4, 16, 16))
    with torch.inference_mode():  # inference tensors have no version counter: checked at every call
        stale = torch.tensor([0, 1], dtype=torch.int32)
        for _ in range(2):
            with pytest.raises(ValueError, match="not allocated"):
                decode_step_packed(pool.layers[0], stale, *_token(2))
    assert pool.alloc() == [2]  # a new request gets the slot freed longest ago, not the stale id 1
    with pytest.raises(ValueError, match=r"slots \[1\] are not allocated"):
        decode_step_packed(pool.layers[1], slots, *_token(2))
    slots[1] = 2  # modified in place: checked again, and slot 2 is in use
    decode_step_packed(pool.layers[1], slots, *_token(2))
    with pytest.raises(ValueError, match=r"slots \[1, 1\] are not allocated|double free"):
        pool.free([1, 1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["torch", "triton", "cuda"])
def test_gpu_kernels_refuse_bad_and_freed_slot_ids(backend):
    from stepquant.kernels.decode import cuda

    if backend == "cuda" and not cuda.nvcc_path():
        pytest.skip("needs nvcc")
    bits = torch.tensor([4, 6, 8, PIVOT_BITS], dtype=torch.int8)[:, None].expand(4, 128).clone()
    pool = PackedStatePool([LayerFormat(bits, torch.rand(4, 128) + 0.5)], num_slots=3, value_dim=128,
                           device="cuda")
    layer = pool.layers[0]
    token = [t.cuda() for t in _token(2, key_dim=128, value_dim=128)]
    token[3] = token[3][..., 0]  # GDN gates [N, H]
    decode = _backends()[backend]
    ids = pool.alloc(2)
    slots = pool.slot_tensor(ids)
    decode(layer.tables, layer.pages, slots, *token)
    for bad, message in ((torch.tensor([0, 3]), r"in \[0, 3\)"), (torch.tensor([0, -5]), r"got \[-5\]"),
                         (torch.tensor([1, 1]), "more than one batch row"),
                         (torch.tensor([0, 2]), "not allocated")):
        before = [t.clone() for t in layer.tensors()]
        with pytest.raises(ValueError, match=message):
            decode(layer.tables, layer.pages, bad.to("cuda", torch.int32), *token)
        assert all(torch.equal(a, b) for a, b in zip(before, layer.tensors(), strict=True))
    pool.free(ids[0])
    with pytest.raises(ValueError, match=r"slots \[0\] are not allocated"):
        decode(layer.tables, layer.pages, slots, *token)
