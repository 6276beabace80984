"""The paper's mechanism analyses as functions, on captured recurrences or calibration arrays.

Every analysis of docs/analysis.md is here, computed from what stepquant already has: the recurrence
inputs a model fed its linear-attention layers (calibrate.observers.RecurrenceCapture, one layer and a
batch of streams), the float reference and quantized loops of stepquant.recurrence, and a calibrated
plan's arrays (half-lives, omega, lifetime weights, distortion table). Per-capture functions return
tensors with the streams in the leading dimension, so a command can stream layer by layer; the
summaries turn the pooled tensors into the numbers the paper reports.

    1  lifetime predicts error    unit_state_error (per layer) -> lifetime_error            (Fig. 1b, B1c)
    2  native vs oracle feedback  feedback_errors (per layer) -> feedback_summary           (Appendix B)
    3a row-impact identity        row_impact_identity (per layer)                           (Appendix B)
    3b row-impact perplexity      row_impact_groups, RowGroupCodec, row_impact_perplexity   (Fig. 2a)
       row-impact spread          omega_spread                                              (Appendix B)
    4  state geometry             states_at, outlier_contrasts -> geometry_summary          (Sec. 4.2)
    5  lifetime ranks             lifetime_classes, lifetime_rank_stability                 (Fig. B3)
    6  where the bits went        bit_allocation (of a Plan)

Units are those of allocation (docs/method.md section 3): a GDN head ([*, H]) or a KDA key row
([*, H, K]). All summaries use full-population Spearman correlations (average ranks for ties).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from stepquant.calibrate.stats import DEFAULT_OMEGA_FLOOR
from stepquant.codecs import CastCodec, Codec, UniformCodec
from stepquant.codecs.base import as_fp32, check_bits, check_dims
from stepquant.families import linear_layers as linear_layers_of
from stepquant.recurrence import (
    FEEDBACKS,
    gated_delta_rule,
    prepare_qk,
    quantized_gated_delta_rule,
    step,
    transition_readout_weights,
)

LIFETIME_CLASSES = (
    "short",
    "middle",
    "long",
)  # within-layer half-life ranks: lowest quarter, middle half, top


# ---------------------------------------------------------------- ranks


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks of the flattened x (float64), ties sharing their average rank (scipy's rankdata)."""
    flat = torch.as_tensor(x).reshape(-1).to(torch.float64)
    if bool(torch.isnan(flat).any()):
        raise ValueError("cannot rank NaN values")
    order = torch.argsort(flat, stable=True)
    _, inverse, counts = torch.unique_consecutive(flat[order], return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).to(torch.float64)
    ranks = torch.empty_like(flat)
    ranks[order] = (ends - (counts.to(torch.float64) - 1) / 2)[inverse]
    return ranks


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman's rank correlation of two equally sized tensors (nan when either is constant)."""
    rx, ry = average_ranks(x), average_ranks(y)
    if rx.numel() != ry.numel():
        raise ValueError(f"spearman needs equally many values, got {rx.numel()} and {ry.numel()}")
    rx, ry = rx - rx.mean(), ry - ry.mean()
    norm = math.sqrt(float((rx * rx).sum()) * float((ry * ry).sum()))
    return float((rx * ry).sum()) / norm if norm > 0 else math.nan


def percentile_ranks(x: torch.Tensor) -> torch.Tensor:
    """Global ranks of the flattened x as percentiles in (0, 100] (shortest first, as Fig. B3 plots them)."""
    ranks = average_ranks(x)
    return 100.0 * ranks / ranks.numel()


# ---------------------------------------------------------------- helpers on captures


def _inputs(capture, start: int = 0, stop: int | None = None):
    part = slice(start, stop)
    return tuple(x[:, part] for x in (capture.q, capture.k, capture.v, capture.g, capture.beta))


def _run(capture, start: int, stop: int | None, state: torch.Tensor | None, **kwargs):
    return gated_delta_rule(
        *_inputs(capture, start, stop),
        initial_state=state,
        use_qk_l2norm=capture.use_qk_l2norm,
        mode=capture.family,
        **kwargs,
    )


def unit_sum(values: torch.Tensor, family: str) -> torch.Tensor:
    """[..., H, K, V] summed over each unit's values: [..., H] (GDN head) or [..., H, K] (KDA key row)."""
    per_row = values.sum(dim=-1)
    return per_row.sum(dim=-1) if family == "gdn" else per_row


def states_at(capture, positions: Sequence[int]) -> torch.Tensor:
    """FP32 reference states after ``p`` tokens for every p in positions (1 <= p <= T): [B, P, H, K, V]."""
    positions = [int(p) for p in positions]
    if (
        not positions
        or positions != sorted(set(positions))
        or positions[0] < 1
        or positions[-1] > capture.length
    ):
        raise ValueError(f"positions must be increasing token counts in 1..{capture.length}, got {positions}")
    state, start, snapshots = capture.initial_state, 0, []
    for stop in positions:
        _, state = _run(capture, start, stop, state)
        snapshots.append(state)
        start = stop
    return torch.stack(snapshots, dim=1)


def _check_within(capture, position: int, name: str) -> int:
    if isinstance(position, bool) or not isinstance(position, int) or not 1 <= position < capture.length:
        raise ValueError(
            f"{name} must be an int in 1..{capture.length - 1} (the stream has {capture.length} "
            f"tokens), got {position!r}"
        )
    return position


# ---------------------------------------------------------------- 1. lifetime predicts error


def unit_state_error(capture, codec, *, boundary: int = 2) -> torch.Tensor:
    """Accumulated state error of every unit under ``codec`` along the capture's own inputs (Fig. 1b, B1c).

    The paper's protocol: FP32 for the first ``boundary`` tokens, then the state is quantized at the
    boundary and after every update while the trajectory follows the reference q, k, v, g, beta
    (stepquant.recurrence.quantized_gated_delta_rule, native feedback). Returns [B, H] (GDN) or
    [B, H, K] (KDA), float64: the mean over the T - boundary updates of sum over the unit's values of
    (Ŝ_t - S_t)^2, S_t the exact reference state.
    """
    _check_within(capture, boundary, "boundary")
    _, state = _run(capture, 0, boundary, capture.initial_state)
    total = torch.zeros(())

    def on_step(t, x, s_hat, s_ref):
        nonlocal total
        total = total + unit_sum((s_hat - s_ref).pow(2), capture.family).to(torch.float64)

    quantized_gated_delta_rule(
        *_inputs(capture, boundary),
        codec,
        initial_state=state,
        use_qk_l2norm=capture.use_qk_l2norm,
        mode=capture.family,
        on_step=on_step,
        track_reference=True,
        output_final_state=False,
    )
    return total / (capture.length - boundary)


def lifetime_error(half_lives: torch.Tensor, errors: torch.Tensor) -> dict:
    """Spearman of half-life vs accumulated error over all units, per layer, and the longest quarter's share.

    half_lives, errors: [L, H] (GDN) or [L, H, K] (KDA). "error_share_longest_quarter": the share of the
    total error held by the quarter of units with the longest half-lives within each layer (the paper's
    cumulative curve pools ranks within groups the same way).
    """
    half_lives, errors = torch.as_tensor(half_lives).double(), torch.as_tensor(errors).double()
    if half_lives.shape != errors.shape:
        raise ValueError(
            f"half_lives {list(half_lives.shape)} and errors {list(errors.shape)} differ in shape"
        )
    per_layer = [spearman(h, e) for h, e in zip(half_lives, errors, strict=True)]
    classes = lifetime_classes(half_lives)
    long_share = float(errors[classes == 2].sum() / errors.sum()) if float(errors.sum()) > 0 else math.nan
    return {
        "spearman": spearman(half_lives, errors),
        "spearman_per_layer": per_layer,
        "error_share_longest_quarter": long_share,
        "units": half_lives.numel(),
        "zero_error_units": int((errors == 0).sum()),
    }


# ---------------------------------------------------------------- 2. native feedback vs the exact-read oracle


def _collect_state_error(into: list):
    """An on_step(t, X_t, Ŝ_t, S_t) appending ||Ŝ_t - S_t||_F^2 summed over heads ([B]) to ``into``."""
    return lambda t, x, s_hat, s_ref: into.append((s_hat - s_ref).pow(2).sum(dim=(1, 2, 3)))


class _InjectOnce:
    """A roundtrip applying ``codec`` on its first call (the one injected error), exact afterwards."""

    def __init__(self, codec) -> None:
        self.codec, self.calls = codec, 0

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.codec.roundtrip(x) if self.calls == 1 else x


def feedback_errors(capture, codec, *, inject_at: int = 256) -> dict[str, torch.Tensor]:
    """Squared readout error after ONE quantization error, under native feedback and the exact-read oracle.

    The state after ``inject_at`` tokens is stored once through ``codec`` (Ŝ = Q(S)); the remaining
    updates run without further quantization, with the model's delta residual reading the path's own
    state ("native") or the exact reference state ("oracle", stepquant.recurrence, paper Appendix B).
    Both start from the identical error. Returns {"native", "oracle"}: [B, T - inject_at] float64, the
    squared output error summed over heads and values, per stream and step; and "native_state",
    "oracle_state": the squared state error ||Ŝ_t - S_t||_F^2 summed over heads, likewise. (For GDN the
    native state error can never exceed the oracle's: its error is the oracle's times contractions
    I - beta k k^T, which commute with the scalar gate.)
    """
    _check_within(capture, inject_at, "inject_at")
    _, state = _run(capture, 0, inject_at, capture.initial_state)
    reference, _ = _run(capture, inject_at, None, state, output_final_state=False)
    out = {}
    for feedback in FEEDBACKS:
        state_error = []
        o, _ = quantized_gated_delta_rule(
            *_inputs(capture, inject_at),
            _InjectOnce(codec),
            initial_state=state,
            use_qk_l2norm=capture.use_qk_l2norm,
            mode=capture.family,
            feedback=feedback,
            output_final_state=False,
            track_reference=True,
            on_step=_collect_state_error(state_error),
        )
        out[feedback] = (o - reference).to(torch.float64).pow(2).sum(dim=(2, 3))
        out[f"{feedback}_state"] = torch.stack(state_error, dim=1).to(torch.float64)
    return out


def feedback_summary(native: torch.Tensor, oracle: torch.Tensor) -> dict:
    """Oracle / native ratio of summed squared output error: pooled, per trajectory (stream), and its minimum.

    native, oracle: [..., B, T'] (e.g. [L, B, T']); streams are the second-to-last dimension.
    """
    native, oracle = torch.as_tensor(native).double(), torch.as_tensor(oracle).double()
    per_stream_native = native.transpose(0, -2).reshape(native.shape[-2], -1).sum(-1)
    per_stream_oracle = oracle.transpose(0, -2).reshape(oracle.shape[-2], -1).sum(-1)
    ratios = (per_stream_oracle / per_stream_native).tolist()
    return {
        "ratio": float(oracle.sum() / native.sum()),
        "ratio_per_trajectory": ratios,
        "min_ratio": min(ratios),
        "above_one_on_every_trajectory": all(r > 1 for r in ratios),
        "native_sum": float(native.sum()),
        "oracle_sum": float(oracle.sum()),
    }


# ---------------------------------------------------------------- 3a. row-impact identity


def row_impact_identity(
    capture,
    positions: Sequence[int],
    *,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    rows_per_call: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Direct propagation of a unit-norm error confined to one key row against g_{t,i}^2 (paper Appendix B).

    For each probe position t (0-based token index, 1 <= t < T), every stream, head and key row i: E_i is
    zero except row i, a random unit vector (Frobenius norm 1), sitting in the stored state before token t.
    It is advanced one token by the recurrence step itself (stepquant.recurrence.step with token t's q, k,
    g, beta and v = 0: the error recursion E_t = A_t E_{t-1}, which the state does not enter), and the
    squared readout it causes, ||(A_t E_i)^T q_t||^2, is compared with the prediction g_{t,i}^2,
    g_t = A_t^T q_t (stepquant.recurrence.transition_readout_weights). Arithmetic in ``dtype``.
    Returns (direct, predicted), both [P, B, H, K].
    """
    positions = [_check_within(capture, int(p), "a probe position") for p in positions]
    gen = torch.Generator().manual_seed(seed)
    batch, heads, key_dim, value_dim = (
        capture.batch,
        capture.v.shape[2],
        capture.q.shape[3],
        capture.v.shape[3],
    )
    directs, predicted = [], []
    for p in positions:
        q, k, g, beta = (x[:, p].to(dtype) for x in (capture.q, capture.k, capture.g, capture.beta))
        b_q, b_k = prepare_qk(q, k, use_qk_l2norm=capture.use_qk_l2norm, mode=capture.family)
        g_t = transition_readout_weights(b_q, b_k, g, beta)  # [B, H, K]
        direct = torch.empty(batch, heads, key_dim, dtype=dtype)
        for start in range(0, key_dim, rows_per_call):
            rows = range(start, min(start + rows_per_call, key_dim))
            e = torch.randn(len(rows), batch, heads, value_dim, generator=gen, dtype=torch.float64).to(dtype)
            errors = torch.zeros(len(rows), batch, heads, key_dim, value_dim, dtype=dtype)  # [n, B, H, K, V]
            for j, i in enumerate(rows):
                errors[j, :, :, i] = e[j] / e[j].norm(dim=-1, keepdim=True)
            count = len(rows)
            repeat = lambda x, n=count: x.repeat(n, *([1] * (x.dim() - 1)))
            no_value = torch.zeros(len(rows) * batch, heads, value_dim, dtype=dtype)
            _, read = step(errors.flatten(0, 1), repeat(b_q), repeat(b_k), no_value, repeat(g), repeat(beta))
            squared = read.view(len(rows), batch, heads, value_dim).pow(2).sum(-1)  # [n, B, H]
            direct[:, :, start : start + len(rows)] = squared.permute(1, 2, 0)
        directs.append(direct)
        predicted.append(g_t.pow(2))
    return torch.stack(directs), torch.stack(predicted)


def identity_errors(direct: torch.Tensor, predicted: torch.Tensor) -> dict:
    """Relative differences |direct - predicted| / predicted: pointwise (max, median), and of the averages
    over probe positions (dim 0) per stream, head and row, as the paper averages its probe positions."""
    direct, predicted = direct.double(), predicted.double()
    pointwise = (direct - predicted).abs() / predicted
    averaged = (direct.mean(0) - predicted.mean(0)).abs() / predicted.mean(0)
    finite = torch.isfinite(pointwise)
    return {
        "max_relative_error": float(pointwise[finite].max()),
        "median_relative_error": float(pointwise[finite].median()),
        "max_relative_error_of_position_means": float(averaged[torch.isfinite(averaged)].max()),
        "checks": int(finite.sum()),
        "skipped_zero_predictions": int((~finite).sum()),
    }


def omega_spread(omega: torch.Tensor, floor: float = DEFAULT_OMEGA_FLOOR) -> dict:
    """Within-head P90 / P10 of omega (floored at ``floor`` x the head's largest, as w is), over all heads."""
    omega = torch.as_tensor(omega).double()
    floored = torch.maximum(omega, floor * omega.amax(dim=-1, keepdim=True))
    q = torch.quantile(floored, torch.tensor([0.1, 0.9], dtype=torch.float64), dim=-1)  # [2, L, H]
    ratio = (q[1] / q[0]).reshape(-1)
    p10, p50, p90 = torch.quantile(ratio, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    return {"median": p50, "p10": p10, "p90": p90, "heads": ratio.numel()}


def omega_vs_half_life(omega: torch.Tensor, half_lives: torch.Tensor) -> dict | None:
    """KDA: Spearman of key rows' omega against their half-lives, over all rows and within each head
    (median over heads): whether the rows the next read weighs most are also the long-lived ones.
    None for GDN, whose rows share their head's gate."""
    omega, tau = torch.as_tensor(omega).double(), torch.as_tensor(half_lives).double()
    if tau.shape != omega.shape:
        return None
    within = torch.tensor(
        [
            spearman(o, t)
            for o, t in zip(omega.reshape(-1, omega.shape[-1]), tau.reshape(-1, tau.shape[-1]), strict=True)
        ]
    )
    return {"spearman": spearman(omega, tau), "median_within_head": float(within.nanmedian())}


# ---------------------------------------------------------------- 3b. row-impact groups and perplexity


def row_impact_groups(omega: torch.Tensor, groups: int = 8) -> torch.Tensor:
    """Group of every key row, ranked by omega within its head: [..., K] int64 in 0..groups-1 (0 = lowest).

    Rows are sorted by omega (ties keep row order) and cut into ``groups`` near-equal groups:
    rank r of K goes to group r * groups // K.
    """
    omega = torch.as_tensor(omega)
    key_dim = omega.shape[-1]
    if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= key_dim:
        raise ValueError(f"groups must be an int in 1..{key_dim} (the key rows of a head), got {groups!r}")
    order = torch.argsort(omega, dim=-1, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(key_dim).expand_as(order).contiguous())
    return rank * groups // key_dim


@dataclass(frozen=True, eq=False)
class RowGroupCodec(Codec):
    """The Fig. 2(a) intervention: key rows where ``rows`` [H, K] is True are stored as rowwise-absmax
    INT-``bits`` (stepquant.codecs.UniformCodec), every other row is kept exactly (FP32).

    Rowwise absmax quantizes each row on its own scale, so this equals quantizing those rows alone.
    The encoded object is the FP32 tensor of the reconstructed state.
    """

    rows: torch.Tensor
    bits: int = 4
    name: str = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.rows, torch.Tensor) or self.rows.dtype != torch.bool or self.rows.dim() != 2:
            raise TypeError("rows must be a bool tensor [H, K]")
        check_bits(self.bits)
        object.__setattr__(self, "name", f"int{self.bits}-rows")

    def encode(self, states: torch.Tensor) -> torch.Tensor:
        x = as_fp32(states)  # [N, H, K, V]
        rows = self.rows.to(x.device)[None, :, :, None]
        return torch.where(rows, UniformCodec(bits=self.bits).roundtrip(x), x)

    def decode(self, encoded: torch.Tensor) -> torch.Tensor:
        return encoded

    def storage_bits(self, num_heads: int, key_dim: int, value_dim: int, *, analytical: bool = False) -> int:
        check_dims(num_heads, key_dim, value_dim)
        quantized = int(self.rows.sum())
        return quantized * (self.bits * value_dim + 16) + (num_heads * key_dim - quantized) * 32 * value_dim


def row_impact_perplexity(
    model,
    tokens: torch.Tensor,
    omega: torch.Tensor,
    *,
    prefill_len: int,
    groups: int = 8,
    bits: int = 4,
    desc: str = "row-impact perplexity",
) -> dict:
    """Perplexity with one omega-ranked group of key rows quantized to INT-``bits``, group by group (Fig. 2a).

    omega [L, H, K] (calibrated); tokens [S, P + D + 1]. Every group is one method of one batched drift
    probe (stepquant.eval.probe.drift_probe, FP32 reference first): a native prefill of P tokens, then D
    decode updates, each storing the state with the group's rows quantized (in every linear-attention
    layer) and the other rows exact. Perplexity is exp(mean NLL) over all S x D decode predictions.
    """
    from stepquant.eval.probe import drift_probe

    layers = linear_layers_of(model.config)
    group_of = row_impact_groups(omega, groups)  # [L, H, K]
    if group_of.shape[0] != len(layers):
        raise ValueError(f"omega covers {group_of.shape[0]} linear layers, the model has {len(layers)}")
    reference = CastCodec("fp32")
    row_codecs = [dict.fromkeys(layers, reference)]
    row_codecs += [
        {layer: RowGroupCodec(group_of[i] == n, bits) for i, layer in enumerate(layers)}
        for n in range(groups)
    ]
    probe = drift_probe(model, tokens, row_codecs, prefill_len=prefill_len, desc=desc)
    nll = probe.decode_nll.double()  # [1 + groups, S, D]
    ppl = nll.mean(dim=(1, 2)).exp()
    excess = probe.excess
    delta = (ppl[1:] - ppl[0]).tolist()
    return {
        "fp32_ppl": float(ppl[0]),
        "group_ppl": ppl[1:].tolist(),
        "delta_ppl": delta,
        "excess_nll": excess.all[1:].mean(-1).tolist(),
        "excess_nll_stderr": excess.stderr[1:].tolist(),
        "spearman_group_vs_delta": spearman(torch.arange(groups), torch.tensor(delta)),
        "highest_over_lowest_delta": delta[-1] / delta[0] if delta[0] > 0 else None,
        "streams": int(tokens.shape[0]),
        "decode_predictions": int(nll.shape[-1]),
    }


# ---------------------------------------------------------------- 4. state geometry


def outlier_contrasts(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column outlier contrasts of states [..., K, V] (Sec. 4.2): max_i r_i / median_i r_i with
    r_i the RMS of key row i over V, and the same for the value-column RMS over K. Medians interpolate
    linearly (torch.quantile); a zero median gives nan. Returns (rows [...], cols [...]) float64."""
    x = states.to(torch.float64)
    out = []
    for rms in (x.pow(2).mean(-1).sqrt(), x.pow(2).mean(-2).sqrt()):
        median = torch.quantile(rms.reshape(-1, rms.shape[-1]), 0.5, dim=-1).reshape(rms.shape[:-1])
        contrast = rms.amax(-1) / median
        out.append(torch.where(median > 0, contrast, torch.full_like(contrast, math.nan)))
    return out[0], out[1]


def geometry_summary(rows: torch.Tensor, cols: torch.Tensor, threshold: float = 3.0) -> dict:
    """Median row / column contrasts over all snapshots and the share where both exceed ``threshold``."""
    rows, cols = rows.reshape(-1).double(), cols.reshape(-1).double()
    valid = torch.isfinite(rows) & torch.isfinite(cols)
    rows, cols = rows[valid], cols[valid]
    return {
        "median_row_contrast": float(torch.quantile(rows, 0.5)),
        "median_col_contrast": float(torch.quantile(cols, 0.5)),
        f"share_both_above_{threshold:g}x": float(((rows > threshold) & (cols > threshold)).double().mean()),
        "snapshots": int(valid.sum()),
        "skipped_zero_states": int((~valid).sum()),
    }


# ---------------------------------------------------------------- 5. lifetime ranks across text


def lifetime_classes(half_lives: torch.Tensor) -> torch.Tensor:
    """Class of every unit by its half-life rank within its layer (dim 0): 0 short (lowest quarter),
    1 middle (middle half), 2 long (top quarter); the paper's Qwen ranks 1-12 / 13-36 / 37-48 of 48.
    Ties keep unit order. Returns int64 of half_lives' shape ([L, H] or [L, H, K])."""
    tau = torch.as_tensor(half_lives).double()
    flat = tau.reshape(tau.shape[0], -1)
    n = flat.shape[1]
    order = torch.argsort(flat, dim=-1, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(n).expand_as(order).contiguous())  # 0-based
    classes = (rank >= n // 4).to(torch.int64) + (rank >= n - n // 4).to(torch.int64)
    return classes.reshape(tau.shape)


def lifetime_rank_stability(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """How well the half-lives measured on another text keep the reference (calibration) ordering: Spearman
    over all units (= of the global percentile ranks) and the share of units keeping their within-layer
    short / middle / long class."""
    reference, other = torch.as_tensor(reference).double(), torch.as_tensor(other).double()
    if reference.shape != other.shape:
        raise ValueError(f"half-life shapes differ: {list(reference.shape)} vs {list(other.shape)}")
    kept = lifetime_classes(reference) == lifetime_classes(other)
    return {
        "spearman": spearman(reference, other),
        "class_retention": float(kept.double().mean()),
        "units": reference.numel(),
    }


# ---------------------------------------------------------------- 6. where the bits went


def unit_omega(plan) -> torch.Tensor:
    """omega per allocation unit: the mean over a GDN head's key rows, a KDA row's ([L, H] / [L, H, K])"""
    return plan.omega.mean(-1) if plan.family == "gdn" else plan.omega


def bit_allocation(plan) -> dict:
    """A plan's bits against half-life and omega, per layer, and its lifetime-weighted distortion vs uniform.

    Pivots count as 16 bits in the rank correlations and with zero distortion in the objective (FP16
    rounding is ~2^-11 relative, outside the 2..8-bit table). "plan" is sum_u lambda_u d_u(b_u) over the
    integer units (the allocation objective); "uniform_all" is sum_u lambda_u d_u(b̄) over every unit,
    uniform b̄ at the same nominal budget; "uniform_integer" the same over the plan's integer units (the
    ratio plan.json's summary reports).
    """
    bits = plan.unit_bits.to(torch.int64)
    tau, omega = plan.half_lives, unit_omega(plan)
    integer = bits != 16
    column = torch.where(integer, bits, torch.full_like(bits, plan.budget_bits)) - 2
    weighted = plan.lifetime[..., None] * plan.distortion  # [*unit, 7]
    chosen = weighted.gather(-1, column[..., None]).squeeze(-1)
    uniform = weighted[..., plan.budget_bits - 2]
    cost = float(chosen[integer].sum())
    layers = []
    for i, layer in enumerate(plan.linear_layers):
        b, ints = bits[i].reshape(-1), integer[i].reshape(-1)
        layers.append(
            {
                "layer": int(layer),
                "mean_bits_integer_units": float(b[ints].double().mean()) if bool(ints.any()) else None,
                "pivots": int((~ints).sum()),
                "median_half_life": float(tau[i].median()),
                "spearman_bits_vs_half_life": spearman(b, tau[i]),
                "spearman_bits_vs_omega": spearman(b, omega[i]),
            }
        )
    return {
        "variant": plan.variant,
        "budget_bits": plan.budget_bits,
        "bits_per_value_served": plan.bits_per_value(serving=True),
        "spearman_bits_vs_half_life": spearman(bits, tau),
        "spearman_bits_vs_omega": spearman(bits, omega),
        "lifetime_weighted_distortion": {
            "plan": cost,
            "uniform_all": float(uniform.sum()),
            "uniform_integer": float(uniform[integer].sum()),
            "ratio_vs_uniform_all": cost / float(uniform.sum()),
            "ratio_vs_uniform_integer": cost / float(uniform[integer].sum()),
        },
        "layers": layers,
    }
