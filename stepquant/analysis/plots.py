"""The figures of `stepquant analyze` (PNG, matplotlib's Agg canvas, small enough to commit).

Each function takes the numbers stepquant.analysis.mechanisms produced and a path, and returns the path.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

DPI = 72


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path: str | Path) -> Path:
    path = Path(path)
    figure.tight_layout()
    figure.savefig(path)
    return path


def _layer_numbers(shape: tuple[int, ...]) -> torch.Tensor:
    """The linear-layer number of every unit of a [L, ...] array, flattened."""
    return torch.arange(shape[0]).repeat_interleave(math.prod(shape[1:]))


def _end_ticks(axes, values: torch.Tensor) -> None:
    """A log x axis labelled only at the smallest and largest value (narrow ranges crowd the labels)."""
    from matplotlib.ticker import NullFormatter

    axes.set_xscale("log")
    low, high = float(values.min()), float(values.max())
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.set_xticks(
        [low, high] if high > low else [low], [f"{low:.2g}", f"{high:.2g}"][: 2 if high > low else 1]
    )


def plot_lifetime_error(
    half_lives: torch.Tensor, errors: torch.Tensor, rho: float, title: str, path: str | Path
) -> Path:
    """Fig. 1b / B1c: half-life vs accumulated INT6 state error per unit, log axes, coloured by layer."""
    tau = half_lives.reshape(-1).clamp(max=1e9)
    err = errors.reshape(-1)
    shown = err > 0
    figure = _figure(6, 4)
    axes = figure.add_subplot()
    many = err.numel() > 500
    points = axes.scatter(
        tau[shown].numpy(),
        err[shown].numpy(),
        c=_layer_numbers(tuple(errors.shape))[shown],
        cmap="viridis",
        s=3 if many else 22,
        alpha=1 if many else 0.8,
        linewidths=0,
    )
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("gate half-life on the calibration text (tokens)")
    axes.set_ylabel("mean squared state error, INT6")
    hidden = int((~shown).sum())
    axes.set_title(
        f"{title}: Spearman {rho:.3f}" + (f" ({hidden} zero-error units not shown)" if hidden else ""),
        fontsize=9,
    )
    figure.colorbar(points, ax=axes).set_label("linear layer number")
    return _save(figure, path)


def plot_feedback(curves: dict, title: str, path: str | Path) -> Path:
    """Squared readout error after one injected error (summed over layers, heads, streams) per step."""
    figure = _figure(6, 3.6)
    axes = figure.add_subplot()
    styles = {"native": "-", "oracle": "--"}
    for (bits, feedback), curve in curves.items():
        steps = torch.arange(1, curve.numel() + 1)
        axes.plot(
            steps.numpy(),
            curve.clamp_min(1e-30).numpy(),
            styles[feedback],
            linewidth=1,
            label=f"INT{bits} {feedback}",
        )
    axes.set_yscale("log")
    axes.set_xscale("log")
    axes.set_xlabel("updates after the injected error")
    axes.set_ylabel("squared readout error")
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=8)
    return _save(figure, path)


def plot_row_impact_ppl(result: dict, title: str, path: str | Path) -> Path:
    """Fig. 2(a): perplexity increase when one omega-ranked group of key rows is stored in INT4."""
    delta = result["delta_ppl"]
    groups = list(range(1, len(delta) + 1))
    # error bars: the standard error of the excess NLL carried to perplexity to first order (ppl x stderr)
    spread = [result["fp32_ppl"] * s for s in result["excess_nll_stderr"]]
    figure = _figure(5.6, 3.6)
    axes = figure.add_subplot()
    axes.errorbar(groups, delta, yerr=spread, fmt="o-", capsize=3)
    axes.axhline(0, color="grey", linewidth=0.5)
    axes.set_xticks(list(groups))
    axes.set_xlabel("row group by calibrated omega within each head (1 = lowest)")
    axes.set_ylabel("perplexity - FP32-state perplexity")
    axes.set_title(
        f"{title}\nFP32-state perplexity {result['fp32_ppl']:.2f}; "
        f"Spearman(group, increase) {result['spearman_group_vs_delta']:.2f}",
        fontsize=9,
    )
    return _save(figure, path)


def plot_state_geometry(
    state: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, label: str, title: str, path: str | Path
) -> Path:
    """Sec. 4.2 / Fig. 2(b): |S| of one representative head as a surface, beside the contrast histograms."""
    figure = _figure(10, 3.8)
    surface = figure.add_subplot(1, 3, (1, 2), projection="3d")
    values = state.abs().to(torch.float64)
    key_dim, value_dim = values.shape
    ii, jj = torch.meshgrid(torch.arange(key_dim), torch.arange(value_dim), indexing="ij")
    stride = max(1, key_dim // 64)
    surface.plot_surface(
        jj.numpy(),
        ii.numpy(),
        values.numpy(),
        cmap="viridis",
        rstride=stride,
        cstride=stride,
        linewidth=0,
        antialiased=False,
    )
    surface.set_xlabel("value column j", fontsize=8)
    surface.set_ylabel("key row i", fontsize=8)
    surface.set_zlabel("|S_ij|", fontsize=8)
    surface.set_title(label, fontsize=8)
    hist = figure.add_subplot(1, 3, 3)
    finite = torch.isfinite(rows) & torch.isfinite(cols)
    bins = torch.logspace(0, math.log10(max(float(rows[finite].max()), float(cols[finite].max()), 10.0)), 30)
    hist.hist(rows[finite].numpy(), bins=bins.numpy(), alpha=0.6, label="key rows")
    hist.hist(cols[finite].numpy(), bins=bins.numpy(), alpha=0.6, label="value columns")
    hist.axvline(3, color="grey", linewidth=0.8, linestyle=":")
    hist.set_xscale("log")
    hist.set_xlabel("max / median RMS")
    hist.set_ylabel("snapshots")
    hist.legend(fontsize=8)
    figure.suptitle(title, fontsize=9)
    return _save(figure, path)


def plot_lifetime_ranks(
    reference: torch.Tensor, sources: dict, results: dict, title: str, path: str | Path
) -> Path:
    """Fig. B3: global half-life percentile ranks on each text source against the calibration source."""
    from .mechanisms import percentile_ranks

    x = percentile_ranks(reference)
    figure = _figure(4.2 * len(sources), 3.8)
    many = x.numel() > 500
    for n, (name, half_lives) in enumerate(sources.items()):
        axes = figure.add_subplot(1, len(sources), n + 1)
        axes.scatter(
            x.numpy(),
            percentile_ranks(half_lives).numpy(),
            s=2 if many else 14,
            alpha=1 if many else 0.8,
            linewidths=0,
        )
        axes.plot([0, 100], [0, 100], color="grey", linewidth=0.6)
        axes.set_xlabel("half-life rank on the calibration text (%)")
        axes.set_ylabel(f"rank on {name} (%)")
        result = results[name]
        axes.set_title(
            f"{name}: Spearman {result['spearman']:.3f}, classes kept {100 * result['class_retention']:.1f}%",
            fontsize=9,
        )
    figure.suptitle(title, fontsize=9)
    return _save(figure, path)


def plot_bit_allocation(plan, title: str, path: str | Path) -> Path:
    """The plan's bits against half-life (top row) and omega (bottom row), one column per linear layer."""
    from .mechanisms import unit_omega

    bits = plan.unit_bits.to(torch.float64)
    tau, omega = plan.half_lives.clamp(max=1e9), unit_omega(plan)
    layers = len(plan.linear_layers)
    pivot_row = max(plan.candidates) + 1.5
    y = torch.where(bits == 16, torch.full_like(bits, pivot_row), bits)
    many = y[0].numel() > 64
    if many:  # thousands of KDA rows share a few widths: a little vertical jitter
        noise = torch.rand(y.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        y = y + (noise - 0.5) * 0.4
    figure = _figure(2.3 * layers + 0.6, 4.8)
    ticks = sorted(set(plan.candidates) | {plan.budget_bits})
    labels = [str(b) for b in ticks] + (["FP16"] if plan.pivots else [])
    ticks = ticks + ([pivot_row] if plan.pivots else [])
    for i in range(layers):
        for row, (x, name) in enumerate(((tau[i], "half-life (tokens)"), (omega[i], "omega"))):
            axes = figure.add_subplot(2, layers, row * layers + i + 1)
            axes.scatter(
                x.reshape(-1).numpy(),
                y[i].reshape(-1).numpy(),
                s=2 if many else 16,
                alpha=1 if many else 0.8,
                linewidths=0,
            )
            _end_ticks(axes, x)
            axes.set_yticks(ticks, labels if i == 0 else [""] * len(ticks))
            axes.set_ylim(min(ticks) - 0.5, max(ticks) + 0.5)
            axes.set_xlabel(name, fontsize=8)
            axes.tick_params(labelsize=7)
            if row == 0:
                axes.set_title(f"layer {plan.linear_layers[i]}", fontsize=8)
    figure.suptitle(title, fontsize=9)
    return _save(figure, path)
