#!/usr/bin/env bash
# Sourced by the device scripts (h200_run.sh, deferred_run.sh, gpu_tasks.sh, quantizer_ablation.sh): `carried_wheels [MORE...]`
# installs the wheels a device call carries under .whl/ (benchmarks/device_wheels.sh fills it), and any further
# wheel files given as arguments, into /tmp/site without the index or dependencies, unpacks each package tree
# packed as .whl/*.tgz there (transformers cut down to the shipped families: benchmarks/slim_transformers.sh),
# and puts the repository, then /tmp/site, first on PYTHONPATH. Run from the repository root. `has_cuda` says
# whether torch sees a CUDA GPU (the exit status).
has_cuda() {
    python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
}
carried_wheels() {
    local wheels=() wheel tree
    for wheel in .whl/*.whl "$@"; do [ -e "$wheel" ] && wheels+=("$wheel"); done
    if [ ${#wheels[@]} -gt 0 ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "${wheels[@]}" \
            2>&1 | tail -n 3
    fi
    for tree in .whl/*.tgz; do
        [ -e "$tree" ] || continue
        mkdir -p /tmp/site && tar xzf "$tree" -C /tmp/site
    done
    export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}"
}
