"""Choose the dual-axis fitting defaults by measurement, and compare them with the baselines.

STEPQuant's paper leaves the codebook, the row statistic m_i and the fitting iterations of its spatial
quantizer to an appendix we do not have (docs/method.md section 3). This script measures the candidates of
the kernel-expressible algorithm in stepquant/codecs/dual_axis.py:

    grid {midtread, midrise} x row_stat {absmax, rms} x clip_b {--clips} x refit_iters {--refits}

at every bit width in --bits, on realistic states, by the w^2-weighted reconstruction error the fit
minimises (weighted SQNR in dB and relative weighted MSE, averaged over (sequence, head) states) and
the unweighted SQNR; and compares the chosen configuration with uniform rowwise absmax (the paper's
baseline) and DSQ (Q-Mamba) at the same bits. A short drift probe then runs the quantized serving
loop (X_t = A_t S_hat_{t-1} + B_t, y_t = X_t^T q_t, S_hat_t = Q(X_t)) on the synthetic token stream
and reports the readout error relative to the float loop.

States come from either
  --states FILE.safetensors   a tensor "states" [N, H, K, V] (any float dtype; the serving layout
                              must be transposed to key-row-major first) and optionally "w" [H, K]
                              (row-impact factors > 0; absent = all ones, then weighted = unweighted)
or the built-in synthetic generator (default): the gated delta rule run on structured inputs with the
state geometry the paper reports (heavy key-row AND value-column outliers: max/median row RMS ~10x,
column ~19x) and row-impact factors w = omega^(1/8) measured on the same stream (omega_i =
E[(A_t^T q_t)_i^2], per-head P90/P10 of omega ~5-40). Half of the heads have a scalar gate per head
(GDN), half a gate per key channel (KDA). The drift probe needs the token stream, so it runs only on
synthetic states.

Selection rule (printed, applied to the measurements, never hard-coded): the (grid, row_stat) with the
best mean weighted SQNR over --bits, each bit at its best clip and the largest refit count; then the
smallest refit count within --refit-tolerance-db of the best (every refit is one more pass in the
kernel); then clip_b = the best clip per bit for that configuration.

Prints a table and one final JSON line; writes --out (markdown) unless --out ''.
Example: python -m studies.codec_study                  (synthetic, ~2 min on 2 idle CPU cores)
         python -m studies.codec_study --states snap.safetensors --out '' --drift-steps 0
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import platform
import sys
import time

import torch

from stepquant.calibrate.stats import row_impact_factors
from stepquant.codecs import DSQCodec, DualAxisConfig, Grid, MixedCodec, UniformCodec
from stepquant.codecs import dual_axis as dual_axis_module
from stepquant.codecs.dual_axis import DualAxisCodec, dual_axis_iterates
from stepquant.recurrence import gated_delta_rule, quantized_gated_delta_rule, transition_readout_weights

OMEGA_FLOOR = 1e-8  # relative to the head's largest omega, before the 1/8 power
DSQ_EXPONENTS = (1.0, 0.5)  # the two readings of DSQ's column scale (stepquant/codecs/dsq.py)


# ---------------------------------------------------------------------------------------------------
# synthetic gated-delta-rule states


def synthetic_inputs(
    num_seqs: int, num_heads: int, steps: int, seed: int, key_dim: int = 128, value_dim: int = 128
):
    """Structured token stream: q, k [B, T, H, K] (k L2-normalised, q also * K^-1/2), v [B, T, H, V],
    log-decay g [B, T, H, K] (first half of the heads: one gate per head = GDN; second half: one per key
    channel = KDA), beta [B, T, H]. Each head has fixed log-normal channel profiles for keys, queries and
    values (the source of row and column outliers) and 64 key prototypes (tokens repeat topics)."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
        return low + (high - low) * torch.rand(*shape, generator=gen)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    heads, batch = num_heads, num_seqs
    key_profile = torch.exp(uniform(1.0, 1.6, heads, 1) * randn(heads, key_dim))  # row outliers
    value_profile = torch.exp(uniform(0.9, 1.4, heads, 1) * randn(heads, value_dim))  # column outliers
    query_profile = torch.exp(uniform(0.3, 0.85, heads, 1) * randn(heads, key_dim))  # row impact spread
    prototypes = randn(heads, 64, key_dim)
    is_kda = (torch.arange(heads) >= heads // 2)[:, None]
    half_life_head = torch.exp(uniform(math.log(4), math.log(1000), heads, 1)).expand(heads, key_dim)
    half_life_channel = torch.exp(uniform(math.log(2), math.log(2000), heads, key_dim))
    log_decay = math.log(0.5) / torch.where(is_kda, half_life_channel, half_life_head)  # [H, K]

    pick = torch.randint(0, 64, (batch, steps, heads), generator=gen)
    k = key_profile * (prototypes[torch.arange(heads), pick] + 0.7 * randn(batch, steps, heads, key_dim))
    k = k / k.norm(dim=-1, keepdim=True)
    q = query_profile * randn(batch, steps, heads, key_dim)
    q = q / q.norm(dim=-1, keepdim=True) / math.sqrt(key_dim)
    v = value_profile * randn(batch, steps, heads, value_dim)
    beta = torch.sigmoid(randn(batch, steps, heads) + 0.5)
    g = (log_decay * torch.exp(0.3 * randn(batch, steps, heads, 1))).clamp(max=0.0)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta}


def _sequence(inputs: dict, start: int, stop: int) -> list[torch.Tensor]:
    return [inputs[name][:, start:stop] for name in ("q", "k", "v", "g", "beta")]


def run_delta_rule(inputs: dict, codec=None, start: int = 0, stop: int | None = None, state=None,
                   snapshots=()):
    """The gated delta rule over tokens [start, stop) (stepquant.recurrence): returns (y [B, T', H, V], the
    final state, the states after the tokens listed in ``snapshots``).

    Without a codec the float reference (``gated_delta_rule``, run piecewise between snapshots); with one
    the quantized serving loop (``quantized_gated_delta_rule``: X_t = A_t S_hat_{t-1} + B_t, y_t = X_t^T q_t,
    S_hat_t = Q(X_t), a given state stored through the codec first). q is already scaled (scale 1); g is
    per key channel, so the loops run in KDA mode (a GDN head's channels share one gate).
    """
    stop = inputs["k"].shape[1] if stop is None else stop
    if codec is not None:
        y, final = quantized_gated_delta_rule(*_sequence(inputs, start, stop), codec, state, scale=1.0,
                                              mode="kda")
        return y, final, []
    bounds = sorted({start, stop, *(t for t in snapshots if start < t < stop)})
    outputs, taken = [], []
    for first, last in zip(bounds[:-1], bounds[1:], strict=True):
        y, state = gated_delta_rule(*_sequence(inputs, first, last), state, scale=1.0, mode="kda")
        outputs.append(y)
        if last in snapshots:
            taken.append(state)
    return torch.cat(outputs, dim=1), state, taken


def row_impact(inputs: dict) -> torch.Tensor:
    """omega [H, K] = mean over tokens and sequences of (A_t^T q_t)^2 (recurrence.transition_readout_weights),
    and w = omega^(1/8) after a floor of OMEGA_FLOOR x the head's largest omega, geometric mean 1 per head
    (stepquant.calibrate.stats.row_impact_factors, what calibration computes)."""
    q, k, _, g, beta = _sequence(inputs, 0, None)
    omega = transition_readout_weights(q, k, g, beta).pow(2).mean(dim=(0, 1))
    return row_impact_factors(omega, exponent=1 / 8, floor=OMEGA_FLOOR)


def contrasts(states: torch.Tensor) -> dict:
    """The paper's state-geometry statistics: max/median RMS along key rows and value columns."""
    row_rms = (states**2).mean(-1).sqrt()  # [N, H, K]
    col_rms = (states**2).mean(-2).sqrt()  # [N, H, V]
    row = row_rms.amax(-1) / row_rms.quantile(0.5, dim=-1).clamp_min(1e-30)
    col = col_rms.amax(-1) / col_rms.quantile(0.5, dim=-1).clamp_min(1e-30)
    return {
        "row_max_over_median_rms": row.median().item(),
        "col_max_over_median_rms": col.median().item(),
        "fraction_both_above_3x": ((row > 3) & (col > 3)).float().mean().item(),
    }


def omega_spread(w: torch.Tensor) -> dict:
    omega = w**8
    quantiles = torch.quantile(omega, torch.tensor([0.1, 0.9]), dim=-1)
    ratio = quantiles[1] / quantiles[0]
    return {
        "omega_p90_over_p10_median": ratio.median().item(),
        "w_p90_over_p10_median": (ratio ** (1 / 8)).median().item(),
    }


# ---------------------------------------------------------------------------------------------------
# metrics


def error_metrics(states: torch.Tensor, approx: torch.Tensor, w: torch.Tensor) -> dict:
    """Per (n, h) relative errors, averaged: weighted SQNR (dB), relative weighted MSE, unweighted SQNR."""
    x, diff2 = states.double(), (states.double() - approx.double()) ** 2
    w2 = w.double() ** 2
    weighted = torch.einsum("hk,nhkv->nh", w2, diff2) / torch.einsum("hk,nhkv->nh", w2, x**2).clamp_min(
        1e-300
    )
    plain = diff2.sum((-1, -2)) / (x**2).sum((-1, -2)).clamp_min(1e-300)
    sqnr = lambda e: (-10 * torch.log10(e.clamp_min(1e-30))).mean().item()
    return {"wsqnr_db": sqnr(weighted), "rel_wmse": weighted.mean().item(), "sqnr_db": sqnr(plain)}


# ---------------------------------------------------------------------------------------------------
# the study


def sweep(states, w, bits_list, clips, refits):
    """Every candidate: results[(bits, grid, row_stat, clip, refit)] = metrics."""
    results = {}
    for bits, grid, row_stat, clip in itertools.product(bits_list, Grid, ("absmax", "rms"), clips):
        config = DualAxisConfig(grid=grid, row_stat=row_stat, clip=clip, refit_iters=max(refits))
        plan = torch.full(tuple(states.shape[1:3]), bits, dtype=torch.int8)
        for refit, qstate in enumerate(dual_axis_iterates(states, plan, w, config)):
            if refit in refits:
                results[(bits, grid.value, row_stat, clip, refit)] = error_metrics(
                    states, qstate.dequantize(), w
                )
    return results


def choose(results, bits_list, clips, refits, tolerance_db):
    """Apply the selection rule (module docstring) to the sweep."""

    def best_clip(bits, grid, row_stat, refit):
        return max(clips, key=lambda c: results[(bits, grid, row_stat, c, refit)]["wsqnr_db"])

    def mean_score(grid, row_stat, refit):
        scores = [
            results[(b, grid, row_stat, best_clip(b, grid, row_stat, refit), refit)]["wsqnr_db"]
            for b in bits_list
        ]
        return sum(scores) / len(scores)

    pairs = [(g.value, s) for g in Grid for s in ("absmax", "rms")]
    grid, row_stat = max(pairs, key=lambda p: mean_score(*p, max(refits)))
    by_refit = {r: mean_score(grid, row_stat, r) for r in refits}
    refit = min(r for r in refits if by_refit[r] >= max(by_refit.values()) - tolerance_db)
    clip = {b: best_clip(b, grid, row_stat, refit) for b in bits_list}
    other_grid = next(g.value for g in Grid if g.value != grid)
    return {
        "other_grid": other_grid,
        "other_grid_clip": {b: best_clip(b, other_grid, row_stat, refit) for b in bits_list},
        "grid": grid,
        "row_stat": row_stat,
        "refit_iters": refit,
        "clip": clip,
        "mean_wsqnr_by_pair": {f"{g}/{s}": mean_score(g, s, max(refits)) for g, s in pairs},
        "mean_wsqnr_by_refit": by_refit,
    }


def chosen_config(chosen: dict, bits: int, other_grid: bool = False) -> DualAxisConfig:
    """The chosen configuration (clip of `bits` from the sweep when it was studied, else the default);
    other_grid: the same but on the other grid, at that grid's best clip."""
    grid, clips = (
        (chosen["other_grid"], chosen["other_grid_clip"]) if other_grid else (chosen["grid"], chosen["clip"])
    )
    clip = {bits: clips[bits]} if bits in clips else {}
    return DualAxisConfig(
        grid=grid, row_stat=chosen["row_stat"], clip=clip, refit_iters=chosen["refit_iters"]
    )


def choose_dsq(base: dict, bits_list) -> float:
    """The DSQ column exponent with the better mean weighted SQNR over bits (the stronger baseline)."""
    score = lambda e: sum(base[(b, f"DSQ col^{e:g}")]["wsqnr_db"] for b in bits_list)
    return max(DSQ_EXPONENTS, key=score)


def baseline_codecs(bits: int, w, chosen) -> dict:
    """Uniform rowwise absmax, DSQ (two column exponents), dual-axis w=1 and with w at ``bits``."""
    config = chosen_config(chosen, bits)
    return {
        "int (rowwise absmax)": UniformCodec(bits),
        **{f"DSQ col^{e:g}": DSQCodec(bits, col_exponent=e) for e in DSQ_EXPONENTS},
        "dual w=1": DualAxisCodec(bits, None, config),
        "dual w (STEPQuant spatial)": DualAxisCodec(bits, w, config),
    }


def baselines(states, w, bits_list, chosen):
    """The baseline codecs' reconstruction errors, per bit."""
    out = {}
    for bits in bits_list:
        for name, codec in baseline_codecs(bits, w, chosen).items():
            out[(bits, name)] = error_metrics(states, codec.roundtrip(states), w)
    return out


def drift_probe(inputs, w, bits_list, chosen, prefill: int, steps: int):
    """Readout error of the quantized serving loop vs the float loop after a float prefill."""
    _, state, _ = run_delta_rule(inputs, stop=prefill)
    y_ref, _, _ = run_delta_rule(inputs, start=prefill, stop=prefill + steps, state=state)
    out = {}
    for bits in bits_list:
        codecs = {
            **baseline_codecs(bits, w, chosen),
            f"dual w, {chosen['other_grid']} grid": DualAxisCodec(bits, w, chosen_config(chosen, bits, True)),
        }
        for name, codec in codecs.items():
            y, _, _ = run_delta_rule(inputs, codec, start=prefill, stop=prefill + steps, state=state)
            err = ((y - y_ref) ** 2).sum((1, 3)) / (y_ref**2).sum((1, 3)).clamp_min(1e-30)  # [B, H]
            last = ((y - y_ref)[:, -steps // 4 :] ** 2).sum((1, 3)) / (y_ref[:, -steps // 4 :] ** 2).sum(
                (1, 3)
            )
            out[(bits, name)] = {
                "readout_snr_db": (-10 * torch.log10(err)).mean().item(),
                "readout_snr_last_quarter_db": (-10 * torch.log10(last)).mean().item(),
            }
    return out


def lifetime_plan(inputs, nominal_bits: int) -> torch.Tensor:
    """A toy temporal plan [H, K] for the mixed-codec probe: GDN heads (one gate per head) at the nominal
    bits; in KDA heads the longest-lived quarter of the key rows (mean log-decay closest to 0) gets +2
    bits, the shortest-lived quarter -2, the rest nominal (clamped to 2..8)."""
    mean_log_decay = inputs["g"].mean(dim=(0, 1))  # [H, K]
    heads, key_dim = mean_log_decay.shape
    plan = torch.full((heads, key_dim), nominal_bits)
    is_gdn = (mean_log_decay == mean_log_decay[:, :1]).all(dim=1)  # [H]
    rank = mean_log_decay.argsort(dim=1).argsort(dim=1)  # 0 = shortest-lived row of the head
    plan = torch.where(rank >= key_dim - key_dim // 4, nominal_bits + 2, plan)
    plan = torch.where(rank < key_dim // 4, nominal_bits - 2, plan)
    plan = torch.where(is_gdn[:, None], nominal_bits, plan)
    return plan.clamp(2, 8)


def mixed_drift_probe(inputs, w, bits_list, chosen, prefill: int, steps: int):
    """The drift probe for plan-driven mixed codecs: the w^2 refit vs the step-normalised refit."""
    _, state, _ = run_delta_rule(inputs, stop=prefill)
    y_ref, _, _ = run_delta_rule(inputs, start=prefill, stop=prefill + steps, state=state)
    out = {}
    for bits in bits_list:
        plan = lifetime_plan(inputs, bits)
        is_mixed = plan.amax(1) != plan.amin(1)  # [H]
        config = chosen_config(chosen, bits)
        plain = dataclasses.replace(config, step_normalised_refit=False)
        normalised = dataclasses.replace(config, step_normalised_refit=True)
        codecs = {
            "mixed absmax (temporal only)": MixedCodec(plan, spatial="absmax"),
            "mixed dual w, w^2 refit": MixedCodec(plan, w, config=plain),
            "mixed dual w, step-normalised refit": MixedCodec(plan, w, config=normalised),
        }
        for name, codec in codecs.items():
            y, _, _ = run_delta_rule(inputs, codec, start=prefill, stop=prefill + steps, state=state)
            snr = -10 * torch.log10(((y - y_ref) ** 2).sum((1, 3)) / (y_ref**2).sum((1, 3)))  # [B, H]
            out[(bits, name)] = {
                "readout_snr_db": snr.mean().item(),
                "readout_snr_mixed_heads_db": snr[:, is_mixed].mean().item(),
            }
    return out


# ---------------------------------------------------------------------------------------------------
# report


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def build_tables(results, base, drift, mixed_drift, chosen, bits_list, clips, refits):
    tables = {}
    header = ["grid / row_stat / refits"] + [f"{b} bit" for b in bits_list]
    rows = []
    for grid, row_stat, refit in itertools.product([g.value for g in Grid], ("absmax", "rms"), refits):
        cells = []
        for b in bits_list:
            clip = max(clips, key=lambda c: results[(b, grid, row_stat, c, refit)]["wsqnr_db"])
            cells.append(f"{results[(b, grid, row_stat, clip, refit)]['wsqnr_db']:.2f} ({clip:g})")
        rows.append([f"{grid} / {row_stat} / {refit}"] + cells)
    tables["candidates"] = markdown_table(header, rows)

    grid, row_stat, refit = chosen["grid"], chosen["row_stat"], chosen["refit_iters"]
    rows = [
        [f"{c:g}"] + [f"{results[(b, grid, row_stat, c, refit)]['wsqnr_db']:.2f}" for b in bits_list]
        for c in clips
    ]
    tables["clips"] = markdown_table(["clip_b"] + [f"{b} bit" for b in bits_list], rows)

    names = sorted({name for _, name in base}, key=lambda n: [k[1] for k in base].index(n))
    header = ["codec"] + [f"{b} bit: wSQNR / SQNR dB" for b in bits_list]
    rows = [
        [n] + [f"{base[(b, n)]['wsqnr_db']:.2f} / {base[(b, n)]['sqnr_db']:.2f}" for b in bits_list]
        for n in names
    ]
    tables["baselines"] = markdown_table(header, rows)
    rows = [[n] + [f"{base[(b, n)]['rel_wmse']:.3e}" for b in bits_list] for n in names]
    tables["baselines_mse"] = markdown_table(["codec"] + [f"{b} bit rel. wMSE" for b in bits_list], rows)

    if drift:
        drift_bits = sorted({b for b, _ in drift})
        names = sorted({n for _, n in drift}, key=lambda n: [k[1] for k in drift].index(n))
        header = ["codec"] + [f"{b} bit: all / last quarter" for b in drift_bits]
        rows = [
            [n]
            + [
                f"{drift[(b, n)]['readout_snr_db']:.2f} / {drift[(b, n)]['readout_snr_last_quarter_db']:.2f}"
                for b in drift_bits
            ]
            for n in names
        ]
        tables["drift"] = markdown_table(header, rows)
    if mixed_drift:
        drift_bits = sorted({b for b, _ in mixed_drift})
        names = sorted({n for _, n in mixed_drift}, key=lambda n: [k[1] for k in mixed_drift].index(n))
        header = ["codec"] + [f"{b}-bit plan: all heads / mixed-bit heads" for b in drift_bits]
        mixed_keys = ("readout_snr_db", "readout_snr_mixed_heads_db")
        rows = [
            [n]
            + [
                "{:.2f} / {:.2f}".format(*(mixed_drift[(b, n)][key] for key in mixed_keys))
                for b in drift_bits
            ]
            for n in names
        ]
        tables["mixed_drift"] = markdown_table(header, rows)
    return tables


def findings(results, base, drift, chosen, bits_list) -> list[str]:
    """One-line measured comparisons for the report (every number computed from this run)."""
    lines = []
    spatial, plain = "dual w (STEPQuant spatial)", "dual w=1"
    dsq = f"DSQ col^{chosen['dsq_col_exponent']:g}"
    for b in bits_list:
        gain_int = base[(b, spatial)]["wsqnr_db"] - base[(b, "int (rowwise absmax)")]["wsqnr_db"]
        gain_dsq = base[(b, spatial)]["wsqnr_db"] - base[(b, dsq)]["wsqnr_db"]
        text = f"{b} bits: STEPQuant spatial {gain_int:+.2f} dB weighted SQNR vs rowwise absmax, "
        text += f"{gain_dsq:+.2f} dB vs {dsq}"
        if (b, spatial) in drift:
            d_int = (
                drift[(b, spatial)]["readout_snr_db"] - drift[(b, "int (rowwise absmax)")]["readout_snr_db"]
            )
            d_dsq = drift[(b, spatial)]["readout_snr_db"] - drift[(b, dsq)]["readout_snr_db"]
            d_w = drift[(b, spatial)]["readout_snr_db"] - drift[(b, plain)]["readout_snr_db"]
            text += f"; drift readout SNR {d_int:+.2f} dB vs absmax, {d_dsq:+.2f} dB vs {dsq}, "
            text += f"{d_w:+.2f} dB vs w=1"
        lines.append(text + ".")
    w_effect = [base[(b, spatial)]["wsqnr_db"] - base[(b, plain)]["wsqnr_db"] for b in bits_list]
    lines.append(
        f"Row-impact factors (w vs w=1) change the weighted SQNR by {min(w_effect):+.2f} to "
        f"{max(w_effect):+.2f} dB over the bits (w = omega^(1/8) spans little, see Data)."
    )
    row_stat, refit = chosen["row_stat"], chosen["refit_iters"]

    def best(grid, b):
        return max(
            v["wsqnr_db"]
            for k, v in results.items()
            if k[0] == b and k[1:3] == (grid, row_stat) and k[4] == refit
        )

    grid_gain = {b: best("midrise", b) - best("midtread", b) for b in bits_list}
    lines.append(
        "Mid-rise minus mid-tread grid (best clip each, "
        f"{row_stat}, {refit} refits): "
        + ", ".join(f"{b} bits {g:+.2f} dB" for b, g in grid_gain.items())
        + "."
    )
    return lines


def write_markdown(path, args, meta, chosen, tables, elapsed, defaults_match, finding_lines):
    clip_text = ", ".join(f"{b}: {c:g}" for b, c in chosen["clip"].items())
    by_pair = ", ".join(f"{p} {v:.2f} dB" for p, v in chosen["mean_wsqnr_by_pair"].items())
    by_refit = ", ".join(f"{r}: {v:.2f} dB" for r, v in chosen["mean_wsqnr_by_refit"].items())
    spread = meta["spread"]
    text = f"""# Codec study: choosing the dual-axis fitting defaults

Generated by `studies/codec_study.py` (do not edit by hand; rerun it). Command:
`{meta["command"]}`; machine: {meta["machine"]}; torch {torch.__version__}; {meta["date"]}; {elapsed:.0f} s.

## Data

{meta["data"]}

Measured state geometry: median max/median key-row RMS {meta["contrasts"]["row_max_over_median_rms"]:.1f}x,
value-column RMS {meta["contrasts"]["col_max_over_median_rms"]:.1f}x, both above 3x in
{100 * meta["contrasts"]["fraction_both_above_3x"]:.1f}% of (sequence, head) states (paper, Qwen on C4:
10.3x, 19.4x, 98.6%). Row impact: median per-head P90/P10 of omega
{spread["omega_p90_over_p10_median"]:.1f} (paper: 15.95), i.e. {spread["w_p90_over_p10_median"]:.2f}
in w = omega^(1/8).

To repeat the study on states captured from a model: save a safetensors file with a float tensor
`states` [N, H, K, V] (key-row-major; transpose the serving layout [N, H, V, K] first) and, optionally,
the calibrated row-impact factors `w` [H, K] (> 0), then run
`python -m studies.codec_study --states FILE.safetensors` (the drift probes need the synthetic token
stream and are skipped; without `w` the weighted metrics equal the unweighted ones).

## Metric

Per (sequence, head) state X [K, V]: relative weighted MSE e_w = sum w_i^2 (X - X_hat)^2 / sum w_i^2 X^2
(the objective the fit minimises; docs/method.md section 3), weighted SQNR = -10 log10 e_w, and the
unweighted SQNR (w = 1); each averaged over all (sequence, head) states (SQNR: mean of the dB values).

## Chosen defaults (stepquant/codecs/dual_axis.py)

- grid **{chosen["grid"]}**, row_stat **{chosen["row_stat"]}** (mean weighted SQNR over {args.bits} bits
  at each bit's best clip, {max(args.refits)} refits: {by_pair}).
- refit_iters **{chosen["refit_iters"]}**: the smallest count within {args.refit_tolerance_db} dB of the best
  (mean weighted SQNR by refits: {by_refit}).
- clip_b: {clip_text}.
- DSQ baseline: column exponent **{chosen["dsq_col_exponent"]:g}** (of {list(DSQ_EXPONENTS)}, the better mean
  weighted SQNR over bits: the comparison is against the stronger reading of DSQ).
- Defaults in dual_axis.py match this run: **{defaults_match}**.

Selection rule: best (grid, row_stat) by mean weighted SQNR over bits (each bit at its best clip,
the most refits); then the fewest refits within the tolerance; then the best clip per bit.

## Findings (computed from the tables below)

{chr(10).join("- " + line for line in finding_lines)}

## Candidates: weighted SQNR dB (best clip_b in parentheses)

{tables["candidates"]}

## Clip ratio for the chosen grid / row_stat / refits: weighted SQNR dB

{tables["clips"]}

## Against the baselines at the same bits

Weighted / unweighted SQNR in dB (higher is better). Storage per 128x128 head: int b + 0.125 bits/value
(row scales), DSQ and dual-axis b + 0.25 (row + column scales).

{tables["baselines"]}

{tables["baselines_mse"]}
"""
    if "drift" in tables:
        text += f"""
## Drift probe: quantized serving loop vs float loop

{meta["drift"]}
Readout SNR in dB (higher is better) = -10 log10 of sum (y_hat - y)^2 / sum y^2 per (sequence, head),
averaged; over all decode tokens / over the last quarter.

{tables["drift"]}
"""
    if "mixed_drift" in tables:
        text += f"""
## Drift probe: plan-driven mixed bits (KDA rows), w^2 refit vs step-normalised refit

The same loop with `MixedCodec` and a toy lifetime plan per nominal budget b: GDN heads at b bits; in
each KDA head the longest-lived quarter of the key rows at b+2, the shortest-lived quarter at b-2, the
rest at b (`lifetime_plan`). Readout SNR in dB over all heads / over the heads with mixed bit widths.
The w^2 refit (the paper's objective) lowers a mixed head's total weighted error by moving the shared
column scales towards its low-bit rows; the step-normalised refit weights each row's error in units of
its own step. Default chosen here: step_normalised_refit = **{chosen["step_normalised_refit"]}** (the
better mean readout SNR of the mixed-bit heads over the budgets).

{tables["mixed_drift"]}
"""
    with open(path, "w") as f:
        f.write(text)


def parse_list(text: str, cast):
    return [cast(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--states", default="", help="safetensors file with 'states' [N,H,K,V] and optional 'w' [H,K]"
    )
    parser.add_argument("--bits", default="2,3,4,5,6,7,8", help="bit widths to study (comma-separated)")
    parser.add_argument("--clips", default="1.0,0.95,0.9,0.85,0.8,0.7,0.6,0.5", help="clip_b candidates")
    parser.add_argument("--refits", default="0,1,2,3", help="refit_iters candidates")
    parser.add_argument(
        "--refit-tolerance-db", type=float, default=0.05, help="dB a cheaper refit count may lose"
    )
    parser.add_argument("--seqs", type=int, default=4, help="synthetic: sequences")
    parser.add_argument("--heads", type=int, default=16, help="synthetic: heads (half GDN, half KDA gates)")
    parser.add_argument("--steps", type=int, default=1024, help="synthetic: tokens per sequence")
    parser.add_argument("--snapshots", default="128,512,1024", help="synthetic: token positions to snapshot")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drift-bits", default="4,6", help="bit widths of the drift probe")
    parser.add_argument("--drift-prefill", type=int, default=128, help="float tokens before quantized decode")
    parser.add_argument("--drift-steps", type=int, default=256, help="quantized decode tokens (0 = no probe)")
    parser.add_argument("--drift-seqs", type=int, default=2, help="sequences in the drift probe")
    parser.add_argument("--out", default="docs/codec_study.md", help="markdown report ('' = do not write)")
    args = parser.parse_args(argv)
    args.bits = parse_list(args.bits, int)
    args.clips = parse_list(args.clips, float)
    args.refits = sorted(parse_list(args.refits, int))
    start_time = time.time()

    meta = {
        "command": " ".join(["python -m studies.codec_study", *(sys.argv[1:] if argv is None else argv)]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.1f} at start",
        "date": datetime.date.today().isoformat(),
    }
    inputs = None
    if args.states:
        from safetensors.torch import load_file

        tensors = load_file(args.states)
        if "states" not in tensors:
            raise SystemExit(f"{args.states}: no tensor named 'states' (found {sorted(tensors)})")
        states = tensors["states"].to(torch.float32)
        if states.dim() != 4:
            raise SystemExit(f"{args.states}: 'states' must be [N, H, K, V], got {list(states.shape)}")
        w = tensors.get("w")
        w = torch.ones(states.shape[1:3]) if w is None else w.to(torch.float32)
        has_w = "w" in tensors
        meta["data"] = (
            f"`{args.states}`: states {list(states.shape)}"
            + ("" if has_w else " (no 'w' in the file: w = 1, weighted = unweighted)")
            + "."
        )
    else:
        snapshots = parse_list(args.snapshots, int)
        inputs = synthetic_inputs(args.seqs, args.heads, max(args.steps, max(snapshots)), args.seed)
        _, _, taken = run_delta_rule(inputs, snapshots=set(snapshots))
        states = torch.cat(taken)  # [snapshots * seqs, H, K, V]
        w = row_impact(inputs)
        meta["data"] = (
            f"Synthetic gated delta rule (`synthetic_inputs`, seed {args.seed}): {args.seqs} sequences x "
            f"{args.heads} heads ({args.heads // 2} GDN gates, {args.heads - args.heads // 2} KDA gates) of "
            f"128x128, snapshots after tokens {snapshots}: {states.shape[0]} x {args.heads} head states. "
            "Row-impact factors w = omega^(1/8) (geometric mean 1 per head, as calibration computes them) "
            "from the same stream."
        )
    meta["contrasts"] = contrasts(states)
    meta["spread"] = omega_spread(w)
    print(
        f"states {list(states.shape)}  geometry {json.dumps(meta['contrasts'])}  {json.dumps(meta['spread'])}"
    )

    results = sweep(states, w, args.bits, args.clips, args.refits)
    chosen = choose(results, args.bits, args.clips, args.refits, args.refit_tolerance_db)
    base = baselines(states, w, args.bits, chosen)
    drift, mixed_drift = {}, {}
    if inputs is not None and args.drift_steps > 0:
        drift_inputs = {k: v[: args.drift_seqs] for k, v in inputs.items()}
        drift_seqs = drift_inputs["k"].shape[0]
        drift = drift_probe(
            drift_inputs, w, parse_list(args.drift_bits, int), chosen, args.drift_prefill, args.drift_steps
        )
        mixed_drift = mixed_drift_probe(
            drift_inputs, w, parse_list(args.drift_bits, int), chosen, args.drift_prefill, args.drift_steps
        )
        gains = [
            mixed_drift[(b, "mixed dual w, step-normalised refit")]["readout_snr_mixed_heads_db"]
            - mixed_drift[(b, "mixed dual w, w^2 refit")]["readout_snr_mixed_heads_db"]
            for b in parse_list(args.drift_bits, int)
        ]
        chosen["step_normalised_refit"] = sum(gains) / len(gains) > 0
        meta["drift"] = (
            f"{drift_seqs} synthetic sequences x {args.heads} heads: {args.drift_prefill} float prefill "
            f"tokens, then {args.drift_steps} decode tokens, the state stored through the codec after each."
        )
    tables = build_tables(results, base, drift, mixed_drift, chosen, args.bits, args.clips, args.refits)
    for key in ("candidates", "clips", "baselines", "baselines_mse", "drift", "mixed_drift"):
        if key in tables:
            print(f"\n{key}\n{tables[key]}")

    defaults = {
        "grid": dual_axis_module.DEFAULT_GRID.value,
        "row_stat": dual_axis_module.DEFAULT_ROW_STAT,
        "refit_iters": dual_axis_module.DEFAULT_REFIT_ITERS,
        "clip": {b: dual_axis_module.DEFAULT_CLIP[b - 2] for b in args.bits},
    }
    chosen["dsq_col_exponent"] = choose_dsq(base, args.bits)
    defaults["dsq_col_exponent"] = DSQCodec(2).col_exponent
    if "step_normalised_refit" in chosen:
        defaults["step_normalised_refit"] = DualAxisConfig().step_normalised_refit
    defaults_match = all(defaults[k] == chosen[k] for k in defaults)
    finding_lines = findings(results, base, drift, chosen, args.bits)
    print("\n" + "\n".join(finding_lines))
    elapsed = time.time() - start_time
    if args.out:
        write_markdown(args.out, args, meta, chosen, tables, elapsed, defaults_match, finding_lines)
        print(f"\nwrote {args.out}")
    summary = {
        "chosen": {k: chosen[k] for k in defaults},
        "defaults_match": defaults_match,
        "geometry": meta["contrasts"],
        "row_impact": meta["spread"],
        "baselines": {f"{n}@{b}": round(m["wsqnr_db"], 3) for (b, n), m in base.items()},
        "drift_readout_snr_db": {f"{n}@{b}": round(m["readout_snr_db"], 3) for (b, n), m in drift.items()},
        "mixed_drift_readout_snr_mixed_heads_db": {
            f"{n}@{b}": round(m["readout_snr_mixed_heads_db"], 3) for (b, n), m in mixed_drift.items()
        },
        "seconds": round(elapsed, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
