"""The method table on one or more models: what `stepquant eval` runs (eval/cli.py parses it).

First every argument and data source is checked (eval/cli.py checks the device and the output
directory) and the methods of every model are resolved (plans loaded and checked against the model's
config), so that nothing the user can fix fails after minutes of work. Then for each model: cut S
streams of P + D + 1 tokens from the eval data (shipped streams "wiki", "sotu", "brown", or the user's
own .txt / .jsonl), run the drift probe with every method in one batch (stepquant.eval.probe), run greedy
generation the same way, and collect bytes per request (codec storage, and what the cache measured).
eval.json, eval.md and one PNG per model are written as each model finishes (a later failure keeps the
finished ones); the table is printed, and one JSON summary line last.

    stepquant eval --quick --models gdn,kda --out docs/results     # the committed table (docs/eval.md)
    stepquant eval --models gdn --methods int4,stepquant-4 --data my_text.jsonl

Speed on a 2-core CPU: the work is a few hundred small tensor ops per token, so one thread per process is
faster than two sharing a busy machine; ``--jobs 2`` evaluates two models at once in worker processes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

from stepquant.eval.methods import DEFAULT_METHODS, DEFAULT_PLANS_DIR, resolve_methods
from stepquant.eval.probe import drift_probe, greedy_generation
from stepquant.eval.report import markdown_report, write_outputs
from stepquant.eval.settings import DEFAULT_BLOCK, FULL, QUICK, SHIPPED_STREAMS
from stepquant.families import shape_from_config


def _round(values, digits: int = 5):
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if isinstance(values, list):
        return [_round(v, digits) for v in values]
    return round(float(values), digits)


def _stream_dict(values: torch.Tensor, names: list[str], rows_of: dict[str, list[int]]) -> dict:
    """Per-stream means of values [S] (rows grouped by their data source) plus the mean over all rows."""
    out = {name: float(values[rows_of[name]].mean()) for name in names}
    out["mean"] = float(values.mean())
    return out


def document_prompts(data: str, tokenizer, count: int, length: int) -> torch.Tensor:
    """[count, length]: the first ``length`` tokens of the first ``count`` documents longer than that.

    Generation starts at a document start so that EOS (the document separator the models were trained
    with) is the natural place to stop.
    """
    from stepquant.data import texts_for

    prompts = []
    for text in texts_for(data):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > length:
            prompts.append(ids[:length])
            if len(prompts) == count:
                return torch.tensor(prompts, dtype=torch.long)
    raise ValueError(f"{data}: only {len(prompts)} documents have more than {length} tokens, {count} "
                     "generation prompts were asked for; lower --gen-prompts or --gen-prompt-tokens")


def model_methods(model_name: str, methods: list[str], *, plans_dir: str | None, plan_paths: list[str],
                  skip_missing_plans: bool = False) -> list:
    """The methods of one model, resolved (every plan loaded and checked against the model's config) from
    its config alone: run_eval calls it for every model before the first one runs."""
    from stepquant.models import resolve

    config_dir = resolve(model_name)
    linear_layers = list(shape_from_config(config_dir).layer_indices)
    return resolve_methods(methods, Path(model_name).name, linear_layers, plans_dir=plans_dir,
                           plan_paths=plan_paths, model_config=config_dir,
                           skip_missing_plans=skip_missing_plans)


def evaluate_model(model_name: str, *, methods: list[str], data: list[str], prefill: int, decode: int,
                   window: int, segments: int, gen_prompts: int, gen_prompt_tokens: int, gen_max_new: int,
                   plans_dir: str | None, plan_paths: list[str], packed: bool, threads: int | None,
                   skip_missing_plans: bool = False, device: str = "cpu",
                   device_map: str | None = None) -> dict:
    """Everything the table needs for one model, as a JSON-ready dict."""
    from stepquant.data import segments as cut_segments
    from stepquant.models import load, resolve

    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    resolved = model_methods(model_name, methods, plans_dir=plans_dir, plan_paths=plan_paths,
                             skip_missing_plans=skip_missing_plans)
    model, tokenizer = load(model_name, device=device, device_map=device_map)
    input_device = model.get_input_embeddings().weight.device
    config = model.config.get_text_config(decoder=True)
    shape = shape_from_config(resolve(model_name))
    skipped = [m for m in methods if m != "fp32" and m not in {r.name for r in resolved}]
    if skipped:
        print(f"stepquant eval: {model_name}: no calibrated plan for {', '.join(skipped)} (looked in "
              f"{plans_dir or DEFAULT_PLANS_DIR}); evaluating the other methods", file=sys.stderr)
    row_codecs = [m.codecs for m in resolved]

    names = [Path(d).stem if d not in SHIPPED_STREAMS else d for d in data]
    probe_tokens = [cut_segments(d, tokenizer, segments, prefill + decode + 1) for d in data]
    rows_of = {n: list(range(i * segments, (i + 1) * segments)) for i, n in enumerate(names)}
    tokens = torch.cat(probe_tokens).to(input_device)  # [S, P + D + 1]
    probe = drift_probe(model, tokens, row_codecs, prefill_len=prefill, window=window, packed=packed,
                        desc=f"{model_name} drift probe")

    generation = None
    if gen_max_new > 0 and gen_prompts > 0:
        prompts = torch.cat([document_prompts(d, tokenizer, gen_prompts, gen_prompt_tokens) for d in data])
        prompts = prompts.to(input_device)
        generation = greedy_generation(model, prompts, row_codecs, max_new_tokens=gen_max_new,
                                       eos_token_id=tokenizer.eos_token_id, packed=packed,
                                       desc=f"{model_name} greedy generation")
        gen_rows = {n: list(range(i * gen_prompts, (i + 1) * gen_prompts)) for i, n in enumerate(names)}

    measured = probe.held_bytes
    decode_ppl = probe.decode_nll.mean(-1).exp()  # [M, S]
    method_records = {}
    for m, method in enumerate(resolved):
        state = method.state_bytes(shape)
        record = {
            "label": method.label,
            "bits_per_value": state.bits_per_value(serving=True),
            "analytical_bits_per_value": state.bits_per_value(),
            "bytes_per_request": state.serving_bytes,
            "analytical_bytes_per_request": state.analytical_bytes,
            "ratio_vs_fp32": state.ratio_vs_fp32(serving=True),
            "measured_bytes_per_request": measured["serving_bytes_per_request"][m],
            "held_bytes_per_request": measured["bytes_per_request"][m],
            "excess_nll": {
                "first": _stream_dict(probe.excess.first[m], names, rows_of),
                "last": _stream_dict(probe.excess.last[m], names, rows_of),
                "all": _stream_dict(probe.excess.all[m], names, rows_of),
                "stderr": float(probe.excess.stderr[m]),
                "block": probe.excess.block,
                "block_means": _round(probe.excess.block_means[m], 6),
            },
            "decode_ppl": _stream_dict(decode_ppl[m], names, rows_of),
            "curve": _round(probe.excess.curve[m]),
        }
        if method.plan is not None:
            record["plan"] = {"variant": getattr(method.plan, "variant", None),
                              "budget_bits": getattr(method.plan, "budget_bits", None)}
        if generation is not None:
            lengths = generation.lengths[m].double()
            record["generation"] = {
                "mean_length": float(lengths.mean()),
                "length": {n: float(lengths[gen_rows[n]].mean()) for n in names},
                "capped_fraction": float(generation.capped[m].double().mean()),
                "mean_agree": float(generation.agree[m].double().mean()),
                "lengths": generation.lengths[m].tolist(),
            }
        method_records[method.name] = record
    prefill_ppl = probe.prefill_nll.mean(-1).exp()
    seconds = dict(probe.seconds)
    seconds["generation"] = 0.0 if generation is None else generation.seconds
    seconds["total"] = time.perf_counter() - started
    return {
        "architecture": type(model).__name__,
        "model_type": config.model_type,
        "trained_context": 4096 if model_name in ("gdn", "kda") else None,
        "shape": {"linear_layers": shape.linear_layers, "heads": shape.heads, "key_dim": shape.key_dim,
                  "value_dim": shape.value_dim, "fp32_bytes": shape.fp32_bytes, "values": shape.values},
        "rows": tokens.shape[0] * len(resolved),
        "streams": names,
        "prefill_ppl": {n: float(prefill_ppl[rows_of[n]].mean()) for n in names},
        "window": probe.excess.window,
        "held_bytes": measured,
        "skipped_methods": skipped,
        "methods": method_records,
        "generation": None if generation is None else {
            "prompts_per_stream": gen_prompts, "prompt_tokens": gen_prompt_tokens,
            "max_new_tokens": gen_max_new},
        "seconds": seconds,
    }


def machine() -> str:
    """The CPU, its core count and the OS, for the record of a run."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return f"{cpu}, {os.cpu_count()} CPU cores, {platform.system()} {platform.machine()}"


def _worker(args: tuple) -> tuple[str, dict]:
    model_name, kwargs = args
    return model_name, evaluate_model(model_name, **kwargs)


def _check_arguments(args: argparse.Namespace, settings: dict, models: list[str], methods: list[str],
                     data: list[str]) -> None:
    """Every argument and data source of the run, before the first model is loaded (eval/cli.py has
    checked the output directory and the device)."""
    from stepquant.data import check_source

    if not models:
        raise ValueError("--models lists no model: give shipped names (gdn, kda) or checkpoint directories")
    if not methods:
        raise ValueError(f"--methods {args.methods!r} lists no method: give a comma list (e.g. "
                         "int4,stepquant-4), or leave --methods out for the default comparison")
    if len(set(data)) != len(data):
        raise ValueError(f"--data lists a stream more than once: {data}")
    minimum = {"prefill": 2, "decode": 1, "segments": 1, "gen_prompts": 0, "gen_prompt_tokens": 1,
               "gen_max_new": 0}
    for key, low in minimum.items():
        if settings[key] < low:
            raise ValueError(f"--{key.replace('_', '-')} must be >= {low}, got {settings[key]}")
    if args.window < 1:
        raise ValueError(f"--window must be >= 1 (decode predictions per first / last window), got "
                         f"{args.window}")
    for source in data:
        check_source(source)


def run_eval(args: argparse.Namespace) -> int:
    import transformers

    defaults = QUICK if args.quick else FULL
    settings = {key: getattr(args, key) if getattr(args, key) is not None else value
                for key, value in defaults.items()}
    models = [m for item in args.models for m in item.split(",") if m]
    defaulted = args.methods in (None, "default")
    methods = list(DEFAULT_METHODS) if defaulted else [m for m in args.methods.split(",") if m.strip()]
    data = [d for item in args.data for d in item.split(",") if d]
    _check_arguments(args, settings, models, methods, data)
    kwargs = dict(methods=methods, data=data, window=args.window, plans_dir=args.plans_dir,
                  plan_paths=args.plan or [], packed=args.packed, threads=args.threads,
                  prefill=settings["prefill"], decode=settings["decode"], segments=settings["segments"],
                  gen_prompts=settings["gen_prompts"], gen_prompt_tokens=settings["gen_prompt_tokens"],
                  gen_max_new=settings["gen_max_new"], skip_missing_plans=defaulted,
                  device=getattr(args, "device", "cpu"), device_map=getattr(args, "device_map", None))
    for model_name in models:  # a missing or mismatched plan of any model, before minutes of the first one
        model_methods(model_name, methods, plans_dir=args.plans_dir, plan_paths=args.plan or [],
                      skip_missing_plans=defaulted)
    out = Path(args.out)
    started = time.perf_counter()
    record = {
        "command": "stepquant eval " + " ".join(shlex.quote(a) for a in args.argv),
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "seconds": 0.0,
        "settings": {**settings, "window": args.window, "block": DEFAULT_BLOCK, "data": data,
                     "packed": args.packed, "threads": args.threads, "jobs": args.jobs, "quick": args.quick,
                     "device": getattr(args, "device", "cpu"),
                     "device_map": getattr(args, "device_map", None)},
        "models": {},
    }
    results = {}

    def finished(model_name: str, result: dict) -> dict:
        """Write the outputs with every model done so far: a later failure keeps this model's results."""
        results[model_name] = result
        record["models"] = {m: results[m] for m in models if m in results}
        record["seconds"] = time.perf_counter() - started
        return write_outputs(record, out, plots=not args.no_plots)

    if args.jobs > 1 and len(models) > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(min(args.jobs, len(models))) as pool:
            for model_name, result in pool.imap_unordered(_worker, [(m, kwargs) for m in models]):
                paths = finished(model_name, result)
    else:
        for model_name in models:
            paths = finished(*_worker((model_name, kwargs)))
    print(markdown_report(record))
    summary = {
        "seconds": round(record["seconds"], 1),
        "outputs": paths,
        "excess_nll_all": {
            m: {name: round(r["excess_nll"]["all"]["mean"], 5) for name, r in res["methods"].items()}
            for m, res in record["models"].items()
        },
    }
    print(json.dumps(summary, separators=(",", ":")))
    return 0
