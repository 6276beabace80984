"""Tests of calibration (stepquant/calibrate): observers and replay on the shipped models, statistics,
the exact allocation against brute force, and the paper's byte counts reached by an actual allocation.

Plan files (round trip, validation, tampering) and the CLI are in tests/test_calibrate_plan.py.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from stepquant.accounting import PRESETS, default_pivots, stepquant_bytes
from stepquant.calibrate import (
    CalibrationStats,
    RecurrenceObserver,
    StatsConfig,
    allocate,
    collect_stats,
    default_candidates,
    half_life_census,
    lifetime_weights,
    replay,
    replay_error,
    row_impact_factors,
    select_pivots,
    solve_allocation,
    unit_half_lives,
)
from stepquant.calibrate.plan import build_plan, plan_accounting
from stepquant.calibrate.stats import BIT_WIDTHS
from stepquant.data import calibration_segments
from stepquant.families import FAMILIES, GDN
from stepquant.models import load, use_recurrent_prefill

# ---------------------------------------------------------------- shared helpers


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    """One torch thread while these tests run: on a 2-core machine shared with other jobs, two OpenMP
    threads per process slowed a small calibration ~35x (38 s vs 1.1 s); alone it costs little."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def synthetic_stats(family="gdn", layers=(0, 1), heads=3, key_dim=8, value_dim=8, seed=0, model_type=None):
    """CalibrationStats with random lifetimes, omega and strictly decreasing d(b) (no model run)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)
    unit = (len(layers), heads) if family == "gdn" else (len(layers), heads, key_dim)
    magnitude = rand(*unit) * 10 + 0.1
    # d(b) ~ 4^-b with a per-unit random slope, so units differ in how much a bit buys
    slope = 3.0 + rand(*unit)
    bit_widths = torch.tensor(BIT_WIDTHS, dtype=torch.float64)
    distortion = magnitude[..., None] * slope[..., None] ** -bit_widths
    omega = rand(len(layers), heads, key_dim) + 0.01
    return CalibrationStats(
        model_name="synthetic",
        model_type=model_type or ("qwen3_5_text" if family == "gdn" else "kimi_linear"),
        family=family,
        linear_layers=tuple(layers),
        num_heads=heads,
        key_dim=key_dim,
        value_dim=value_dim,
        mean_log_retention=-(rand(*unit) * 0.2 + 1e-3),
        omega=omega,
        w=row_impact_factors(omega),
        distortion_dual_axis=distortion,
        distortion_absmax=distortion * (1.5 + rand(*unit)[..., None]),
        state_energy=magnitude,
        replay_error=torch.zeros(len(layers), dtype=torch.float64),
        tokens=100,
        snapshots=4,
    )


@pytest.fixture
def restore_kernels():
    """Put every observed transformers kernel function back after a test that switches prefill paths."""
    saved = []
    for family in FAMILIES.values():
        for model_type in family.types:
            module = family.modeling_module(model_type)
            saved += [(module, name, getattr(module, name)) for name in family.recurrence_functions]
    yield
    for module, name, function in saved:
        setattr(module, name, function)


_MODELS: dict = {}


def shipped(name: str, **kwargs):
    """A shipped model loaded once per test session (fp32 CPU), with its tokenizer."""
    key = (name, tuple(sorted(kwargs.items())))
    if key not in _MODELS:
        _MODELS[key] = load(name, recurrent_prefill=False, **kwargs)
    return _MODELS[key]


# ---------------------------------------------------------------- observers and replay


@pytest.mark.parametrize(
    "name, token_loop",
    [("gdn", False), ("gdn", True), ("kda", False), ("kda", True)],
    ids=["gdn-chunked", "gdn-token-loop", "kda-chunked", "kda-token-loop"],
)
def test_replay_matches_model(restore_kernels, name, token_loop):
    model, tokenizer = shipped(name)
    use_recurrent_prefill(token_loop)
    tokens = calibration_segments(tokenizer, 2, 96)
    captures = []
    with RecurrenceObserver(model, captures.append) as observer, torch.inference_mode():
        model(input_ids=tokens, use_cache=False, logits_to_keep=1)
    linear = [i for i, t in enumerate(model.config.layer_types) if t == "linear_attention"]
    assert observer.linear_layers == tuple(linear)
    assert [c.layer for c in captures] == linear and [c.index for c in captures] == list(range(len(linear)))
    for capture in captures:
        assert capture.use_qk_l2norm and capture.q.dtype == torch.float32 and capture.v.shape[:2] == (2, 96)
        assert capture.g.dim() == (3 if name == "gdn" else 4)
        replayed = replay(capture, snapshot_every=32)
        assert replayed.positions == (31, 63, 95) and replayed.snapshots.shape[1] == 3
        assert replay_error(capture, replayed) < 2e-5


def test_observer_restores_kernel_functions():
    model, tokenizer = shipped("gdn")
    module = GDN.modeling_module("qwen3_5_text")
    before = [getattr(module, name) for name in GDN.recurrence_functions]
    seen = []
    with RecurrenceObserver(model, seen.append):
        assert module.torch_chunk_gated_delta_rule is not before[0]
    assert [getattr(module, name) for name in GDN.recurrence_functions] == before
    with torch.inference_mode():
        model(input_ids=calibration_segments(tokenizer, 1, 8), use_cache=False)
    assert seen == []  # nothing is captured outside the block


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_bf16_weights_device_map_auto_capture_fp32(restore_kernels, name):
    model, tokenizer = shipped(name, dtype=torch.bfloat16, device_map="auto")
    captures = []
    with RecurrenceObserver(model, captures.append, device="cpu"), torch.inference_mode():
        model(input_ids=calibration_segments(tokenizer, 1, 64), use_cache=False, logits_to_keep=1)
    assert len(captures) == 6
    for capture in captures:
        tensors = (capture.q, capture.g, capture.output)
        assert all(x.dtype == torch.float32 and x.device.type == "cpu" for x in tensors)
        # the model's own output is rounded to bf16 (~2^-9 relative); the replay is FP32
        assert replay_error(capture, replay(capture)) < 1e-2


def test_observer_refuses_unknown_model_type():
    class Config:
        model_type = "llama"

    class Model(torch.nn.Module):
        config = Config()

    with pytest.raises(ValueError, match="unsupported model_type 'llama'; supported: qwen3_next"):
        RecurrenceObserver(Model(), lambda capture: None)


# ---------------------------------------------------------------- statistics


def test_row_impact_factors_normalised_and_monotone():
    omega = torch.tensor([[1.0, 16.0, 256.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    w = row_impact_factors(omega, exponent=0.125, floor=1e-6)
    assert torch.allclose(w.double().log().mean(dim=-1), torch.zeros(2, dtype=torch.float64), atol=1e-6)
    assert w[0, 0] < w[0, 1] < w[0, 2] and w[0, 3] < w[0, 0]
    assert w[0, 2] / w[0, 1] == pytest.approx(16**0.125, rel=1e-6)
    assert w[0, 2] / w[0, 3] == pytest.approx(1e6**0.125, rel=1e-6)  # the floor bounds the spread
    assert torch.equal(w[1], torch.ones(4))  # a head that is never read: w = 1
    assert torch.equal(row_impact_factors(omega, exponent=0.0), torch.ones(2, 4))


@pytest.mark.parametrize("log_retention", [-0.5, -0.01, -1e-4, 0.0], ids=lambda x: f"l{x:g}")
@pytest.mark.parametrize("horizon", [1, 7, 2048], ids=lambda h: f"H{h}")
def test_lifetime_weights_closed_form(log_retention, horizon):
    explicit = sum(math.exp(2 * j * log_retention) for j in range(horizon))
    weight = lifetime_weights(torch.tensor([log_retention], dtype=torch.float64), horizon)
    assert weight.item() == pytest.approx(explicit, rel=1e-9)


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_collect_stats_on_shipped_model(name, tmp_path):
    model, tokenizer = shipped(name)
    tokens = calibration_segments(tokenizer, 2, 64)
    stats = collect_stats(model, tokens, StatsConfig(snapshot_every=32, batch_size=2), model_name=name,
                          progress=False)
    unit = (6, 8) if name == "gdn" else (6, 4, 128)
    assert stats.unit_shape == unit and stats.tokens == 128 and stats.snapshots == 4
    assert stats.distortion_dual_axis.shape == (*unit, 7) and bool((stats.replay_error < 2e-5).all())
    # more bits, less error: in total, and no more error for (nearly) every unit, under both quantizers
    for quantizer in ("dual_axis", "absmax"):
        d = stats.distortion(quantizer).reshape(-1, 7)
        assert bool((d.sum(0)[1:] < d.sum(0)[:-1]).all())
        # (rows decayed below the smallest FP16 scale, 2^-14, keep the same error at every width)
        assert (d[:, 1:] <= d[:, :-1] * (1 + 1e-9)).all(dim=1).double().mean() > 0.99
    # l_u is the token mean of the g the model passed; unit_half_lives gives the same half-lives
    captures = []
    with RecurrenceObserver(model, captures.append), torch.inference_mode():
        model(input_ids=tokens, use_cache=False, logits_to_keep=1)
    direct = torch.stack([c.g.double().mean(dim=(0, 1)) for c in captures])
    assert torch.allclose(stats.mean_log_retention, direct, rtol=1e-9)
    lives = unit_half_lives(model, tokens, batch_size=2, progress=False)
    assert torch.allclose(torch.stack(lives), stats.half_lives, rtol=1e-9)
    assert half_life_census(lives) == half_life_census(stats.half_lives)
    loaded = CalibrationStats.load(stats.save(tmp_path))
    for field in ("mean_log_retention", "omega", "w", "distortion_dual_axis", "distortion_absmax"):
        assert torch.equal(getattr(loaded, field), getattr(stats, field))
    assert loaded.linear_layers == stats.linear_layers and loaded.settings == stats.settings


def test_half_life_census_counts_strictly_above():
    lives = [torch.tensor([10.0, 64.0, 65.0]), torch.tensor([[300.0, 2000.0], [math.inf, 1.0]])]
    assert half_life_census(lives) == {64: 4, 256: 3, 1024: 2}


# ---------------------------------------------------------------- exact allocation


def _instance(seed: int):
    gen = torch.Generator().manual_seed(seed)
    num_units = int(torch.randint(1, 7, (1,), generator=gen))
    widths = torch.randperm(7, generator=gen)[: int(torch.randint(1, 5, (1,), generator=gen))] + 2
    candidates = tuple(sorted(int(b) for b in widths))
    if seed % 3 == 0:  # small integer costs: many ties
        costs = torch.randint(0, 4, (num_units, len(candidates)), generator=gen).double()
    else:  # arbitrary, not convex, not even decreasing in b
        costs = torch.rand(num_units, len(candidates), generator=gen, dtype=torch.float64) * 10
    low, high = num_units * candidates[0], num_units * candidates[-1]
    budget = int(torch.randint(low, high + 3, (1,), generator=gen))
    return costs, candidates, budget


INSTANCES = [_instance(seed) for seed in range(60)]


@pytest.mark.parametrize(
    "costs, candidates, budget",
    INSTANCES,
    ids=[f"U{c.shape[0]}-b{'.'.join(map(str, b))}-budget{n}-s{i}" for i, (c, b, n) in enumerate(INSTANCES)],
)
def test_solve_allocation_matches_brute_force(costs, candidates, budget):
    chosen = solve_allocation(costs, candidates, budget)
    column = {b: c for c, b in enumerate(candidates)}
    objective = sum(costs[u, column[int(b)]].item() for u, b in enumerate(chosen))
    best = min(
        sum(costs[u, c].item() for u, c in enumerate(choice))
        for choice in itertools.product(range(len(candidates)), repeat=costs.shape[0])
        if sum(candidates[c] for c in choice) <= budget
    )
    assert int(chosen.sum()) <= budget
    assert objective == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_solve_allocation_block_mode_equals_single_block():
    gen = torch.Generator().manual_seed(5)
    costs = torch.rand(300, 5, generator=gen, dtype=torch.float64)
    candidates, budget = (4, 5, 6, 7, 8), 300 * 6
    whole = solve_allocation(costs, candidates, budget)
    blocks = solve_allocation(costs, candidates, budget, max_cells=4000)  # ~6 units per block
    assert torch.equal(whole, blocks)


def test_solve_allocation_refuses_an_impossible_budget():
    with pytest.raises(ValueError, match="cannot give 3 units the narrowest candidate 4 bits"):
        solve_allocation(torch.zeros(3, 2, dtype=torch.float64), (4, 6), 11)


def test_select_pivots_takes_highest_risk_first_index_on_ties():
    risk = torch.tensor([[1.0, 5.0, 5.0], [7.0, 0.0, 5.0]])
    assert select_pivots(risk, 3).tolist() == [1, 2, 3]


@pytest.mark.parametrize("family", ["gdn", "kda"])
@pytest.mark.parametrize("variant", ["stepquant", "temporal", "temporal-nopivot", "spatial"])
@pytest.mark.parametrize("bits", [4, 6])
def test_allocate_meets_the_budget_exactly(family, variant, bits):
    # 36 GDN heads (1.39% -> 1 pivot) or 384 KDA rows (0.625% -> 2 pivots)
    heads = 12 if family == "gdn" else 4
    stats = synthetic_stats(family, layers=(0, 1, 3), heads=heads, key_dim=32, value_dim=32, seed=bits)
    allocation = allocate(stats, variant, bits)
    unit_bits = allocation.unit_bits.to(torch.int64)
    is_pivot = unit_bits == 16
    expected_pivots = default_pivots(stats.shape, bits) if variant in ("stepquant", "temporal") else 0
    assert allocation.pivots == expected_pivots == int(is_pivot.sum())
    if variant == "spatial":
        assert bool((unit_bits == bits).all())
    else:
        assert set(unit_bits[~is_pivot].unique().tolist()) <= set(default_candidates(bits))
    # the pivots are the highest-risk units at the budget's width
    if expected_pivots:
        assert allocation.risk[is_pivot].min() >= allocation.risk[~is_pivot].max()
    budget = bits * stats.num_units * stats.unit_values - 8 * expected_pivots * stats.unit_values
    assert allocation.code_bits_budget == budget
    assert allocation.code_bits_used == int(unit_bits[~is_pivot].sum()) * stats.unit_values
    assert allocation.slack_bits == 0  # strictly decreasing d: every spare bit is worth spending
    accounting = plan_accounting(list(build_plan(stats, allocation).bits), stats.shape, bits,
                                 allocation.pivots, allocation.variant.has_col_scale)
    assert accounting["analytical_bytes"] == accounting["nominal_analytical_bytes"]
    assert accounting["serving_bytes"] == accounting["nominal_serving_bytes"]
    assert allocation.objective <= allocation.uniform_objective + 1e-12


def test_allocate_gives_long_lived_units_more_bits():
    stats = synthetic_stats("gdn", heads=8)
    same_distortion = stats.distortion_absmax[:1, :1].expand_as(stats.distortion_absmax).clone()
    stats = CalibrationStats(**{**stats.__dict__, "distortion_absmax": same_distortion})
    allocation = allocate(stats, "temporal-nopivot", 5)
    order = torch.argsort(stats.mean_log_retention.reshape(-1))  # most forgetful first
    bits = allocation.unit_bits.reshape(-1)[order]
    assert bool((bits[1:] >= bits[:-1]).all()) and bits[0] < bits[-1]


def test_allocate_reaches_the_papers_qwen_byte_counts():
    """STEPQuant@6 on Qwen3.8-27B's shape, 32 pivot heads: 30,015,488 B analytical, 29,999,104 B served
    (paper); at 4 bits the nominal 20,578,304 / 20,561,920 B (docs/accounting.md: why not 21,804,032 B)."""
    qwen = PRESETS["qwen3.8-27b"]
    stats = synthetic_stats("gdn", layers=tuple(range(qwen.linear_layers)), heads=qwen.heads,
                            key_dim=qwen.key_dim, value_dim=qwen.value_dim, seed=3)
    for bits, analytical, serving in ((6, 30_015_488, 29_999_104), (4, 20_578_304, 20_561_920)):
        plan = build_plan(stats, allocate(stats, "stepquant", bits))
        state = plan.state_bytes()
        assert plan.pivots == 32 and plan.accounting()["slack_bits"] == 0
        assert (state.analytical_bytes, state.serving_bytes) == (analytical, serving)
        nominal = stepquant_bytes(qwen, bits)
        assert (nominal.analytical_bytes, nominal.serving_bytes) == (analytical, serving)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"variant": "uniform"}, "variant must be one of"),
     ({"bits": 9}, r"bits \(the budget b̄\) must be an int in 2..8"),
     ({"variant": "temporal-nopivot", "pivots": 2}, "has no FP16 pivots"),
     ({"pivots": 10_000}, "do not fit a 6-bit budget"),
     ({"bits": 4, "candidates": (4, 5, 6)}, "cannot give"),
     ({"candidates": (1, 4)}, "must be ints in 2..8"),
     ({"horizon": 0}, "horizon must be a positive int")],
    ids=["unknown-variant", "bits-9", "nopivot-with-pivots", "too-many-pivots", "infeasible-candidates",
         "candidate-1-bit", "horizon-0"],
)
def test_allocate_errors(kwargs, message):
    stats = synthetic_stats("kda", layers=(0,), heads=2, key_dim=64, value_dim=16)
    with pytest.raises(ValueError, match=message):
        allocate(stats, **{"variant": "stepquant", "bits": 6, **kwargs})
