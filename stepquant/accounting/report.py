"""The memory report: every number ``stepquant memory`` prints, as a JSON-ready dict and as tables."""

from __future__ import annotations

from stepquant.codecs.base import check_bits
from stepquant.families import ModelShape

from .capacity import GIB, MIB, capacity, max_batch
from .formulas import (
    StateBytes,
    _check_shape,
    default_pivots,
    dsq_bytes,
    float_bytes,
    int_rowwise_bytes,
    measured_bytes,
    stepquant_bytes,
)


def memory_report(shape: ModelShape, bits: int, pivots: int | None = None, batch: int = 64,
                  slots_per_request: int = 5, context_tokens: int = 0,
                  measured: int | None = None, plan: StateBytes | None = None,
                  budget_bytes: int | None = None, extra: tuple[StateBytes, ...] = ()) -> dict:
    """Every number ``stepquant memory`` prints, as a JSON-ready dict.

    budget_bytes: a GPU memory budget; each capacity row then gets ``max_batch``, the largest B whose total
    (weights + state slots + KV) fits it, per weight format (:func:`stepquant.accounting.max_batch`).
    extra: more formats for the bytes table (e.g. ``codec_bytes`` of an error-feedback codec)."""
    _check_shape(shape)
    check_bits(bits)
    pivots_source = "given"
    if pivots is None:
        pivots = default_pivots(shape, bits)
        pivots_source = f"default: the paper's share ({shape.family.paper_pivot_text}), rounded"
        if pivots < default_pivots(shape):
            pivots_source += f", capped at what a {bits}-bit budget pays for"
    formats = [float_bytes(shape, 32), float_bytes(shape, 16), int_rowwise_bytes(shape, bits),
               dsq_bytes(shape, bits), stepquant_bytes(shape, bits, pivots)]
    if plan is not None:
        formats.append(plan)
    formats.extend(extra)
    if measured is not None:
        formats.append(measured_bytes(shape, measured, f"measured ({measured:,} B)"))
    step = formats[4]
    capacities = [capacity(shape, fmt, batch, slots_per_request, context_tokens) for fmt in formats[:4]]
    capacities.append(capacity(shape, step, batch, slots_per_request, context_tokens))
    capacities.append(capacity(shape, step, batch, slots_per_request, context_tokens, serving=True))
    capacity_rows = []
    for cap, kind in zip(capacities, ["", "", "", "", " analytical", " serving"], strict=True):
        row = cap.as_dict()
        row["format"] = cap.label + kind
        if context_tokens:
            row["kv_bytes"] = cap.kv_bytes
        row["total_bytes"] = {w: cap.total_bytes(size) for w, size in shape.weight_bytes}
        if budget_bytes is not None:
            state = cap.state_bytes
            row["max_batch"] = {
                w: max_batch(shape, state, budget_bytes, size, slots_per_request, context_tokens)
                for w, size in (shape.weight_bytes or (("none", 0),))}
        capacity_rows.append(row)
    return {
        "model": shape.name,
        "mixer": shape.family.name,
        "linear_layers": shape.linear_layers,
        "heads": shape.heads,
        "key_dim": shape.key_dim,
        "value_dim": shape.value_dim,
        "values_per_request": shape.values,
        "bits": bits,
        "pivots": pivots,
        "pivot_unit": shape.family.unit,
        "pivots_source": pivots_source,
        "num_units": shape.num_units,
        "formats": [fmt.as_dict() for fmt in formats],
        "capacity": {
            "batch": batch,
            "slots_per_request": slots_per_request,
            "slots": slots_per_request * batch + 1,
            "context_tokens": context_tokens,
            "conv_state_bytes": shape.conv_state_bytes,
            "kv_bytes_per_token": shape.kv_bytes_per_token,
            "weight_bytes": dict(shape.weight_bytes),
            "budget_bytes": budget_bytes,
            "rows": capacity_rows,
        },
    }


def format_report(report: dict) -> str:
    """The human-readable tables of ``stepquant memory``."""
    lines = []
    n_units, pivots = report["num_units"], report["pivots"]
    unit = report["pivot_unit"]
    lines.append(
        f"model {report['model']}: {report['mixer'].upper()}, {report['linear_layers']} linear-attention "
        f"layers x {report['heads']} heads of {report['key_dim']}x{report['value_dim']} = "
        f"{report['values_per_request']:,} state values/request"
    )
    share = pivots / n_units if n_units else 0.0
    lines.append(f"pivots: {pivots:,} FP16 {unit}s of {n_units:,} ({share * 100:.3g}%; "
                 f"{report['pivots_source']})")
    lines.append("")
    header = (f"{'format (bytes per request)':<34} {'analytical':>15} {'serving':>15} {'bits/value':>10} "
              f"{'serving':>8} {'vs FP32':>8} {'serving':>8}")
    lines += [header, "-" * len(header)]
    for fmt in report["formats"]:
        lines.append(
            f"{fmt['format']:<34} {fmt['analytical_bytes']:>15,} {fmt['serving_bytes']:>15,} "
            f"{fmt['bits_per_value']:>10.4f} {fmt['serving_bits_per_value']:>8.4f} "
            f"{fmt['ratio_vs_fp32']:>7.2f}x {fmt['serving_ratio_vs_fp32']:>7.2f}x"
        )
    step = report["formats"][4]
    fp32 = report["formats"][0]
    lines.append("")
    lines.append(
        f"{step['format']}: {step['bits_per_value']:.2f} bits/value, "
        f"{step['analytical_bytes'] / MIB:.4f} MiB analytical / "
        f"{step['serving_bytes'] / MIB:.4f} MiB serving vs {fp32['analytical_bytes'] / MIB:.4f} MiB FP32 "
        f"({step['ratio_vs_fp32']:.2f}x / {step['serving_ratio_vs_fp32']:.2f}x)"
    )
    for fmt in report["formats"][5:]:
        lines.append(
            f"{fmt['format']}: {fmt['bits_per_value']:.4f} bits/value, {fmt['ratio_vs_fp32']:.4f}x vs FP32 "
            f"({fmt['analytical_bytes'] / MIB:.4f} MiB)"
        )

    cap = report["capacity"]
    lines.append("")
    conv = cap["conv_state_bytes"]
    conv_text = f"conv state {conv:,} B kept as is" if conv is not None else "conv state unknown, left out"
    lines.append(
        f"capacity: ({cap['slots_per_request']} x B + 1) state slots at B={cap['batch']} = "
        f"{cap['slots']:,} slots; slot = recurrent state + {conv_text}"
    )
    weights = cap["weight_bytes"]
    header = f"{'state format':<45} {'slot MiB':>10} {'pool GiB':>10}"
    if cap["context_tokens"]:
        header += f" {'KV GiB':>8}"
    for w in weights:
        header += f" {'total GiB (' + w + ')':>18}"
    lines += [header, "-" * len(header)]
    for row in cap["rows"]:
        line = f"{row['format']:<45} {row['slot_mib']:>10.4f} {row['pool_bytes'] / GIB:>10.2f}"
        if cap["context_tokens"]:
            kv = row.get("kv_bytes")
            line += f" {kv / GIB:>8.2f}" if kv is not None else f" {'unknown':>8}"
        for w in weights:
            total = row["total_bytes"][w]
            line += f" {total / GIB:>18.2f}" if total is not None else f" {'unknown':>18}"
        lines.append(line)
    if weights:
        listed = [f"{w} {size:,} B ({size / GIB:.2f} GiB)" for w, size in weights.items()]
        lines.append("weights: " + "; ".join(listed))
    else:
        lines.append("weights: unknown (not given for this model)")
    kv = cap["kv_bytes_per_token"]
    kv_text = f"{kv:,} B/token" if kv is not None else "unknown"
    lines.append(f"attention KV: {kv_text}; context {cap['context_tokens']:,} tokens/request in the totals")
    if cap.get("budget_bytes") is not None:
        lines.append("")
        lines.append(f"largest batch in a budget of {cap['budget_bytes'] / GIB:.2f} GiB (weights + "
                     f"({cap['slots_per_request']} x B + 1) slots + B x {cap['context_tokens']:,} "
                     "tokens of KV):")
        for row in cap["rows"]:
            fits = ", ".join(f"{b:,} ({w} weights)" for w, b in row["max_batch"].items())
            lines.append(f"  {row['format']:<43} B = {fits}")
    return "\n".join(lines)
