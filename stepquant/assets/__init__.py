"""The shipped files: two small trained models, the real text they were trained and are evaluated on, and
their calibrated plans. They install with the package (package data), so a plain ``pip install`` has them.

    stepquant/assets/models/<gdn|kda>/   config, generation and tokenizer configs, the model card, and the
                                         weights as model.safetensors.xz + model.safetensors.sha256
    stepquant/assets/data/               wiki / sotu / brown .jsonl.gz (README.md: sources, licences) and
                                         tokenizer/tokenizer.json, the one tokenizer both models use
    stepquant/assets/plans/<model>/      stats.safetensors and one plan directory per <variant>-<bits>

Weights are stored xz-compressed (lossless, stdlib lzma: 27 MB -> 19 MB each) to keep the repository
small. :func:`checkpoint` unpacks a shipped model once into a cache directory, checks the weights against
the recorded sha256 (so they are bit-identical to the trained ones) and returns a directory transformers
loads. The cache is ``$STEPQUANT_CACHE``, else ``$XDG_CACHE_HOME/stepquant``, else ``~/.cache/stepquant``.
scripts/ship_model.py turns a trained checkpoint into this form.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent
MODELS = ROOT / "models"
DATA = ROOT / "data"
PLANS = ROOT / "plans"
TOKENIZER = DATA / "tokenizer" / "tokenizer.json"
WEIGHTS = "model.safetensors"
PACKED_WEIGHTS = WEIGHTS + ".xz"
WEIGHTS_SHA256 = WEIGHTS + ".sha256"
# what transformers reads from a checkpoint directory besides the weights and the shared tokenizer
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer_config.json")


def cache_dir() -> Path:
    """Where shipped models are unpacked ($STEPQUANT_CACHE, $XDG_CACHE_HOME/stepquant, ~/.cache/stepquant)."""
    if os.environ.get("STEPQUANT_CACHE"):
        return Path(os.environ["STEPQUANT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "stepquant"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def recorded_sha256(model_dir: Path) -> str:
    """The weights' sha256 from model.safetensors.sha256 (sha256sum format)."""
    return (model_dir / WEIGHTS_SHA256).read_text().split()[0]


def checkpoint(model_dir: Path) -> Path:
    """A transformers checkpoint directory for the shipped model in ``model_dir``: its configs, the shared
    tokenizer.json and the weights unpacked from model.safetensors.xz, in the cache (unpacked once; the
    weights' sha256 is checked every time)."""
    sha = recorded_sha256(model_dir)
    target = cache_dir() / "models" / f"{model_dir.name}-{sha[:16]}"
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name in CHECKPOINT_FILES:
            _copy_if_changed(model_dir / name, target / name)
        _copy_if_changed(TOKENIZER, target / "tokenizer.json")
        weights = target / WEIGHTS
        if not weights.is_file() or sha256_of(weights) != sha:
            partial = target / f"{WEIGHTS}.partial-{os.getpid()}"
            with lzma.open(model_dir / PACKED_WEIGHTS) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            if sha256_of(partial) != sha:
                partial.unlink()
                raise ValueError(f"{model_dir / PACKED_WEIGHTS} does not unpack to the weights recorded in "
                                 f"{model_dir / WEIGHTS_SHA256}; reinstall stepquant")
            os.replace(partial, weights)
    except PermissionError as err:
        raise PermissionError(f"cannot unpack the shipped model into {target} ({err}); point STEPQUANT_CACHE "
                              "at a writable directory") from err
    return target


def _copy_if_changed(source: Path, target: Path) -> None:
    data = source.read_bytes()
    if not target.is_file() or target.read_bytes() != data:
        partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
        partial.write_bytes(data)
        os.replace(partial, target)
