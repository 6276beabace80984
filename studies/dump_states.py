"""Dump real recurrent states of a shipped model for the codec study (studies/codec_study.py --states).

    python -m studies.dump_states --model gdn --out /tmp/gdn_states.safetensors

Runs the model over the first --segments calibration segments (2048 tokens each) with a cache and
saves the FP32 recurrent states of every linear-attention layer at the end of each segment as
"states" [segments, layers * heads, K, V].
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file

from stepquant.data import calibration_segments
from stepquant.families import linear_layers
from stepquant.models import load


def segment_end_states(model_name: str, segments: int) -> list[torch.Tensor]:
    """The FP32 recurrent state of each linear-attention layer at the end of each of the first ``segments``
    calibration segments (2048 tokens): one [segments, H, K, V] tensor per layer."""
    model, tokenizer = load(model_name)
    x = calibration_segments(tokenizer, segments, 2048)
    linear = linear_layers(model.config)
    per_layer = [[] for _ in linear]
    with torch.no_grad():
        for n in range(segments):
            cache = model(input_ids=x[n : n + 1], use_cache=True).past_key_values
            for states, i in zip(per_layer, linear, strict=True):
                states.append(cache.get_recurrent_state(i).float())
    return [torch.cat(states) for states in per_layer]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gdn")
    parser.add_argument("--segments", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    states = torch.cat(segment_end_states(args.model, args.segments), dim=1).contiguous()
    save_file({"states": states}, str(args.out))
    print(f"{args.out}: states {tuple(states.shape)}")


if __name__ == "__main__":
    main()
