"""The shipped real text and its deterministic splits, plus loading a user's own text.

Three sources ship in stepquant/assets/data/ (its README.md gives versions, licences and attribution):
English Wikipedia lead paragraphs ("wiki", the WikiText-like calibration source), US State of
the Union addresses 1790-2021 ("sotu", long documents) and the Brown Corpus ("brown", 15 genres).

Splits, fixed forever so numbers stay comparable:
- a document is *held out* when sha1("<source>:<id>") read as an integer is 0 mod 10 (~10%);
- documents are ordered by that hash (a deterministic shuffle) and joined with the EOS token;
- "train": the non-held-out documents of all three sources (what the shipped models saw);
- "calib": the non-held-out wiki stream; calibration takes its first segments (default
  32 x 2048 tokens, as the paper does with WikiText-2 train);
- "wiki", "sotu", "brown": the held-out stream of each source, for evaluation.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import torch

from stepquant import assets

SOURCES = ("wiki", "sotu", "brown")
EVAL_STREAMS = SOURCES
SPLITS = ("train", "calib", *EVAL_STREAMS)


def _hash(source: str, doc_id: str) -> int:
    return int(hashlib.sha1(f"{source}:{doc_id}".encode()).hexdigest(), 16)


def is_heldout(source: str, doc_id: str) -> bool:
    return _hash(source, doc_id) % 10 == 0


def load_documents(source: str) -> list[dict]:
    """All documents of one shipped source, in hash order."""
    if source not in SOURCES:
        raise ValueError(f"unknown text source {source!r}; shipped sources are {', '.join(SOURCES)}")
    path = assets.DATA / f"{source}.jsonl.gz"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; it ships with stepquant (reinstall, or git checkout "
                                "stepquant/assets/data)")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    return sorted(docs, key=lambda d: _hash(source, d["id"]))


def split_texts(split: str) -> list[str]:
    """The document texts of a named split, in their fixed order."""
    if split not in SPLITS:
        raise ValueError(
            f"unknown split {split!r}; choose one of {', '.join(SPLITS)} or pass a .txt/.jsonl path"
        )
    if split == "train":
        return [d["text"] for s in SOURCES for d in load_documents(s) if not is_heldout(s, d["id"])]
    if split == "calib":
        return [d["text"] for d in load_documents("wiki") if not is_heldout("wiki", d["id"])]
    return [d["text"] for d in load_documents(split) if is_heldout(split, d["id"])]


def read_user_texts(path: str | Path) -> list[str]:
    """A user's own text: a .txt file (one document) or .jsonl with a "text" field per line, UTF-8.

    Errors name the file and the line: a missing file (with the shipped split names, for a mistyped
    one), bytes that are not UTF-8, a line that is not a JSON object with a string "text".
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist, and {str(path)!r} is not a shipped "
                                f"split ({', '.join(SPLITS)}); give one of those or a .txt / .jsonl path")
    if path.suffix not in (".jsonl", ".txt", ".md", ""):
        raise ValueError(
            f"unsupported text file {path.name!r}: use .txt (one document) or .jsonl ('text' per line)"
        )
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {raw[err.start]:#04x} at offset {err.start}: "
                         f"{err.reason}); save the file as UTF-8") from None
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as text-mode open()
    if path.suffix != ".jsonl":
        return [text]
    texts = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: not valid JSON ({err.msg}, column {err.colno}); each JSONL line "
                             "must be an object with a string 'text' field") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{n}: each JSONL line must be an object with a string 'text' field")
        texts.append(record["text"])
    return texts


def texts_for(data: str | Path) -> list[str]:
    """A shipped split name or a path to the user's own .txt/.jsonl."""
    if isinstance(data, str) and data in SPLITS:
        return split_texts(data)
    return read_user_texts(data)


def check_source(data: str | Path) -> None:
    """Raise unless ``data`` is a shipped split or a readable user text file (read and parsed, so that a
    mistyped name or a malformed line is reported before any model runs)."""
    if not (isinstance(data, str) and data in SPLITS):
        read_user_texts(data)


def token_stream(texts: list[str], tokenizer, max_tokens: int | None = None) -> torch.Tensor:
    """Tokenize and join documents with EOS into one 1-D LongTensor (stops early at max_tokens)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; it is needed to join documents")
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eos)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)


def segments(data: str | Path, tokenizer, num_segments: int, length: int) -> torch.Tensor:
    """[num_segments, length] consecutive non-overlapping token segments of a split or file."""
    if num_segments < 1 or length < 2:
        raise ValueError(f"need num_segments >= 1 and length >= 2, got {num_segments} x {length}")
    stream = token_stream(texts_for(data), tokenizer, max_tokens=num_segments * length)
    if stream.numel() < num_segments * length:
        have = stream.numel() // length
        raise ValueError(
            f"{data}: only {stream.numel():,} tokens, enough for {have} segments of {length} "
            f"(asked for {num_segments}); use fewer or shorter segments"
        )
    return stream.view(num_segments, length)


def calibration_segments(tokenizer, num_segments: int = 32, length: int = 2048) -> torch.Tensor:
    """The default calibration set: the first num_segments x length tokens of the wiki train stream."""
    return segments("calib", tokenizer, num_segments, length)
