"""stepquant: low-bit compression of the recurrent state of delta-rule linear-attention LLMs.

Gated DeltaNet (Qwen3-Next / Qwen3.5) and Kimi Delta Attention (Kimi-Linear) keep a d_k x d_v
state per head that every decode token reads and rewrites. stepquant stores it in 4-6 bits
(STEPQuant: lifetime-aware mixed precision, FP16 pivots, key-row-aware dual-axis fitting) with
the baselines it is judged against, and serves it from packed GPU memory.
"""

__version__ = "0.1.0"
