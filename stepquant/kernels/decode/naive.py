"""Torch reference of the packed-state decode step and the boundary pack (same signatures as fused.py).

Built from the modules that define the format and the method, so the kernels are judged against them
and nothing here re-derives their logic: ``packing.unpack`` -> ``QState.dequantize`` -> one
``recurrence.step`` (readout from X, before requantizing) -> the layer format's codec ``encode`` ->
``packing.pack`` -> written back into the slots. Runs on any device; it is also the CPU path
of :func:`stepquant.kernels.decode.decode_step`.

Every function takes the layer's ``tables`` and ``pages`` (stepquant.kernels.tables); the
``naive_packed_decode`` / ``naive_pack_states`` / ``naive_unpack_states`` forms take a
``pool.PackedLayer`` instead and run on its tables and pages.
"""

from __future__ import annotations

import torch

from stepquant.codecs.packing import pack, unpack
from stepquant.kernels.tables import FormatTables, Pages, check_pages, check_slots
from stepquant.recurrence import prepare_qk, step


def naive_decode(
    tables: FormatTables,
    pages: Pages,
    slots: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    out: torch.Tensor | None = None,
    part: str = "fused",
    debug: dict | None = None,
) -> torch.Tensor:
    """One decode token for N requests whose states live in ``pages``' slots; returns y [N, H, V].

    slots int [N] (-1: skip the row, its output and every slot untouched); q, k [N, H_k, K]; v [N, H, V];
    g [N, H] (GDN) or [N, H, K] (KDA) log decays; beta [N, H]. The slots are updated in place.
    part: "fused" (both), "readout" (y only) or "writeback" (slots only), as the Triton kernel.
    debug (a dict) receives "x": the float state X [n, H, K, V] of the active rows before requantizing.
    """
    check_token_inputs(tables, pages, slots, q, k, v, g, beta)
    num_rows = v.shape[0]
    if out is None:
        out = torch.zeros(num_rows, tables.num_heads, tables.value_dim, dtype=v.dtype, device=v.device)
    active = torch.nonzero(slots.to(torch.int64) >= 0).flatten().to(v.device)
    if active.numel() == 0:
        return out
    slot_ids = slots.to(torch.int64)[active.to(slots.device)]
    states = unpack(pages.gather(tables, slot_ids)).dequantize()  # [n, H, K, V]
    mode = "kda" if g.dim() == 3 else "gdn"
    b_q, b_k = prepare_qk(q[active], k[active], scale=scale, use_qk_l2norm=use_qk_l2norm, mode=mode)
    x, y = step(states.to(v.device), b_q, b_k, v[active], g[active], beta[active])
    if part in ("fused", "writeback"):
        pages.scatter(tables, slot_ids, pack(tables.format.codec().encode(x), tables.layout))
    if part in ("fused", "readout"):
        out[active] = y.to(out.dtype)
    if debug is not None:
        debug["x"] = x
    return out


def naive_pack(tables: FormatTables, pages: Pages, slots: torch.Tensor, states: torch.Tensor) -> None:
    """Quantize FP32 states [N, H, K, V] with the format's codec and write them into ``slots`` (-1: skip)."""
    check_states(tables, pages, slots, states)
    active = torch.nonzero(slots.to(torch.int64) >= 0).flatten()
    if active.numel() == 0:
        return
    slot_ids = slots.to(torch.int64)[active]
    encoded = tables.format.codec().encode(states[active.to(states.device)])
    pages.scatter(tables, slot_ids, pack(encoded, tables.layout))


def naive_unpack(tables: FormatTables, pages: Pages, slots: torch.Tensor) -> torch.Tensor:
    """FP32 states [N, H, K, V] of ``slots`` (every index must be a valid slot)."""
    check_pages(tables, pages)
    return unpack(pages.gather(tables, slots.to(torch.int64))).dequantize()


def check_token_inputs(tables: FormatTables, pages: Pages, slots: torch.Tensor, q, k, v, g, beta, *,
                       chunk: bool = False) -> None:
    """ValueError naming the argument and its shape unless the inputs fit the layer and the rows of
    ``slots`` (tables.check_slots): one decode token (q, k [N, H_k, K]) or, with chunk=True, T tokens
    (q, k [N, T, H_k, K])."""
    check_pages(tables, pages)
    check_slots(slots, pages)
    heads, key_dim, value_dim = tables.num_heads, tables.key_dim, tables.value_dim
    rows, dims = slots.shape[0], "N, T" if chunk else "N"
    if q.dim() != (4 if chunk else 3) or q.shape[0] != rows or q.shape[-1] != key_dim or k.shape != q.shape:
        raise ValueError(f"q and k must have shape [{dims}, H_k, K] with N={rows} (len(slots)), K={key_dim}; "
                         f"got {list(q.shape)} and {list(k.shape)}")
    lead = list(q.shape[:-2])
    if heads % q.shape[-2] != 0:
        raise ValueError(f"the layer's {heads} value heads must be a multiple of q/k's {q.shape[-2]} heads")
    if list(v.shape) != [*lead, heads, value_dim]:
        raise ValueError(f"v must have shape [{dims}, H, V] = {[*lead, heads, value_dim]}, "
                         f"got {list(v.shape)}")
    if list(g.shape) not in ([*lead, heads], [*lead, heads, key_dim]):
        raise ValueError(f"g must have shape [{dims}, H] (GDN) or [{dims}, H, K] (KDA) = {[*lead, heads]} / "
                         f"{[*lead, heads, key_dim]}, got {list(g.shape)}")
    if list(beta.shape) != [*lead, heads]:
        raise ValueError(f"beta must have shape [{dims}, H] = {[*lead, heads]}, got {list(beta.shape)}")


def check_states(tables: FormatTables, pages: Pages, slots: torch.Tensor, states: torch.Tensor) -> None:
    """ValueError unless ``states`` is [N, H, K, V] for the N rows of ``slots`` (the boundary pack)."""
    check_pages(tables, pages)
    check_slots(slots, pages)
    expected = (slots.shape[0], tables.num_heads, tables.key_dim, tables.value_dim)
    if tuple(states.shape) != expected:
        raise ValueError(f"states must have shape [N, H, K, V] = {list(expected)}, got {list(states.shape)}")


# ---------------------------------------------------------------- on a pool layer (pool.PackedLayer)

def naive_packed_decode(layer, slots: torch.Tensor, q, k, v, g, beta, **options) -> torch.Tensor:
    """:func:`naive_decode` on a pool.PackedLayer's tables and pages (after its pending writeback)."""
    layer.wait_writes()
    return naive_decode(layer.tables, layer.pages, slots, q, k, v, g, beta, **options)


def naive_pack_states(layer, slots: torch.Tensor, states: torch.Tensor) -> None:
    """:func:`naive_pack` on a pool.PackedLayer."""
    layer.wait_writes()
    naive_pack(layer.tables, layer.pages, slots, states)


def naive_unpack_states(layer, slots: torch.Tensor) -> torch.Tensor:
    """:func:`naive_unpack` on a pool.PackedLayer."""
    layer.wait_writes()
    return naive_unpack(layer.tables, layer.pages, slots)
