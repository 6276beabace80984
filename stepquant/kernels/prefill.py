"""Prefill / boundary step on packed states: unpack, run a chunked kernel over the prompt, pack the result.

Decode keeps every request's state packed; a prefill (or any multi-token chunk) instead runs the
float chunk kernel over T tokens and only its final state is stored. This helper is that boundary:

1. unpack the active slots' states to FP32 [N, H, K, V] (zeros for new requests);
2. run fla's ``chunk_gated_delta_rule`` (GDN) / ``chunk_kda`` (KDA) when fla is importable and the
   tensors are on CUDA, else stepquant.recurrence.gated_delta_rule (the float reference);
3. quantize + pack the boundary states into the slots (the Triton pack kernel on CUDA, the torch codec
   elsewhere; both produce the same words, tests/test_kernels.py).

:func:`prefill` takes the layer's tables and pages (stepquant.kernels.tables), :func:`prefill_packed` a
``pool.PackedLayer``.
"""

from __future__ import annotations

import torch

from stepquant.kernels.decode import naive_unpack, pack
from stepquant.kernels.decode.naive import check_token_inputs
from stepquant.kernels.tables import FormatTables, Pages
from stepquant.recurrence import expand_key_heads, gated_delta_rule


def untuned_triton_autotune() -> None:
    """Make every Triton autotuner run its first configuration instead of benchmarking them all.

    fla's chunk kernels (the prefill) autotune a dozen configurations per kernel on their first call:
    minutes of compilation on a fresh machine (the KDA prefill of tests/test_gpu_serving.py once spent
    more than six minutes there). The GPU tests and bench_generate.py call this when
    STEPQUANT_UNTUNED_TRITON=1 (benchmarks/h200_run.sh sets it): results are the same up to the order of
    float sums, only the speed of autotuned kernels is untuned. fla's recurrent decode kernels (the FP32
    baselines of the benchmarks) are not autotuned, so their timings are unaffected.
    """
    from triton.runtime.autotuner import Autotuner

    if getattr(Autotuner.run, "_stepquant_untuned", False):
        return
    run = Autotuner.run

    def first_config_run(self, *args, **kwargs):
        if len(self.configs) > 1:
            self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    first_config_run._stepquant_untuned = True
    Autotuner.run = first_config_run


def _fla_chunk(mode: str):
    try:
        if mode == "kda":
            from fla.ops.kda import chunk_kda as fn
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    except Exception:  # fla missing or built for another torch/triton: use the torch reference
        return None
    return fn


def prefill(
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
    from_state: bool = True,
    use_fla: bool | None = None,
) -> torch.Tensor:
    """Run T tokens for N requests and pack their final states into ``slots``; returns o [N, T, H, V].

    slots int [N] (-1: skip the row; its output is zeros); q, k [N, T, H_k, K]; v [N, T, H, V];
    g [N, T, H] (GDN) or [N, T, H, K] (KDA) log decays; beta [N, T, H]. from_state=False starts from the
    zero state (a new request) instead of the slot's current state. use_fla: None = when available.
    """
    check_token_inputs(tables, pages, slots, q, k, v, g, beta, chunk=True)
    mode = "kda" if g.dim() == 4 else "gdn"
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    active = torch.nonzero(slots.to(torch.int64) >= 0).flatten()
    if active.numel() == 0:
        return out
    slot_ids = slots.to(torch.int64)[active.to(slots.device)]
    rows = active.to(v.device)
    q, k, v, g, beta = (t[rows] for t in (q, k, v, g, beta))
    if from_state:
        h0 = naive_unpack(tables, pages, slot_ids).to(v.device)
    else:
        h0 = torch.zeros(rows.numel(), tables.num_heads, tables.key_dim, tables.value_dim, device=v.device)
    fn = _fla_chunk(mode) if (use_fla is None or use_fla) and v.is_cuda else None
    if use_fla and fn is None:
        raise RuntimeError("use_fla=True but fla's chunk kernels are not importable on this device")
    if fn is not None:
        # fla's chunk kernels take q/k with as many heads as v: expand grouped key heads first
        q_full, k_full = (expand_key_heads(t, tables.num_heads) for t in (q, k))
        o, final = fn(q_full, k_full, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                      use_qk_l2norm_in_kernel=use_qk_l2norm)
    else:
        o, final = gated_delta_rule(q, k, v, g, beta, h0, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                    output_final_state=True, mode=mode)
    pack(tables, pages, slot_ids.to(torch.int32).to(tables.device), final.to(torch.float32))
    out[rows] = o.to(out.dtype)
    return out


def prefill_packed(layer, slots: torch.Tensor, q, k, v, g, beta, **options) -> torch.Tensor:
    """:func:`prefill` on a pool.PackedLayer's tables and pages (after its pending writeback)."""
    layer.wait_writes()
    return prefill(layer.tables, layer.pages, slots, q, k, v, g, beta, **options)
