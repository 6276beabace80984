"""Tests of the deferred-fit state format (stepquant.codecs.deferred): the cadence of fits, its bytes, the
quantized loop, the compressed-state cache and the eval's method names."""

from __future__ import annotations

import pytest
import torch
from test_error_feedback import GDN_LINEAR, states  # the same random states and layers

from stepquant.accounting import codec_bytes
from stepquant.codecs import DeferredCodec, DeferredState, make_codec
from stepquant.codecs.deferred import pending_layout
from stepquant.eval.methods import resolve_method
from stepquant.families import shape_from_config
from stepquant.models import resolve
from stepquant.recurrence import quantized_gated_delta_rule


def test_fits_every_r_tokens_and_reads_the_float_state_between():
    codec, inner = make_codec("int4-defer3"), make_codec("int4")
    xs = [states((2, 3, 16, 8), seed=s) for s in range(8)]
    stored = codec.encode(xs[0])
    assert stored.age == 0 and stored.pending is None
    assert torch.equal(codec.decode(stored), inner.roundtrip(xs[0]))  # the boundary pack is a fit
    for t in range(1, 8):
        stored = codec.requantize(xs[t], stored)
        fitted = t % 3 == 0
        assert stored.age == t % 3 and (stored.pending is None) == fitted
        expected = inner.roundtrip(xs[t]) if fitted else xs[t]
        assert torch.equal(codec.decode(stored), expected)
    # the codes a pending state keeps are the last fit's
    stored = codec.requantize(xs[1], codec.encode(xs[0]))
    assert torch.equal(inner.decode(stored.state), inner.roundtrip(xs[0]))


def test_names_bytes_and_errors():
    dims = (8, 128, 128)
    for every in (2, 4, 8):
        extra = 8 * ((every - 1) * 256 * 16 + 128 * 32)
        plain = make_codec("int6").storage_bits(*dims)
        assert make_codec(f"int6-defer{every}").storage_bits(*dims) == plain + extra
    assert make_codec("int6-defer4").bits_per_value(*dims) == 6.125 + 0.75 + 0.25
    shape = shape_from_config(resolve("gdn"))
    deferred, plain = (codec_bytes(make_codec(n), shape).serving_bytes for n in ("int6-defer4", "int6"))
    # GDN's layout, as the eval counts it (Method.state_bytes): 3 u_j and a gate per head, 3 k_j per q/k head
    assert deferred == plain + shape.linear_layers * (shape.heads * (3 * 128 * 2 + 4)
                                                      + shape.key_heads * 3 * 128 * 2)
    for name, message in (("int6-defer1", "every 2..16"), ("int6-defer17", "every 2..16"),
                          ("int6-ef4-defer4", "stateless"), ("int6-defer4-ef4", "applied once"),
                          ("mixed-defer4", "valid names")):
        with pytest.raises(ValueError, match=message):
            make_codec(name)
    with pytest.raises(TypeError, match="DeferredState"):
        make_codec("int4-defer2").requantize(states((1, 1, 16, 8)), torch.zeros(1))
    with pytest.raises(TypeError, match="Codec"):
        DeferredCodec("int4", 2)
    # GDN's layout: one k_j per q/k head (4 value heads each here), one gate per head
    inner = make_codec("int6")
    gdn = DeferredCodec(inner, 4, shared_keys=4, head_gate=True)
    assert gdn.storage_bits(*dims) - inner.storage_bits(*dims) == 3 * (2 * 128 + 8 * 128) * 16 + 8 * 32
    with pytest.raises(ValueError, match="groups of 3"):
        DeferredCodec(inner, 4, shared_keys=3).storage_bits(*dims)
    with pytest.raises(ValueError, match="value heads per stored k_j"):
        DeferredCodec(inner, 4, shared_keys=0)
    # one home for the layout rule: KDA per head with a gate per key row, GDN per q/k head, unknown unshared
    assert pending_layout(True, 8, 2) == {"shared_keys": 1, "head_gate": False}
    assert pending_layout(False, 8, 2) == {"shared_keys": 4, "head_gate": True}
    assert pending_layout(False, 8, None) == {"shared_keys": 1, "head_gate": True}
    with pytest.raises(ValueError, match="divisor of its 8 value heads"):
        pending_layout(False, 8, 3)


def test_quantized_loop_fits_every_r_tokens():
    gen = torch.Generator().manual_seed(0)
    b, t, h, d = 1, 7, 2, 16
    q, k, v = (torch.randn(b, t, h, d, generator=gen) for _ in range(3))
    g = -torch.rand(b, t, h, generator=gen)
    beta = torch.rand(b, t, h, generator=gen)
    s0 = states((b, h, d, d), seed=3)
    fits = []
    _, final = quantized_gated_delta_rule(q, k, v, g, beta, make_codec("int4-defer3"), initial_state=s0,
                                          use_qk_l2norm=True,
                                          on_step=lambda t, x, s_hat: fits.append(not torch.equal(x, s_hat)))
    assert fits == [False, False, True, False, False, True, False]  # tokens 2 and 5 are the 3rd after a fit
    _, plain = quantized_gated_delta_rule(q, k, v, g, beta, make_codec("int4"), initial_state=s0,
                                          use_qk_l2norm=True)
    assert not torch.equal(final, plain)


def test_eval_method_and_cache():
    from stepquant.integrations.hf_cache import CompressedStateCache
    from stepquant.models import load

    method = resolve_method("stepquant-6-defer4", "gdn", GDN_LINEAR)
    assert method.label.endswith("fit/4")
    assert all(isinstance(c, DeferredCodec) for c in method.codecs.values())
    plain = resolve_method("stepquant-6", "gdn", GDN_LINEAR)
    shape = shape_from_config(resolve("gdn"))
    extra = method.state_bytes(shape).serving_bytes - plain.state_bytes(shape).serving_bytes
    # every linear layer: per value head 3 u_j in FP16 and one FP32 gate, 3 k_j per q/k head (GDN's layout)
    assert shape.key_heads < shape.heads
    assert extra == shape.linear_layers * (shape.heads * (3 * 128 * 2 + 4) + shape.key_heads * 3 * 128 * 2)

    torch.set_num_threads(1)
    model, _ = load("kda")
    ids = torch.randint(1, 8000, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = []
    with torch.inference_mode():
        for codecs in (["fp32", "int4-defer2"], ["fp32", "int4"]):
            cache = CompressedStateCache(model.config, row_codecs=codecs)
            model(input_ids=ids[:, :6].repeat(2, 1), past_key_values=cache, use_cache=True)
            logits.append([model(input_ids=ids[:, t:t + 1].repeat(2, 1), past_key_values=cache,
                                 use_cache=True).logits for t in range(6, 9)])
            layer = cache.layers[cache.linear_layers[0]]
            if codecs[1].endswith("defer2"):
                stored = layer.encoded[0][1]
                assert isinstance(stored, DeferredState) and stored.age == 1 and stored.pending is not None
    # the first decode token reads the boundary fit in both; the second reads the deferred float state
    assert torch.equal(logits[0][0], logits[1][0])
    assert not torch.equal(logits[0][1][2:], logits[1][1][2:])
    assert torch.equal(logits[0][1][:2], logits[1][1][:2])  # the FP32 row group is untouched


def test_codec_methods_take_the_suffix():
    method = resolve_method("int6-defer4", "gdn", GDN_LINEAR)
    assert method.label == "INT6 fit/4" and isinstance(method.codecs[0], DeferredCodec)
    with pytest.raises(ValueError, match="-defer<R>"):
        resolve_method("int6-defer", "gdn", GDN_LINEAR)
