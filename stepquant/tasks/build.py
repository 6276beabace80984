"""Build the offline lm-eval tasks' data from the shipped held-out text (committed in lm_eval_tasks/data/).

Two tasks run without a hub (lm_eval_tasks/*.yaml, docs/tasks.md):

- ``stepquant_cloze``, a last-word cloze in the LAMBADA style: a passage of up to ``words`` words of a
  held-out document (wiki, sotu, brown, taken in turn) and the word that follows it, a word of 4+ letters
  that already occurs in the passage (LAMBADA kept words that need the context; recurrence in the passage
  is our cheap stand-in for its human filter). Scored by lm-eval's loglikelihood: acc = the whole word
  is the greedy continuation.
- ``stepquant_continuation``, a long continuation scored against the FP32 state: the first
  ``prompt_tokens`` tokens of a held-out document and the model's own greedy continuation of
  ``new_tokens`` tokens with the FP32 state (made here through the wrapper with method fp32, so the FP32
  row reproduces it). The reference depends on the model: one file per model, chosen by the task's
  metadata ``model`` (``stepquant tasks`` sets it; ``lm_eval --metadata '{"model": "gdn"}'``).

    python -m stepquant.tasks.build                       # both files for both shipped models
    python -m stepquant.tasks.build --model /ckpt --out my_tasks/data   # references for your checkpoint

Deterministic: the shipped splits are fixed (stepquant.data) and greedy decoding is argmax.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from stepquant.data import EVAL_STREAMS, split_texts

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
DATA_DIR = TASKS_DIR / "data"
CLOZE_FILE = "cloze.jsonl"
CONTINUATION_SETTINGS = {"prompt_tokens": 32, "new_tokens": 64, "per_stream": 20}


def continuation_file(model_name: str) -> str:
    return f"continuation_{Path(model_name).name}.jsonl"


def cloze_items(per_stream: int = 100, words: int = 100) -> list[dict]:
    """{"context", "target", "source"} items: passages of the held-out streams, the streams taken in turn.

    The context is the original text up to the target word (its whitespace included); the target is
    the word with trailing punctuation removed. Passages of one document do not overlap."""
    per_source = []
    for source in EVAL_STREAMS:
        items = []
        for text in split_texts(source):
            spans = [m.span() for m in re.finditer(r"\S+", text)]
            j = words
            while j < len(spans) and len(items) < per_stream:
                start, end = spans[j]
                word = re.sub(r"[^\w]+$", "", text[start:end])
                window = {re.sub(r"[^\w]+$", "", text[a:b]).lower() for a, b in spans[j - words:j]}
                if word.isalpha() and len(word) >= 4 and word.lower() in window:
                    items.append({"context": text[spans[j - words][0]:start], "target": word,
                                  "source": source})
                    j += words + 1  # the next passage starts after this target
                else:
                    j += 1
            if len(items) == per_stream:
                break
        if len(items) < per_stream:
            raise ValueError(f"{source}: only {len(items)} cloze passages of {words} words (asked for "
                             f"{per_stream})")
        per_source.append(items)
    return [item for group in zip(*per_source, strict=True) for item in group]


def continuation_items(model_name: str, *, prompt_tokens: int, new_tokens: int, per_stream: int,
                       batch_size: int = 8, threads: int | None = None) -> list[dict]:
    """{"prompt", "reference", "source"}: document starts and the FP32-state greedy continuation of the
    model (the wrapper's generate_until with method fp32, stopping only at EOS)."""
    from stepquant.eval.run import document_prompts
    from stepquant.tasks.harness import StepquantLM

    lm = StepquantLM(model=model_name, method="fp32", batch_size=batch_size, threads=threads)
    prompts, sources = [], []
    for source in EVAL_STREAMS:
        for ids in document_prompts(source, lm.tokenizer, per_stream, prompt_tokens).tolist():
            prompts.append(lm.tok_decode(ids))
            sources.append(source)
    order = [i for group in zip(*(range(s * per_stream, (s + 1) * per_stream)
                                  for s in range(len(EVAL_STREAMS))), strict=True) for i in group]
    contexts = [lm.tok_encode(prompts[i]) for i in order]
    references = []
    for start in range(0, len(contexts), batch_size):
        references += lm._generate(contexts[start:start + batch_size], [], new_tokens, 0.0)
    return [{"prompt": prompts[i], "reference": ref, "source": sources[i]}
            for i, ref in zip(order, references, strict=True)]


def write_jsonl(path: Path, items: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stepquant.tasks.build",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", default=None,
                        help="shipped name or checkpoint directory for the continuation references "
                             "(repeatable; default: gdn and kda)")
    parser.add_argument("--out", default=str(DATA_DIR), help=f"output directory (default {DATA_DIR})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    print(write_jsonl(out / CLOZE_FILE, cloze_items()))
    for model_name in args.model or ["gdn", "kda"]:
        items = continuation_items(model_name, threads=args.threads, **CONTINUATION_SETTINGS)
        print(write_jsonl(out / continuation_file(model_name), items))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
