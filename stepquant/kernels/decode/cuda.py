"""The CUDA packed-state decode step (packed_step.cu): built with nvcc at first use, launched through ctypes.

Why CUDA next to the Triton kernel (fused.py): the step must keep a whole head's tile in registers and
reduce it along both axes (rows within a warp, columns across warps through shared memory), stage the
head's code words in shared memory with one copy, and round with directed-rounding adds; Triton gives
none of these controls, and its version of the step is 2x slower than fla's FP32 update (docs/kernels.md).

The library is compiled once per quantizer configuration (part, spatial quantizer, grid, division, row
statistic, gate kind, clip table: the SQ_* macros of the source) for the GPU's architecture, into
``$STEPQUANT_KERNEL_CACHE`` (default ``~/.cache/stepquant/kernels``), keyed by a hash of the source, the
flags and the nvcc version; later processes load it without compiling. It needs ``nvcc`` on PATH (or
``$CUDA_HOME/bin``) at first use and links the CUDA runtime statically, so it runs beside any torch build
of a compatible driver. :func:`supported` says whether a layer's format tables fit the kernel (V = 128,
K a multiple of 16 up to 128); decode_step falls back to the Triton kernel otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from stepquant.codecs.base import Grid
from stepquant.codecs.deferred import MAX_DEFER, pending_layout
from stepquant.codecs.dual_axis import ROW_STATS
from stepquant.kernels.tables import FormatTables, Pages

from .naive import check_states, check_token_inputs

SOURCE = Path(__file__).with_name("packed_step.cu")
EMULATION_HEADER = Path(__file__).with_name("cuda_emulation.h")
CPU = "cpu"  # the target of the CPU emulation build (cuda_emulation.h): tests run the kernel's source with it
VALUE_DIM = 128  # four value columns per lane of a warp
MAX_KEY_DIM = 128  # sixteen key rows per warp, eight warps
KEY_DIM_STEP = 16  # K is a multiple of the rows of one warp
PARTS = {"fused": 0, "readout": 1, "writeback": 2, "pack": 3}
MAX_PENDING = MAX_DEFER - 1  # a deferred state's held updates per (row, head); packed_step.cu's MAX_PENDING


def _tuning_from_env(name: str, default: int | None, allowed, what: str) -> int | None:
    if name not in os.environ:
        return default
    value = os.environ[name]
    if not value.isdigit() or int(value) not in allowed:
        raise ValueError(f"{name}={value!r}: the CUDA kernel {what}")
    return int(value)


# tuning knobs compiled into the library (benchmarks/bench_decode.py times alternatives): CTAs per
# multiprocessor the registers must allow, key rows per warp (16: 8 warps per CTA, a 16 x 4 register tile per
# thread; 8: 16 warps, 8 x 4; STEPQUANT_CUDA_ROWS overrides the default), batch rows per CTA of the fused step
# and the writeback (> 1: they copy the next row's inputs into shared memory while one row computes; 4
# measured 3-8% faster than 1 on the H200, 2026-12-07, docs/kernels.md; the readout and the pack keep one row
# per CTA, where rows past the first would only loop; STEPQUANT_CUDA_ITEMS overrides the default), and
# whether the readout part sums heads of one width b <= 7 on tensor cores (SQ_MMA: BF16 levels and a BF16
# high and low part of a k, a q, FP32 sums; y within ~2e-6 relative RMS of the FP32 sums on the H100). None,
# the default, takes each family's measured choice (mma_for); STEPQUANT_CUDA_MMA=0 or 1 sets it for both.
# Off, the readout's FP32 FMAs are the other parts', whose sums the split readout then reproduces bit for bit.
TUNING = {
    "SQ_MIN_BLOCKS": 2,
    "SQ_ROWS": _tuning_from_env("STEPQUANT_CUDA_ROWS", 16, (8, 16), "holds 8 or 16 key rows per warp"),
    "SQ_ITEMS": _tuning_from_env("STEPQUANT_CUDA_ITEMS", 4, range(1, 33), "steps 1 to 32 batch rows per CTA"),
    "SQ_MMA": _tuning_from_env("STEPQUANT_CUDA_MMA", None, (0, 1),
                               "sums the readout on tensor cores (1) or not (0)"),
}
STAGED_PARTS = ("fused", "writeback")  # the parts SQ_ITEMS > 1 stages (packed_step.cu's STAGED)
MMA_PARTS = ("readout",)  # the parts SQ_MMA compiles into (packed_step.cu's mma_readout)
ALIGN = 16  # bytes: the staged parts copy their inputs in 16-byte chunks


def items_for(part: str) -> int:
    """Batch rows per CTA compiled into a part: TUNING's SQ_ITEMS for the staged parts, else 1."""
    return TUNING["SQ_ITEMS"] if part in STAGED_PARTS else 1


@contextlib.contextmanager
def tuning(**knobs):
    """TUNING with these knobs set inside the block (launches build and load the libraries for them), then
    as it was."""
    saved = dict(TUNING)
    TUNING.update(knobs)
    try:
        yield
    finally:
        TUNING.clear()
        TUNING.update(saved)


def mma_for(part: str, kda: bool) -> int:
    """Whether a part sums the readout on tensor cores (at 16 key rows per warp): TUNING's SQ_MMA, or where
    that is None each family's measured choice: KDA's readout on tensor cores (faster in every row of an
    H100 run, 2026-12-08: readout alone 2-3%, deferred readout tokens 5-9%), GDN's on FP32 FMAs (the tensor
    cores lost 6-15% on the readout alone; on deferred readout tokens they went from 5% faster at 6 bits to
    3% slower at 4 bits; benchmarks/results/h100_2026-12-08/, docs/kernels.md)."""
    if part not in MMA_PARTS or TUNING["SQ_ROWS"] != 16:
        return 0
    return int(kda) if TUNING["SQ_MMA"] is None else TUNING["SQ_MMA"]


class _Params(ctypes.Structure):
    """The kernel's Params struct, field for field (packed_step.cu)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "q", "k", "v", "g", "beta", "x_in", "y", "work", "slots", "codes", "row_scale", "col_scale",
        "heads", "row_info", "row_winv", "row_w2", "row_gain", "dbg_x", "dbg_c", "dbg_r")] + [
        ("scale", ctypes.c_float), ("slot_words", ctypes.c_longlong), ("group_magic", ctypes.c_ulonglong),
        ("H", ctypes.c_int), ("HQ", ctypes.c_int), ("K", ctypes.c_int), ("num_scaled", ctypes.c_int),
        ("l2norm", ctypes.c_int), ("bf16_mask", ctypes.c_int), ("pend_n", ctypes.c_int),
        ("pend_k", ctypes.c_void_p), ("pend_u", ctypes.c_void_p), ("pend_stride", ctypes.c_int),
        ("pend_append", ctypes.c_int), ("pend_gate", ctypes.c_void_p)]


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found is None and os.environ.get("CUDA_HOME"):
        candidate = Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"
        found = str(candidate) if candidate.exists() else None
    return found


def cache_dir() -> Path:
    return Path(os.environ.get("STEPQUANT_KERNEL_CACHE", Path.home() / ".cache" / "stepquant" / "kernels"))


@functools.cache
def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout


def build(defines: tuple[tuple[str, int], ...], target: str, source: Path | None = None) -> Path:
    """The shared library for one configuration, compiled into the cache on first use.

    target: a CUDA architecture ("90" for sm_90), or CPU for the emulation build (g++, cuda_emulation.h).
    source: another version of packed_step.cu (benchmarks/ab_cuda_source.py times two against each other);
    default SOURCE.
    """
    source = SOURCE if source is None else Path(source)
    if target == CPU:
        compiler = shutil.which("g++") or shutil.which("c++")
        if compiler is None:
            raise RuntimeError("the CPU emulation of the CUDA kernel needs a C++20 compiler (g++) on PATH")
        flags = ["-O2", "-std=c++20", "-shared", "-fPIC", "-pthread", "-DSQ_EMULATE", "-x", "c++"]
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    else:
        compiler = nvcc_path()
        if compiler is None:
            raise RuntimeError("the CUDA decode kernel needs nvcc at first use (put it on PATH or set "
                               "CUDA_HOME); without it decode_step uses the Triton kernel")
        flags = ["-O3", "-std=c++20", f"-gencode=arch=compute_{target},code=sm_{target}", "-shared",
                 "-Xcompiler", "-fPIC"]
        version = _nvcc_version(compiler)
    flags += [f"-D{name}={value}" for name, value in defines]
    sources = source.read_bytes() + EMULATION_HEADER.read_bytes()
    digest = hashlib.sha256(sources + repr(flags).encode() + version.encode())
    target_path = cache_dir() / digest.hexdigest()[:20] / "packed_step.so"
    if target_path.exists():
        return target_path
    target_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target_path.parent) as tmp:  # build aside, then rename: no torn file
        out = Path(tmp) / "packed_step.so"
        command = [compiler, *flags, "-o", str(out), str(source)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed to build {source.name} ({' '.join(flags)}):\n"
                               f"{result.stderr[-4000:]}")
        os.replace(out, target_path)
    return target_path


@functools.cache
def _load(defines: tuple[tuple[str, int], ...], target: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build(defines, target)))
    lib.sq_packed_step.argtypes = [ctypes.POINTER(_Params), ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.sq_packed_step.restype = ctypes.c_int
    lib.sq_error_string.argtypes = [ctypes.c_int]
    lib.sq_error_string.restype = ctypes.c_char_p
    if lib.sq_params_size() != ctypes.sizeof(_Params):
        raise RuntimeError(f"{SOURCE.name} Params ({lib.sq_params_size()} B) and cuda._Params "
                           f"({ctypes.sizeof(_Params)} B) differ: rebuild after editing one of them")
    return lib


def defines_for(tables: FormatTables, part: str, kda: bool, debug: bool = False,
                pending: bool = False) -> tuple[tuple[str, int], ...]:
    """The SQ_* macros of a layer's quantizer (what one compiled library serves); pending: the readout and the
    writeback take a deferred state's pending updates (SQ_PENDING)."""
    config = tables.format.config
    dual = tables.has_col_scale
    clipped = sum(1 << b for b in range(2, 9) if config.clip_for(b) < 1.0)
    return (("SQ_PART", PARTS[part]), ("SQ_DUAL", int(dual)),
            ("SQ_MIDRISE", int(dual and tables.grid is Grid.MIDRISE)),
            ("SQ_RECIP", int(dual and config.division == "reciprocal")),
            ("SQ_ROW_STAT", ROW_STATS.index(config.row_stat)), ("SQ_KDA", int(kda)), ("SQ_CLIPPED", clipped),
            ("SQ_REFITS", config.refit_iters if dual else 0), ("SQ_ROW_FILL", int(tables.row_fill)),
            ("SQ_DEBUG", int(debug)), *((("SQ_PENDING", 1),) if pending else ()),
            *sorted({**TUNING, "SQ_ITEMS": items_for(part), "SQ_MMA": mma_for(part, kda)}.items()))


def supported(tables: FormatTables) -> bool:
    """Whether the CUDA kernel serves this layer (V = 128, K <= 128, on a CUDA device, nvcc at hand)."""
    return (tables.device.type == "cuda" and fits(tables)
            and torch.cuda.get_device_capability(tables.device)[0] >= 8 and nvcc_path() is not None)


def fits(tables: FormatTables) -> bool:
    """Whether the kernel's shapes cover this layer (V = 128, K a multiple of 16 up to 128), on any device."""
    k = tables.key_dim
    return tables.value_dim == VALUE_DIM and k <= MAX_KEY_DIM and k % KEY_DIM_STEP == 0


def _target(device: torch.device) -> str:
    if device.type != "cuda":
        return CPU
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _aligned(t: torch.Tensor | None) -> torch.Tensor | None:
    """t, or a copy of it where its data does not start on a 16-byte boundary (a view at an offset)."""
    return t if t is None or t.data_ptr() % ALIGN == 0 else t.clone()


def launch(tables: FormatTables, pages: Pages, slots: torch.Tensor, q, k, v, g, beta, y, x_in, *, part: str,
           scale: float, use_qk_l2norm: bool, work: torch.Tensor | None = None,
           debug: dict | None = None, pending: tuple[torch.Tensor, torch.Tensor] | None = None,
           pending_count: int = 0, pending_append: int = -1,
           pending_gate: torch.Tensor | None = None) -> None:
    """One launch for every head of the layer (grid N x H); inputs already checked and contiguous FP32."""
    kda = g is not None and g.dim() == 3
    device = tables.device
    if items_for(part) > 1:
        for name in ("codes", "row_scale", "col_scale"):
            t = getattr(pages, name)
            if t is not None and t.data_ptr() % ALIGN:
                raise ValueError(f"pages.{name} starts {t.data_ptr() % ALIGN} bytes past a {ALIGN}-byte "
                                 "boundary; the CUDA kernel copies it in 16-byte chunks (allocate the pages "
                                 "with Pages.empty, not as a view at an offset)")
        q, k, v, g, beta, work = (_aligned(t) for t in (q, k, v, g, beta, work))
    lib = _load(defines_for(tables, part, kda, debug is not None, pending is not None), _target(device))
    pend_k, pend_u = (None, None) if pending is None else pending
    num_rows = slots.shape[0]
    heads, key_dim = tables.num_heads, tables.key_dim
    key_heads = heads if q is None else q.shape[1]
    dbg_x = dbg_c = dbg_r = None
    if debug is not None:
        dbg_x = torch.full((num_rows, heads, key_dim, VALUE_DIM), float("nan"), device=device)
        dbg_c = torch.full((num_rows, heads, VALUE_DIM), float("nan"), device=device)
        dbg_r = torch.full((num_rows, heads, key_dim), float("nan"), device=device)
    p = _Params(
        q=_ptr(q), k=_ptr(k), v=_ptr(v), g=_ptr(g), beta=_ptr(beta), x_in=_ptr(x_in), y=_ptr(y),
        work=_ptr(work),
        slots=_ptr(slots), codes=_ptr(pages.codes), row_scale=_ptr(pages.row_scale),
        col_scale=_ptr(pages.col_scale), heads=_ptr(tables.head_info), row_info=_ptr(tables.row_table),
        row_winv=_ptr(tables.row_winv), row_w2=_ptr(tables.row_w2), row_gain=_ptr(tables.row_gain),
        dbg_x=_ptr(dbg_x), dbg_c=_ptr(dbg_c), dbg_r=_ptr(dbg_r), scale=scale,
        slot_words=tables.words_per_slot,
        H=heads, HQ=key_heads, K=key_dim, group_magic=-(-(1 << 32) // (heads // key_heads)),
        num_scaled=tables.num_scaled_heads, l2norm=int(use_qk_l2norm),
        bf16_mask=sum(1 << i for i, t in enumerate((q, k, v, g, beta, y))
                      if t is not None and t.dtype == torch.bfloat16),
        pend_n=pending_count, pend_k=_ptr(pend_k), pend_u=_ptr(pend_u),
        pend_stride=0 if pend_k is None else pend_k.shape[2], pend_append=pending_append,
        pend_gate=_ptr(pending_gate))
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    status = lib.sq_packed_step(ctypes.byref(p), num_rows, device.index or 0, ctypes.c_void_p(stream))
    if status != 0:
        raise RuntimeError(f"CUDA decode kernel failed: {lib.sq_error_string(status).decode()}")
    if debug is not None:
        debug["x"], debug["c"] = dbg_x, dbg_c
        if tables.row_fill:
            debug["r_before_fill"] = dbg_r


def _check_supported(tables: FormatTables) -> None:
    if not fits(tables):
        raise ValueError(f"the CUDA kernel serves V = {VALUE_DIM} and K a multiple of {KEY_DIM_STEP} up "
                         f"to {MAX_KEY_DIM}; this layer has K = {tables.key_dim}, V = {tables.value_dim} "
                         "(the Triton kernel, fused.py, serves any shape)")


def _as_input(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t as the kernel reads it: FP32 or BF16 (as it comes), contiguous, on the layer's device."""
    if t.dtype not in (torch.float32, torch.bfloat16):
        t = t.to(torch.float32)
    return t.to(device).contiguous()


def decode(
    tables: FormatTables,
    pages: Pages,
    slots: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    out: torch.Tensor | None = None,
    part: str = "fused",
    work: torch.Tensor | None = None,
    pending: tuple[torch.Tensor, torch.Tensor] | None = None,
    pending_count: int | None = None,
    pending_append: int = -1,
    pending_gate: torch.Tensor | None = None,
    debug: dict | None = None,
) -> torch.Tensor:
    """One decode token on packed states, in place; the signature of fused.fused_decode.

    part: "fused", or the split "readout" (y, and u into ``work`` [N, H, V] FP32 when given; slots
    untouched) then "writeback" (requantizes the slots from the u in ``work``; y untouched). On CPU
    tables this runs the emulation build (tests only: slow).
    pending: a deferred state's updates since its last fit (stepquant.kernels.decode.deferred), (k_j [N, HK,
    R - 1, K] L2-normalized, HK = H for KDA, the q/k heads HQ for GDN; u_j [N, H, R - 1, V]) FP16
    contiguous, decayed to this token, of which the first
    ``pending_count`` (default R - 1) are held. The readout adds sum_j (k.k_j) u_j to k^T S and sum_j (q.k_j)
    u_j to y, and with ``pending_append`` >= 0 stores this token's normalized k and u at that entry; the
    writeback adds sum_j k_j u_j^T to X (every entry held: a fit). The fused step does both (a fit token in
    one pass: every entry held, no append).
    pending_gate: with ``pending`` on the readout or the fused step, the log decay summed since the last fit
    (FP32, g's shape, in place), g then being this token's alone: the codes decay by e^(pending_gate + g) and
    the held updates by e^g (KDA's k_j, GDN's u_j, in FP16). The readout stores pending_gate + g and the
    decayed updates back; the fused step (a fit) stores 0. Without it the held updates are taken as decayed
    to this token and g as the codes' whole decay.
    """
    check_token_inputs(tables, pages, slots, q, k, v, g, beta)
    _check_supported(tables)
    if part not in ("fused", "readout", "writeback"):
        raise ValueError(f"part must be 'fused', 'readout' or 'writeback', got {part!r}")
    if part == "writeback" and work is None:
        raise ValueError("part='writeback' starts from the readout's u: pass the work buffer the readout "
                         "filled")
    if work is not None and (work.shape != v.shape or work.dtype != torch.float32
                             or not work.is_contiguous()):
        raise ValueError(f"work must be a contiguous FP32 tensor of v's shape {list(v.shape)}")
    device = tables.device
    if pending is not None:
        pending = _check_pending(pending, v.shape[0], key_heads_of_pending(tables, q.shape[1], g.dim() == 3),
                                 tables, device)
        stride = pending[0].shape[2]
        pending_count = stride if pending_count is None else int(pending_count)
        if not 0 <= pending_count <= stride or not -1 <= pending_append < stride or (
                part != "readout" and (pending_count != stride or pending_append != -1)):
            raise ValueError(f"pending_count must be in [0, {stride}] (a fit, part={part!r}, folds all "
                             f"{stride}) and pending_append in [-1, {stride}) (the readout only); got "
                             f"{pending_count}, {pending_append}")
        if pending_gate is not None:
            _check_pending_gate(pending_gate, part, g, device)
    elif pending_count or pending_append != -1 or pending_gate is not None:
        raise ValueError("pending_count, pending_append and pending_gate need pending=(k_j, u_j)")
    q, k, v, g, beta = (_as_input(t, device) for t in (q, k, v, g, beta))
    slots = slots.to(device, torch.int32).contiguous()
    direct = out is not None and (part == "writeback" or _as_input(out, device) is out)
    result = out if direct else torch.empty(v.shape, dtype=torch.float32, device=device)
    scale = tables.key_dim**-0.5 if scale is None else float(scale)
    launch(tables, pages, slots, q, k, v, g, beta, result, None, part=part, scale=scale,
           use_qk_l2norm=use_qk_l2norm, work=work, debug=debug, pending=pending,
           pending_count=pending_count or 0, pending_append=pending_append, pending_gate=pending_gate)
    if out is not None and result is not out:
        active = slots >= 0
        out[active] = result[active].to(out.dtype)
        return out
    return result


def key_heads_of_pending(tables: FormatTables, key_heads: int, kda: bool) -> int:
    """Heads of a deferred state's pending k_j (codecs.deferred.pending_layout): KDA's H, GDN's HQ."""
    return tables.num_heads // pending_layout(kda, tables.num_heads, key_heads)["shared_keys"]


def _check_pending(pending, num_rows: int, key_heads: int, tables: FormatTables, device) -> tuple:
    pend_k, pend_u = pending
    heads = tables.num_heads
    if (pend_k.dim() != 4 or pend_k.shape[:2] != (num_rows, key_heads) or pend_k.shape[3] != tables.key_dim
            or pend_u.shape != (num_rows, heads, pend_k.shape[2], VALUE_DIM)
            or not 1 <= pend_k.shape[2] <= MAX_PENDING):
        raise ValueError(f"pending must be (k [N, HK, R - 1, K], u [N, H, R - 1, V]) with N = {num_rows}, "
                         f"HK = {key_heads} (GDN: the q/k heads, KDA: H), H = {heads}, K = {tables.key_dim}, "
                         f"V = {VALUE_DIM}, 1 <= R - 1 <= {MAX_PENDING}; got {list(pend_k.shape)} and "
                         f"{list(pend_u.shape)}")
    if any(t.dtype != torch.float16 or not t.is_contiguous() or t.device != device for t in (pend_k, pend_u)):
        raise ValueError("pending k_j and u_j must be contiguous FP16 tensors on the layer's device (the "
                         "readout writes into them)")
    if any(t.data_ptr() % 16 for t in (pend_k, pend_u)):  # the writeback copies them in 16-byte chunks
        raise ValueError("pending k_j and u_j must start at a 16-byte aligned address (a view at an offset "
                         "is not; allocate them on their own, as DeferredBuffers.empty does)")
    return pend_k, pend_u


def _check_pending_gate(gate: torch.Tensor, part: str, g: torch.Tensor, device) -> None:
    if part == "writeback":
        raise ValueError("pending_gate is carried by the readout and the fused step; the writeback after a "
                         "readout takes the summed gate the readout stored as g")
    if (gate.shape != g.shape or gate.dtype != torch.float32 or not gate.is_contiguous()
            or gate.device != device or gate.data_ptr() % 16):
        raise ValueError(f"pending_gate must be a contiguous, 16-byte aligned FP32 tensor of g's shape "
                         f"{list(g.shape)} on the layer's device (the kernel writes it); got "
                         f"{list(gate.shape)} {gate.dtype} on {gate.device}")


def pack(tables: FormatTables, pages: Pages, slots: torch.Tensor, states: torch.Tensor, *,
         debug: dict | None = None) -> None:
    """Quantize float states [N, H, K, V] into ``slots`` (-1: skip a row), as fused.fused_pack."""
    check_states(tables, pages, slots, states)
    _check_supported(tables)
    states = states.to(tables.device, torch.float32).contiguous()
    slots = slots.to(tables.device, torch.int32).contiguous()
    launch(tables, pages, slots, None, None, None, None, None, None, states, part="pack", scale=1.0,
           use_qk_l2norm=False, debug=debug)
