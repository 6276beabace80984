"""GPU checks of the serving path around the decode kernel (run on the H200 by benchmarks/h200_run.sh).

- ``prefill_packed`` through fla's chunk kernels (GDN and KDA) against stepquant's torch recurrence on
  the same GPU, including the packed boundary state and a second chunk continued from it;
- ``PackedStateCache`` on CUDA (the CUDA decode and pack kernels on the pool) against
  ``CompressedStateCache`` (transformers' own step and the torch codec) with the shipped checkpoints:
  per-step logits from the same stored state, and greedy generation; with defer=4 (the deferred-fit
  format) against the compressed cache with the plan's codecs deferred alike.

Every test is marked gpu and skips without CUDA; the prefill tests need fla, the cache tests a shipped
checkpoint.
"""

from __future__ import annotations

import time

import pytest
import torch

from stepquant.calibrate import Plan
from stepquant.codecs import LayerFormat
from stepquant.codecs.packing import unpack
from stepquant.kernels import decode as decode_kernels
from stepquant.kernels.decode import naive_pack_states
from stepquant.kernels.prefill import _fla_chunk, prefill_packed
from stepquant.pool import PackedLayer
from stepquant.recurrence import gated_delta_rule

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ---------------------------------------------------------------- prefill through fla's chunk kernels

@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_prefill_with_fla_matches_the_torch_recurrence(kda):
    if _fla_chunk("kda" if kda else "gdn") is None:
        pytest.skip("fla's chunk kernels are not importable here (carry the fla-core wheel)")
    heads, key_heads, dim, length = 4, 2, 128, 69  # grouped keys, a length that is not a chunk multiple
    gen = torch.Generator().manual_seed(21)
    bits = torch.tensor([4, 5, 6, 8], dtype=torch.int8)[:, None].expand(heads, dim).clone()
    bits[1, :3] = 16  # FP16 pivot rows
    layer = PackedLayer(LayerFormat(bits, torch.ones(heads, dim)), 4, dim, "cuda")
    slots = torch.tensor([3, -1, 0], dtype=torch.int32, device="cuda")
    q, k = (torch.randn(3, length, key_heads, dim, generator=gen).cuda() for _ in range(2))
    v = torch.randn(3, length, heads, dim, generator=gen).cuda()
    g = (-0.1 * torch.rand(3, length, heads, *((dim,) if kda else ()), generator=gen)).cuda()
    beta = torch.rand(3, length, heads, generator=gen).cuda()
    active = [0, 2]
    rows = (q[active], k[active], v[active], g[active], beta[active])

    o = prefill_packed(layer, slots, q, k, v, g, beta, use_qk_l2norm=True, from_state=False, use_fla=True)
    o_ref, final = gated_delta_rule(*rows, None, use_qk_l2norm=True)
    assert not o[1].any()  # the skipped row
    err_o = rel_rms(o[active], o_ref)
    ref_layer = PackedLayer(layer.format, 4, dim, "cuda")
    naive_pack_states(ref_layer, slots[active], final)
    index = slots[active].long()
    stored = unpack(layer.gather(index)).dequantize()
    err_state = rel_rms(stored, final)
    err_codec = rel_rms(unpack(ref_layer.gather(index)).dequantize(), final)
    print(f"prefill {'kda' if kda else 'gdn'}: o rel rms {err_o:.2e}, stored state {err_state:.2e} "
          f"(the codec alone on the reference state: {err_codec:.2e})")
    assert err_o < 5e-3  # fla's chunk kernels use TF32 dots on FP32 inputs
    assert err_state <= 1.1 * err_codec + 5e-3

    # a second chunk starts from the stored (quantized) state
    o2 = prefill_packed(layer, slots, q, k, v, g, beta, use_qk_l2norm=True, use_fla=True)
    o2_ref, _ = gated_delta_rule(*rows, stored, use_qk_l2norm=True)
    assert rel_rms(o2[active], o2_ref) < 5e-3
    assert not layer.pages.codes[[1, 2]].any()  # slots nobody used


# ---------------------------------------------------------------- PackedStateCache on CUDA

def shipped_on_gpu(name: str):
    from stepquant import assets
    from stepquant.models import load

    model, _ = load(name, device="cuda")
    return model, Plan.load(assets.PLANS / name / "stepquant-6", model_config=model.config)


def forward(model, cache, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]


def timed_generate(model, ids: torch.Tensor, greedy: dict, options: tuple, make_cache) -> tuple[dict, dict]:
    """model.generate on a fresh make_cache(option) per option, every option twice (the second round timed
    warm): ({option: tokens}, {option: seconds})."""
    outputs, seconds = {}, {}
    for option in (*options, *options):
        cache = make_cache(option)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            outputs[option] = model.generate(ids, past_key_values=cache, **greedy)
        torch.cuda.synchronize()
        seconds[option] = time.perf_counter() - start
    return outputs, seconds


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_packed_cache_on_gpu_matches_the_compressed_cache(name, monkeypatch):
    from stepquant.integrations.hf_cache import CompressedStateCache
    from stepquant.integrations.packed_cache import PackedStateCache

    model, plan = shipped_on_gpu(name)
    launches = []  # decode steps that ran a GPU kernel (CUDA where it serves the layer, else Triton)
    for backend in ("cuda", "triton"):  # decode_step dispatches through this table
        kernel = decode_kernels._DECODE[backend]
        counted = lambda *a, _kernel=kernel, **kw: launches.append(1) or _kernel(*a, **kw)
        monkeypatch.setitem(decode_kernels._DECODE, backend, counted)
    ids = torch.randint(1, 8000, (2, 12), generator=torch.Generator().manual_seed(22)).cuda()
    ours = PackedStateCache(model.config, plan, max_batch=2, device="cuda")
    reference = CompressedStateCache(model.config, plan)
    err_prefill = rel_rms(forward(model, ours, ids[:, :6]), forward(model, reference, ids[:, :6]))
    agree = []
    for i in ours.linear_layers:  # the boundary pack: GPU kernel vs the torch codec on the same state
        mine = ours.layers[i].pool_layer.gather(torch.tensor(ours.slots))
        agree.append(float((mine.codes == reference.layers[i].encoded[0][0].codes).float().mean()))
    errors = []
    for t in range(6, ids.shape[1]):
        token = ids[:, t:t + 1]
        errors.append(rel_rms(forward(model, ours, token), forward(model, reference, token)))
        for i in ours.linear_layers:  # continue the reference from our stored state: compare the math
            reference.layers[i].encoded[0] = [ours.layers[i].pool_layer.gather(torch.tensor(ours.slots))]
    print(f"{name}: prefill logits rel rms {err_prefill:.2e}; boundary words agreeing, worst layer "
          f"{min(agree):.5f}; per decode step {', '.join(f'{e:.1e}' for e in errors)}")
    assert err_prefill == 0.0  # the same float prefill path on both caches
    assert min(agree) > 0.999  # rounding-tie flips of refitted scales only
    assert len(launches) == (ids.shape[1] - 6) * len(ours.linear_layers)  # every decode ran the kernel
    assert max(errors) < 1e-4

    # greedy generation on each cache's own states
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        want = model.generate(ids[:, :6], past_key_values=CompressedStateCache(model.config, plan), **greedy)
        got = model.generate(ids[:, :6], past_key_values=PackedStateCache(model.config, plan, max_batch=2,
                                                                           device="cuda"), **greedy)
    print(f"{name}: greedy tokens equal: {torch.equal(got, want)}")
    assert torch.equal(got[:, :10], want[:, :10])  # later tokens may part on a near tie


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_packed_cache_split_step_generates_the_same_tokens(name, monkeypatch):
    # the split step stores exactly what the fused step stores, so greedy decoding must agree token for token
    # (with the readout's FP32 sums: on tensor cores, SQ_MMA, its u differs by ~1e-6 relative, and a near tie
    # may part)
    from stepquant.integrations.packed_cache import PackedStateCache
    from stepquant.kernels.decode import cuda

    monkeypatch.setitem(cuda.TUNING, "SQ_MMA", 0)
    model, plan = shipped_on_gpu(name)
    ids = torch.randint(1, 8000, (4, 16), generator=torch.Generator().manual_seed(23)).cuda()
    greedy = dict(max_new_tokens=32, do_sample=False, pad_token_id=0)
    outputs, seconds = timed_generate(
        model, ids, greedy, (False, True),
        lambda split: PackedStateCache(model.config, plan, max_batch=4, device="cuda", split=split))
    print(f"{name}: generate 4 x 32 tokens: fused {seconds[False]:.3f} s, split {seconds[True]:.3f} s")
    assert torch.equal(outputs[True], outputs[False])


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_packed_cache_deferred_follows_the_deferred_codec(name):
    # defer=4 on CUDA (the kernel's deferred path) against the compressed cache with the plan's codecs
    # deferred alike (the float state between fits), then greedy decoding on each cache's own states

    from stepquant.codecs import DeferredCodec
    from stepquant.integrations.hf_cache import CompressedStateCache
    from stepquant.integrations.packed_cache import PackedStateCache

    model, plan = shipped_on_gpu(name)
    every, ids = 4, torch.randint(1, 8000, (2, 16), generator=torch.Generator().manual_seed(24)).cuda()
    ours = PackedStateCache(model.config, plan, max_batch=2, device="cuda", defer=every)
    codecs = {layer: DeferredCodec(plan.codec(i), every) for i, layer in enumerate(ours.linear_layers)}
    reference = CompressedStateCache(model.config, codecs)
    assert rel_rms(forward(model, ours, ids[:, :6]), forward(model, reference, ids[:, :6])) == 0.0
    errors = [rel_rms(forward(model, ours, ids[:, t:t + 1]), forward(model, reference, ids[:, t:t + 1]))
              for t in range(6, 14)]  # two fits
    continued = rel_rms(forward(model, ours, ids[:, 14:]), forward(model, reference, ids[:, 14:]))
    print(f"{name}: deferred R={every} per decode step {', '.join(f'{e:.1e}' for e in errors)}; continued "
          f"prompt {continued:.1e}")
    assert max(errors) < 2e-3 and continued < 2e-3  # the CPU twin measured up to 3.3e-4
    greedy = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    outputs, seconds = timed_generate(
        model, ids[:, :6], greedy, (None, every),
        lambda defer: PackedStateCache(model.config, plan, max_batch=2, device="cuda", defer=defer))
    with torch.inference_mode():
        want = model.generate(ids[:, :6], past_key_values=CompressedStateCache(model.config, codecs),
                              **greedy)
    same = torch.equal(outputs[every], want)
    print(f"{name}: generate 2 x 24 tokens: per-token fit {seconds[None]:.3f} s, deferred "
          f"{seconds[every]:.3f} s; deferred tokens equal the deferred codec's: {same}")
    assert torch.equal(outputs[every][:, :12], want[:, :12])  # later tokens may part on a near tie
