#!/usr/bin/env bash
# Train both shipped models at once on one H200 (run through the device tool; see stepquant/assets/models/*/README.md;
# scripts/ship_model.py turns each result into the shipped form).
# transformers 5.23 is carried as a wheel in .whl/; fla is deliberately NOT installed so that
# transformers uses its PyTorch chunked path (fla 0.6.0 refuses the GDN chunk backward on Hopper
# with Triton < 3.7.1). Outputs are split into <16 MiB parts under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/transformers-*.whl || exit 1
export PYTHONPATH=/tmp/site PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-300}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 scripts/train_model.py --arch gdn --out /tmp/models/gdn --time-budget "$BUDGET" > "$OUT/gdn.log" 2>&1 &
gdn=$!
python3 scripts/train_model.py --arch kda --out /tmp/models/kda --batch 4 --lr 1.5e-3 --time-budget "$BUDGET" \
  > "$OUT/kda.log" 2>&1
wait $gdn
tar -C /tmp -cf /tmp/models.tar models && split -b 15M /tmp/models.tar "$OUT/models.tar.part-"
tail -n 3 "$OUT/gdn.log" "$OUT/kda.log"
nvidia-smi --query-gpu=memory.used --format=csv,noheader
