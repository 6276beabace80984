"""Tests of the float reference recurrence and the quantized loop (stepquant/recurrence.py).

Three independent anchors: transformers' own torch fallbacks (what the shipped models run), a float64
loop written here from the equations with explicit D_t, A_t, B_t matrices, and the error recursions
E_t = A_t E_{t-1} + eps_t (native feedback) and E_t = D_t E_{t-1} + eps_t (exact-read oracle).
"""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from stepquant.recurrence import (
    expand_key_heads,
    gated_delta_rule,
    prepare_qk,
    quantized_gated_delta_rule,
    step,
    transition_readout_weights,
)


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp_min(1e-300)).item()


class IdentityCodec:
    def roundtrip(self, states):
        return states


class RoundingCodec:
    """Rounds every value to a multiple of `step_size`: a coarse uniform quantizer with a visible error."""

    def __init__(self, step_size: float):
        self.step_size = step_size

    def roundtrip(self, states):
        return torch.round(states / self.step_size) * self.step_size


def make_inputs(batch, seq_len, key_heads, heads, key_dim, value_dim, mode, *, unit_keys=True, seed=0):
    """Random inputs in the transformers convention, float64; unit_keys keeps beta k k^T a contraction."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    q, k = randn(batch, seq_len, key_heads, key_dim), randn(batch, seq_len, key_heads, key_dim)
    if unit_keys:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g_shape = (batch, seq_len, heads) if mode == "gdn" else (batch, seq_len, heads, key_dim)
    return dict(
        q=q,
        k=k,
        v=randn(batch, seq_len, heads, value_dim),
        g=F.logsigmoid(randn(*g_shape) + 2.0),  # retention exp(g) mostly in 0.7..0.99
        beta=torch.sigmoid(randn(batch, seq_len, heads)),
    ), 0.5 * randn(batch, heads, key_dim, value_dim)


def explicit_operators(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False):
    """Float64 q_t, k_t [B, T, H, K], v_t, beta_t [B, T, H, 1, 1] and the matrices D_t, A_t, B_t.

    D_t, A_t are [B, T, H, K, K]; B_t is [B, T, H, K, V]. q and k are normalised, scaled and expanded.
    """
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    heads, key_dim = v.shape[2], q.shape[-1]
    if use_qk_l2norm:
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    q = q * (key_dim**-0.5 if scale is None else scale)
    q, k = q.repeat_interleave(heads // q.shape[2], dim=2), k.repeat_interleave(heads // k.shape[2], dim=2)
    eye = torch.eye(key_dim, dtype=torch.float64)
    if g.dim() == 3:  # GDN: D = exp(g) I
        D = g.exp()[..., None, None] * eye
    else:  # KDA: D = diag(exp(g))
        D = torch.diag_embed(g.exp())
    b = beta[..., None, None]
    A = (eye - b * k[..., :, None] * k[..., None, :]) @ D
    B = b * k[..., :, None] * v[..., None, :]
    return q, k, v, b, D, A, B


def explicit_loop(
    inputs, initial_state, *, codec=None, feedback="native", quantize_initial_state=True, **prep
):
    """S_t = A_t S_{t-1} + B_t, y_t = S_t^T q_t; with a codec, the loop of docs/method.md section 2."""
    q, k, v, b, D, A, B = explicit_operators(**inputs, **prep)
    batch, seq_len, heads, key_dim = q.shape
    S = torch.zeros(batch, heads, key_dim, v.shape[-1], dtype=torch.float64)
    if initial_state is not None:
        S = initial_state.double()
    S_hat = (
        codec.roundtrip(S)
        if codec is not None and initial_state is not None and quantize_initial_state
        else S
    )
    ys = []
    for t in range(seq_len):
        if codec is None:
            S = A[:, t] @ S + B[:, t]
            ys.append((S.transpose(-1, -2) @ q[:, t, ..., None])[..., 0])
            continue
        if feedback == "native":
            X = A[:, t] @ S_hat + B[:, t]
        else:  # oracle: the delta residual reads the exact state S_{t-1}
            residual = v[:, t, :, None, :] - k[:, t, :, None, :] @ D[:, t] @ S  # [B, H, 1, V]
            X = D[:, t] @ S_hat + b[:, t] * k[:, t, ..., None] * residual
        S = A[:, t] @ S + B[:, t]
        ys.append((X.transpose(-1, -2) @ q[:, t, ..., None])[..., 0])
        S_hat = codec.roundtrip(X)
    return torch.stack(ys, dim=1), (S if codec is None else S_hat)


SHAPES = [  # (B, T, H_k, H, K, V)
    pytest.param((2, 1, 1, 1, 7, 5), id="B2-T1-Hk1-H1-K7-V5"),
    pytest.param((1, 63, 2, 4, 100, 72), id="B1-T63-Hk2-H4-K100-V72"),
    pytest.param((3, 17, 3, 3, 16, 32), id="B3-T17-Hk3-H3-K16-V32"),
    pytest.param((2, 9, 1, 3, 5, 7), id="B2-T9-Hk1-H3-K5-V7"),
]


def transformers_reference(mode):
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("fla is importable: transformers would route to its GPU kernels (never install it here)")
    if mode == "gdn":
        return pytest.importorskip(
            "transformers.models.qwen3_5.modeling_qwen3_5"
        ).torch_recurrent_gated_delta_rule
    return pytest.importorskip(
        "transformers.models.kimi_linear.modeling_kimi_linear"
    ).recurrent_kimi_delta_attention


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("use_qk_l2norm", [False, True], ids=["raw-qk", "l2norm"])
@pytest.mark.parametrize("with_initial_state", [False, True], ids=["zero-init", "init"])
@pytest.mark.parametrize(
    "shape, mode",
    [
        pytest.param(p.values[0], mode, id=f"{p.id}-{mode}")
        for p in SHAPES
        for mode in ("gdn", "kda")
        if mode == "gdn" or p.values[0][2] == p.values[0][3]
    ],  # transformers' KDA has no grouped value heads
)
def test_matches_transformers(shape, mode, with_initial_state, use_qk_l2norm, layout):
    batch, seq_len, key_heads, heads, key_dim, value_dim = shape
    reference = transformers_reference(mode)
    inputs, state0 = make_inputs(*shape, mode, unit_keys=not use_qk_l2norm)
    inputs = {name: x.float() for name, x in inputs.items()}
    state0 = state0.float() if with_initial_state else None

    positional = [inputs[name] for name in ("q", "k", "v", "g", "beta")]  # it names them query, key, value
    expected_o, expected_state = reference(
        *positional, initial_state=state0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm
    )
    given_state = (
        None if state0 is None else (state0 if layout == "kv" else state0.transpose(-1, -2).contiguous())
    )
    o, final_state = gated_delta_rule(
        **inputs, initial_state=given_state, use_qk_l2norm=use_qk_l2norm, layout=layout
    )
    if layout == "vk":
        assert final_state.is_contiguous() and final_state.shape == (batch, heads, value_dim, key_dim)
        final_state = final_state.transpose(-1, -2)
    assert o.dtype == torch.float32 and final_state.dtype == torch.float32
    assert rel_rms(o, expected_o) < 1e-5
    assert rel_rms(final_state, expected_state) < 1e-5


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("with_initial_state", [False, True], ids=["zero-init", "init"])
@pytest.mark.parametrize("mode", ["gdn", "kda"])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_explicit_float64_loop(shape, mode, with_initial_state, layout):
    inputs, state0 = make_inputs(*shape, mode, unit_keys=False, seed=1)
    state0 = state0 if with_initial_state else None
    expected_o, expected_state = explicit_loop(inputs, state0, scale=0.3, use_qk_l2norm=True)

    given_state = None if state0 is None else (state0 if layout == "kv" else state0.transpose(-1, -2))
    o, final_state = gated_delta_rule(
        **inputs, initial_state=given_state, scale=0.3, use_qk_l2norm=True, layout=layout
    )
    final_state = final_state if layout == "kv" else final_state.transpose(-1, -2)
    assert o.dtype == torch.float64 and final_state.dtype == torch.float64
    assert rel_rms(o, expected_o) < 1e-12
    assert rel_rms(final_state, expected_state) < 1e-12


def test_low_precision_inputs_compute_in_fp32():
    inputs, state0 = make_inputs(2, 12, 2, 4, 24, 20, "kda", seed=2)
    half_inputs = {name: x.bfloat16() for name, x in inputs.items()}
    o, final_state = gated_delta_rule(**half_inputs, initial_state=state0.bfloat16())
    expected_o, expected_state = gated_delta_rule(
        **{name: x.float() for name, x in half_inputs.items()}, initial_state=state0.bfloat16().float()
    )
    assert o.dtype == torch.bfloat16 and final_state.dtype == torch.float32
    assert torch.equal(o, expected_o.bfloat16())
    assert torch.equal(final_state, expected_state)


def test_output_final_state_false_returns_none():
    inputs, _ = make_inputs(1, 3, 1, 1, 4, 4, "gdn")
    assert gated_delta_rule(**inputs, output_final_state=False)[1] is None
    assert quantized_gated_delta_rule(**inputs, codec=IdentityCodec(), output_final_state=False)[1] is None


@pytest.mark.parametrize("feedback", ["native", "oracle"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("mode", ["gdn", "kda"])
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_quantized_loop_with_identity_codec_equals_float_loop(shape, mode, layout, feedback):
    inputs, state0 = make_inputs(*shape, mode, seed=3)
    inputs = {name: x.float() for name, x in inputs.items()}
    state0 = state0.float() if layout == "kv" else state0.float().transpose(-1, -2)
    expected_o, expected_state = gated_delta_rule(**inputs, initial_state=state0, layout=layout)
    o, final_state = quantized_gated_delta_rule(
        **inputs, codec=IdentityCodec(), initial_state=state0, layout=layout, feedback=feedback
    )
    assert torch.equal(o, expected_o)
    assert torch.equal(final_state, expected_state)


@pytest.mark.parametrize("quantize_initial_state", [True, False], ids=["quantized-init", "exact-init"])
@pytest.mark.parametrize("feedback", ["native", "oracle"])
@pytest.mark.parametrize("mode", ["gdn", "kda"])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantized_loop_with_coarse_codec_matches_equations(shape, mode, feedback, quantize_initial_state):
    inputs, state0 = make_inputs(*shape, mode, seed=4)
    codec = RoundingCodec(0.05)
    expected_o, expected_state = explicit_loop(
        inputs, state0, codec=codec, feedback=feedback, quantize_initial_state=quantize_initial_state
    )
    o, final_state = quantized_gated_delta_rule(
        **inputs,
        codec=codec,
        initial_state=state0,
        feedback=feedback,
        quantize_initial_state=quantize_initial_state,
    )
    assert rel_rms(o, expected_o) < 1e-12
    assert rel_rms(final_state, expected_state) < 1e-12
    _, float_state = gated_delta_rule(**inputs, initial_state=state0)
    assert rel_rms(final_state, float_state) > 1e-3  # the codec really acted


def test_initial_state_is_quantized_only_when_asked():
    inputs, state0 = make_inputs(2, 4, 2, 2, 12, 10, "gdn", seed=5)
    codec = RoundingCodec(0.25)
    float_o, _ = gated_delta_rule(**inputs, initial_state=state0)
    exact_o, _ = quantized_gated_delta_rule(
        **inputs, codec=codec, initial_state=state0, quantize_initial_state=False
    )
    packed_o, _ = quantized_gated_delta_rule(**inputs, codec=codec, initial_state=state0)
    assert torch.equal(exact_o[:, 0], float_o[:, 0])  # first token reads A_0 S_0 + B_0 exactly
    assert rel_rms(packed_o[:, 0], float_o[:, 0]) > 1e-3


@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_readout_is_taken_before_requantization(mode):
    inputs, state0 = make_inputs(2, 8, 1, 2, 9, 6, mode, seed=6)
    q = explicit_operators(**inputs)[0]  # [B, T, H, K]
    seen = []
    o, _ = quantized_gated_delta_rule(
        **inputs,
        codec=RoundingCodec(0.25),
        initial_state=state0,
        on_step=lambda t, x, s_hat: seen.append((t, x, s_hat)),
    )
    assert [t for t, _, _ in seen] == list(range(8))
    for t, x, s_hat in seen:
        read_before = torch.einsum("bhk,bhkv->bhv", q[:, t], x)
        read_after = torch.einsum("bhk,bhkv->bhv", q[:, t], s_hat)
        assert rel_rms(o[:, t], read_before) < 1e-12
        assert rel_rms(o[:, t], read_after) > 1e-3


def record_errors(inputs, state0, feedback):
    """Run the quantized loop with the reference tracked; return E_{-1..T-1} and eps_{0..T-1}."""
    codec = RoundingCodec(0.05)
    errors, roundings = [codec.roundtrip(state0) - state0], []

    def on_step(t, x, s_hat, s_ref):
        errors.append(s_hat - s_ref)
        roundings.append(s_hat - x)

    quantized_gated_delta_rule(
        **inputs, codec=codec, initial_state=state0, feedback=feedback, on_step=on_step, track_reference=True
    )
    return errors, roundings


@pytest.mark.parametrize("mode", ["gdn", "kda"])
@pytest.mark.parametrize("shape", SHAPES[1:3])
def test_native_error_recursion(shape, mode):
    inputs, state0 = make_inputs(*shape, mode, seed=7)
    _, _, _, _, D, A, _ = explicit_operators(**inputs)
    errors, roundings = record_errors(inputs, state0, "native")
    for t, eps in enumerate(roundings):
        assert rel_rms(errors[t + 1], A[:, t] @ errors[t] + eps) < 1e-10
    # the oracle's recursion (no delta correction of the error) does not describe the native loop
    assert max(rel_rms(errors[t + 1], D[:, t] @ errors[t] + eps) for t, eps in enumerate(roundings)) > 1e-3


@pytest.mark.parametrize("mode", ["gdn", "kda"])
@pytest.mark.parametrize("shape", SHAPES[1:3])
def test_oracle_error_recursion(shape, mode):
    inputs, state0 = make_inputs(*shape, mode, seed=8)
    _, _, _, _, D, A, _ = explicit_operators(**inputs)
    errors, roundings = record_errors(inputs, state0, "oracle")
    for t, eps in enumerate(roundings):
        assert rel_rms(errors[t + 1], D[:, t] @ errors[t] + eps) < 1e-10
    assert max(rel_rms(errors[t + 1], A[:, t] @ errors[t] + eps) for t, eps in enumerate(roundings)) > 1e-3


@pytest.mark.parametrize("mode", ["gdn", "kda"])
@pytest.mark.parametrize("shape", SHAPES)
def test_transition_readout_weights_equal_explicit_transpose(shape, mode):
    inputs, _ = make_inputs(*shape, mode, unit_keys=False, seed=9)
    q, _, _, _, _, A, _ = explicit_operators(**inputs, use_qk_l2norm=True)
    expected = (A.transpose(-1, -2) @ q[..., None])[..., 0]  # A_t^T q_t  [B, T, H, K]
    b_q, b_k = prepare_qk(inputs["q"], inputs["k"], use_qk_l2norm=True)
    weights = transition_readout_weights(b_q, b_k, inputs["g"], inputs["beta"])
    assert weights.shape == expected.shape
    assert rel_rms(weights, expected) < 1e-12


@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_step_matches_equations_with_grouped_heads(mode):
    inputs, state0 = make_inputs(3, 1, 2, 4, 11, 6, mode, seed=10)
    q, k, v, b, D, A, B = explicit_operators(**inputs)
    token = {name: x[:, 0] for name, x in inputs.items()}  # [N, ...]
    b_q = token["q"] * 11**-0.5
    new_state, y = step(state0, b_q, token["k"], token["v"], token["g"], token["beta"])
    assert rel_rms(new_state, A[:, 0] @ state0 + B[:, 0]) < 1e-12
    assert rel_rms(y, (new_state.transpose(-1, -2) @ q[:, 0, ..., None])[..., 0]) < 1e-12
    # residual_state: X = D S_hat + beta k (v - k^T D S)^T
    exact = torch.randn_like(state0)
    x, _ = step(state0, b_q, token["k"], token["v"], token["g"], token["beta"], residual_state=exact)
    residual = v[:, 0, :, None, :] - k[:, 0, :, None, :] @ D[:, 0] @ exact
    assert rel_rms(x, D[:, 0] @ state0 + b[:, 0] * k[:, 0, ..., None] * residual) < 1e-12


def test_expand_key_heads_is_repeat_interleave():
    x = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)  # [N, H_k=3, K=2]
    expanded = expand_key_heads(x, 6)
    assert torch.equal(expanded[:, 1], x[:, 0]) and torch.equal(expanded[:, 2], x[:, 1])


def _valid_sequence_args():
    inputs, state0 = make_inputs(2, 5, 2, 4, 7, 5, "gdn")
    return dict(**inputs, initial_state=state0)


BAD_SEQUENCE_INPUTS = [
    pytest.param(dict(q=torch.randn(2, 5, 7)), ValueError, r"q must have shape \[B, T, H_k, K\]", id="q-3d"),
    pytest.param(
        dict(k=torch.randn(2, 5, 2, 6)), ValueError, "k must have the shape of q", id="k-K-mismatch"
    ),
    pytest.param(
        dict(v=torch.randn(3, 5, 4, 5)), ValueError, r"v must have shape \[B, T, H, V\]", id="v-batch"
    ),
    pytest.param(
        dict(v=torch.randn(2, 5, 3, 5), beta=torch.rand(2, 5, 3), g=-torch.rand(2, 5, 3)),
        ValueError,
        "multiple of the H_k=2",
        id="H-not-multiple-of-Hk",
    ),
    pytest.param(dict(beta=torch.rand(2, 5)), ValueError, r"beta must have shape \[B, T, H\]", id="beta-2d"),
    pytest.param(dict(g=-torch.rand(2, 5, 4, 6)), ValueError, "g must have shape", id="g-wrong-K"),
    pytest.param(dict(mode="kda"), ValueError, "mode='kda' needs g of shape", id="mode-mismatch"),
    pytest.param(dict(mode="mamba"), ValueError, "mode must be one of", id="mode-unknown"),
    pytest.param(dict(layout="kvv"), ValueError, "layout must be one of", id="layout-unknown"),
    pytest.param(
        dict(layout="vk"), ValueError, r"initial_state must have shape \[B, H, V, K\]", id="state-layout"
    ),
    pytest.param(
        dict(initial_state=torch.zeros(2, 2, 7, 5)), ValueError, "initial_state must have", id="state-H"
    ),
    pytest.param(
        dict(q=torch.ones(2, 5, 2, 7, dtype=torch.int64)), TypeError, "q must be a floating", id="q-int"
    ),
    pytest.param(dict(beta=[0.5]), TypeError, "beta must be a torch.Tensor", id="beta-list"),
    pytest.param(dict(scale=0.0), ValueError, "scale must be a positive", id="scale-zero"),
]


@pytest.mark.parametrize("overrides, error, message", BAD_SEQUENCE_INPUTS)
def test_bad_sequence_inputs_raise_clear_errors(overrides, error, message):
    args = {**_valid_sequence_args(), **overrides}
    with pytest.raises(error, match=message):
        gated_delta_rule(**args)
    with pytest.raises(error, match=message):
        quantized_gated_delta_rule(**args, codec=IdentityCodec())


class WrongShapeCodec:
    def roundtrip(self, states):
        return states[:, :1]


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        pytest.param(dict(codec=object()), TypeError, "codec must have a roundtrip", id="codec-no-roundtrip"),
        pytest.param(
            dict(codec=WrongShapeCodec()), ValueError, "codec.roundtrip must return", id="codec-shape"
        ),
        pytest.param(dict(feedback="exact"), ValueError, "feedback must be one of", id="feedback-unknown"),
        pytest.param(dict(on_step=3), TypeError, "on_step must be callable", id="on_step-not-callable"),
    ],
)
def test_bad_quantized_loop_arguments_raise_clear_errors(overrides, error, message):
    args = {**_valid_sequence_args(), "codec": IdentityCodec(), **overrides}
    with pytest.raises(error, match=message):
        quantized_gated_delta_rule(**args)


def test_bad_step_and_readout_inputs_raise_clear_errors():
    inputs, state0 = make_inputs(3, 1, 1, 2, 6, 4, "kda")
    token = {name: x[:, 0] for name, x in inputs.items()}
    with pytest.raises(ValueError, match=r"state must have shape \[N, H, K, V\] = \[3, 2, 6, 4\]"):
        step(state0.transpose(-1, -2), **token)
    with pytest.raises(TypeError, match="state must be a torch.Tensor"):
        step(None, **token)
    with pytest.raises(ValueError, match="residual_state must have shape"):
        step(state0, **token, residual_state=state0[:, :1])
    with pytest.raises(ValueError, match="g must have shape"):
        transition_readout_weights(token["q"], token["k"], token["g"][..., :3], token["beta"])
