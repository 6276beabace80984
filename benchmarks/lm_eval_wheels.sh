#!/usr/bin/env bash
# Put lm-eval 0.4.13 and every package it needs that the H200 image lacks into .whl/lm_eval/ (git-ignored:
# /.whl/ in .gitignore), as CPython 3.12 / x86-64 wheels, for benchmarks/gpu_tasks.sh: the GPU machine has
# no internet and no lm-eval, and the wrapper's CUDA path (stepquant/tasks/harness.py) can only be checked
# there. Needs pip access to PyPI. Then checks the set, twice:
#
# 1. benchmarks/lm_eval_deps.py walks the wheels' requirements: each is a carried wheel (its version checked)
#    or in the image's package list (versions checked where known; the others are printed as unverified);
# 2. the import check (NO_SIMULATE=1 skips it, ~30 s): the wheels installed into /tmp/lmeval_check, this
#    machine's copies of the image's packages linked beside them (huggingface-hub, httpx and httpcore
#    installed at the image's versions instead), and `stepquant tasks` run on the CPU with `python3 -S`, i.e.
#    with nothing else on the path (Python 3.11 here, 3.12 there: the carried wheels are pure Python).
#
# lm-eval's wheel is 9 MB of task definitions (lm_eval/tasks/*/, for hub tasks that cannot run offline);
# the GPU upload is capped at 64 MiB and the tracked tree is ~55 MiB, so lm-eval is carried slim
# (lm_eval-0.4.13-0slim-py3-none-any.whl: the package without those folders; the offline tasks of
# stepquant/tasks/lm_eval_tasks/ do not need them). Three packages publish no wheel (rouge-score,
# sqlitedict, word2number): built here from their sdists (pure Python).
#
#   bash benchmarks/lm_eval_wheels.sh            # then: OUT=DIR bash benchmarks/gpu_tasks.sh on the GPU
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl/lm_eval
# lm-eval's requirements (no extras) minus the image's packages, at the versions tested here. datasets 5.0.1
# rather than 5.2: it accepts the image's huggingface-hub 1.33 and httpx (5.1+ want hub >= 1.31 with httpx2)
# and pyarrow >= 21 (5.1+ want >= 24; the image's pyarrow version is not known here).
WHEELS="lm-eval==0.4.13 datasets==5.0.1 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19
    pytablewriter==1.2.1 dataproperty==1.1.1 mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5
    tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1 pytz==2026.6 nltk==3.10.4 defusedxml==0.7.1
    more-itertools==11.2.1"
SDISTS="rouge-score==0.1.2 sqlitedict==2.1.0 word2number==1.1"
SIM_PINS="huggingface-hub==1.33.0 httpx==0.28.1 httpcore==1.0.9"  # the image's, for the import check only
PLATFORM="--python-version 3.12 --implementation cp --platform manylinux2014_x86_64"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$DEST"
mkdir -p "$DEST"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: $PLATFORM -d "$work/dl" $WHEELS
# shellcheck disable=SC2086
python3 -m pip wheel -q --no-deps -w "$work/dl" $SDISTS
# lm-eval without lm_eval/tasks/*/ (the RECORD keeps the remaining files' lines)
python3 - "$work"/dl/lm_eval-0.4.13-py3-none-any.whl "$DEST/lm_eval-0.4.13-0slim-py3-none-any.whl" <<'EOF'
import re, sys, zipfile
src, dst = sys.argv[1:]
dropped = re.compile(r"lm_eval/tasks/[^/]+/")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if dropped.match(item.filename):
            continue
        data = zin.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(True) if not dropped.match(line.decode()))
        zout.writestr(item, data)
EOF
rm "$work"/dl/lm_eval-0.4.13-py3-none-any.whl
mv "$work"/dl/*.whl "$DEST"/
ls -l "$DEST"
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(du -ch "$DEST"/*.whl | tail -n 1 | cut -f1) in $DEST"
if git ls-files --others --exclude-standard "$DEST" | grep -q .; then
    echo "warning: $DEST is not git-ignored: add /.whl/ to .gitignore or .git/info/exclude" >&2
fi

echo "== requirements of lm-eval vs the carried wheels and the image's packages"
python3 benchmarks/lm_eval_deps.py wheels "$DEST"

[ -z "${NO_SIMULATE:-}" ] || exit 0
echo "== import check: the carried wheels + this machine's copies of the image's packages, nothing else"
check=/tmp/lmeval_check
rm -rf "$check" "$check.image"
python3 -m pip install -q --no-index --no-deps --target "$check" $PLATFORM --only-binary=:all: "$DEST"/*.whl
# shellcheck disable=SC2086
python3 -m pip install -q --no-deps --target "$check.image" $SIM_PINS
python3 benchmarks/lm_eval_deps.py simulate "$check.image"
PYTHONPATH="$check:$check.image:$PWD" python3 -S - <<'EOF'
import sys, tempfile
import datasets, evaluate, huggingface_hub, lm_eval
from lm_eval import simple_evaluate  # noqa: F401
from stepquant.cli import main
print("imports:", ", ".join(f"{m.__name__} {m.__version__} ({m.__file__.split('/')[2]})"
                            for m in (lm_eval, datasets, evaluate, huggingface_hub)))
with tempfile.TemporaryDirectory() as out:
    code = main(["tasks", "--model", "gdn", "--methods", "fp32,int6", "--limit", "2", "--batch-size", "2",
                 "--decode-context", "4", "--threads", "1", "--no-plots", "--out", out])
lazy = sorted(m for m in ("nltk", "rouge_score", "sqlitedict", "word2number", "pytablewriter") if m in sys.modules)
print("stepquant tasks exit", code, "| lazily imported packages that ran:", ", ".join(lazy) or "none")
sys.exit(code)
EOF
echo "import check passed"
