"""Lifetime-aware bit allocation with FP16 pivots: the exact solution of docs/method.md section 3's problem.

Given calibration statistics (stats.py) for U units (GDN heads or KDA key rows, all of n values):

    lambda_u = sum_{j=0}^{H-1} exp(2 j l_u) = (1 - exp(2 H l_u)) / (1 - exp(2 l_u))     (H if l_u = 0)

    pivots:  the P units of highest risk lambda_u d_u(b̄) (d at the budget's own bit width b̄, under the
             variant's quantizer; ties broken by unit order) are stored in FP16. By the paper's
             accounting each pivot replaces an 8-bit unit, so the integer codes get b̄ N - 8 P n bits.
    bits:    min  sum_u lambda_u d_u(b_u)   over b_u in the candidate set B (default b̄-2..b̄+2 within 2..8)
             s.t. sum_u n b_u <= b̄ N - 8 P n,  i.e.  sum_u b_u <= b̄ U - 8 P  over the U - P integer units.

Because every unit of a model has the same n, the constraint is an integer budget of bits per unit and
the multiple-choice knapsack is solved exactly by dynamic programming over the spare bits above the
smallest candidate (:func:`solve_allocation`); tests check it against brute force. The DP keeps the
argmin table of one block of units at a time and the value row at block boundaries, so its memory is
O(sqrt(U) x budget) even for Kimi-Linear-48B's 81,920 rows.

Variants (the paper's ablations):
  "stepquant"         mixed bits + pivots, dual-axis fitting with w   (d measured under dual-axis)
  "temporal"          mixed bits + pivots, rowwise absmax format       (d under absmax)
  "temporal-nopivot"  mixed bits, no pivots, rowwise absmax
  "spatial"           uniform b̄, no pivots, dual-axis fitting with w
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stepquant.accounting import PIVOT_REPLACES_BITS, default_pivots, max_pivots
from stepquant.codecs.base import MAX_BITS, MIN_BITS, PIVOT_BITS

from .stats import BIT_WIDTHS, CalibrationStats

DEFAULT_HORIZON = 2048  # lifetime horizon H in tokens: the calibration segment length


@dataclass(frozen=True)
class Variant:
    """One allocation / format recipe (module docstring)."""

    name: str
    mixed: bool  # per-unit bits from the knapsack (else uniform b̄)
    pivots: bool  # FP16 pivots
    spatial: str  # "dual_axis" or "absmax": the stored format and the quantizer d is measured under

    @property
    def has_col_scale(self) -> bool:
        return self.spatial == "dual_axis"


VARIANTS: dict[str, Variant] = {
    "stepquant": Variant("stepquant", mixed=True, pivots=True, spatial="dual_axis"),
    "temporal": Variant("temporal", mixed=True, pivots=True, spatial="absmax"),
    "temporal-nopivot": Variant("temporal-nopivot", mixed=True, pivots=False, spatial="absmax"),
    "spatial": Variant("spatial", mixed=False, pivots=False, spatial="dual_axis"),
}


def get_variant(name: str) -> Variant:
    if name not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {name!r}")
    return VARIANTS[name]


def default_candidates(bits: int) -> tuple[int, ...]:
    """b̄-2 .. b̄+2 clipped to 2..8."""
    _check_budget_bits(bits)
    return tuple(range(max(MIN_BITS, bits - 2), min(MAX_BITS, bits + 2) + 1))


def _check_budget_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"bits (the budget b̄) must be an int in {MIN_BITS}..{MAX_BITS}, got {bits!r}")
    return bits


def check_candidates(candidates) -> tuple[int, ...]:
    """Sorted unique bit widths, each an int in 2..8."""
    try:
        values = tuple(candidates)
    except TypeError:
        raise TypeError(
            f"candidates must be a sequence of ints in {MIN_BITS}..{MAX_BITS}, got {candidates!r}"
        ) from None
    if not values:
        raise ValueError("candidates must hold at least one bit width")
    for b in values:
        if isinstance(b, bool) or not isinstance(b, int) or not MIN_BITS <= b <= MAX_BITS:
            raise ValueError(
                f"candidate bit widths must be ints in {MIN_BITS}..{MAX_BITS}, got {list(values)}"
            )
    return tuple(sorted(set(values)))


def lifetime_weights(mean_log_retention: torch.Tensor, horizon: int = DEFAULT_HORIZON) -> torch.Tensor:
    """lambda_u = sum_{j<H} exp(2 j l_u) in closed form (float64), H = horizon >= 1; H where l_u = 0."""
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
        raise ValueError(f"horizon must be a positive int (tokens), got {horizon!r}")
    l = torch.as_tensor(mean_log_retention).to(torch.float64)
    two_l = 2.0 * l
    small = two_l.abs() < 1e-12
    ratio = torch.expm1(horizon * two_l) / torch.expm1(torch.where(small, torch.ones_like(two_l), two_l))
    return torch.where(small, torch.full_like(l, float(horizon)), ratio)


def solve_allocation(
    costs: torch.Tensor, candidates, budget: int, *, max_cells: int = 1 << 26
) -> torch.Tensor:
    """Exact min_c sum_u costs[u, c_u]  s.t.  sum_u candidates[c_u] <= budget  (multiple-choice knapsack).

    costs [U, C] (finite, float64 arithmetic) for the sorted candidate widths; budget: an int, the bits per
    value summed over units. Returns the chosen widths [U] (int64). Dynamic programming over the spare
    bits e = sum_u (b_u - min B) <= E: F_u(e) = min_c F_{u-1}(e - (b_c - min B)) + costs[u, c] with
    F_0 = 0 ("at most" E). Ties go to the narrower width. The argmin table is kept for blocks of units
    of at most ``max_cells`` cells, value rows at block boundaries, so memory stays bounded.
    """
    candidates = check_candidates(candidates)
    if not isinstance(costs, torch.Tensor) or costs.dim() != 2 or costs.shape[1] != len(candidates):
        got = list(costs.shape) if isinstance(costs, torch.Tensor) else type(costs).__name__
        raise ValueError(f"costs must be a tensor [U, C] with C = {len(candidates)} candidates, got {got}")
    costs = costs.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(costs).all()):
        raise ValueError("costs must be finite")
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"budget must be an int (bits per value summed over units), got {budget!r}")
    num_units, lowest = costs.shape[0], candidates[0]
    if num_units == 0:
        return torch.zeros(0, dtype=torch.int64)
    if budget < num_units * lowest:
        raise ValueError(
            f"budget {budget} bits cannot give {num_units} units the narrowest candidate "
            f"{lowest} bits ({num_units * lowest} needed); widen the candidate set or lower the pivots"
        )
    extra = [b - lowest for b in candidates]  # spare bits of each candidate
    spare = min(budget - num_units * lowest, num_units * extra[-1])
    width = spare + 1
    block = max(1, min(num_units, max_cells // width))

    def advance(row: torch.Tensor, unit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """F_u from F_{u-1}: (new row [E+1], argmin candidate index [E+1] as uint8)."""
        best = torch.full_like(row, math.inf)
        choice = torch.zeros(width, dtype=torch.uint8)
        for c, e in enumerate(extra):
            if e > spare:
                break
            shifted = torch.full_like(row, math.inf)
            shifted[e:] = row[: width - e] + costs[unit, c]
            better = shifted < best  # strict: ties keep the narrower candidate
            best = torch.where(better, shifted, best)
            choice[better] = c
        return best, choice

    # forward pass: keep the value row at the start of every block
    row = torch.zeros(width, dtype=torch.float64)
    block_starts = list(range(0, num_units, block))
    rows_at_block_start = []
    last_choices = None
    for start in block_starts:
        rows_at_block_start.append(row)
        stop = min(start + block, num_units)
        is_last = stop == num_units
        choices = torch.empty(stop - start, width, dtype=torch.uint8) if is_last else None
        for u in range(start, stop):
            row, choice = advance(row, u)
            if is_last:
                choices[u - start] = choice
        last_choices = choices
    # backward pass: recompute each earlier block's argmin table from its start row
    chosen = torch.empty(num_units, dtype=torch.int64)
    remaining = spare
    for block_index in range(len(block_starts) - 1, -1, -1):
        start = block_starts[block_index]
        stop = min(start + block, num_units)
        if block_index == len(block_starts) - 1:
            choices = last_choices
        else:
            row = rows_at_block_start[block_index]
            choices = torch.empty(stop - start, width, dtype=torch.uint8)
            for u in range(start, stop):
                row, choices[u - start] = advance(row, u)
        for u in range(stop - 1, start - 1, -1):
            c = int(choices[u - start, remaining])
            chosen[u] = candidates[c]
            remaining -= extra[c]
    return chosen


def select_pivots(risk: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of the ``count`` highest-risk units (ties: lower index first), sorted ascending."""
    flat = risk.reshape(-1).to(torch.float64)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= flat.numel():
        raise ValueError(f"pivots must be an int in 0..{flat.numel()}, got {count!r}")
    order = torch.argsort(-flat, stable=True)
    return torch.sort(order[:count]).values


@dataclass(frozen=True, eq=False)
class Allocation:
    """The outcome of one allocation (tensors over units, [L, H] for GDN or [L, H, K] for KDA).

    unit_bits: int8, 2..8 or 16 (FP16 pivot); lifetime: lambda_u; risk: lambda_u d_u(b̄);
    distortion: d_u(b) [*unit_shape, 7] of the variant's quantizer (b = 2..8);
    code_bits_budget = b̄ N - 8 P n and code_bits_used = sum over integer units of n b_u (bits per request).
    objective / uniform_objective: sum lambda_u d_u(b_u) over integer units, and the same at b̄ everywhere
    (pivots excluded from both: their error is FP16 rounding).
    """

    variant: Variant
    budget_bits: int
    candidates: tuple[int, ...]
    horizon: int
    pivots: int
    unit_bits: torch.Tensor
    lifetime: torch.Tensor
    risk: torch.Tensor
    distortion: torch.Tensor
    unit_values: int
    code_bits_budget: int
    code_bits_used: int
    objective: float
    uniform_objective: float

    @property
    def slack_bits(self) -> int:
        """Budget bits the integer codes leave unused (>= 0)."""
        return self.code_bits_budget - self.code_bits_used


def allocate(
    stats: CalibrationStats,
    variant: str = "stepquant",
    bits: int = 6,
    *,
    pivots: int | None = None,
    candidates=None,
    horizon: int = DEFAULT_HORIZON,
) -> Allocation:
    """Bits per unit for ``variant`` at the nominal budget ``bits`` (b̄), from calibration statistics.

    pivots: FP16 pivot units for variants with pivots (default: the paper's share, 1.39% of GDN heads /
    0.625% of KDA key rows, rounded half up and capped at what the budget pays for); must be 0 or None for
    "temporal-nopivot" and "spatial". candidates: bit widths (default b̄-2..b̄+2 within 2..8).
    horizon: H of the lifetime weights, tokens.
    """
    if not isinstance(stats, CalibrationStats):
        raise TypeError(f"stats must be a CalibrationStats, got {type(stats).__name__}")
    spec = get_variant(variant)
    bits = _check_budget_bits(bits)
    shape = stats.shape
    if not spec.pivots:
        if pivots not in (None, 0):
            raise ValueError(f"variant {spec.name!r} has no FP16 pivots, got pivots={pivots}")
        pivots = 0
    elif pivots is None:
        pivots = default_pivots(shape, bits)
    elif isinstance(pivots, bool) or not isinstance(pivots, int) or pivots < 0:
        raise ValueError(f"pivots must be an int >= 0, got {pivots!r}")
    limit = max_pivots(shape, bits)
    if pivots > limit:
        raise ValueError(
            f"pivots={pivots} do not fit a {bits}-bit budget: each replaces an 8-bit unit and the "
            f"other units need >= {MIN_BITS} bits, so at most {limit} of {stats.num_units} units"
        )
    if not spec.mixed:
        if candidates is not None and check_candidates(candidates) != (bits,):
            raise ValueError(f"variant {spec.name!r} is uniform {bits} bits; it takes no candidate set")
        candidates = (bits,)
    candidates = default_candidates(bits) if candidates is None else check_candidates(candidates)

    distortion = stats.distortion(spec.spatial)  # [*unit, 7]
    lifetime = lifetime_weights(stats.mean_log_retention, horizon)  # [*unit]
    risk = lifetime * distortion[..., BIT_WIDTHS.index(bits)]
    flat_bits = torch.zeros(stats.num_units, dtype=torch.int64)
    pivot_index = select_pivots(risk, pivots)
    flat_bits[pivot_index] = PIVOT_BITS
    integer_units = torch.nonzero(flat_bits == 0).flatten()
    columns = [BIT_WIDTHS.index(b) for b in candidates]
    flat_cost = (lifetime[..., None] * distortion).reshape(stats.num_units, len(BIT_WIDTHS))
    costs = flat_cost[integer_units][:, columns]  # [U - P, C]
    budget = bits * stats.num_units - PIVOT_REPLACES_BITS * pivots  # bits per value summed over units
    flat_bits[integer_units] = solve_allocation(costs, candidates, budget)

    chosen = flat_bits[integer_units]
    objective = float(flat_cost[integer_units, chosen - MIN_BITS].sum())
    uniform = float(flat_cost[integer_units, bits - MIN_BITS].sum())
    n = stats.unit_values
    return Allocation(
        variant=spec,
        budget_bits=bits,
        candidates=candidates,
        horizon=horizon,
        pivots=pivots,
        unit_bits=flat_bits.reshape(stats.unit_shape).to(torch.int8),
        lifetime=lifetime,
        risk=risk,
        distortion=distortion,
        unit_values=n,
        code_bits_budget=budget * n,
        code_bits_used=int(chosen.sum()) * n,
        objective=objective,
        uniform_objective=uniform,
    )
