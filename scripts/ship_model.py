"""Turn a trained checkpoint (scripts/train_model.py --out DIR) into a shipped model under stepquant/assets.

    python scripts/ship_model.py /tmp/models/gdn --name gdn

Copies config.json, generation_config.json and tokenizer_config.json into
stepquant/assets/models/<name>/, stores the weights as model.safetensors.xz (lossless, lzma preset 9e)
with their sha256 in model.safetensors.sha256, and checks that the checkpoint's tokenizer.json is the
shared stepquant/assets/data/tokenizer/tokenizer.json (both models use it; stepquant.assets.checkpoint
puts it back beside the weights). Then ``stepquant.models.load(name)`` unpacks and verifies them.
"""

from __future__ import annotations

import argparse
import lzma
import shutil
from pathlib import Path

from stepquant import assets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a transformers checkpoint directory")
    parser.add_argument("--name", required=True, help="the shipped name (gdn, kda)")
    args = parser.parse_args()
    if (args.checkpoint / "tokenizer.json").read_bytes() != assets.TOKENIZER.read_bytes():
        raise SystemExit(f"{args.checkpoint}/tokenizer.json is not {assets.TOKENIZER}; "
                         "ship the tokenizer first")
    target = assets.MODELS / args.name
    target.mkdir(parents=True, exist_ok=True)
    for name in assets.CHECKPOINT_FILES:
        shutil.copyfile(args.checkpoint / name, target / name)
    weights = args.checkpoint / assets.WEIGHTS
    (target / assets.PACKED_WEIGHTS).write_bytes(
        lzma.compress(weights.read_bytes(), preset=9 | lzma.PRESET_EXTREME))
    (target / assets.WEIGHTS_SHA256).write_text(f"{assets.sha256_of(weights)}  {assets.WEIGHTS}\n")
    packed = (target / assets.PACKED_WEIGHTS).stat().st_size
    print(f"{target}: {weights.stat().st_size:,} B of weights -> {packed:,} B")


if __name__ == "__main__":
    main()
