"""Write the model card (stepquant/assets/models/<name>/README.md, loss_curve.png) of a shipped model
from measurements.

    python scripts/model_card.py --model gdn      # ~2-4 minutes on 2 CPU cores
    python scripts/model_card.py --model kda

Measures here, on CPU in FP32: held-out perplexity on each eval stream (the first --chunks
non-overlapping 2048-token chunks of the held-out wiki / sotu / brown streams), a greedy sample, and
the gate half-life census from the calibration statistics in stepquant/assets/plans/<name>/stats.safetensors
(written by `stepquant calibrate`, 32 x 2048 calibration tokens). Training facts come from the
train_log.json that scripts/train_model.py wrote on the GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stepquant import assets  # noqa: E402
from stepquant.calibrate.stats import CalibrationStats, half_life_census  # noqa: E402
from stepquant.data import EVAL_STREAMS, segments  # noqa: E402
from stepquant.models import load, resolve  # noqa: E402

ARCH = {
    "gdn": "Qwen3.5-style hybrid (`Qwen3_5ForCausalLM`): 8 layers, 6 Gated DeltaNet + 2 full attention "
    "(3:1), width 256, 4 key heads and 8 value heads of 128 x 128 state per GDN layer (grouped value heads, "
    "as in Qwen3.5), 4 attention heads with partial RoPE, SwiGLU MLP 768, tied embeddings",
    "kda": "Kimi-Linear-style hybrid (`KimiLinearForCausalLM`): 8 layers, 6 Kimi Delta Attention + 2 MLA "
    "full attention (3:1, no positional encoding as in Kimi-Linear), width 256, 4 KDA heads of 128 x 128 "
    "state per layer with per-channel decay, dense SwiGLU MLP 768 (no MoE), tied embeddings",
}


@torch.no_grad()
def perplexities(model, tokenizer, chunks: int) -> dict[str, float]:
    out = {}
    for stream in EVAL_STREAMS:
        x = segments(stream, tokenizer, chunks, 2048)
        losses = [model(input_ids=x[i : i + 1], labels=x[i : i + 1]).loss.item() for i in range(chunks)]
        out[stream] = math.exp(sum(losses) / len(losses))
    return out


def loss_curve(logs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    offset = 0
    for n, log in enumerate(logs, 1):
        tokens = [offset + p["tokens"] / 1e6 for p in log["loss_curve"]]
        ax.plot(tokens, [p["loss"] for p in log["loss_curve"]], label=f"stage {n}")
        offset = tokens[-1]
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("train loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gdn", "kda"], required=True)
    parser.add_argument("--chunks", type=int, default=4, help="2048-token chunks per eval stream")
    args = parser.parse_args()
    started = time.time()
    path = resolve(args.model)
    model, tokenizer = load(args.model)
    params = sum(p.numel() for p in model.parameters())

    log = json.loads((path / "train_log.json").read_text())
    stages = [log["previous_stage"], log] if log.get("previous_stage") else [log]
    loss_curve(stages, path / "loss_curve.png")
    ppl = perplexities(model, tokenizer, args.chunks)
    prompt = "The President said that"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    sample = tokenizer.decode(model.generate(ids, max_new_tokens=40, do_sample=False)[0])

    stats_path = assets.PLANS / args.model / "stats.safetensors"
    stats = CalibrationStats.load(stats_path)
    half = stats.half_lives.reshape(stats.half_lives.shape[0], -1)  # [L, units per layer]
    census = half_life_census(half)
    unit = "heads" if args.model == "gdn" else "key rows"
    q = torch.quantile(half.flatten().clamp(max=1e9), torch.tensor([0.1, 0.5, 0.9], dtype=half.dtype))

    rows = [
        f"| stage {n} | {s['steps']} | {s['batch']} x {s['seq_len']} | {s['tokens_seen']:,} | {s['lr']} "
        f"| {s['train_seconds']:.0f} s | `{s['rerun']}` |"
        for n, s in enumerate(stages, 1)
    ]
    per_layer = [
        f"| {i} | "
        + " | ".join(f"{int((half[i] > t).sum())}" for t in (64, 256, 1024))
        + f" | {half[i].median().item():.0f} |"
        for i in range(half.shape[0])
    ]
    card = f"""# stepquant shipped model: `{args.model}`

{ARCH[args.model]}. {params / 1e6:.2f} M parameters, bf16 safetensors
({(path / "model.safetensors").stat().st_size / 1e6:.1f} MB), context trained at 4,096 tokens.
Load offline: `from stepquant.models import load; model, tokenizer = load("{args.model}")`
(or `AutoModelForCausalLM.from_pretrained(stepquant.models.checkpoint("{args.model}"))`: the weights ship as
`model.safetensors.xz` and are unpacked once into a cache, sha256-checked; see stepquant/assets/__init__.py).

Trained from scratch for stepquant's experiments: a real hybrid delta-rule LM whose recurrent state we
quantize. It is tiny and undertrained; it writes plausible but repetitive English. Do not use it for
anything else.

## Data and tokenizer

The "train" split of stepquant/assets/data/ (`stepquant.data`): English Wikipedia lead paragraphs, State
of the Union addresses and the Brown Corpus, minus the held-out 10% of documents (4,604,329 tokens).
Tokenizer: our 8,192-token byte-level BPE (`stepquant/assets/data/tokenizer`,
`scripts/train_tokenizer.py`) - GPT-2's 50,257-token vocabulary would spend 12.9 M parameters on the
embedding at this width, more than the layers we study.

## Training (NVIDIA H200, {stages[-1]["torch"]}, transformers {stages[-1]["transformers"]}, 2026-12-02)

AdamW (betas 0.9/0.95, weight decay 0.1), bf16 autocast, warm-up then cosine to 10%, seed 0, gradient
clipping 1.0. Gate initialisation spread log-uniformly so that some units keep memory for thousands of
tokens (`scripts/train_model.py`, `spread_gates`). Trained on transformers' PyTorch path (fla 0.6.0
refuses the GDN chunk backward on Hopper with Triton < 3.7.1, and its KDA chunk check failed on the
device, see scripts/h200_train_stage2.sh).

| stage | steps | batch | tokens seen | peak lr | time | rerun |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

To reproduce, run the stages in order on one GPU (the device run wrote to /tmp/models; a later stage's
`--init-from` is the earlier stage's `--out`).

![loss curve](loss_curve.png)

## Held-out perplexity

Measured on CPU in FP32 by `python scripts/model_card.py --model {args.model}` ({date.today()}): the first
{args.chunks} x 2,048 tokens of each held-out stream.

| stream | wiki | sotu | brown |
|---|---|---|---|
| perplexity | {ppl["wiki"]:.2f} | {ppl["sotu"]:.2f} | {ppl["brown"]:.2f} |

Greedy sample: "{sample}"

## Gate half-lives

From the calibration statistics (`stepquant calibrate --model {args.model}`, 32 x 2,048 wiki calibration
tokens): half-life tau = ln 2 / (-E[g]) per {unit[:-1]}, {half.numel():,} {unit} in all;
10th / 50th / 90th percentile {q[0]:.0f} / {q[1]:.0f} / {q[2]:.0f} tokens.

| {unit} with half-life above | 64 tokens | 256 tokens | 1024 tokens |
|---|---|---|---|
| count | {census[64]} | {census[256]} | {census[1024]} |
| share | {" | ".join(f"{census[t] / half.numel():.1%}" for t in (64, 256, 1024))} |

Per linear-attention layer (counts above each threshold, median half-life):

| layer | > 64 | > 256 | > 1024 | median |
|---|---|---|---|---|
{chr(10).join(per_layer)}

Card written in {time.time() - started:.0f} s.
"""
    (path / "README.md").write_text(card)
    print(card)
    print(json.dumps({"model": args.model, "perplexity": ppl, "half_life_census": census}))


if __name__ == "__main__":
    main()
