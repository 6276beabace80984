"""Float reference of the gated delta rule (GDN and KDA), and the quantized serving loop built on it.

Everything else in stepquant is judged against these loops: codecs by how far the quantized loop
drifts from the float one, kernels by matching them, calibration by the row-impact vectors they
define. They are written to read like docs/method.md section 2 (one head, t = token):

    D_t = exp(g_t) I (GDN, scalar g per head)  or  diag(exp(g_t)) (KDA, g per key channel)
    A_t = (I - beta_t k_t k_t^T) D_t,   B_t = beta_t k_t v_t^T
    S_t = A_t S_{t-1} + B_t,            y_t = S_t^T q_t

computed as the delta rule does it: h = D_t S; h += k (beta (v - k^T h))^T; y = h^T q.

Conventions (those of transformers' torch fallbacks): q, k [B, T, H_k, K]; v [B, T, H, V];
g [B, T, H] (GDN) or [B, T, H, K] (KDA); beta [B, T, H]. Value head h reads key head h // (H // H_k)
(q and k are repeat_interleave'd, as Qwen3.5 does when num_v_heads > num_k_heads). Arithmetic is FP32,
or float64 when any input is float64. Inside the loops the state is always "kv" = [N, H, K, V]
(key-row-major, what codecs see); initial and final states may instead use the serving layout
"vk" = [N, H, V, K] (SGLang/vLLM, K contiguous).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QK_L2NORM_EPS = 1e-6
MODES = ("gdn", "kda")
LAYOUTS = ("kv", "vk")
FEEDBACKS = ("native", "oracle")


def l2norm(x: torch.Tensor, mode: str = "gdn", eps: float = QK_L2NORM_EPS) -> torch.Tensor:
    """transformers' in-kernel q/k normalisation over the last dim; equal up to rounding in both modes.

    GDN (Qwen3.5): x * rsqrt(sum(x^2) + eps).  KDA (Kimi-Linear): x / sqrt(sum(x^2) + eps).
    """
    _check_choice(mode, "mode", MODES)
    squared_norm = (x * x).sum(dim=-1, keepdim=True) + eps
    return x * torch.rsqrt(squared_norm) if mode == "gdn" else x / torch.sqrt(squared_norm)


def prepare_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    mode: str = "gdn",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The q_t, k_t the recurrence uses: cast to FP32 (float64 stays), optionally L2-normalised, q * scale.

    scale defaults to K^-1/2. Shapes are kept ([..., H_k, K]); heads are not expanded here.
    """
    _check_float_tensor(q, "q")
    _check_float_tensor(k, "k")
    scale = _check_scale(scale, q.shape[-1])
    dtype = _compute_dtype(q, k)
    b_q, b_k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm:
        b_q, b_k = l2norm(b_q, mode), l2norm(b_k, mode)
    return b_q * scale, b_k


def expand_key_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., H_k, K] -> [..., H, K]: value head h reads key head h // (H // H_k) (repeat_interleave)."""
    num_key_heads = x.shape[-2]
    return x if num_key_heads == num_heads else x.repeat_interleave(num_heads // num_key_heads, dim=-2)


def to_kv_layout(state: torch.Tensor, layout: str) -> torch.Tensor:
    """A state in `layout` ("kv" = [N, H, K, V] or "vk" = [N, H, V, K]) viewed as [N, H, K, V]."""
    _check_choice(layout, "layout", LAYOUTS)
    return state if layout == "kv" else state.transpose(-1, -2)


def from_kv_layout(state: torch.Tensor, layout: str) -> torch.Tensor:
    """A [N, H, K, V] state returned in `layout`; "vk" comes back contiguous (K innermost)."""
    _check_choice(layout, "layout", LAYOUTS)
    return state if layout == "kv" else state.transpose(-1, -2).contiguous()


def _decay(h: torch.Tensor, b_g: torch.Tensor) -> torch.Tensor:
    """D_t S: GDN scales the whole head by exp(g), KDA scales key row i by exp(g_i)."""
    gate = b_g.exp()
    return h * (gate[..., None, None] if gate.dim() == h.dim() - 2 else gate[..., None])


def _step(
    h: torch.Tensor,
    b_q: torch.Tensor,
    b_k: torch.Tensor,
    b_v: torch.Tensor,
    b_g: torch.Tensor,
    b_beta: torch.Tensor,
    residual_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token on prepared, head-expanded inputs; residual_state replaces h inside v - k^T D h (oracle)."""
    h = _decay(h, b_g)  # D_t S  [N, H, K, V]
    h_read = h if residual_state is None else _decay(residual_state, b_g)
    b_delta = b_beta[..., None] * (b_v - torch.einsum("nhk,nhkv->nhv", b_k, h_read))  # [N, H, V]
    h = h + b_k[..., None] * b_delta[..., None, :]  # (I - beta k k^T) D S + beta k v^T
    o = torch.einsum("nhk,nhkv->nhv", b_q, h)  # y = S^T q  [N, H, V]
    return h, o


def step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    residual_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for N sequences: returns (S_t [N, H, K, V], y_t [N, H, V]).

    state [N, H, K, V]; q, k [N, H_k, K] already normalised/scaled (see prepare_qk); v [N, H, V];
    g [N, H] (GDN) or [N, H, K] (KDA); beta [N, H]. With residual_state (same shape as state) the
    delta residual v - k^T D_t S reads residual_state instead of state (the exact-read oracle).
    """
    _check_token_inputs(q, k, v, g, beta, lead="N")
    num_heads, key_dim, value_dim = beta.shape[-1], q.shape[-1], v.shape[-1]
    expected = (q.shape[0], num_heads, key_dim, value_dim)
    for name, s in (("state", state), ("residual_state", residual_state)):
        if name == "residual_state" and s is None:
            continue
        _check_float_tensor(s, name)
        if tuple(s.shape) != expected:
            raise ValueError(f"{name} must have shape [N, H, K, V] = {list(expected)}, got {list(s.shape)}")
    dtype = _compute_dtype(state, q, k, v, g, beta, residual_state)
    b_q, b_k = (expand_key_heads(x.to(dtype), num_heads) for x in (q, k))
    return _step(
        state.to(dtype),
        b_q,
        b_k,
        v.to(dtype),
        g.to(dtype),
        beta.to(dtype),
        None if residual_state is None else residual_state.to(dtype),
    )


def transition_readout_weights(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """Row-impact vector A_t^T q_t = D_t (q - beta k (k . q)) per value head: [..., H, K].

    An error E in the stored state reaches the next readout as E^T A_t^T q_t, so its entry i is how
    strongly key row i is read (calibration's omega_i = E[entry_i^2]). q, k [..., H_k, K] prepared as
    the recurrence uses them (prepare_qk); g [..., H] (GDN) or [..., H, K] (KDA); beta [..., H].
    """
    _check_token_inputs(q, k, None, g, beta, lead="...")
    num_heads = beta.shape[-1]
    dtype = _compute_dtype(q, k, g, beta)
    b_q, b_k = (expand_key_heads(x.to(dtype), num_heads) for x in (q, k))
    b_beta, gate = beta.to(dtype)[..., None], g.to(dtype).exp()
    projected = b_q - b_beta * b_k * (b_k * b_q).sum(dim=-1, keepdim=True)  # (I - beta k k^T) q  [..., H, K]
    return projected * (gate[..., None] if gate.dim() == b_q.dim() - 1 else gate)  # D_t (...)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    layout: str = "kv",
    output_final_state: bool = True,
    mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float reference over a sequence: returns (o [B, T, H, V] in q's dtype, final state or None).

    q, k [B, T, H_k, K]; v [B, T, H, V]; g [B, T, H] (GDN) or [B, T, H, K] (KDA); beta [B, T, H].
    initial_state (zeros if None) and the final state are [B, H, K, V] (layout "kv") or [B, H, V, K]
    ("vk"); the final state is FP32 (float64 for float64 inputs). mode ("gdn"/"kda") is inferred from
    g's shape; passing it makes a mismatch an error. scale defaults to K^-1/2.
    """
    mode, b_q, b_k, b_v, b_g, b_beta, h = _prepare_sequence(
        q, k, v, g, beta, initial_state, scale, use_qk_l2norm, layout, mode
    )
    o = torch.empty_like(b_v)  # [B, T, H, V]
    for t in range(b_v.shape[1]):
        h, o[:, t] = _step(h, b_q[:, t], b_k[:, t], b_v[:, t], b_g[:, t], b_beta[:, t])
    return o.to(q.dtype), (from_kv_layout(h, layout) if output_final_state else None)


def quantized_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    codec,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    layout: str = "kv",
    output_final_state: bool = True,
    mode: str | None = None,
    feedback: str = "native",
    quantize_initial_state: bool = True,
    on_step: Callable[..., None] | None = None,
    track_reference: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The quantized serving loop (docs/method.md section 2): (o [B, T, H, V], final stored state or None).

    Per token, from the dequantized stored state Ŝ_{t-1}:
      feedback="native": X_t = A_t Ŝ_{t-1} + B_t                               (what a server computes)
      feedback="oracle": X_t = D_t Ŝ_{t-1} + beta_t k_t (v_t - k_t^T D_t S_{t-1})^T  (paper App. B: the delta
                         residual reads the exact reference S_{t-1}, so E_t = D_t E_{t-1} + eps_t)
      y_t = X_t^T q_t (read BEFORE requantizing);  Ŝ_t = codec.roundtrip(X_t) is stored (a codec that
      carries a residual, stepquant.codecs.ErrorFeedbackCodec, is requantized: Ŝ_t = Q(X_t + e_{t-1})).

    codec: any object with roundtrip(states [N, H, K, V]) -> [N, H, K, V] (stepquant.codecs.base.Codec);
    it always sees the "kv" layout. quantize_initial_state: a given initial_state is stored through the
    codec once before the first token (Ŝ_0 = Q(S_0)); the zero state is never quantized.
    on_step(t, X_t, Ŝ_t) is called after every token t = 0..T-1 (states [B, H, K, V]) so analyses can
    stream statistics; with track_reference=True the exact float state S_t is tracked alongside and
    passed as a fourth argument, on_step(t, X_t, Ŝ_t, S_t). Other arguments as in gated_delta_rule.
    """
    if not callable(getattr(codec, "roundtrip", None)):
        raise TypeError(
            "codec must have a roundtrip(states [N, H, K, V]) method (see stepquant.codecs.base.Codec), "
            f"got {type(codec).__name__}"
        )
    _check_choice(feedback, "feedback", FEEDBACKS)
    if on_step is not None and not callable(on_step):
        raise TypeError(
            f"on_step must be callable as on_step(t, X_t, S_hat_t) or None, got {type(on_step).__name__}"
        )
    mode, b_q, b_k, b_v, b_g, b_beta, h = _prepare_sequence(
        q, k, v, g, beta, initial_state, scale, use_qk_l2norm, layout, mode
    )
    needs_reference = feedback == "oracle" or track_reference
    h_ref = h  # exact S_t, advanced only when needed
    stored = None  # what an error-feedback codec stored for the previous token
    if initial_state is not None and quantize_initial_state:
        h_hat, stored = _roundtrip(codec, h, stored)
    else:
        h_hat = h
    o = torch.empty_like(b_v)  # [B, T, H, V]
    for t in range(b_v.shape[1]):
        inputs = (b_q[:, t], b_k[:, t], b_v[:, t], b_g[:, t], b_beta[:, t])
        x, o[:, t] = _step(h_hat, *inputs, residual_state=h_ref if feedback == "oracle" else None)
        if needs_reference:
            h_ref, _ = _step(h_ref, *inputs)
        h_hat, stored = _roundtrip(codec, x, stored)
        if on_step is not None:
            if track_reference:
                on_step(t, x, h_hat, h_ref)
            else:
                on_step(t, x, h_hat)
    return o.to(q.dtype), (from_kv_layout(h_hat, layout) if output_final_state else None)


def _roundtrip(codec, x: torch.Tensor, stored=None) -> tuple[torch.Tensor, object]:
    """(Ŝ = the stored state's reconstruction, the stored object when the codec carries a residual)."""
    if getattr(codec, "carries_residual", False):
        stored = codec.requantize(x, stored)
        s_hat = codec.decode(stored)
    else:
        s_hat, stored = codec.roundtrip(x), None
    if not isinstance(s_hat, torch.Tensor) or s_hat.shape != x.shape:
        got = list(s_hat.shape) if isinstance(s_hat, torch.Tensor) else type(s_hat).__name__
        raise ValueError(
            f"codec.roundtrip must return a tensor of its input's shape {list(x.shape)}, got {got}"
        )
    return s_hat.to(x.dtype), stored


def _prepare_sequence(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, layout, mode):
    """Validate sequence inputs; return (mode, b_q, b_k [B, T, H, K], b_v, b_g, b_beta, h0 [B, H, K, V])."""
    mode = _check_token_inputs(q, k, v, g, beta, lead="B, T", mode=mode)
    _check_choice(layout, "layout", LAYOUTS)
    batch, _, _, key_dim = q.shape
    num_heads, value_dim = v.shape[-2:]
    if initial_state is not None:
        _check_float_tensor(initial_state, "initial_state")
        expected = (
            (batch, num_heads, key_dim, value_dim)
            if layout == "kv"
            else (batch, num_heads, value_dim, key_dim)
        )
        if tuple(initial_state.shape) != expected:
            dims = "[B, H, K, V]" if layout == "kv" else "[B, H, V, K]"
            raise ValueError(
                f"initial_state must have shape {dims} = {list(expected)} for layout={layout!r}, "
                f"got {list(initial_state.shape)}"
            )
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    b_q, b_k = prepare_qk(q.to(dtype), k.to(dtype), scale=scale, use_qk_l2norm=use_qk_l2norm, mode=mode)
    b_q, b_k = expand_key_heads(b_q, num_heads), expand_key_heads(b_k, num_heads)
    if initial_state is None:
        h = torch.zeros(batch, num_heads, key_dim, value_dim, dtype=dtype, device=v.device)
    else:
        h = to_kv_layout(initial_state, layout).to(dtype)
    return mode, b_q, b_k, v.to(dtype), g.to(dtype), beta.to(dtype), h


def _check_float_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor (float32/float64/bfloat16/float16), got {x.dtype}"
        )


def _check_choice(value, name: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def _check_scale(scale, key_dim: int) -> float:
    if scale is None:
        return key_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"scale must be a positive finite number (default K^-1/2), got {scale!r}")
    return float(scale)


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    return (
        torch.float64 if any(x is not None and x.dtype == torch.float64 for x in tensors) else torch.float32
    )


def _check_token_inputs(q, k, v, g, beta, *, lead: str, mode: str | None = None) -> str:
    """Check q, k [lead, H_k, K], v [lead, H, V] (if given), g [lead, H] or [lead, H, K], beta [lead, H].

    lead names the leading dims ("B, T", "N", or "..." for any). Returns the mode g's shape selects.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x is not None or name != "v":
            _check_float_tensor(x, name)
    if mode is not None:
        _check_choice(mode, "mode", MODES)
    num_lead = q.dim() - 2 if lead == "..." else len(lead.split(","))
    if q.dim() != num_lead + 2 or q.dim() < 2:
        raise ValueError(f"q must have shape [{lead}, H_k, K], got {list(q.shape)}")
    lead_shape, (num_key_heads, key_dim) = list(q.shape[:-2]), q.shape[-2:]
    if k.shape != q.shape:
        raise ValueError(
            f"k must have the shape of q [{lead}, H_k, K] = {list(q.shape)}, got {list(k.shape)}"
        )
    if list(beta.shape[:-1]) != lead_shape or beta.dim() != num_lead + 1:
        raise ValueError(f"beta must have shape [{lead}, H] = {lead_shape + ['H']}, got {list(beta.shape)}")
    num_heads = beta.shape[-1]
    if num_heads % num_key_heads != 0:
        raise ValueError(
            f"beta and v have H={num_heads} value heads, which must be a multiple of the H_k={num_key_heads} "
            "heads of q and k (value head h reads key head h // (H // H_k))"
        )
    if v is not None and (v.dim() != num_lead + 2 or list(v.shape[:-1]) != lead_shape + [num_heads]):
        raise ValueError(
            f"v must have shape [{lead}, H, V] = {lead_shape + [num_heads, 'V']}, got {list(v.shape)}"
        )
    gdn_shape, kda_shape = lead_shape + [num_heads], lead_shape + [num_heads, key_dim]
    if list(g.shape) == gdn_shape:
        inferred = "gdn"
    elif list(g.shape) == kda_shape:
        inferred = "kda"
    else:
        raise ValueError(
            f"g must have shape {gdn_shape} (GDN: one log-decay per head) or {kda_shape} "
            f"(KDA: one per key channel), got {list(g.shape)}"
        )
    if mode is not None and mode != inferred:
        expected = gdn_shape if mode == "gdn" else kda_shape
        raise ValueError(
            f"mode={mode!r} needs g of shape {expected}, got {list(g.shape)} (a {inferred.upper()} g)"
        )
    return inferred
