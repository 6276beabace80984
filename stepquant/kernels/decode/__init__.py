"""Packed-state decode step (GDN and KDA): fused Triton kernel (fused.py) and torch reference (naive.py).

:func:`decode_step_packed` is what a cache integration calls once per layer and token: it runs the
Triton kernel when the pool lives on a CUDA device and the torch reference otherwise, updating the
slots in place and returning the readout.
"""

from __future__ import annotations

import torch

from stepquant.pool import PackedLayer

from .fused import PARTS, fused_pack_states, fused_packed_decode, fused_packed_decode_split
from .naive import naive_pack_states, naive_packed_decode, naive_unpack_states

__all__ = [
    "PARTS",
    "decode_step_packed",
    "fused_packed_decode_split",
    "fused_pack_states",
    "fused_packed_decode",
    "naive_pack_states",
    "naive_packed_decode",
    "naive_unpack_states",
    "pack_states",
]


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
) -> torch.Tensor:
    """One decode token on packed states, in place; y [N, H, V] (see fused_packed_decode for shapes)."""
    fn = fused_packed_decode if layer.codes.is_cuda else naive_packed_decode
    return fn(layer, slots, q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm, out=out)


def pack_states(layer: PackedLayer, slots: torch.Tensor, states: torch.Tensor) -> None:
    """Quantize float states [N, H, K, V] into ``slots`` (Triton on CUDA, torch elsewhere)."""
    fn = fused_pack_states if layer.codes.is_cuda else naive_pack_states
    fn(layer, slots, states)
