"""Smoke test of a non-editable install: run from outside the checkout, in the venv the wheel went into.

Loads the shipped GDN model (weights unpacked from the installed package into $STEPQUANT_CACHE and
sha256-checked), a shipped plan and a shipped data split, and decodes a few tokens through the plan's
compressed-state cache; prints one JSON line.
"""

import json
import sys
from pathlib import Path

import torch

import stepquant
from stepquant import assets
from stepquant.calibrate import Plan
from stepquant.data import segments
from stepquant.eval.methods import DEFAULT_PLANS_DIR
from stepquant.integrations.hf_cache import CompressedStateCache
from stepquant.models import load

site = Path(stepquant.__file__).resolve().parent
checkout = Path(sys.argv[1]).resolve()
assert checkout not in site.parents, f"stepquant was imported from the checkout ({site}), not the install"
assert DEFAULT_PLANS_DIR.is_relative_to(site) and assets.DATA.is_relative_to(site)
model, tokenizer = load("gdn")
plan = Plan.load(DEFAULT_PLANS_DIR / "gdn" / "stepquant-6", model_config=model.config)
ids = segments("wiki", tokenizer, 1, 40)
cache = CompressedStateCache(model.config, plan)
with torch.inference_mode():
    out = model(input_ids=ids[:, :32], past_key_values=cache, use_cache=True)
    for t in range(32, 40):
        out = model(input_ids=ids[:, t : t + 1], past_key_values=out.past_key_values, use_cache=True)
assert torch.isfinite(out.logits).all()
summary = {"stepquant": str(site), "plan": plan.variant, "bits_per_value": round(plan.bits_per_value(), 4),
           "state_bytes": cache.state_bytes()["bytes_per_request"]}
print(json.dumps(summary))
