"""Packed-state decode step (GDN and KDA): CUDA kernel (cuda.py + packed_step.cu), Triton kernel (fused.py)
and torch reference (naive.py), all with one signature: ``(tables, pages, slots, q, k, v, g, beta, ...)``
(stepquant.kernels.tables), so any engine's pool can drive them.

:func:`decode_step` is what a cache integration calls once per layer and token: on a CUDA device it runs
the CUDA kernel where it serves the layer (V = 128, K a multiple of 16, nvcc at first use) and the Triton
kernel otherwise; elsewhere the torch reference. It updates the slots in place and returns the readout.
:func:`pack` (the boundary pack after a prefill) dispatches the same way; :func:`decode_split` is the
paper's split step. ``decode_step_packed``, ``pack_states`` and ``decode_step_split`` run them on a
``pool.PackedLayer`` (its tables and pages, after its pending side-stream writeback). Every backend
checks its slot indices first (tables.check_slots: int32 [N], -1 the only skip value, in range, no slot
twice, allocated when the pages carry the pool's in_use mask).
"""

from __future__ import annotations

import torch

from stepquant.kernels.tables import FormatTables, Pages, check_slots

from . import cuda
from .fused import PARTS, fused_decode, fused_pack, fused_pack_states, fused_packed_decode
from .naive import (
    naive_decode,
    naive_pack,
    naive_pack_states,
    naive_packed_decode,
    naive_unpack,
    naive_unpack_states,
)

BACKENDS = ("cuda", "triton", "torch")

__all__ = [
    "BACKENDS",
    "PARTS",
    "backend_for",
    "cuda",
    "decode_split",
    "decode_step",
    "decode_step_packed",
    "decode_step_split",
    "fused_decode",
    "fused_pack",
    "fused_pack_states",
    "fused_packed_decode",
    "naive_decode",
    "naive_pack",
    "naive_pack_states",
    "naive_packed_decode",
    "naive_unpack",
    "naive_unpack_states",
    "pack",
    "pack_states",
]

_DECODE = {"cuda": cuda.decode, "triton": fused_decode, "torch": naive_decode}
_PACK = {"cuda": cuda.pack, "triton": fused_pack, "torch": naive_pack}


def backend_for(tables: FormatTables) -> str:
    """The implementation decode_step and pack use for a layer: "cuda", "triton" or "torch"."""
    if tables.device.type != "cuda":
        return "torch"
    return "cuda" if cuda.supported(tables) else "triton"


def decode_step(
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
    backend: str | None = None,
) -> torch.Tensor:
    """One decode token on packed states, in place; y [N, H, V] (see fused.fused_decode for shapes).

    backend: "cuda", "triton" or "torch"; default :func:`backend_for` (the fastest that serves the layer).
    """
    backend = backend_for(tables) if backend is None else backend
    fn = _DECODE.get(backend)
    if fn is None:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    return fn(tables, pages, slots, q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, out=out)


def pack(tables: FormatTables, pages: Pages, slots: torch.Tensor, states: torch.Tensor) -> None:
    """Quantize float states [N, H, K, V] into ``slots`` (the backend of :func:`backend_for`)."""
    _PACK[backend_for(tables)](tables, pages, slots, states)


def decode_split(
    tables: FormatTables,
    pages: Pages,
    slots: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    stream: torch.cuda.Stream,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.cuda.Event]:
    """The paper's split step (CUDA kernel): the readout on the current stream, the requantize + writeback
    on ``stream``, starting from the u the readout left in a work buffer.

    Returns y, ready in the current stream's order, and the event that marks the writeback's completion:
    the caller makes every later access of these pages (decode, pack, reads) wait for it.
    """
    if not cuda.supported(tables):
        raise ValueError("decode_split runs the CUDA kernel's parts: the layer must be on a CUDA device "
                         "with V = 128 and K a multiple of 16, and nvcc must be at hand")
    check_slots(slots, pages)  # before the copy to the device, which would hide the caller's dtype
    device = tables.device
    current = torch.cuda.current_stream(device)
    q, k, v, g, beta = (cuda._as_input(t, device) for t in (q, k, v, g, beta))
    slots = slots.to(device).contiguous()
    work = torch.empty(v.shape, dtype=torch.float32, device=device)
    kwargs = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, work=work)
    y = cuda.decode(tables, pages, slots, q, k, v, g, beta, out=out, part="readout", **kwargs)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        cuda.decode(tables, pages, slots, q, k, v, g, beta, out=y, part="writeback", **kwargs)
    for t in (slots, q, k, v, g, beta, work):
        t.record_stream(stream)  # the caller may drop them before the side stream is done
    done = torch.cuda.Event()
    done.record(stream)
    return y, done


# ---------------------------------------------------------------- on a pool layer (pool.PackedLayer)

def decode_step_packed(layer, slots: torch.Tensor, q, k, v, g, beta, **options) -> torch.Tensor:
    """:func:`decode_step` on a pool.PackedLayer's tables and pages (after its pending writeback)."""
    layer.wait_writes()
    return decode_step(layer.tables, layer.pages, slots, q, k, v, g, beta, **options)


def pack_states(layer, slots: torch.Tensor, states: torch.Tensor) -> None:
    """:func:`pack` on a pool.PackedLayer."""
    layer.wait_writes()
    pack(layer.tables, layer.pages, slots, states)


def decode_step_split(layer, slots: torch.Tensor, q, k, v, g, beta, *, stream: torch.cuda.Stream,
                      **options) -> torch.Tensor:
    """:func:`decode_split` on a pool.PackedLayer: the writeback's completion is recorded on the layer
    (``layer.pending``), so the next decode, pack, gather, scatter or zero of this layer first makes the
    current stream wait for it; later layers of the same token do not wait."""
    layer.wait_writes()  # the previous token's writeback of this layer
    y, layer.pending = decode_split(layer.tables, layer.pages, slots, q, k, v, g, beta, stream=stream,
                                    **options)
    return y
