"""Test-session set-up: run Triton kernels in the CPU interpreter unless told otherwise.

TRITON_INTERPRET must be set before anything imports triton, so it lives here rather than in a test
module. On the GPU machine benchmarks/h200_run.sh sets TRITON_INTERPRET=0 and this leaves it alone.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("STEPQUANT_UNTUNED_TRITON") == "1":  # GPU runs: fla's prefill without minutes of autotuning
    from stepquant.kernels.prefill import untuned_triton_autotune

    untuned_triton_autotune()
