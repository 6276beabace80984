"""Several state formats on the same lm-eval tasks, one table: what `stepquant tasks` runs (tasks/cli.py).

Everything the user can get wrong is checked before the first model loads: every model's methods are
resolved (plans loaded and checked against the model's config, stepquant.eval.run.model_methods) and every
task name is looked up in lm-eval's registry plus the offline tasks of lm_eval_tasks/. Then per model the
weights load once and each method runs the tasks through the ``stepquant`` lm-eval model
(stepquant.tasks.harness), FP32 first. Per task and metric the table gives the value, lm-eval's standard
error, and the difference to FP32 with the standard error of the paired per-document differences (both
methods answer the same documents, so this is usually much tighter than the two errors combined).
tasks.json, tasks.md and one bar plot per model (tasks_<model>.png) are rewritten after every method.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from stepquant.eval.report import mean_and_stderr
from stepquant.tasks.build import TASKS_DIR

OFFLINE_PREFIX = "stepquant_"  # the offline tasks of lm_eval_tasks/
SKIP_METRICS = ("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")  # no paired difference


def task_manager(model_name: str, tasks: list[str] | None = None):
    """lm-eval's task index with the offline tasks added; the continuation task reads the model from
    the metadata. Only the offline tasks are indexed when only they are asked for (lm-eval's own index
    takes seconds to build)."""
    from lm_eval.tasks import TaskManager

    offline_only = tasks is not None and all(t.startswith(OFFLINE_PREFIX) for t in tasks)
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=not offline_only,
                       metadata={"model": Path(model_name).name})


def check_tasks(manager, tasks: list[str]) -> None:
    """ValueError naming every unknown task, with close names from the index."""
    import difflib

    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        hints = {t: difflib.get_close_matches(t, known, n=3) for t in unknown}
        text = "; ".join(f"{t!r}" + (f" (did you mean {', '.join(h)}?)" if h else "")
                         for t, h in hints.items())
        raise ValueError(f"unknown lm-eval task {text}: the offline tasks are stepquant_cloze and "
                         "stepquant_continuation; `lm-eval ls tasks` lists the hub tasks")


def _paired(samples_m: list[dict], samples_ref: list[dict], metric: str,
            filt: str) -> tuple[float, float, int]:
    """Mean and standard error of the per-document difference method - FP32 of one metric."""
    ref = {s["doc_id"]: float(s[metric]) for s in samples_ref if s.get("filter") == filt and metric in s}
    diffs = [float(s[metric]) - ref[s["doc_id"]] for s in samples_m
             if s.get("filter") == filt and metric in s and s["doc_id"] in ref]
    if not diffs:
        return math.nan, math.nan, 0
    return (*mean_and_stderr(diffs), len(diffs))


def method_results(output: dict, reference: dict | None) -> dict:
    """{task: {"metric,filter": {value, stderr, n, diff, diff_stderr}}} of one lm-eval output."""
    table = {}
    for task, values in output["results"].items():
        rows = {}
        for key, value in values.items():
            metric, comma, filt = key.partition(",")  # "acc,none"; "alias", "sample_len" are not metrics
            if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = values.get(f"{metric}_stderr,{filt}")
            row = {"value": float(value), "stderr": None if stderr in (None, "N/A") else float(stderr),
                   "n": len([s for s in output["samples"].get(task, []) if s.get("filter") == filt])}
            if reference is not None and metric not in SKIP_METRICS:
                diff, diff_se, _ = _paired(output["samples"][task], reference["samples"][task], metric, filt)
                row.update(diff=diff, diff_stderr=diff_se)
            rows[key] = row
        table[task] = rows
    return table


def run_tasks(args) -> int:
    import lm_eval
    import torch

    from stepquant.eval.methods import DEFAULT_METHODS
    from stepquant.eval.run import model_methods
    from stepquant.tasks.harness import StepquantLM, offline

    offline()
    models = [m.strip() for spec in args.models for m in spec.split(",") if m.strip()]
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError("--tasks is empty: give a comma list, e.g. stepquant_cloze,stepquant_continuation")
    names = DEFAULT_METHODS if args.methods is None else [m for m in args.methods.split(",") if m.strip()]
    resolved = {m: model_methods(m, list(names), plans_dir=args.plans_dir, plan_paths=args.plan or [],
                                 skip_missing_plans=args.methods is None) for m in models}
    managers = {m: task_manager(m, tasks) for m in models}
    for manager in managers.values():
        check_tasks(manager, tasks)

    out = Path(args.out)
    record = {"command": "stepquant tasks " + shlex.join(getattr(args, "argv", [])),
              "date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}",
              "versions": {"torch": torch.__version__, "lm_eval": lm_eval.__version__,
                           "transformers": __import__("transformers").__version__},
              "settings": {"tasks": tasks, "limit": args.limit, "batch_size": args.batch_size,
                           "decode_context": args.decode_context, "threads": args.threads,
                           "device": args.device, "num_fewshot": args.num_fewshot},
              "models": {}}
    for model_name in models:
        started = time.perf_counter()
        lm = StepquantLM(model=model_name, device=args.device, batch_size=args.batch_size,
                         decode_context=args.decode_context, threads=args.threads, plans_dir=args.plans_dir)
        entry = record["models"][Path(model_name).name] = {"methods": {}}
        outputs = {}
        for method in resolved[model_name]:
            print(f"stepquant tasks: {model_name} / {method.label}", file=sys.stderr)
            method_started = time.perf_counter()
            outputs[method.name] = output = lm_eval.simple_evaluate(
                model=lm.use(method), tasks=tasks, limit=args.limit, num_fewshot=args.num_fewshot,
                task_manager=managers[model_name], log_samples=True, bootstrap_iters=1000,
                random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
            reference = outputs.get(resolved[model_name][0].name) if method is not resolved[model_name][0] \
                else None
            entry["methods"][method.name] = {
                "label": method.label, "seconds": round(time.perf_counter() - method_started, 1),
                "cache": lm.cache_kind, "tasks": method_results(output, reference)}
            entry["seconds"] = round(time.perf_counter() - started, 1)
            write_outputs(record, out, plots=not args.no_plots)
    paths = write_outputs(record, out, plots=not args.no_plots)
    print(markdown_report(record))
    print(json.dumps({"out": paths, "models": {m: e["seconds"] for m, e in record["models"].items()}}))
    return 0


def _fmt(x, digits: int = 3, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def markdown_report(record: dict) -> str:
    settings = record["settings"]
    lines = ["# Downstream tasks with a compressed recurrent state", "",
             f"Command: `{record['command']}`  ", f"Date: {record['date']}; machine: {record['machine']}; "
             + ", ".join(f"{k} {v}" for k, v in record["versions"].items()), "",
             f"Settings: limit {settings['limit']} documents per task, batch size {settings['batch_size']}, "
             f"decode_context {settings['decode_context']} (context tokens fed as compressed-state decode "
             "steps), greedy generation. value ± lm-eval's standard error; Δ FP32 ± the standard error of "
             "the paired per-document differences.", ""]
    for model_name, model in record["models"].items():
        lines += [f"## {model_name} (wall time {model.get('seconds', 0):,.0f} s)", ""]
        methods = model["methods"]
        keys = [(task, key) for task, rows in next(iter(methods.values()))["tasks"].items() for key in rows]
        lines += ["| method | " + " | ".join(f"{t} {k.replace(',none', '')}" for t, k in keys) + " |",
                  "|---|" + "---|" * len(keys)]
        for method in methods.values():
            cells = []
            for task, key in keys:
                row = method["tasks"].get(task, {}).get(key)
                if row is None:
                    cells.append("")
                    continue
                cell = _fmt(row["value"]) + (f" ± {_fmt(row['stderr'])}" if row["stderr"] is not None else "")
                if "diff" in row:
                    cell += f" (Δ {_fmt(row['diff'], signed=True)} ± {_fmt(row['diff_stderr'])})"
                cells.append(cell)
            lines.append(f"| {method['label']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(model_name: str, model: dict, path: Path) -> Path:
    """One panel per task: the primary metric (first in the task) of every method, with its stderr."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(model["methods"].values())
    tasks = list(methods[0]["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(max(6, 0.45 * len(methods)) * len(tasks), 4.2),
                             squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        key = next(k for k in methods[0]["tasks"][task] if k.split(",")[0] not in SKIP_METRICS)
        rows = [m["tasks"][task][key] for m in methods]
        ax.bar(range(len(rows)), [r["value"] for r in rows], yerr=[r["stderr"] or 0 for r in rows],
               color=["#444444"] + ["#4c72b0"] * (len(rows) - 1), capsize=2)
        ax.set_xticks(range(len(rows)), [m["label"].replace(" (reference)", "") for m in methods],
                      rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{model_name}: {task} ({key.replace(',none', '')})")
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(record: dict, out_dir: Path, plots: bool = True) -> dict:
    """tasks.json, tasks.md and tasks_<model>.png in out_dir; returns {kind: path}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out_dir / "tasks.json"), "markdown": str(out_dir / "tasks.md")}
    if plots:
        for model_name, model in record["models"].items():
            if model["methods"]:
                png = plot(model_name, model, out_dir / f"tasks_{model_name}.png")
                paths[f"plot_{model_name}"] = str(png)
    Path(paths["json"]).write_text(json.dumps(record, indent=1) + "\n")
    Path(paths["markdown"]).write_text(markdown_report(record))
    return paths
