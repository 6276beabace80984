"""The lm-eval model `stepquant` and `stepquant tasks` (stepquant/tasks/, docs/tasks.md).

The wrapper's loglikelihood is the model's own loss under the FP32 state, padded batches included; a
compressed method changes the scores exactly where a compressed state is read; generate_until stops at
the task's stop strings; bad methods, plans, caches and task names fail with errors that name the fix.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

from stepquant.tasks.harness import StepquantLM
from stepquant.tasks.lm_eval_tasks import utils as task_utils
from stepquant.tasks.run import _paired, check_tasks, task_manager

TEXT = ("The river rises in the northern hills and flows south through a wide valley, where farmers have "
        "grown wheat and barley for centuries. In the spring the water is high and")
CONTINUATION = " the fields along its banks are often flooded for several weeks"


@pytest.fixture(scope="module", params=["gdn", "kda"])
def fp32_lm(request):
    torch.set_num_threads(1)
    return StepquantLM(model=request.param, method="fp32", batch_size=3)


def _reference_logprob(lm: StepquantLM, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    with torch.inference_mode():
        logp = F.log_softmax(lm.lm(input_ids=ids).logits[0].float(), -1)
    return sum(float(logp[len(context) - 1 + j, t]) for j, t in enumerate(continuation))


def _requests(lm: StepquantLM) -> list:
    context, continuation = lm._encode_pair(TEXT, CONTINUATION)
    # three lengths in one batch: the prefill is left-padded
    return [(None, context, continuation), (None, context[7:], continuation[:3]),
            (None, context[:20], context[20:30])]


@pytest.mark.parametrize("decode_context", [0, 12])
def test_fp32_loglikelihood_equals_the_model_loss(fp32_lm, decode_context):
    fp32_lm.decode_context = decode_context
    try:
        got = fp32_lm._loglikelihood_tokens(_requests(fp32_lm), disable_tqdm=True)
    finally:
        fp32_lm.decode_context = 0
    for (_, context, continuation), (logprob, _) in zip(_requests(fp32_lm), got, strict=True):
        assert logprob == pytest.approx(_reference_logprob(fp32_lm, context, continuation), abs=2e-3)
    # loglikelihood_rolling: the whole text from the EOS prefix, i.e. the model's own mean loss x tokens
    tokens = fp32_lm.tok_encode(TEXT)
    ids = torch.tensor([[fp32_lm.eot_token_id, *tokens]])
    with torch.inference_mode():
        loss = float(fp32_lm.lm(input_ids=ids, labels=ids).loss)
    rolling = fp32_lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (TEXT,), 0)],
                                            disable_tqdm=True)
    assert rolling[0] == pytest.approx(-loss * len(tokens), abs=2e-3)


def test_a_compressed_method_changes_the_scores_where_it_reads_the_state(fp32_lm):
    requests = _requests(fp32_lm)
    one_token = [(None, requests[0][1], requests[0][2][:1])]
    int4 = StepquantLM(model=fp32_lm.model_name, method="int4", batch_size=3)
    int4.lm = fp32_lm.lm  # the same weights
    fp32, quantized = (lm._loglikelihood_tokens(requests, disable_tqdm=True) for lm in (fp32_lm, int4))
    for (a, _), (b, _) in zip(fp32, quantized, strict=True):
        assert abs(a - b) > 1e-3  # every continuation has decode steps that read the INT4 state
    # a one-token continuation is predicted by the prefill logits (float state): the same for every method
    assert int4._loglikelihood_tokens(one_token)[0][0] == pytest.approx(
        fp32_lm._loglikelihood_tokens(one_token)[0][0], abs=1e-5)
    int4.decode_context = 16  # unless the context's tail ran as decode steps
    tail_read = int4._loglikelihood_tokens(one_token)[0][0]
    assert abs(tail_read - fp32_lm._loglikelihood_tokens(one_token)[0][0]) > 1e-4


def check_generate_until_stops(lm) -> tuple[str, str, str, str]:
    """generate_until stops at a stop string taken from its own free continuation, and at max_gen_toks;
    returns (free text, stop, stopped text, capped text). Also used by tests/test_gpu_tasks.py on CUDA."""
    prompt = "The history of the city began in the early nineteenth century, when"
    request = Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 24}), 0)
    free = lm.generate_until([request], disable_tqdm=True)[0]
    words = free.split()
    assert len(lm.tok_encode(free)) >= 20  # ran to the cap (no EOS in 24 tokens)
    stop = " " + words[len(words) // 2]
    requests = [Instance("generate_until", {}, (prompt, {"until": [stop], "max_gen_toks": 24}), 0),
                Instance("generate_until", {}, (prompt, {"until": ["\n\n"], "max_gen_toks": 5}), 1)]
    stopped, capped = lm.generate_until(requests, disable_tqdm=True)
    assert stopped == free.split(stop)[0] and stop not in stopped
    assert free.startswith(capped) and len(lm.tok_encode(capped)) <= 5
    return free, stop, stopped, capped


def test_generate_until_stops_at_the_stop_strings(fp32_lm):
    check_generate_until_stops(fp32_lm)


def test_bad_methods_plans_caches_and_tasks_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown method 'int3x'"):
        StepquantLM(model="gdn", method="int3x")
    with pytest.raises(FileNotFoundError, match="no calibrated plan"):
        StepquantLM(model="gdn", method="stepquant-6", plans_dir=tmp_path)
    with pytest.raises(ValueError, match="calibrated for 'kda'.*give a plan calibrated for this model"):
        StepquantLM(model="gdn", plan="stepquant/assets/plans/kda/stepquant-6")
    with pytest.raises(ValueError, match="both method=int4 and plan"):
        StepquantLM(model="gdn", method="int4", plan="stepquant/assets/plans/gdn/stepquant-6")
    with pytest.raises(ValueError, match="cache=packed .* not a plan"):
        StepquantLM(model="gdn", method="int4", cache="packed")
    with pytest.raises(ValueError, match="unknown model_args .*methd"):
        StepquantLM(model="gdn", methd="int4")
    with pytest.raises(FileNotFoundError, match="no model at"):
        StepquantLM(model=str(tmp_path))
    with pytest.raises(ValueError, match="unknown lm-eval task 'stepquant_clozee' .*did you mean "
                                         "stepquant_cloze"):
        check_tasks(task_manager("gdn", ["stepquant_clozee"]), ["stepquant_cloze", "stepquant_clozee"])
    with pytest.raises(FileNotFoundError, match="no FP32 reference continuations for model '/ckpt/mine'"):
        task_utils.load_continuation(model="/ckpt/mine")


def test_packed_cache_on_cpu_scores_like_the_compressed_cache():
    compressed = StepquantLM(model="gdn", method="stepquant-6", batch_size=2)
    packed = StepquantLM(model="gdn", method="stepquant-6", batch_size=2, cache="packed")
    assert (compressed.cache_kind, packed.cache_kind) == ("compressed", "packed")
    requests = _requests(compressed)[:2]
    for (a, _), (b, _) in zip(compressed._loglikelihood_tokens(requests, disable_tqdm=True),
                              packed._loglikelihood_tokens(requests, disable_tqdm=True), strict=True):
        # the packed kernels sum in another order: codes on a rounding boundary flip and the two caches drift
        # apart slowly (docs/eval.md section 1); measured 2.9e-5 relative over 13 scored tokens
        assert a == pytest.approx(b, rel=2e-4)


def test_paired_difference_and_continuation_metric():
    ref = [{"doc_id": i, "filter": "none", "acc": v} for i, v in enumerate([1, 1, 0, 0])]
    got = [{"doc_id": i, "filter": "none", "acc": v} for i, v in enumerate([1, 0, 0, 1])]
    mean, se, n = _paired(got, ref, "acc", "none")
    assert (mean, n) == (0.0, 4) and se == pytest.approx((2 / 3 / 4) ** 0.5)
    scores = task_utils.process_continuation({"reference": "a b c d"}, ["a b x d"])
    assert scores == {"exact_match": 0.0, "agree": 0.5}


def test_stepquant_tasks_writes_the_table(tmp_path):
    from stepquant.cli import main

    out = tmp_path / "out"
    assert main(["tasks", "--model", "gdn", "--methods", "int4", "--tasks", "stepquant_cloze", "--limit", "3",
                 "--decode-context", "8", "--out", str(out)]) == 0
    record = json.loads((out / "tasks.json").read_text())
    methods = record["models"]["gdn"]["methods"]
    assert list(methods) == ["fp32", "int4"]
    assert [m["cache"] for m in methods.values()] == ["compressed", "compressed"]  # the state's cache
    acc = methods["int4"]["tasks"]["stepquant_cloze"]["acc,none"]
    assert acc["n"] == 3 and "diff" in acc
    assert "diff" not in methods["fp32"]["tasks"]["stepquant_cloze"]["acc,none"]
    assert (out / "tasks.md").read_text().count("| INT4 |") == 1
    assert (out / "tasks_gdn.png").stat().st_size > 0
    bad = ["tasks", "--model", "gdn", "--methods", "int4", "--tasks", "stepquant_nosuch", "--out", str(out)]
    assert main(bad) == 2
