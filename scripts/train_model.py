"""Train one of the two shipped small hybrid LMs (GDN or KDA) on the "train" split.

    python scripts/train_model.py --arch gdn --out /tmp/models/gdn --time-budget 240
    python scripts/train_model.py --arch kda --out /tmp/models/kda --max-steps 1234   # exact rerun
    python scripts/ship_model.py /tmp/models/gdn --name gdn     # into stepquant/assets/models/gdn

Both use transformers' own architectures (Qwen3_5ForCausalLM with Gated DeltaNet, and
KimiLinearForCausalLM with Kimi Delta Attention) so the code that serves them also serves real
checkpoints. Seeded: the step count fixes the run. With --time-budget the script times its first
steps and fixes the step count (and the cosine schedule) from that, then records it in
train_log.json so --max-steps reproduces the run.

Gate initialisation: the stock inits give almost only short half-lives; we spread the decay
rate log-uniformly so that, as in the large models, some units keep memory for thousands of
tokens (see the model card's half-life table for what training made of it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stepquant.data import EVAL_STREAMS, split_texts, token_stream  # noqa: E402


def gdn_config(vocab_size: int, eos: int):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        layer_types=["linear_attention"] * 3
        + ["full_attention"]
        + ["linear_attention"] * 3
        + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


def kda_config(vocab_size: int, eos: int):
    from transformers import KimiLinearConfig

    n_layers = 8
    return KimiLinearConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=n_layers,
        layer_types=["linear_attention"] * 3
        + ["full_attention"]
        + ["linear_attention"] * 3
        + ["full_attention"],
        mlp_layer_types=["dense"] * n_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=128,
        q_lora_rank=None,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=64,
        linear_num_heads=4,
        linear_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=8,
        max_position_embeddings=16384,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )


@torch.no_grad()
def spread_gates(model, arch: str, generator: torch.Generator) -> None:
    """Log-uniform decay rates: GDN A in [1e-4, 1] per head; KDA dt in [1e-5, 1e-1] per channel."""
    for module in model.modules():
        if arch == "gdn" and hasattr(module, "A_log") and hasattr(module, "dt_bias"):
            n = module.A_log.numel()
            a = torch.empty(n).uniform_(math.log(1e-4), 0.0, generator=generator)
            module.A_log.copy_(a.to(module.A_log))
        elif arch == "kda" and type(module).__name__ == "KimiLinearForgetGate":
            n = module.dt_bias.numel()
            dt = torch.empty(n).uniform_(math.log(1e-5), math.log(1e-1), generator=generator).exp()
            module.dt_bias.copy_((dt + torch.log(-torch.expm1(-dt))).to(module.dt_bias))


def sample_batch(stream: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=generator)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, max_chunks: int, device: str) -> float:
    n = min(max_chunks, stream.numel() // (seq_len + 1))
    chunks = stream[: n * (seq_len + 1)].view(n, seq_len + 1)
    total, count = 0.0, 0
    for i in range(0, n, 4):
        x = chunks[i : i + 4].to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    return total / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["gdn", "kda"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, default=Path("stepquant/assets/data/tokenizer"))
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument(
        "--max-steps", type=int, default=None, help="exact step count (overrides --time-budget)"
    )
    parser.add_argument(
        "--time-budget", type=float, default=240.0, help="seconds of training, sets the step count"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--init-from", type=Path, default=None, help="continue from this checkpoint (stage 2)"
    )
    parser.add_argument("--eval-chunks", type=int, default=16, help="held-out 2048-token chunks per stream")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    stream = token_stream(split_texts("train"), tokenizer)
    eos = tokenizer.eos_token_id
    config = (gdn_config if args.arch == "gdn" else kda_config)(len(tokenizer), eos)
    if args.init_from is not None:
        model = AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        previous = json.loads((args.init_from / "train_log.json").read_text())
    else:
        model = AutoModelForCausalLM.from_config(config)
        spread_gates(model, args.arch, gen)
        previous = None
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"{args.arch}: {n_params / 1e6:.2f} M parameters, {stream.numel():,} training tokens, device {device}"
    )

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 or "A_log" in name or "dt_bias" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device == "cuda",
    )
    total_steps = args.max_steps or 10**9
    log, t_start, step = [], time.time(), 0
    while step < total_steps:
        if step < args.warmup:
            lr = args.lr * (step + 1) / args.warmup
        else:
            progress = min(1.0, (step - args.warmup) / max(1, total_steps - args.warmup))
            lr = args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        x = sample_batch(stream, args.batch, args.seq_len, gen).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step in (5, 25) and args.max_steps is None:
            # time steps 5..25 (the first ones pay for start-up), then fix the schedule
            if device == "cuda":
                torch.cuda.synchronize()
            if step == 5:
                t_five = time.time()
                continue
            per_step = (time.time() - t_five) / 20
            total_steps = max(step + 1, int((args.time_budget - (time.time() - t_start)) / per_step) + step)
            print(f"{per_step * 1000:.0f} ms/step -> {total_steps} steps in {args.time_budget:.0f} s")
        if step % 25 == 0 or step == total_steps:
            elapsed = time.time() - t_start
            tokens = step * args.batch * args.seq_len
            log.append(
                {
                    "step": step,
                    "loss": round(loss.item(), 4),
                    "lr": lr,
                    "tokens": tokens,
                    "s": round(elapsed, 1),
                }
            )
            print(
                f"step {step}/{total_steps} loss {loss.item():.3f} lr {lr:.2e} {tokens / elapsed:,.0f} tok/s"
            )
    train_seconds = time.time() - t_start

    model.eval()
    eval_loss = {
        name: heldout_loss(model, token_stream(split_texts(name), tokenizer), 2048, args.eval_chunks, device)
        for name in EVAL_STREAMS
    }
    print(
        "held-out loss:",
        {k: round(v, 4) for k, v in eval_loss.items()},
        "ppl:",
        {k: round(math.exp(v), 2) for k, v in eval_loss.items()},
    )

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    record = {
        "previous_stage": previous,
        "init_from": str(args.init_from) if args.init_from else None,
        "fla": "fla" in sys.modules,
        "arch": args.arch,
        "seed": args.seed,
        "steps": step,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "warmup": args.warmup,
        "tokens_seen": step * args.batch * args.seq_len,
        "train_tokens": stream.numel(),
        "parameters": n_params,
        "train_seconds": round(train_seconds, 1),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "heldout_loss_gpu_bf16": eval_loss,
        "loss_curve": log,
        "rerun": f"python scripts/train_model.py --arch {args.arch} --out {args.out} --max-steps {step} "
        f"--seq-len {args.seq_len} --batch {args.batch} --lr {args.lr} --warmup {args.warmup} "
        f"--seed {args.seed}"
        + (f" --init-from {args.init_from}" if args.init_from else ""),
    }
    (args.out / "train_log.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k != "loss_curve"}))


if __name__ == "__main__":
    main()
