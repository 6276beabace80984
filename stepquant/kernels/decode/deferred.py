"""Deferred fitting on packed states (the format of stepquant.codecs.deferred, served by the CUDA kernel's
parts): the readout from the codes every token, the fit and writeback every R-th token.

A request's deferred state is its slot (the codes of the last fit) plus :class:`DeferredBuffers`: the log
decay accumulated since that fit (GDN [N, H], KDA [N, H, K], FP32) and the updates since, (k_j, u_j) FP16,
kept decayed to the last token (GDN scales u_j by each token's gate, KDA k_j by its per-row gates), so
S = e^{g_sum} . dequant(codes) + sum_j k_j u_j^T. GDN's k_j is its q/k head's normalized k, never decayed:
one copy serves the H / HQ value heads of the group (KDA's k_j is per head). One token, every row of the
batch on the same cadence:

    readout part (SQ_PENDING, pending_gate): g_sum += g and the held updates decayed by e^g (both stored
        back), then with gate g_sum: u = beta (v - S^T k), y = S^T q + (k . q) u, where S^T k and S^T q take
        the pending terms sum_j (k . k_j) u_j, sum_j (q . k_j) u_j (warp reductions of the dots, then one
        FP16 load per pending update and column); it appends this token's (k, u) in FP16
    the R-th token: the fused step (SQ_PENDING, pending_gate) in one pass: the same, no append, then sum_j
        k_j u_j^T added to X, the codes fitted with gate g_sum, and g_sum stored as 0 (fit="split": the
        readout part, then the writeback part from its u, the first versions' way)

One launch per token. (The first version, 496bde0, computed the pending terms as batched torch ops around the
plain readout: 2-3x the readout's own time; the second, b866649, kept the gate sum and the decay as two torch
ops, gates="torch"; docs/kernels.md, "Deferred fitting".)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stepquant.codecs.deferred import check_every, check_key_heads
from stepquant.kernels.tables import FormatTables, Pages

from . import cuda


@dataclass
class DeferredBuffers:
    """What a batch's deferred states hold beside their slots (see module docstring)."""

    every: int
    g_sum: torch.Tensor   # [N, H] (GDN) or [N, H, K] (KDA) FP32
    pend_k: torch.Tensor  # [N, HK, R - 1, K] FP16; HK = HQ (GDN, the q/k heads) or H (KDA)
    pend_u: torch.Tensor  # [N, H, R - 1, V] FP16
    age: int = 0          # pending updates held (0 right after a fit)

    @classmethod
    def empty(cls, tables: FormatTables, num_rows: int, every: int, kda: bool,
              key_heads: int) -> DeferredBuffers:
        """Zeroed buffers for ``num_rows`` batch rows; key_heads: the layer's q/k heads HQ."""
        check_every(every)
        heads, key_dim, value_dim = tables.num_heads, tables.key_dim, tables.value_dim
        check_key_heads(heads, key_heads)
        device = tables.device
        g_sum = torch.zeros(num_rows, heads, *((key_dim,) if kda else ()), device=device)
        pend_k = torch.zeros(num_rows, cuda.key_heads_of_pending(tables, key_heads, kda), every - 1, key_dim,
                             dtype=torch.float16, device=device)
        pend_u = torch.zeros(num_rows, heads, every - 1, value_dim, dtype=torch.float16, device=device)
        return cls(every, g_sum, pend_k, pend_u)

    def clear(self) -> None:
        self.g_sum.zero_()
        self.age = 0

    @property
    def bytes_per_row(self) -> int:
        """What one batch row holds here: the gate sum (FP32) and R - 1 pending (k, u) pairs (FP16)."""
        return sum(t[0].numel() * t.element_size() for t in (self.g_sum, self.pend_k, self.pend_u))

    def state(self, fitted: torch.Tensor) -> torch.Tensor:
        """The whole state [N, H, K, V] FP32 from the last fit's dequantized codes ``fitted``:
        e^{g_sum} fitted + sum_j k_j u_j^T over the held updates (what a multi-token call starts from)."""
        decay = torch.exp(self.g_sum[..., None] if self.g_sum.dim() == 3 else self.g_sum[..., None, None])
        k, u = (t[:, :, :self.age].float() for t in (self.pend_k, self.pend_u))
        k = k.repeat_interleave(u.shape[1] // k.shape[1], dim=1)  # GDN: a q/k head's k_j to its value heads
        return fitted * decay + torch.einsum("nhjk,nhjv->nhkv", k, u)

    def reorder(self, rows: torch.Tensor) -> None:
        """Row r takes row rows[r]'s buffers (beam search; the slots' contents move alike)."""
        rows = rows.to(self.g_sum.device, torch.int64)
        for name in ("g_sum", "pend_k", "pend_u"):
            setattr(self, name, getattr(self, name).index_select(0, rows).contiguous())


def decode_deferred(tables: FormatTables, pages: Pages, slots: torch.Tensor, q, k, v, g, beta,
                    buffers: DeferredBuffers, *, scale: float | None = None, use_qk_l2norm: bool = False,
                    out: torch.Tensor | None = None, fit: str = "fused",
                    gates: str = "kernel") -> torch.Tensor:
    """One decode token on deferred packed states (CUDA kernel parts); y [N, H, V]. Fits (writes the slots)
    when ``buffers`` already holds R - 1 pending updates, else appends this token's. Inputs as
    cuda.decode's. fit: "fused" (one pass) or "split" (readout, then writeback). gates: "kernel" (the
    kernel sums the gate and decays the held updates: one launch per token) or "torch" (two small torch ops
    before it, the first versions' way). Every batch row is on the same cadence: a row skipped (slot -1)
    within a cycle loses its deferred state."""
    if fit not in ("fused", "split") or gates not in ("kernel", "torch"):
        raise ValueError(f"fit must be 'fused' or 'split' and gates 'kernel' or 'torch', got {fit!r}, "
                         f"{gates!r}")
    if buffers.g_sum.shape != g.shape:
        raise ValueError(f"buffers were made for g of shape {list(buffers.g_sum.shape)}, got {list(g.shape)}")
    age = buffers.age
    gate, gate_sum = g, buffers.g_sum  # this token's gate for the kernel, and the sum it carries on
    if gates == "torch":
        g = g.to(buffers.g_sum.device, torch.float32)
        buffers.g_sum += g
        if age:  # the held updates decayed to this token: KDA's k_j by its row gates, GDN's u_j by its gate
            if g.dim() == 3:
                buffers.pend_k[:, :, :age].mul_(torch.exp(g)[:, :, None, :])
            else:
                buffers.pend_u[:, :, :age].mul_(torch.exp(g)[:, :, None, None])
        gate, gate_sum = buffers.g_sum, None
    fits = age == buffers.every - 1
    pending = (buffers.pend_k, buffers.pend_u)
    one_pass = fits and fit == "fused"
    split = fits and not one_pass
    work = torch.empty(v.shape, dtype=torch.float32, device=buffers.g_sum.device) if split else None
    y = cuda.decode(tables, pages, slots, q, k, v, gate, beta, scale=scale,
                    use_qk_l2norm=use_qk_l2norm, out=out, part="fused" if one_pass else "readout", work=work,
                    pending=pending, pending_count=age, pending_append=-1 if fits else age,
                    pending_gate=gate_sum)
    if split:  # the readout stored the summed gate (gates="kernel") and decayed the held updates
        cuda.decode(tables, pages, slots, q, k, v, buffers.g_sum, beta, scale=scale,
                    use_qk_l2norm=use_qk_l2norm, out=y, part="writeback", work=work, pending=pending)
    if not fits:
        buffers.age = age + 1
    elif one_pass and gates == "kernel":
        buffers.age = 0  # the fused fit stored a zero gate sum
    else:
        buffers.clear()
    return y
