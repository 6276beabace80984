#!/usr/bin/env bash
# Pack the installed transformers version as a cut-down source tree, .whl/transformers-<version>-slim.tgz,
# for a device call: the H200 image has an older transformers than stepquant's cache supports, and the
# full wheel (13 MB) does not fit the 64 MiB upload next to both shipped models. Keeps the package minus
# every model family except those the GPU tests load (and what their auto classes import); h200_run.sh
# unpacks .whl/*.tgz ahead of the image's packages. Needs pip access to PyPI (or WHEEL=path/to/wheel).
#
#   bash benchmarks/slim_transformers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
KEEP="auto qwen3_next qwen3_5 qwen3_5_moe kimi_linear encoder_decoder"
version=$(python3 -c "import transformers; print(transformers.__version__)")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheel=${WHEEL:-}
if [ -z "$wheel" ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$work/dl" "transformers==$version"
    wheel=$(ls "$work"/dl/transformers-*.whl)
fi
mkdir -p "$work/tree" .whl
(cd "$work/tree" && python3 -m zipfile -e "$wheel" .)
for dir in "$work"/tree/transformers/models/*/; do
    name=$(basename "$dir")
    case " $KEEP " in *" $name "*) ;; *) rm -rf "$dir" ;; esac
done
out=".whl/transformers-$version-slim.tgz"
tar czf "$out" -C "$work/tree" .
echo "$out: $(du -h "$out" | cut -f1) (model families kept: $KEEP)"
