#!/usr/bin/env bash
# Fill .whl/ for a device call: fla-core (the FP32 baseline and the prefill kernels) and the slim
# transformers tree (slim_transformers.sh). .whl/ is ignored by git, so a fresh checkout has none: run this
# once before the first device call of a session (h200_run.sh, ab_cuda_source.py, gpu_tasks.sh carry
# ".whl"). Needs pip access to PyPI; about 3 MiB.
#
#   bash benchmarks/device_wheels.sh            (FLA_VERSION=0.6.0 by default: the version of the committed runs)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "fla-core==${FLA_VERSION:-0.6.0}"
bash benchmarks/slim_transformers.sh
du -ch .whl/* | tail -n 1
ls .whl
