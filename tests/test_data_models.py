"""The shipped text splits and the two shipped models: offline loading, a forward pass, a pinned loss."""

import math
import os

import pytest
import torch

from stepquant import data
from stepquant.families import family_for
from stepquant.models import load, resolve

# Loss of each shipped model on the first 256 tokens of the held-out wiki stream (FP32, CPU).
# Pinned so that any change to the checkpoints, the tokenizer or the splits is noticed.
PINNED_LOSS = {"gdn": 4.1409, "kda": 4.4385}


@pytest.fixture(scope="module", params=["gdn", "kda"])
def shipped(request):
    model, tokenizer = load(request.param)
    return request.param, model, tokenizer


def test_splits_are_disjoint_and_fixed():
    wiki = data.load_documents("wiki")
    held = [d for d in wiki if data.is_heldout("wiki", d["id"])]
    assert 0.08 < len(held) / len(wiki) < 0.12
    calib = set(data.split_texts("calib"))
    assert not calib & set(data.split_texts("wiki"))
    # the hash order is a fixed permutation, not the alphabetical file order
    assert [d["id"] for d in wiki[:3]] != sorted(d["id"] for d in wiki)[:3]


def test_unknown_split_and_bad_user_file(tmp_path):
    with pytest.raises(ValueError, match="unknown split"):
        data.split_texts("wikitext")
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"txt": "no text field"}\n')
    with pytest.raises(ValueError, match="'text' field"):
        data.read_user_texts(bad)
    with pytest.raises(FileNotFoundError):
        data.read_user_texts(tmp_path / "missing.txt")


def test_user_text_segments(tmp_path, shipped):
    _, _, tokenizer = shipped
    path = tmp_path / "mine.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    seg = data.segments(path, tokenizer, 2, 64)
    assert seg.shape == (2, 64) and seg.dtype == torch.long
    with pytest.raises(ValueError, match="only"):
        data.segments(path, tokenizer, 100, 64)


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="shipped name"):
        resolve(tmp_path)
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        family_for("llama")


def test_forward_loss_is_pinned_and_learned(shipped):
    name, model, tokenizer = shipped
    assert model.config.model_type in ("qwen3_5_text", "kimi_linear")
    x = data.segments("wiki", tokenizer, 1, 256)
    with torch.no_grad():
        loss = model(input_ids=x, labels=x).loss.item()
        again = model(input_ids=x, labels=x).loss.item()
    assert loss == again
    assert loss == pytest.approx(PINNED_LOSS[name], abs=2e-3)
    assert loss < math.log(len(tokenizer)) - 3  # far below the uniform 9.01 nats: it learned English


def test_greedy_generation_is_english(shipped):
    _, model, tokenizer = shipped
    ids = tokenizer("The President said that", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :])
    words = text.split()
    assert len(words) >= 5
    assert sum(w.strip(".,;").isalpha() for w in words) >= 0.7 * len(words)


def test_shipped_weights_unpack_bit_identical_into_the_cache(tmp_path, monkeypatch):
    from stepquant import assets
    from stepquant.models import checkpoint

    monkeypatch.setenv("STEPQUANT_CACHE", str(tmp_path))
    path = checkpoint("gdn")
    assert path.parent == tmp_path / "models" and (path / "config.json").is_file()
    weights = path / assets.WEIGHTS
    assert assets.sha256_of(weights) == assets.recorded_sha256(assets.MODELS / "gdn")
    assert (path / "tokenizer.json").read_bytes() == assets.TOKENIZER.read_bytes()  # the one shared file
    weights.write_bytes(weights.read_bytes()[:-1])  # a damaged cache is unpacked again
    assert checkpoint("gdn") == path
    assert checkpoint(os.path.relpath(assets.MODELS / "gdn")) == path  # the shipped folder by its path
    assert assets.sha256_of(weights) == assets.recorded_sha256(assets.MODELS / "gdn")


@pytest.mark.parametrize("switch", ["use_recurrent_prefill", "use_torch_recurrences"])
def test_cpu_models_run_where_fla_would_be_called(shipped, switch, monkeypatch):
    """With fla installed, transformers' GDN/KDA functions call fla's Triton kernels on any device (they fail
    on CPU tensors); load() on CPU switches to transformers' PyTorch functions (token loop or chunked).
    Simulated: each function is replaced by a wrapper that, like the fla path, cannot take CPU tensors."""
    import functools
    import importlib

    from stepquant import models

    name, model, tokenizer = shipped
    x = data.segments("wiki", tokenizer, 1, 32)
    with torch.no_grad():
        want = model(input_ids=x).logits
    monkeypatch.setattr(models, "_ORIGINAL_FUNCTIONS", {})
    for module_name, *function_names in models._prefill_functions():
        module = importlib.import_module(module_name)
        for function_name in function_names:
            torch_fn = getattr(module, function_name)
            torch_fn = getattr(torch_fn, "__wrapped__", torch_fn)  # the PyTorch function under any switch

            @functools.wraps(torch_fn)
            def fla_like(*args, **kwargs):
                raise RuntimeError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")

            monkeypatch.setattr(module, function_name, fla_like)
    getattr(models, switch)()
    with torch.no_grad():
        got = model(input_ids=x).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # calls on CUDA tensors still reach transformers' functions (fla's kernels): a CUDA model loaded in
    # the same process keeps them (here every tensor is taken for a CUDA one, so fla_like is reached)
    monkeypatch.setattr(models, "_on_cuda", lambda args, kwargs: True)
    with torch.no_grad(), pytest.raises(RuntimeError, match="cannot be accessed from Triton"):
        model(input_ids=x)


def test_user_text_errors_name_the_file_and_line(tmp_path):
    not_utf8 = tmp_path / "latin1.txt"
    not_utf8.write_bytes("first line\nna\u00efve\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt:2: not UTF-8 text \(byte 0xef at offset 13.*UTF-8"):
        data.read_user_texts(not_utf8)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "one"}\n\n{"text": "two",}\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:3: not valid JSON \(.*column 16\); each JSONL"):
        data.read_user_texts(broken)
    with pytest.raises(FileNotFoundError, match=r"'wikitxt' is not a shipped split \(train, calib, wiki, "):
        data.texts_for("wikitxt")
    with pytest.raises(ValueError, match="unsupported text file 'x.csv'"):
        (tmp_path / "x.csv").write_text("a,b")
        data.check_source(tmp_path / "x.csv")
    windows = tmp_path / "crlf.jsonl"  # universal newlines, as before: \r\n and \r end a line, U+2028 not
    windows.write_bytes('{"text": "a\u2028b"}\r\n{"text": "c"}\r'.encode())
    assert data.read_user_texts(windows) == ["a\u2028b", "c"]
    (tmp_path / "crlf.txt").write_bytes(b"one\r\ntwo\r")
    assert data.read_user_texts(tmp_path / "crlf.txt") == ["one\ntwo\n"]
