"""Drift probe (paper Appendix E), plain perplexity and greedy generation, all methods in one batch.

Drift probe. A native prefill of P tokens evolves the FP32 state and packs it once at the boundary; D
forced decode updates then read and rewrite the compressed state every token (teacher forcing on the real
stream). The prefill predictions are the FP32 model's for every method (no compressed state is read), so
the probe scores the D compressed-read predictions: decode step j feeds token P + j and predicts token
P + j + 1. Excess NLL = NLL(method) - NLL(FP32 state), per predicted token, in nats; reported over the
first ``window`` (256), the last ``window`` and all D predictions, and as a per-step curve.

Speed: every method starts from the same FP32 prefill, so each stream is prefilled once and the cache is
replicated per method (:meth:`CompressedStateCache.replicate`: row group m = method m, the boundary pack
done with method m's codec); one batched teacher-forced decode loop then runs all methods and streams
together (rows ordered method-major: row m * S + s is method m on stream s). The FP32 reference is
just another row group, so excess NLL compares rows of the same forward pass.

Plain perplexity is the FP32 model's over the P prefill predictions (no state quantization involved).
Greedy generation continues a prompt from the shared FP32 prefill until EOS or a cap, per method, and
reports output lengths (the paper observes quantized states generating longer) and agreement with the
FP32-state continuation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from stepquant.eval.settings import DEFAULT_BLOCK, DEFAULT_WINDOW
from stepquant.integrations.hf_cache import CompressedStateCache


@dataclass(frozen=True)
class ExcessNLL:
    """Excess NLL of M methods on S streams over D decode predictions (nats per predicted token).

    first, last, all: [M, S] means over the first / last ``window`` predictions and over all D
    curve:            [M, D] per-step excess, averaged over streams
    block_means:      [M, S * (D // block)] means of consecutive blocks of ``block`` predictions
    stderr:           [M] standard error of the all-D mean over streams, from the block means (blocks
                      absorb the token-to-token correlation of the excess; nan with fewer than 2 blocks)
    window, block:    the sizes actually used (each at most D)
    """

    first: torch.Tensor
    last: torch.Tensor
    all: torch.Tensor
    curve: torch.Tensor
    block_means: torch.Tensor
    stderr: torch.Tensor
    window: int
    block: int


def excess_nll(nll: torch.Tensor, reference: int = 0, window: int = DEFAULT_WINDOW,
               block: int = DEFAULT_BLOCK) -> ExcessNLL:
    """Excess NLL windows of nll [M, S, D] (method, stream, decode step) against method ``reference``."""
    if not isinstance(nll, torch.Tensor) or nll.dim() != 3:
        got = tuple(nll.shape) if isinstance(nll, torch.Tensor) else type(nll).__name__
        raise ValueError(f"nll must be a tensor [methods, streams, decode steps], got {got}")
    num_methods, _, steps = nll.shape
    if steps < 1:
        raise ValueError("nll has no decode steps")
    if not 0 <= reference < num_methods:
        raise ValueError(f"reference must index one of the {num_methods} methods, got {reference}")
    for name, value in (("window", window), ("block", block)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    window, block = min(window, steps), min(block, steps)
    excess = nll.double() - nll[reference].double()  # [M, S, D]
    num_blocks = steps // block
    block_means = excess[..., : num_blocks * block].reshape(num_methods, -1, block).mean(-1)  # [M, S * nb]
    stderr = block_means.std(dim=1) / block_means.shape[1] ** 0.5 if block_means.shape[1] > 1 else (
        torch.full((num_methods,), float("nan"), dtype=torch.float64))
    return ExcessNLL(
        first=excess[..., :window].mean(-1),
        last=excess[..., -window:].mean(-1),
        all=excess.mean(-1),
        curve=excess.mean(1),
        block_means=block_means,
        stderr=stderr,
        window=window,
        block=block,
    )


def prefill(model, tokens: torch.Tensor):
    """FP32-state prefill of tokens [S, P]: (DynamicCache holding the boundary state, NLL [S, P - 1]).

    NLL[s, t] is the loss of predicting token t + 1 from tokens 0..t (all inside the prefill).
    Also returns the logits of the last position [S, vocab] (the prediction of token P).
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = model(input_ids=tokens, past_key_values=cache, use_cache=True).logits  # [S, P, vocab]
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), tokens[:, 1:], reduction="none")
    return cache, nll, logits[:, -1].float()


def _forward_one(model, cache, token_column: torch.Tensor) -> torch.Tensor:
    """One cached decode token for every row: token_column [R] -> logits [R, vocab] (FP32)."""
    return model(input_ids=token_column[:, None], past_key_values=cache, use_cache=True).logits[:, -1].float()


@dataclass
class ProbeResult:
    """Everything one drift-probe run measured.

    prefill_nll:   [S, P] FP32 NLL of the prefill predictions (tokens 1..P; the last one is the boundary
                   prediction of token P, read from the prefill logits)
    decode_nll:    [M, S, D] NLL of the compressed-read predictions (tokens P+1..P+D)
    excess:        ExcessNLL against the FP32 row group (method 0)
    held_bytes:    CompressedStateCache.state_bytes() after the last step
    seconds:       wall times of "prefill", "replicate" (boundary packs) and "decode"
    """

    prefill_nll: torch.Tensor
    decode_nll: torch.Tensor
    excess: ExcessNLL
    held_bytes: dict
    seconds: dict


def drift_probe(model, tokens: torch.Tensor, row_codecs: list, *, prefill_len: int,
                window: int = DEFAULT_WINDOW, packed: bool = False, desc: str = "drift probe") -> ProbeResult:
    """Appendix E drift probe of every codec spec in row_codecs (index 0 must be the FP32 reference).

    tokens [S, P + D + 1]: S streams; the first P are prefilled natively, then D forced decode updates.
    row_codecs: codec specs (see stepquant.integrations.hf_cache), one per method.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [streams, P + D + 1], got shape {tuple(tokens.shape)}")
    num_streams, length = tokens.shape
    steps = length - prefill_len - 1
    if prefill_len < 2 or steps < 1:
        raise ValueError(f"need prefill_len >= 2 and at least one decode step; got P={prefill_len} for "
                         f"{length} tokens per stream")
    num_methods = len(row_codecs)
    seconds = {}
    with torch.inference_mode():
        start = time.perf_counter()
        source, prefill_nll, boundary_logits = prefill(model, tokens[:, :prefill_len])
        boundary_nll = F.cross_entropy(boundary_logits, tokens[:, prefill_len], reduction="none")
        prefill_nll = torch.cat([prefill_nll, boundary_nll[:, None]], dim=1)  # [S, P]
        seconds["prefill"] = time.perf_counter() - start

        start = time.perf_counter()
        cache = CompressedStateCache.replicate(source, model.config, row_codecs, packed=packed)
        del source
        seconds["replicate"] = time.perf_counter() - start

        inputs = tokens[:, prefill_len:].repeat(num_methods, 1)  # [M * S, D + 1], method-major rows
        nll = torch.empty(inputs.shape[0], steps, device=inputs.device)
        start = time.perf_counter()
        bar = tqdm(total=steps * inputs.shape[0], desc=desc, unit="tok", unit_scale=True, leave=False)
        for j in range(steps):
            logits = _forward_one(model, cache, inputs[:, j])
            nll[:, j] = F.cross_entropy(logits, inputs[:, j + 1], reduction="none")
            bar.update(inputs.shape[0])
        bar.close()
        seconds["decode"] = time.perf_counter() - start
    prefill_nll, nll = prefill_nll.cpu(), nll.cpu()  # the model may be on a GPU; results live on the CPU
    decode_nll = nll.view(num_methods, num_streams, steps)
    excess = excess_nll(decode_nll, 0, window)
    return ProbeResult(prefill_nll, decode_nll, excess, cache.state_bytes(), seconds)


@dataclass
class GenerationResult:
    """Greedy continuations of S prompts by M methods.

    tokens:  [M, S, T] generated tokens (after the first EOS: EOS repeated)
    lengths: [M, S] tokens generated up to and including the first EOS, or T when capped
    capped:  [M, S] True where no EOS came within T tokens
    agree:   [M, S] tokens identical to the FP32-state continuation before the first difference
    seconds: wall time of the whole run
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    capped: torch.Tensor
    agree: torch.Tensor
    seconds: float


def first_eos_lengths(tokens: torch.Tensor, eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [..., T] -> (length up to and including the first EOS, or T; capped mask)."""
    is_eos = tokens == eos_token_id
    capped = ~is_eos.any(-1)
    first = torch.where(capped, tokens.shape[-1], is_eos.to(torch.int64).argmax(-1) + 1)
    return first, capped


def agreement_lengths(tokens: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Leading tokens of tokens [..., T] equal to reference [..., T] (T when identical)."""
    differs = tokens != reference
    return torch.where(differs.any(-1), differs.to(torch.int64).argmax(-1), tokens.shape[-1])


def greedy_generation(model, prompts: torch.Tensor, row_codecs: list, *, max_new_tokens: int,
                      eos_token_id: int, packed: bool = False,
                      desc: str = "greedy generation") -> GenerationResult:
    """Greedy decoding from prompts [S, L] with every codec spec (index 0 = FP32) until EOS or the cap.

    The prompt is prefilled once in FP32 and packed per method at the boundary (as in the probe); the first
    new token comes from the prefill logits, every later one from a compressed-state read. A row that has
    emitted EOS keeps being fed EOS (its length is already fixed); the loop stops when every row has.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    num_streams = prompts.shape[0]
    num_methods = len(row_codecs)
    start = time.perf_counter()
    with torch.inference_mode():
        source, _, boundary_logits = prefill(model, prompts)
        cache = CompressedStateCache.replicate(source, model.config, row_codecs, packed=packed)
        del source
        rows = num_methods * num_streams
        out = torch.full((rows, max_new_tokens), eos_token_id, dtype=torch.long, device=prompts.device)
        out[:, 0] = boundary_logits.argmax(-1).repeat(num_methods)
        done = out[:, 0] == eos_token_id
        bar = tqdm(total=(max_new_tokens - 1) * rows, desc=desc, unit="tok", unit_scale=True, leave=False)
        for j in range(1, max_new_tokens):
            if bool(done.all()):
                break
            logits = _forward_one(model, cache, out[:, j - 1])
            out[:, j] = torch.where(done, eos_token_id, logits.argmax(-1))
            done = done | (out[:, j] == eos_token_id)
            bar.update(rows)  # tokens/s over all rows
        bar.close()
    tokens = out.cpu().view(num_methods, num_streams, max_new_tokens)
    lengths, capped = first_eos_lengths(tokens, eos_token_id)
    agree = agreement_lengths(tokens, tokens[0:1].expand_as(tokens))
    return GenerationResult(tokens, lengths, capped, agree, time.perf_counter() - start)
