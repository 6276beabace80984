"""Deferred fitting on packed states (the format of stepquant.codecs.deferred, served by the CUDA kernel's
parts): the readout from the codes every token, the fit and writeback every R-th token.

A request's deferred state is its slot (the codes of the last fit) plus :class:`DeferredBuffers`: the log
decay accumulated since that fit (GDN [N, H], KDA [N, H, K], FP32) and the updates since, (k_j, u_j) FP16,
kept decayed to the last token (GDN scales u_j by each token's gate, KDA k_j by its per-row gates), so
S = e^{g_sum} . dequant(codes) + sum_j k_j u_j^T. One token, every row of the batch on the same cadence:

    g_sum += g;  pending decayed by g;  b_k, b_q = sum_j (k_j . k) u_j, sum_j (k_j . q) u_j   (torch)
    readout part with gate g_sum and v - b_k:   u = beta (v - S^T k), y = S^T q + (k . q) u  (+ b_q)
    the R-th token: writeback part with gate g_sum, u and the pending updates -> new codes; buffers reset
    otherwise:      (k, u) appended to the pending updates

q and k are normalized here (stepquant.recurrence.prepare_qk) and enter the kernel as they are, so the
pending k_j are the kernel's. The buffer terms are a few batched torch ops per token (fusing them into the
readout is the obvious next step; docs/kernels.md, "Deferred fitting").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stepquant.kernels.tables import FormatTables, Pages
from stepquant.recurrence import prepare_qk

from . import cuda


@dataclass
class DeferredBuffers:
    """What a batch's deferred states hold beside their slots (see module docstring)."""

    every: int
    g_sum: torch.Tensor   # [N, H] (GDN) or [N, H, K] (KDA) FP32
    pend_k: torch.Tensor  # [N, H, R - 1, K] FP16
    pend_u: torch.Tensor  # [N, H, R - 1, V] FP16
    age: int = 0          # pending updates held (0 right after a fit)

    @classmethod
    def empty(cls, tables: FormatTables, num_rows: int, every: int, kda: bool) -> DeferredBuffers:
        if isinstance(every, bool) or not isinstance(every, int) or every < 2:
            raise ValueError(f"a deferred state fits every R >= 2 tokens, got every={every!r}")
        heads, key_dim, value_dim = tables.num_heads, tables.key_dim, tables.value_dim
        device = tables.device
        g_sum = torch.zeros(num_rows, heads, *((key_dim,) if kda else ()), device=device)
        pend_k = torch.zeros(num_rows, heads, every - 1, key_dim, dtype=torch.float16, device=device)
        pend_u = torch.zeros(num_rows, heads, every - 1, value_dim, dtype=torch.float16, device=device)
        return cls(every, g_sum, pend_k, pend_u)

    def clear(self) -> None:
        self.g_sum.zero_()
        self.age = 0


def decode_deferred(tables: FormatTables, pages: Pages, slots: torch.Tensor, q, k, v, g, beta,
                    buffers: DeferredBuffers, *, scale: float | None = None,
                    use_qk_l2norm: bool = False) -> torch.Tensor:
    """One decode token on deferred packed states (CUDA kernel parts); y [N, H, V] FP32. Fits (writes the
    slots) when ``buffers`` already holds R - 1 pending updates, else appends this token's."""
    heads = tables.num_heads
    kda = g.dim() == 3
    if buffers.g_sum.shape != g.shape:
        raise ValueError(f"buffers were made for g of shape {list(buffers.g_sum.shape)}, got {list(g.shape)}")
    b_q, b_k = prepare_qk(q.float(), k.float(), scale=scale, use_qk_l2norm=use_qk_l2norm,
                          mode="kda" if kda else "gdn")
    group = heads // b_k.shape[1]
    if group > 1:  # one q/k head per group of value heads
        b_q, b_k = b_q.repeat_interleave(group, 1), b_k.repeat_interleave(group, 1)
    g = g.float().to(buffers.g_sum.device)
    buffers.g_sum += g
    v = v.float()
    age = buffers.age
    if age:
        decay = torch.exp(g)
        pend_k, pend_u = buffers.pend_k[:, :, :age], buffers.pend_u[:, :, :age]
        if kda:
            pend_k.mul_(decay[:, :, None, :])
        else:
            pend_u.mul_(decay[:, :, None, None])
        qk = torch.stack((b_k, b_q), dim=2)                                        # [N, H, 2, K]
        dots = torch.matmul(qk, pend_k.float().transpose(-1, -2))                  # [N, H, 2, age]
        terms = torch.matmul(dots, pend_u.float())                                 # [N, H, 2, V]
        v = v - terms[:, :, 0]
    work = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    y = cuda.decode(tables, pages, slots, b_q, b_k, v, buffers.g_sum, beta, scale=1.0, part="readout",
                    work=work)
    if age:
        y += terms[:, :, 1]
    if age == buffers.every - 1:
        cuda.decode(tables, pages, slots, b_q, b_k, v, buffers.g_sum, beta, scale=1.0, out=y,
                    part="writeback", work=work, pending=(buffers.pend_k, buffers.pend_u))
        buffers.clear()
    else:
        buffers.pend_k[:, :, age] = b_k
        buffers.pend_u[:, :, age] = work
        buffers.age = age + 1
    return y
