"""Dataset loaders and metrics of the offline stepquant tasks (the YAML files beside this one refer to them).

The data are local JSONL files in data/, built from the shipped held-out text by stepquant.tasks.build;
nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def _dataset(path: Path):
    import datasets

    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; build it with python -m stepquant.tasks.build")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}


def load_cloze(**metadata):
    return _dataset(DATA / "cloze.jsonl")


def load_continuation(model: str | None = None, references: str | None = None, **metadata):
    """The FP32-state references of one model: metadata "model" (a shipped name or checkpoint directory,
    whose folder name picks data/continuation_<name>.jsonl) or "references" (a JSONL path)."""
    if references:
        return _dataset(Path(references))
    if not model:
        raise ValueError("stepquant_continuation scores against one model's FP32 continuations: pass the "
                         "model in the task metadata (stepquant tasks does; lm_eval --metadata "
                         "'{\"model\": \"gdn\"}')")
    path = DATA / f"continuation_{Path(str(model)).name}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no FP32 reference continuations for model {model!r} ({path}); build them "
                                f"with python -m stepquant.tasks.build --model {model} --out DIR and pass "
                                "metadata {\"references\": \"DIR/continuation_<name>.jsonl\"}")
    return _dataset(path)


def process_continuation(doc: dict, results: list[str]) -> dict:
    """exact_match: the whole continuation equals the reference; agree: the share of the reference's
    words that the output reproduces before its first difference."""
    output, reference = results[0], doc["reference"]
    out_words, ref_words = output.split(), reference.split()
    same = 0
    for a, b in zip(out_words, ref_words, strict=False):
        if a != b:
            break
        same += 1
    return {"exact_match": float(output == reference), "agree": same / max(1, len(ref_words))}
