"""lm-evaluation-harness model ``stepquant``: any lm-eval task with the recurrent state held compressed.

The wrapper answers lm-eval's three request types the way a server with a compressed state would:

- **prefill is native**: a context is run through the model's own multi-token path on the float state,
  and the final state is stored in the method's format once (the boundary pack);
- **every later token is a decode step** that reads the stored state, updates it in FP32 and writes it
  back compressed (docs/method.md section 2): each generated token of ``generate_until``, and each scored
  token of a ``loglikelihood`` / ``loglikelihood_rolling`` continuation after the first (teacher-forced,
  as in the drift probe of stepquant.eval: the first continuation token is predicted by the prefill
  logits, which read the float state, so a one-token continuation scores the same for every method);
- ``decode_context=K`` (default 0) also feeds the last K context tokens as decode steps, so that a
  cloze task's answer is predicted from a state that was requantized K times (a context that arrived
  token by token, as in a conversation).

State formats are the methods of ``stepquant eval`` (stepquant.eval.methods: "fp32", "int6", "dsq4",
"stepquant-6", ... or a plan directory). The state lives in a
:class:`~stepquant.integrations.hf_cache.CompressedStateCache` (any method; the default on CPU) or, for a
calibrated plan on CUDA, a :class:`~stepquant.integrations.packed_cache.PackedStateCache` (the packed pool
and decode kernels); ``cache=compressed|packed`` overrides the choice.

Batching: requests are sorted by length and run ``batch_size`` at a time, left-padded for the prefill
(transformers zeroes padded positions before the GDN / KDA mixers, so a padded row's state and logits
equal an unpadded run's to float rounding; tested) with per-row position ids; the decode steps run in
lockstep, shorter rows fed padding whose outputs are ignored. Generation is greedy unless the task asks
for ``do_sample`` with a temperature.

Use it from Python (``lm_eval.simple_evaluate(model=StepquantLM(...), tasks=[...])``), through
``stepquant tasks`` (several methods, one table), or with lm-eval's own command line, which this module
wraps so that the model is registered first::

    python -m stepquant.tasks.harness run --model stepquant \\
        --model_args model=/models/Qwen3.5-4B,method=stepquant-6,device=cuda,batch_size=32 --tasks gsm8k
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as err:  # the optional dependency
    raise ImportError(f"stepquant.tasks needs lm-eval (pip install 'stepquant[tasks]'): {err}") from err

CACHES = ("auto", "compressed", "packed")
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HFLM default


def offline() -> None:
    """No hub access at run time: datasets, evaluate and transformers read local files only."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_EVALUATE_OFFLINE"):
        os.environ.setdefault(name, "1")


def _as_bool(value) -> bool:
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"expected true or false, got {value!r}")
        return value.lower() in ("true", "1", "yes")
    return bool(value)


def _positive_int(name: str, value, minimum: int = 1) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number < minimum or isinstance(value, bool):
        raise ValueError(f"model_args {name}={value!r}: give an integer >= {minimum}")
    return number


@register_model("stepquant")
class StepquantLM(TemplateLM):
    """lm-eval model: a shipped model or a transformers checkpoint with its recurrent state in one format.

    model:          shipped name (gdn, kda) or checkpoint directory (``pretrained`` is an alias)
    method:         a method of stepquant eval (fp32, bf16, int6, int4-sr, dsq4, stepquant-6, ...)
    plan:           a calibrated plan directory (instead of method)
    plans_dir:      where <model>/<variant>-<bits>/ plans live (default: the shipped plans)
    device, dtype:  where and in which precision the weights run (the recurrence is FP32 either way)
    batch_size:     requests per forward
    cache:          auto (PackedStateCache for a plan on CUDA, else CompressedStateCache), compressed, packed
    decode_context: the last K context tokens of every request run as compressed-state decode steps
    max_length:     longest sequence (rolling loglikelihood windows; longer contexts keep their end)
    threads:        torch threads (CPU)
    """

    def __init__(self, model: str | None = None, method: str | None = None, plan: str | None = None,
                 plans_dir: str | None = None, device: str = "cpu", dtype: str = "float32",
                 batch_size: int | str = 8, cache: str = "auto", decode_context: int | str = 0,
                 max_length: int | str | None = None, threads: int | str | None = None,
                 pretrained: str | None = None, packed: bool | str = False, **unused):
        super().__init__()
        from stepquant.eval.methods import load_plan, plan_method, resolve_method
        from stepquant.families import linear_layers
        from stepquant.models import load, resolve

        offline()
        unused = {k: v for k, v in unused.items() if v is not None and k not in ("max_batch_size",)}
        if unused:
            raise ValueError(f"unknown model_args for --model stepquant: {', '.join(sorted(unused))}; known: "
                             "model, method, plan, plans_dir, device, dtype, batch_size, cache, "
                             "decode_context, max_length, threads, packed")
        model = model or pretrained
        if not model:
            raise ValueError("model_args needs model=<shipped name (gdn, kda) or checkpoint directory>")
        if method and plan:
            raise ValueError(f"model_args has both method={method} and plan={plan}: give one")
        if str(batch_size).startswith("auto"):
            raise ValueError("batch_size=auto is not supported by --model stepquant: give an integer")
        self.batch_size = _positive_int("batch_size", batch_size)
        self.decode_context = _positive_int("decode_context", decode_context, minimum=0)
        if cache not in CACHES:
            raise ValueError(f"model_args cache={cache!r}: use one of {', '.join(CACHES)}")
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if dtype not in dtypes:
            raise ValueError(f"model_args dtype={dtype!r}: use one of {', '.join(dtypes)}")
        if threads is not None:
            torch.set_num_threads(_positive_int("threads", threads))

        config_dir = resolve(model)  # FileNotFoundError naming the shipped models for a bad path
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(config_dir, local_files_only=True)
        layers = list(linear_layers(config))
        name = Path(model).name
        if plan:
            self.method = plan_method(load_plan(plan, config), Path(plan).name, layers)
        else:
            self.method = resolve_method(method or "fp32", name, layers, plans_dir=plans_dir,
                                         model_config=config)
        self.cache_choice = cache
        self._device = torch.device(device)
        self.use(self.method)
        self.packed = _as_bool(packed)
        self.model_name = str(model)
        self.lm, self.tokenizer = load(model, dtype=dtypes[dtype], device=device)
        self.config = self.lm.config
        text = self.config.get_text_config(decoder=True)
        self.max_length = _positive_int("max_length", max_length) if max_length is not None else \
            int(getattr(text, "max_position_embeddings", 4096))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.eot_token_id

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> StepquantLM:
        """lm-eval's constructor path: its own flags (--batch_size, --device; the command line always
        passes a batch size) fill in what model_args does not say; model_args win."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        if "device" not in arg_dict and str(extra.get("device", "")).startswith("cuda") \
                and not torch.cuda.is_available():  # lm-eval's --device defaults to cuda
            print("stepquant: no CUDA GPU here; running on cpu (say device=... in model_args)",
                  file=sys.stderr)
            extra["device"] = "cpu"
        return cls(**{**extra, **arg_dict})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> StepquantLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    def use(self, method) -> StepquantLM:
        """Hold the state in another format from now on (a stepquant.eval.methods.Method): several methods
        share one loaded model."""
        kind = self.cache_choice
        if kind == "auto":
            kind = "packed" if self._device.type == "cuda" and method.plan is not None else "compressed"
        if kind == "packed" and method.plan is None:
            raise ValueError(f"cache=packed serves a calibrated plan from a packed pool; method "
                             f"{method.name!r} is not a plan (use cache=compressed, or a plan such as "
                             "stepquant-6)")
        self.method, self.cache_kind = method, kind
        return self

    # ------------------------------------------------------------------ lm-eval's interface
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def device(self):
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.model_name.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens))["input_ids"]

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The checkpoint's own chat template (lm_eval --apply_chat_template)."""
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        rows = [(context + continuation)[-(self.max_length + 1):] for _, context, continuation in requests]
        counts = [min(len(continuation), len(row) - 1)
                  for (_, _, continuation), row in zip(requests, rows, strict=True)]
        scored = self._score(rows, counts, disable_tqdm)
        for (key, _, _), result in zip(requests, scored, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return scored

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood: one window per max_length tokens, each a context (the EOS prefix
        or the preceding tokens) and its scored tokens, as lm-eval's HFLM cuts them."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            for context, pred in map(make_disjoint_window, get_rolling_token_windows(
                    self.tok_encode(text), self.prefix_token_id, self.max_length, context_len=1)):
                windows.append((None, context, pred))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm), strict=True):
            totals[n] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for n, req in enumerate(requests):  # one batch shares its generation settings
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(n)
        bar = tqdm(total=len(requests), desc=f"generate_until ({self.method.name})", disable=disable_tqdm)
        for members in groups.values():
            kwargs = dict(requests[members[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eos = self.tok_decode([self.eot_token_id]) or self.tokenizer.eos_token
            if eos and eos not in until:
                until.append(eos)
            max_new = _positive_int("max_gen_toks", kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            sample = _as_bool(kwargs.pop("do_sample", False)) and temperature > 0
            members.sort(key=lambda n: -len(self.tok_encode(requests[n].args[0])))
            for start in range(0, len(members), self.batch_size):
                batch = members[start:start + self.batch_size]
                keep = max(1, self.max_length - max_new)  # the context's end, room for the answer
                contexts = [self.tok_encode(requests[n].args[0])[-keep:] or [self.prefix_token_id]
                            for n in batch]
                texts = self._generate(contexts, until, max_new, temperature if sample else 0.0)
                for n, text in zip(batch, texts, strict=True):
                    results[n] = text
                    self.cache_hook.add_partial("generate_until", requests[n].args, text)
                bar.update(len(batch))
        bar.close()
        return results

    # ------------------------------------------------------------------ the compressed-state forward passes
    def _new_cache(self, rows: int):
        if self.cache_kind == "packed":
            from stepquant.integrations.packed_cache import PackedStateCache

            return PackedStateCache(self.config, self.method.plan, max_batch=rows, device=self._device)
        from stepquant.integrations.hf_cache import CompressedStateCache

        return CompressedStateCache(self.config, self.method.codecs, packed=self.packed)

    def _prefill(self, prefixes: list[list[int]]):
        """Left-padded native prefill of B prefixes: (cache, attention mask [B, L], next positions [B],
        logits of each prefix's last token [B, vocab], FP32)."""
        width = max(len(p) for p in prefixes)
        ids = torch.full((len(prefixes), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prefixes), width), dtype=torch.long)
        for i, prefix in enumerate(prefixes):
            ids[i, width - len(prefix):] = torch.tensor(prefix)
            mask[i, width - len(prefix):] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache(len(prefixes))
        logits = self.lm(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True).logits[:, -1].float()
        return cache, mask, positions[:, -1] + 1, logits

    def _step(self, cache, mask, positions, tokens: torch.Tensor):
        """One decode token per row (reads and rewrites the compressed state): (mask, positions, logits)."""
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        logits = self.lm(input_ids=tokens[:, None].to(self._device), attention_mask=mask,
                         position_ids=positions[:, None], past_key_values=cache, use_cache=True).logits
        return mask, positions + 1, logits[:, -1].float()

    def _score(self, rows: list[list[int]], counts: list[int],
               disable_tqdm: bool) -> list[tuple[float, bool]]:
        """(sum of log p, every token greedy) of the last counts[i] tokens of rows[i]: prefill, then
        teacher-forced decode steps."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        results: list = [None] * len(rows)
        bar = tqdm(total=len(rows), desc=f"loglikelihood ({self.method.name})", disable=disable_tqdm)
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                # prefill all but the scored tokens and the last decode_context context tokens (>= 1 token)
                splits = [max(1, len(rows[i]) - counts[i] - self.decode_context) for i in batch]
                prefixes = [rows[i][:s] for i, s in zip(batch, splits, strict=True)]
                cache, mask, positions, logits = self._prefill(prefixes)
                feeds = [rows[i][s:] for i, s in zip(batch, splits, strict=True)]  # token t is predicted at t
                logprob = torch.zeros(len(batch), dtype=torch.float64)
                greedy = torch.ones(len(batch), dtype=torch.bool)
                for t in range(max(len(f) for f in feeds)):
                    target = torch.tensor([f[t] if t < len(f) else self.pad_id for f in feeds])
                    scored = torch.tensor([len(f) - counts[i] <= t < len(f)
                                           for i, f in zip(batch, feeds, strict=True)])
                    logits = logits.cpu()
                    chosen = F.log_softmax(logits, -1).gather(1, target[:, None])[:, 0].double()
                    logprob += torch.where(scored, chosen, 0.0)
                    greedy &= ~scored | (logits.argmax(-1) == target)
                    if t + 1 < max(len(f) for f in feeds):
                        mask, positions, logits = self._step(cache, mask, positions, target)
                for j, i in enumerate(batch):
                    results[i] = (float(logprob[j]), bool(greedy[j]))
                bar.update(len(batch))
        bar.close()
        return results

    def _generate(self, contexts: list[list[int]], until: list[str], max_new: int,
                  temperature: float) -> list[str]:
        """Continue each context (prefill, its last decode_context tokens as decode steps, then generated
        tokens) until a stop string or max_new tokens; the text is cut before the first stop string."""
        tail = min(self.decode_context, min(len(c) for c in contexts) - 1)  # every row starts together
        with torch.inference_mode():
            cache, mask, positions, logits = self._prefill([c[:len(c) - tail] for c in contexts])
            for t in range(tail, 0, -1):
                tokens = torch.tensor([c[-t] for c in contexts])
                mask, positions, logits = self._step(cache, mask, positions, tokens)
            generated = [[] for _ in contexts]
            done = [False] * len(contexts)
            texts = [""] * len(contexts)
            for _ in range(max_new):
                logits = logits.cpu()
                if temperature > 0:
                    tokens = torch.multinomial(F.softmax(logits / temperature, -1), 1)[:, 0]
                else:
                    tokens = logits.argmax(-1)
                for i, token in enumerate(tokens.tolist()):
                    if done[i]:
                        continue
                    generated[i].append(token)
                    texts[i] = self.tok_decode(generated[i])
                    done[i] = token == self.eot_token_id or any(s in texts[i] for s in until if s)
                if all(done):
                    break
                mask, positions, logits = self._step(cache, mask, positions, tokens)
        out = []
        for text in texts:
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            out.append(text)
        return out


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with ``--model stepquant`` registered: ``python -m stepquant.tasks.harness``."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
