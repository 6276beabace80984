"""GPU kernels on packed states (docs/kernels.md): one folder per op, a Triton kernel beside its torch
reference with the same signature.

- ``decode``: the fused decode step (dequantize + gated delta update + readout + requantize + write back,
  in place on pool slots), its split readout / writeback parts, and the boundary pack.
- ``prefill``: unpack -> chunked float kernel (fla when available) -> pack, for prompts and chunks.
"""
