"""Train the byte-level BPE tokenizer the shipped models use, on the "train" split only.

    python scripts/train_tokenizer.py --vocab-size 8192 --out stepquant/assets/data/tokenizer

Why our own and not GPT-2's 50,257 tokens: at width 256 GPT-2's embedding alone would be
12.9 M parameters (26 MB in fp16), more than the layers we study; an 8 K byte-level BPE on
our own corpus spends the parameter budget on the recurrent layers and still covers every byte.
Deterministic for a given corpus and vocabulary size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from stepquant.data import split_texts  # noqa: E402

EOS = "<|endoftext|>"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=Path("stepquant/assets/data/tokenizer"))
    args = parser.parse_args()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = split_texts("train")
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)
    fast.model_max_length = 1 << 20
    fast.save_pretrained(args.out)
    n_tokens = sum(len(ids) for ids in fast(texts[:2000], add_special_tokens=False)["input_ids"])
    n_chars = sum(len(t) for t in texts[:2000])
    print(f"saved {args.out}: vocab {len(fast)}, {n_chars / n_tokens:.2f} characters per token on train")


if __name__ == "__main__":
    main()
