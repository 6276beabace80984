"""Tests of the error-feedback state format (stepquant.codecs.error_feedback): the equations, its bytes, the
quantized loop, the compressed-state cache and the eval's method names."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stepquant.accounting import codec_bytes, int_rowwise_bytes
from stepquant.codecs import ErrorFeedbackCodec, ErrorFeedbackState, MixedCodec, make_codec
from stepquant.eval.methods import resolve_method
from stepquant.families import shape_from_config
from stepquant.models import resolve
from stepquant.recurrence import gated_delta_rule, quantized_gated_delta_rule

GDN_LINEAR = [0, 1, 2, 4, 5, 6]


def states(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.exp(torch.randn(1, shape[1], shape[2], 1, generator=gen))
    return torch.randn(shape, generator=gen) * rows


def test_requantize_adds_the_stored_residual_and_decode_reads_the_state_only():
    codec = make_codec("int4-ef32")
    inner = make_codec("int4")
    x0, x1 = states((2, 3, 16, 8)), states((2, 3, 16, 8), seed=1)
    first = codec.encode(x0)
    assert torch.equal(codec.decode(first), inner.roundtrip(x0))  # the boundary pack is plain int4
    assert torch.equal(first.residual, x0 - inner.roundtrip(x0))  # the FP32 residual, exactly
    second = codec.requantize(x1, first)
    target = x1 + first.residual
    assert torch.equal(codec.decode(second), inner.roundtrip(target))
    assert torch.equal(second.residual, target - inner.roundtrip(target))
    assert not torch.equal(codec.decode(second), inner.roundtrip(x1))  # the residual changed the codes
    # the same step with an INT4 residual: the carried residual is its int4 reconstruction
    small = make_codec("int4-ef4")
    kept = small.encode(x0)
    carried = make_codec("int4").decode(kept.residual)
    assert torch.equal(small.decode(small.requantize(x1, kept)), inner.roundtrip(x1 + carried))


def test_storage_is_the_state_plus_the_residual_in_the_accounting():
    dims = (8, 128, 128)
    assert make_codec("int6-ef4").storage_bits(*dims) == 8 * 128 * (6 * 128 + 16) + 8 * 128 * (4 * 128 + 16)
    assert make_codec("int6-ef4").bits_per_value(*dims) == 10.25
    assert make_codec("int4-ef16").bits_per_value(*dims) == 4.125 + 16
    assert make_codec("int4-ef32").bits_per_value(*dims) > 32  # an upper bound, not a compression
    shape = shape_from_config(resolve("gdn"))
    counted = codec_bytes(make_codec("int4-ef4"), shape)
    assert counted.serving_bytes == 2 * int_rowwise_bytes(shape, 4).serving_bytes
    bits = torch.full((2, 16), 5)
    bits[0, :2] = 16
    mixed = MixedCodec(bits=bits, w=torch.ones(2, 16))
    wrapped = ErrorFeedbackCodec(mixed, 4)
    for analytical in (False, True):
        assert wrapped.storage_bits(2, 16, 32, analytical=analytical) == (
            mixed.storage_bits(2, 16, 32, analytical=analytical) + 2 * 16 * (4 * 32 + 16))


def test_names_and_bad_input():
    assert make_codec("dual4-ef16").name == "dual4-ef16"
    assert make_codec("INT6-EF4").inner.name == "int6"
    for name, message in (("int6-ef9", "2..8 bits"), ("int6-ef1", "2..8 bits"), ("mixed-ef4", "plan layer"),
                          ("int6-ef4-ef4", "applied once"), ("int9-ef4", "valid names")):
        with pytest.raises(ValueError, match=message):
            make_codec(name)
    with pytest.raises(TypeError, match="stepquant Codec"):
        ErrorFeedbackCodec("int4", 4)
    codec = make_codec("int4-ef4")
    with pytest.raises(TypeError, match="ErrorFeedbackState"):
        codec.decode(torch.zeros(1, 1, 2, 2))
    with pytest.raises(TypeError, match="requantizes after an ErrorFeedbackState"):
        codec.requantize(torch.zeros(1, 1, 2, 2), make_codec("int4").encode(torch.zeros(1, 1, 2, 2)))
    with pytest.raises(ValueError, match="re-encoded with encode"):
        codec.requantize(torch.zeros(2, 1, 2, 2), codec.encode(torch.zeros(1, 1, 2, 2)))


@pytest.mark.parametrize("mode", ["gdn", "kda"])
def test_error_feedback_stops_the_drift_of_long_lived_states(mode):
    """Slowly decaying states (retention ~0.98-0.999): plain INT4 accumulates its rounding errors, error
    feedback with an exact residual keeps the stored state within about one rounding step."""
    gen = torch.Generator().manual_seed(0)
    batch, steps, heads, dim = 2, 200, 2, 32
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    g_shape = (batch, steps, heads) if mode == "gdn" else (batch, steps, heads, dim)
    inputs = dict(q=F.normalize(randn(batch, steps, heads, dim), dim=-1),
                  k=F.normalize(randn(batch, steps, heads, dim), dim=-1), v=randn(batch, steps, heads, dim),
                  g=0.02 * F.logsigmoid(randn(*g_shape) + 2.0),
                  beta=torch.sigmoid(randn(batch, steps, heads)))
    reference, _ = gated_delta_rule(**inputs)
    error = {}
    for name in ("int4", "int4-ef32", "int4-ef4", "int6"):
        out, _ = quantized_gated_delta_rule(**inputs, codec=make_codec(name))
        error[name] = ((out - reference).norm() / reference.norm()).item()
    assert error["int4-ef32"] < 0.35 * error["int4"]  # measured ~0.22x
    assert error["int4-ef4"] < 1.2 * error["int4-ef32"]  # an INT4 residual keeps nearly all of it
    assert error["int4-ef4"] < 0.5 * error["int4"]


def test_eval_methods_take_the_suffix_on_codecs_and_plans():
    shape = shape_from_config(resolve("gdn"))
    method = resolve_method("int6-ef4", "gdn", GDN_LINEAR)
    assert method.label == "INT6 EF4"
    assert method.state_bytes(shape).serving_bytes == (int_rowwise_bytes(shape, 6).serving_bytes
                                                       + int_rowwise_bytes(shape, 4).serving_bytes)
    plain, wrapped = (resolve_method(n, "gdn", GDN_LINEAR) for n in ("stepquant-6", "stepquant-6-ef4"))
    assert wrapped.label == "STEPQuant@6 EF4" and wrapped.plan is not None
    assert all(isinstance(c, ErrorFeedbackCodec) and c.inner is not None for c in wrapped.codecs.values())
    extra = 8 * wrapped.state_bytes(shape).serving_bytes - 8 * plain.state_bytes(shape).serving_bytes
    assert extra == 8 * int_rowwise_bytes(shape, 4).serving_bytes
    one = resolve_method("stepquant-4-ef16@1", "gdn", GDN_LINEAR)
    assert one.codecs[1].name.endswith("-ef16") and one.codecs[0].name == "fp32"
    with pytest.raises(ValueError, match="-ef<r>"):
        resolve_method("int6-ef", "gdn", GDN_LINEAR)


def test_cache_carries_the_residual_packed_or_not_and_counts_its_bytes():
    from stepquant.integrations.hf_cache import CompressedStateCache
    from stepquant.models import load
    from stepquant.recurrence import prepare_qk, step

    torch.set_num_threads(1)
    model, _ = load("kda")
    shape = shape_from_config(resolve("kda"))
    ids = torch.randint(1, 8000, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = []
    caches = [CompressedStateCache(model.config, row_codecs=["int4", "int4-ef4"], packed=packed)
              for packed in (True, False)]
    with torch.inference_mode():
        for cache in caches:
            model(input_ids=ids[:, :6].repeat(2, 1), past_key_values=cache, use_cache=True)
            logits.append([model(input_ids=ids[:, t:t + 1].repeat(2, 1), past_key_values=cache,
                                 use_cache=True).logits for t in range(6, 9)])
    for a, b in zip(*logits, strict=True):
        assert torch.equal(a, b)  # packing both parts is exact
    assert not torch.equal(logits[0][-1][:2], logits[0][-1][2:])  # error feedback changed the state
    held = caches[0].state_bytes()
    assert held["bytes_per_request"][1] == codec_bytes(make_codec("int4-ef4"), shape).serving_bytes
    assert held["serving_bytes_per_request"] == caches[1].state_bytes()["serving_bytes_per_request"]

    layer = caches[1].layers[caches[1].linear_layers[0]]
    previous = layer.encoded[0][1]
    assert isinstance(previous, ErrorFeedbackState)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 4, 128, generator=gen) for _ in range(3))
    g, beta = -torch.rand(4, 4, 128, generator=gen), torch.rand(4, 4, generator=gen)
    state = layer.load()
    layer.decode_step(q, k, v, g, beta)
    b_q, b_k = prepare_qk(q, k, use_qk_l2norm=True, mode="kda")
    x, _ = step(state, b_q, b_k, v, g, beta)
    carried = make_codec("int4").decode(previous.residual)
    assert torch.equal(layer.load()[2:], make_codec("int4").roundtrip(x[2:] + carried))
