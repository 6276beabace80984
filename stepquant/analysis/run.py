"""`stepquant analyze`: the paper's mechanism analyses on one model, written as PNG figures and analysis.json.

    stepquant analyze --model gdn --out docs/results/analysis/gdn

Calibration quantities (half-lives, omega) come from the first plan (``--plan``, default the shipped
stepquant-6 and stepquant-4 plans of a shipped model), i.e. from the frozen calibration text, as in the
paper; the analyses themselves run on other text (default: the held-out wiki, sotu and brown streams).

1. The model runs once over ``--segments`` streams of ``--segment-length`` tokens per source with every
   linear-attention call captured (calibrate.observers); each layer's capture is handed at once to the
   trajectory analyses (1 lifetime-error, 2 feedback, 3a row-identity, 4 geometry) and then dropped.
2. ``row-ppl`` (3b) runs one batched drift probe (eval.probe) with one method per omega-ranked row group.
3. ``lifetime-ranks`` (5) measures half-lives on ``--rank-segments`` streams of each source
   (calibrate.unit_half_lives) and ranks them against the calibration half-lives.
4. ``bits`` (6) reads every plan.

Each analysis's numbers sit in analysis.json beside the paper's; the command prints a summary, then one
JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import shlex
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from stepquant.codecs import UniformCodec

from . import mechanisms as mech
from . import plots

ANALYSES = ("lifetime-error", "feedback", "row-identity", "row-ppl", "geometry", "lifetime-ranks", "bits")
DEFAULT_PLAN_NAMES = ("stepquant-6", "stepquant-4")
GEOMETRY_POSITIONS = (128, 512, 2048)
FEEDBACK_BITS = (6, 8)
ERROR_BITS = 6
IDENTITY_START = 128  # probe positions follow this many replay updates (paper: 128)
IDENTITY_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
}  # exact check; what FP32 arithmetic gives

PAPER = {  # the paper's numbers (Qwen3.8-27B = GDN, Kimi-Linear-48B = KDA); None where it reports none
    "lifetime_error": {
        "gdn": {"spearman": 0.8004},
        "kda": {"spearman": 0.8017},
        "text": "C4, uniform INT6, all units, frozen WikiText half-lives",
    },
    "feedback": {
        "gdn": {"ratio_int6": 26.82, "ratio_int8": 18.65, "above_one_on_every_trajectory": True},
        "kda": None,
        "text": "4 C4 trajectories, 32 heads, inject at 256, 7,936 updates",
    },
    "row_identity": {
        "max_relative_error": 7.1e-7,
        "text": "32 probe positions after 128 updates, 4 Qwen + 2 KDA C4 streams",
    },
    "omega_spread": {
        "gdn": {"median": 15.95, "p10": 3.74, "p90": 79.84},
        "kda": None,
        "text": "within-head P90/P10 of the floored omega, across heads",
    },
    "row_ppl": {
        "text": "Fig. 2(a): higher-omega groups generally raise perplexity more (no numbers in the "
        "text); eight 1,024-token streams"
    },
    "geometry": {
        "gdn": {
            "median_row_contrast": 10.3,
            "median_col_contrast": 19.4,
            "share_both_above_3x": 0.986,
            "positions": [128, 512, 2048],
        },
        "kda": {
            "median_row_contrast": 12.7,
            "median_col_contrast": 5.4,
            "share_both_above_3x": 0.849,
            "positions": [128, 256, 512],
        },
    },
    "lifetime_ranks": {
        "gdn": {
            "spearman": {"c4": 0.989, "livecodebench": 0.985},
            "class_retention": {"c4": 0.936, "livecodebench": 0.901},
        },
        "kda": {"spearman": {"c4": 0.991, "livecodebench": 0.982}, "class_retention": None},
    },
}


def parse_analyses(text: str) -> list[str]:
    names = list(ANALYSES) if text.strip() == "all" else [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in ANALYSES]
    if unknown or not names:
        raise ValueError(f"--analyses must be 'all' or a comma list of {', '.join(ANALYSES)}, got {text!r}")
    return [a for a in ANALYSES if a in names]


def _round(value, digits: int = 6):
    """Floats to ``digits`` significant digits (recursively), so the JSON stays readable."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _round(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_round(v, digits) for v in value]
    if isinstance(value, float):
        return value if not math.isfinite(value) or value == 0 else float(f"{value:.{digits}g}")
    return value


def compact_json(record: dict) -> str:
    """Indented JSON whose innermost lists of numbers sit on one line (the per-unit arrays stay small)."""
    text = json.dumps(record, indent=1)
    return re.sub(r"\[\s*([-+0-9.eE,\sInfinityNa]+?)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)


def identity_positions(length: int, count: int) -> list[int]:
    """``count`` probe positions spread evenly from min(128, T/2) to T - 1 (fewer if the stream is short)."""
    start = min(IDENTITY_START, length // 2)
    if count == 1:
        return [start]
    return sorted({round(start + n * (length - 1 - start) / (count - 1)) for n in range(count)})


class Trajectories:
    """The capture consumer: runs the trajectory analyses on each layer's capture and keeps small results."""

    def __init__(
        self, selected: list[str], *, inject_at: int, positions: list[int], geometry: list[int], bar
    ) -> None:
        self.selected, self.inject_at, self.positions, self.geometry = (
            selected,
            inject_at,
            positions,
            geometry,
        )
        self.bar = bar
        self.errors: dict[int, list] = defaultdict(list)
        self.feedback: dict[tuple[int, str], dict[int, list]] = defaultdict(lambda: defaultdict(list))
        self.identity: dict[int, list] = defaultdict(list)
        self.contrasts: dict[int, list] = defaultdict(list)
        self.surface: dict[int, torch.Tensor] = {}
        self.seconds: dict[str, float] = defaultdict(float)
        self.family = None

    def _timed(self, name: str, fn, *args, **kwargs):
        self.bar.set_postfix_str(name)
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        self.seconds[name] += time.perf_counter() - start
        return result

    def __call__(self, capture) -> None:
        self.family, i = capture.family, capture.index
        if "lifetime-error" in self.selected:
            self.errors[i].append(
                self._timed("lifetime-error", mech.unit_state_error, capture, UniformCodec(bits=ERROR_BITS))
            )
        if "feedback" in self.selected:
            for bits in FEEDBACK_BITS:
                found = self._timed(
                    "feedback",
                    mech.feedback_errors,
                    capture,
                    UniformCodec(bits=bits),
                    inject_at=self.inject_at,
                )
                for feedback, errors in found.items():
                    self.feedback[(bits, feedback)][i].append(errors)
        if "row-identity" in self.selected:
            for dtype in IDENTITY_DTYPES:
                self.identity[(dtype, i)].append(
                    self._timed(
                        "row-identity",
                        mech.row_impact_identity,
                        capture,
                        self.positions,
                        dtype=IDENTITY_DTYPES[dtype],
                    )
                )
        if "geometry" in self.selected:
            states = self._timed("geometry", mech.states_at, capture, self.geometry)  # [B, P, H, K, V]
            self.contrasts[i].append(mech.outlier_contrasts(states))
            self.surface.setdefault(i, states[0, -1].clone())
        self.bar.update(1)


def _stack(per_layer: dict[int, list]) -> torch.Tensor:
    """{layer index: [per-batch tensors with streams first]} -> [L, streams, ...]."""
    return torch.stack([torch.cat(per_layer[i]) for i in sorted(per_layer)])


def _representative(rows: torch.Tensor, cols: torch.Tensor) -> tuple[int, int]:
    """(layer, head) of stream 0 at the last position whose log contrasts are nearest the medians."""
    r, c = rows[:, 0, -1].log(), cols[:, 0, -1].log()  # [L, H]
    distance = (r - rows.nanmedian().log()).pow(2) + (c - cols.nanmedian().log()).pow(2)
    flat = int(torch.nan_to_num(distance, nan=math.inf).reshape(-1).argmin())
    return flat // rows.shape[-1], flat % rows.shape[-1]


def default_plans(model: str, plans_dir=None) -> list[Path]:
    from stepquant.eval.methods import plan_path
    from stepquant.models import SHIPPED

    if model not in SHIPPED and plans_dir is None:
        raise ValueError(
            f"give --plan DIR (a plan of {model} from `stepquant calibrate --model {model} --out "
            "DIR`): the half-lives and omega come from its calibration"
        )
    paths = [plan_path(name, Path(model).name, plans_dir) for name in DEFAULT_PLAN_NAMES]
    return [p for p in paths if p.exists()] or paths[:1]


def run_analyze(args: argparse.Namespace) -> int:
    import transformers

    from stepquant.calibrate import Plan, unit_half_lives
    from stepquant.data import segments
    from stepquant.eval.run import machine
    from stepquant.families import KDA, family_for
    from stepquant.models import load, model_type

    selected = parse_analyses(args.analyses)
    sources = [d for item in args.data for d in item.split(",") if d]
    if not sources or len(set(sources)) != len(sources):
        raise ValueError(f"--data must list distinct text sources, got {sources}")
    for name in ("segments", "rank_segments", "ppl_segments", "threads", "identity_positions", "groups"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    length = args.segment_length
    if not 2 < args.inject_at < length:
        raise ValueError(
            f"--inject-at must lie inside the stream: 2 < {args.inject_at} < --segment-length {length}"
        )
    if not 1 < args.ppl_prefill < args.ppl_tokens:
        raise ValueError(f"--ppl-prefill must be in 2..--ppl-tokens - 1, got {args.ppl_prefill}")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    progress = not args.no_progress

    # On CPU the chunked torch fallback is the faster prefill for GDN, the token loop for KDA (as calibrate).
    model, tokenizer = load(args.model, recurrent_prefill=family_for(model_type(args.model)) is KDA)
    plan_paths = [Path(p) for p in args.plan] if args.plan else default_plans(args.model, args.plans_dir)
    plans = [Plan.load(p, model_config=model.config) for p in plan_paths]
    calibration = plans[0]
    family = calibration.family
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"{Path(args.model).name} ({family.upper()})"
    seconds: dict[str, float] = {}
    results: dict[str, dict] = {}
    figures: dict[str, str] = {}

    trajectory_analyses = [
        a for a in ("lifetime-error", "feedback", "row-identity", "geometry") if a in selected
    ]
    positions = identity_positions(length, args.identity_positions)
    geometry = [p for p in GEOMETRY_POSITIONS if p <= length] or [length]
    if trajectory_analyses:
        from stepquant.calibrate.stats import run_segments

        tokens = torch.cat([segments(s, tokenizer, args.segments, length) for s in sources])
        batch = args.batch_size or tokens.shape[0]
        layers = len(calibration.linear_layers) * math.ceil(tokens.shape[0] / batch)
        with tqdm(total=layers, desc="analyze: trajectories", unit="layer", disable=not progress) as bar:
            consumer = Trajectories(
                trajectory_analyses, inject_at=args.inject_at, positions=positions, geometry=geometry, bar=bar
            )
            run_segments(model, tokens, consumer, batch_size=batch, progress=False)
        seconds.update(consumer.seconds)
        streams = [f"{s}:{n}" for s in sources for n in range(args.segments)]

        if "lifetime-error" in selected:
            errors = _stack(consumer.errors).mean(1)  # [L, *unit of a layer]
            ours = mech.lifetime_error(calibration.half_lives, errors)
            ours["half_life"], ours["error"] = _round(calibration.half_lives, 4), _round(errors, 4)
            figures["lifetime-error"] = plots.plot_lifetime_error(
                calibration.half_lives,
                errors,
                ours["spearman"],
                f"{title}, uniform INT{ERROR_BITS}",
                out / "lifetime_error.png",
            ).name
            results["lifetime_error"] = ours
        if "feedback" in selected:
            ours, curves = {}, {}
            for bits in FEEDBACK_BITS:
                native, oracle = (_stack(consumer.feedback[(bits, f)]) for f in ("native", "oracle"))
                ours[f"int{bits}"] = mech.feedback_summary(native, oracle)
                ours[f"int{bits}"]["state_error"] = mech.feedback_summary(
                    *(_stack(consumer.feedback[(bits, f"{f}_state")]) for f in ("native", "oracle"))
                )
                curves[(bits, "native")], curves[(bits, "oracle")] = native.sum((0, 1)), oracle.sum((0, 1))
            ours["trajectories"] = streams
            figures["feedback"] = plots.plot_feedback(
                curves,
                f"{title}: one error injected after {args.inject_at} tokens, no further quantization",
                out / "feedback.png",
            ).name
            results["feedback"] = ours
        if "row-identity" in selected:
            results["row_identity"] = {"positions": positions}
            for dtype in IDENTITY_DTYPES:
                found = [consumer.identity[key] for key in sorted(consumer.identity) if key[0] == dtype]
                # [P, B, H, K] per batch: streams joined on dim 1, layers on the head dim 2
                direct = torch.cat([torch.cat([d for d, _ in batches], 1) for batches in found], 2)
                predicted = torch.cat([torch.cat([p for _, p in batches], 1) for batches in found], 2)
                results["row_identity"][dtype] = mech.identity_errors(direct, predicted)
        if "geometry" in selected:
            rows = torch.stack(
                [torch.cat([r for r, _ in consumer.contrasts[i]]) for i in sorted(consumer.contrasts)]
            )
            cols = torch.stack(
                [torch.cat([c for _, c in consumer.contrasts[i]]) for i in sorted(consumer.contrasts)]
            )
            ours = mech.geometry_summary(rows, cols)  # rows, cols [L, B, P, H]
            ours["per_position"] = {
                str(p): mech.geometry_summary(rows[:, :, n], cols[:, :, n]) for n, p in enumerate(geometry)
            }
            layer, head = _representative(rows, cols)
            label = (
                f"layer {calibration.linear_layers[layer]}, head {head}, {streams[0]}, after {geometry[-1]} "
                f"tokens: rows {float(rows[layer, 0, -1, head]):.1f}x, "
                f"cols {float(cols[layer, 0, -1, head]):.1f}x"
            )
            ours["surface"] = {
                "layer": int(calibration.linear_layers[layer]),
                "head": head,
                "stream": streams[0],
                "position": geometry[-1],
            }
            figures["geometry"] = plots.plot_state_geometry(
                consumer.surface[layer][head],
                rows,
                cols,
                label,
                f"{title}: max/median RMS contrasts of {ours['snapshots']} state snapshots at {geometry}",
                out / "state_geometry.png",
            ).name
            results["geometry"] = ours

    if "row-identity" in selected or "row-ppl" in selected:
        results["omega_spread"] = mech.omega_spread(calibration.omega)
        results["omega_vs_half_life"] = mech.omega_vs_half_life(calibration.omega, calibration.half_lives)
    if "row-ppl" in selected:
        start = time.perf_counter()
        tokens = torch.cat([segments(s, tokenizer, args.ppl_segments, args.ppl_tokens + 1) for s in sources])
        ours = mech.row_impact_perplexity(
            model,
            tokens,
            calibration.omega,
            prefill_len=args.ppl_prefill,
            groups=args.groups,
            desc="analyze: row-impact perplexity",
        )
        seconds["row-ppl"] = time.perf_counter() - start
        figures["row-ppl"] = plots.plot_row_impact_ppl(
            ours, f"{title}: one row group in INT4", out / "row_impact_ppl.png"
        ).name
        results["row_ppl"] = ours
    if "lifetime-ranks" in selected:
        start = time.perf_counter()
        measured = {}
        for source in sources:
            tokens = segments(source, tokenizer, args.rank_segments, length)
            measured[source] = torch.stack(unit_half_lives(model, tokens, progress=progress))
        ours = {s: mech.lifetime_rank_stability(calibration.half_lives, tau) for s, tau in measured.items()}
        seconds["lifetime-ranks"] = time.perf_counter() - start
        figures["lifetime-ranks"] = plots.plot_lifetime_ranks(
            calibration.half_lives,
            measured,
            ours,
            f"{title}: half-life ranks, calibration text vs others",
            out / "lifetime_ranks.png",
        ).name
        results["lifetime_ranks"] = {
            **ours,
            "half_lives": {s: _round(tau, 4) for s, tau in measured.items()},
            "calibration_half_lives": calibration.half_lives,
        }
    if "bits" in selected:
        start = time.perf_counter()
        results["bits"] = {}
        for path, plan in zip(plan_paths, plans, strict=True):
            name = path.name
            results["bits"][name] = mech.bit_allocation(plan)
            figures[f"bits {name}"] = plots.plot_bit_allocation(
                plan,
                f"{title} {name}: bits per unit vs half-life (top) and omega (bottom)",
                out / f"bits_{name}.png",
            ).name
        seconds["bits"] = time.perf_counter() - start

    seconds["total"] = time.perf_counter() - started
    record = {
        "command": "stepquant analyze " + " ".join(shlex.quote(a) for a in args.argv),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": str(args.model),
        "family": family,
        "plans": [str(p) for p in plan_paths],
        "calibration": calibration.calibration,
        "settings": {
            "data": sources,
            "segments": args.segments,
            "segment_length": length,
            "inject_at": args.inject_at,
            "identity_positions": positions,
            "geometry_positions": geometry,
            "rank_segments": args.rank_segments,
            "ppl_segments": args.ppl_segments,
            "ppl_tokens": args.ppl_tokens,
            "ppl_prefill": args.ppl_prefill,
            "groups": args.groups,
            "threads": args.threads,
            "analyses": selected,
        },
        "seconds": seconds,
        "figures": figures,
        "ours": results,
        "paper": PAPER,
    }
    record = _round(record)
    (out / "analysis.json").write_text(compact_json(record) + "\n")
    if not args.json:
        print(summary_text(record))
    print(
        json.dumps(
            {
                "model": str(args.model),
                "out": str(out),
                "seconds": round(seconds["total"], 1),
                "figures": sorted(figures.values()),
                "numbers": headline(record),
            },
            separators=(",", ":"),
        )
    )
    return 0


def headline(record: dict) -> dict:
    """The numbers the paper reports, from a record (what the last JSON line and the summary show)."""
    ours, out = record["ours"], {}
    if "lifetime_error" in ours:
        out["lifetime_error_spearman"] = ours["lifetime_error"]["spearman"]
    if "feedback" in ours:
        for bits in FEEDBACK_BITS:
            out[f"oracle_over_native_int{bits}"] = ours["feedback"][f"int{bits}"]["ratio"]
            out[f"oracle_over_native_int{bits}_min_trajectory"] = ours["feedback"][f"int{bits}"]["min_ratio"]
    if "row_identity" in ours:
        for dtype in IDENTITY_DTYPES:
            out[f"identity_max_relative_error_{dtype}"] = ours["row_identity"][dtype]["max_relative_error"]
            out[f"identity_max_relative_error_of_position_means_{dtype}"] = ours["row_identity"][dtype][
                "max_relative_error_of_position_means"
            ]
    if "omega_spread" in ours:
        out["omega_p90_over_p10_median"] = ours["omega_spread"]["median"]
    if "row_ppl" in ours:
        out["row_ppl_delta"] = ours["row_ppl"]["delta_ppl"]
        out["row_ppl_spearman"] = ours["row_ppl"]["spearman_group_vs_delta"]
    if "geometry" in ours:
        geometry = ours["geometry"]
        out["median_row_contrast"] = geometry["median_row_contrast"]
        out["median_col_contrast"] = geometry["median_col_contrast"]
        out["share_both_above_3x"] = geometry["share_both_above_3x"]
    if "lifetime_ranks" in ours:
        for source in record["settings"]["data"]:
            out[f"rank_spearman_{source}"] = ours["lifetime_ranks"][source]["spearman"]
            out[f"class_retention_{source}"] = ours["lifetime_ranks"][source]["class_retention"]
    if "bits" in ours:
        for name, result in ours["bits"].items():
            out[f"distortion_ratio_{name}"] = result["lifetime_weighted_distortion"]["ratio_vs_uniform_all"]
    return out


def summary_text(record: dict) -> str:
    """A few readable lines: every headline number."""
    lines = [
        f"stepquant analyze: {record['model']} ({record['family'].upper()}), "
        f"{record['seconds']['total']:.0f} s"
    ]
    lines += [f"  {key}: {value}" for key, value in headline(record).items()]
    lines.append(f"  -> {len(record['figures'])} figures and analysis.json")
    return "\n".join(lines)
