#!/usr/bin/env bash
# Stage 2 of the shipped KDA model on one H200: continue from its stage-1 checkpoint (then models/kda;
# INIT: an unpacked checkpoint directory, e.g. from stepquant.models.checkpoint)
# on fla's chunk_kda when its backward runs on this GPU (checked first), else on transformers'
# PyTorch path. (The GDN model has one stage: the 64 MiB a device call may carry does not hold
# both checkpoints, the text and the transformers wheel.) See stepquant/assets/models/*/README.md;
# scripts/ship_model.py turns the result into the shipped form.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/transformers-*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla .whl/fla_core-*.whl || exit 1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-330}
INIT=${INIT:-models/kda}
KDA_PATH=/tmp/site
KDA_BATCH=4
if PYTHONPATH=/tmp/site:/tmp/fla timeout 120 python3 -c "
import torch
from fla.ops.kda import chunk_kda
B,T,H,K=2,256,4,128
q,k,v=(torch.randn(B,T,H,K,device='cuda',dtype=torch.bfloat16,requires_grad=True) for _ in range(3))
g=(-torch.rand(B,T,H,K,device='cuda')*0.1).requires_grad_()
b=torch.rand(B,T,H,device='cuda',dtype=torch.bfloat16).requires_grad_()
o,_=chunk_kda(q,k,v,g,b,use_qk_l2norm_in_kernel=True)
o.float().pow(2).sum().backward(); torch.cuda.synchronize()
assert torch.isfinite(q.grad).all() and torch.isfinite(g.grad).all()
print('fla chunk_kda forward+backward ran')
"; then KDA_PATH=/tmp/site:/tmp/fla; KDA_BATCH=8; fi
echo "KDA PYTHONPATH=$KDA_PATH"
PYTHONPATH=$KDA_PATH python3 scripts/train_model.py --arch kda --init-from "$INIT" --out /tmp/models/kda \
  --batch $KDA_BATCH --time-budget "$BUDGET" --warmup 30 --lr 1.5e-3 > "$OUT/kda.log" 2>&1 ||
PYTHONPATH=/tmp/site python3 scripts/train_model.py --arch kda --init-from "$INIT" --out /tmp/models/kda \
  --batch 4 --time-budget $((BUDGET / 2)) --warmup 30 --lr 1.5e-3 > "$OUT/kda_torch.log" 2>&1
tar -C /tmp -cf /tmp/models.tar models && split -b 15M /tmp/models.tar "$OUT/models.tar.part-"
tail -n 3 "$OUT/kda.log"
