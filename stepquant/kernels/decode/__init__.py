"""Packed-state decode step (GDN and KDA): CUDA kernel (cuda.py + packed_step.cu), Triton kernel (fused.py)
and torch reference (naive.py), all with one signature.

:func:`decode_step_packed` is what a cache integration calls once per layer and token: on a CUDA device
it runs the CUDA kernel where it serves the layer (V = 128, K a multiple of 16, nvcc at first use) and the
Triton kernel otherwise; elsewhere the torch reference. It updates the slots in place and returns the
readout. :func:`pack_states` (the boundary pack after a prefill) dispatches the same way.
"""

from __future__ import annotations

import torch

from stepquant.pool import PackedLayer

from . import cuda
from .fused import PARTS, fused_pack_states, fused_packed_decode
from .naive import naive_pack_states, naive_packed_decode, naive_unpack_states

BACKENDS = ("cuda", "triton", "torch")

__all__ = [
    "BACKENDS",
    "PARTS",
    "backend_for",
    "cuda",
    "decode_step_packed",
    "decode_step_split",
    "fused_pack_states",
    "fused_packed_decode",
    "naive_pack_states",
    "naive_packed_decode",
    "naive_unpack_states",
    "pack_states",
]


def backend_for(layer: PackedLayer) -> str:
    """The implementation decode_step_packed and pack_states use for a layer: "cuda", "triton" or "torch"."""
    if not layer.codes.is_cuda:
        return "torch"
    return "cuda" if cuda.supported(layer) else "triton"


def decode_step_packed(
    layer: PackedLayer,
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
    """One decode token on packed states, in place; y [N, H, V] (see fused_packed_decode for shapes).

    backend: "cuda", "triton" or "torch"; default :func:`backend_for` (the fastest that serves the layer).
    """
    backend = backend_for(layer) if backend is None else backend
    layer.wait_writes()
    fns = {"cuda": cuda.packed_decode, "triton": fused_packed_decode, "torch": naive_packed_decode}
    fn = fns.get(backend)
    if fn is None:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    return fn(layer, slots, q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, out=out)


def pack_states(layer: PackedLayer, slots: torch.Tensor, states: torch.Tensor) -> None:
    """Quantize float states [N, H, K, V] into ``slots`` (the backend of :func:`backend_for`)."""
    layer.wait_writes()
    fns = {"cuda": cuda.pack_states, "triton": fused_pack_states, "torch": naive_pack_states}
    fns[backend_for(layer)](layer, slots, states)


def decode_step_split(
    layer: PackedLayer,
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
) -> torch.Tensor:
    """The paper's split step (CUDA kernel): the readout on the current stream, the requantize + writeback
    on ``stream``, starting from the u the readout left in a work buffer.

    Returns y, ready in the current stream's order. The writeback's completion is recorded on the layer
    (``layer.pending``): the next decode, pack, gather, scatter or zero of this layer first makes the
    current stream wait for it, so no step reads a slot before its writeback finished; later layers of the
    same token do not wait.
    """
    if not cuda.supported(layer):
        raise ValueError("decode_step_split runs the CUDA kernel's parts: the layer must be on a CUDA device "
                         "with V = 128 and K a multiple of 16, and nvcc must be at hand")
    layer.wait_writes()  # the previous token's writeback of this layer (and of its work buffer)
    current = torch.cuda.current_stream(layer.device)
    q, k, v, g, beta = (cuda._as_input(t, layer.device) for t in (q, k, v, g, beta))
    slots = slots.to(layer.device, torch.int32).contiguous()
    work = torch.empty(v.shape, dtype=torch.float32, device=layer.device)
    kwargs = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, work=work)
    y = cuda.packed_decode(layer, slots, q, k, v, g, beta, out=out, part="readout", **kwargs)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        cuda.packed_decode(layer, slots, q, k, v, g, beta, out=y, part="writeback", **kwargs)
    for t in (slots, q, k, v, g, beta, work):
        t.record_stream(stream)  # the caller may drop them before the side stream is done
    done = torch.cuda.Event()
    done.record(stream)
    layer.pending = done
    return y
