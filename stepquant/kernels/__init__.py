"""GPU kernels on packed states (docs/kernels.md): one folder per op, a Triton kernel beside its torch
reference with the same signature, all taking tensors: ``(tables, pages, slots, ...)``.

- ``tables``: a layer's FormatTables (built once from its LayerFormat) and Pages (its packed slots), what
  every kernel reads; any engine's pool can hold them (stepquant.pool is one user).
- ``decode``: the fused decode step (dequantize + gated delta update + readout + requantize + write back,
  in place on the slots), its split readout / writeback parts, and the boundary pack.
- ``prefill``: unpack -> chunked float kernel (fla when available) -> pack, for prompts and chunks.
"""
