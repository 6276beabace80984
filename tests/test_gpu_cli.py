"""GPU check of the main job's commands: ``stepquant calibrate`` and ``stepquant eval`` with ``--device cuda``
on the shipped models agree with the same commands on the CPU (run on the H200 by benchmarks/h200_run.sh).

On CUDA the prefill runs through fla's chunk kernels (TF32 dots on FP32 inputs) and transformers' CUDA paths,
on the CPU through the torch fallbacks, so the numbers agree to a tolerance, not bit for bit:

- calibration statistics: the row-impact factors w, the gate retention and the dual-axis distortions within
  5% relative RMS; the plans' bit allocations equal on at least 90% of the units (a unit near a tie in the
  exact allocation may flip);
- evaluation: prefill perplexity within 1%, and each method's mean excess NLL within 0.01 nats + 10%.

Small settings (2 x 96 calibration tokens, P = 64 and D = 48 in the probe) keep the test under a minute; the
wall time of each run on each device is printed beside the other.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from stepquant.calibrate import Plan
from stepquant.calibrate.stats import CalibrationStats
from stepquant.cli import main

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    finite = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[finite], b[finite]
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run(argv: list[str], capsys) -> tuple[dict, float]:
    start = time.perf_counter()
    assert main(argv) == 0
    seconds = time.perf_counter() - start
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1]), seconds


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_calibrate_on_cuda_matches_the_cpu(name, tmp_path, capsys):
    common = [
        "calibrate",
        "--model",
        name,
        "--bits",
        "6",
        "--variant",
        "stepquant",
        "--segments",
        "2",
        "--segment-length",
        "96",
        "--snapshot-every",
        "32",
        "--batch-size",
        "2",
        "--no-progress",
    ]
    results, seconds = {}, {}
    for device in ("cpu", "cuda"):
        results[device], seconds[device] = run(
            [*common, "--device", device, "--replay-device", device, "--out", str(tmp_path / device)], capsys
        )
    stats = {d: CalibrationStats.load(tmp_path / d) for d in ("cpu", "cuda")}
    plans = {d: Plan.load(results[d]["plans"][0]["plan"], model_config=name) for d in ("cpu", "cuda")}
    errors = {
        field: rel_rms(getattr(stats["cuda"], field), getattr(stats["cpu"], field))
        for field in ("w", "mean_log_retention", "distortion_dual_axis")
    }
    same = torch.cat([(a == b).flatten() for a, b in zip(plans["cuda"].bits, plans["cpu"].bits, strict=True)])
    agree = float(same.float().mean())
    print(
        f"calibrate {name}: cpu {seconds['cpu']:.1f} s, cuda {seconds['cuda']:.1f} s; rel rms "
        + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
        + f"; plan bits equal on {agree:.3f}"
    )
    assert max(errors.values()) < 0.05
    assert agree >= 0.9


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_eval_on_cuda_matches_the_cpu(name, tmp_path, capsys):
    common = [
        "eval",
        "--model",
        name,
        "--methods",
        "stepquant-6,int6,bf16",
        "--data",
        "wiki",
        "--prefill",
        "64",
        "--decode",
        "48",
        "--window",
        "16",
        "--segments",
        "1",
        "--gen-prompts",
        "1",
        "--gen-max-new",
        "8",
        "--no-plots",
    ]
    results, seconds = {}, {}
    for device in ("cpu", "cuda"):
        out = tmp_path / device
        run([*common, "--device", device, "--out", str(out)], capsys)
        seconds[device] = json.loads((out / "eval.json").read_text())["seconds"]
        results[device] = json.loads((out / "eval.json").read_text())["models"][name]
    cpu, gpu = results["cpu"], results["cuda"]
    ppl_cpu, ppl_gpu = cpu["prefill_ppl"]["wiki"], gpu["prefill_ppl"]["wiki"]
    lines = [
        f"eval {name}: cpu {seconds['cpu']:.1f} s, cuda {seconds['cuda']:.1f} s; prefill ppl "
        f"{ppl_cpu:.4f} / {ppl_gpu:.4f}"
    ]
    assert abs(ppl_gpu - ppl_cpu) <= 0.01 * ppl_cpu
    for method, record in cpu["methods"].items():
        a, b = record["excess_nll"]["all"]["mean"], gpu["methods"][method]["excess_nll"]["all"]["mean"]
        lines.append(f"  {method}: excess NLL cpu {a:.5f} cuda {b:.5f}")
        assert abs(a - b) <= 0.01 + 0.1 * abs(a)
    print("\n".join(lines))
