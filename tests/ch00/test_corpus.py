"""Tests for memlab.models.corpus: the standard-library corpus, batching and the byte tokenizer."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

try:
    import memlab  # noqa: F401
except ImportError:  # package not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "utils"))

from memlab.models import corpus as data  # noqa: E402
from memlab.models.corpus import batches, decode, encode, split_bounds, stdlib_corpus, stdlib_files  # noqa: E402


# ---------------------------------------------------------------------------- corpus


def test_corpus_is_deterministic_across_fresh_reads():
    first = stdlib_corpus()
    data.clear_corpus_cache()
    second = stdlib_corpus()
    assert first.dtype == torch.uint8 and first.dim() == 1
    assert first.numel() > 1_000_000
    assert torch.equal(first, second)


def test_corpus_is_the_sorted_files_joined_by_newlines():
    files = stdlib_files()
    assert files == sorted(files)
    assert "os.py" in files and "json/__init__.py" in files
    root = Path(os.__file__).resolve().parent
    expected = b"\n".join((root / rel).read_bytes() for rel in files)
    assert bytes(stdlib_corpus().tolist()[:5000]) == expected[:5000]
    assert stdlib_corpus().numel() == len(expected)


def test_corpus_excludes_tests_idlelib_and_site_packages():
    excluded = {"test", "tests", "idlelib", "lib2to3", "site-packages"}
    for rel in stdlib_files():
        assert rel.endswith(".py")
        assert not excluded & set(rel.split("/")[:-1]), rel


def test_max_bytes_is_a_prefix():
    full = stdlib_corpus()
    small = stdlib_corpus(max_bytes=1234)
    assert small.shape == (1234,)
    assert torch.equal(small, full[:1234])
    assert torch.equal(stdlib_corpus(max_bytes=full.numel() + 10), full)


def test_returned_corpus_is_a_copy():
    a = stdlib_corpus(max_bytes=100)
    a.zero_()
    assert stdlib_corpus(max_bytes=100).sum() > 0


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_max_bytes_must_be_positive(bad):
    with pytest.raises(ValueError, match=r"stdlib_corpus: max_bytes=.* is invalid; allowed: an int >= 1"):
        stdlib_corpus(max_bytes=bad)


# ---------------------------------------------------------------------------- batches


def test_split_bounds_rule():
    assert split_bounds(1000, "train") == (0, 900)
    assert split_bounds(1000, "val") == (900, 1000)
    assert split_bounds(15, "train") == (0, 13)  # int(13.5) == 13
    with pytest.raises(ValueError, match=r"split='test'.*'train', 'val'"):
        split_bounds(10, "test")


def test_batches_shapes_and_shift():
    corpus = stdlib_corpus(max_bytes=50_000)
    x, y = next(batches(corpus, batch_size=4, seq_len=16))
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    # every row is a real window of the corpus
    text = bytes(corpus.tolist())
    for row_x, row_y in zip(x, y):
        window = bytes(row_x.tolist()) + bytes(row_y[-1:].tolist())
        assert window in text


def test_batches_are_windows_inside_their_split():
    corpus = torch.arange(10_000)  # token value == position, so windows are easy to read
    for split, (lo, hi) in (("train", (0, 9000)), ("val", (9000, 10_000))):
        stream = batches(corpus, batch_size=64, seq_len=50, split=split, seed=3)
        for _ in range(20):
            x, y = next(stream)
            assert torch.equal(y, x + 1)
            assert torch.equal(x, x[:, :1] + torch.arange(50))
            assert x.min() >= lo and y.max() < hi


def test_train_and_val_draw_from_disjoint_regions():
    corpus = torch.arange(5_000)
    train = torch.cat([torch.cat(next(batches(corpus, 32, 20, "train", seed=s))).flatten() for s in range(5)])
    val = torch.cat([torch.cat(next(batches(corpus, 32, 20, "val", seed=s))).flatten() for s in range(5)])
    assert not set(train.tolist()) & set(val.tolist())


def test_batches_are_deterministic_by_seed():
    corpus = stdlib_corpus(max_bytes=100_000)

    def take(split: str, seed: int, n: int = 3):
        stream = batches(corpus, batch_size=8, seq_len=32, split=split, seed=seed)
        return [next(stream) for _ in range(n)]

    a, b = take("train", 0), take("train", 0)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    c = take("train", 1)
    assert not torch.equal(a[0][0], c[0][0])
    assert not torch.equal(a[0][0], a[1][0])  # the stream moves on
    d, e = take("val", 0), take("val", 0)
    assert torch.equal(d[0][0], e[0][0])


def test_val_stream_is_seeded_with_the_documented_offset():
    corpus = torch.arange(1000)
    x, _ = next(batches(corpus, batch_size=16, seq_len=10, split="val", seed=5))
    g = torch.Generator().manual_seed(5 + data.VAL_SEED_OFFSET)
    starts = torch.randint(0, 100 - 10, (16,), generator=g)
    assert torch.equal(x[:, 0], 900 + starts)
    x_train, _ = next(batches(corpus, batch_size=16, seq_len=10, split="train", seed=5))
    g = torch.Generator().manual_seed(5)
    assert torch.equal(x_train[:, 0], torch.randint(0, 900 - 10, (16,), generator=g))


def test_batches_on_smallest_possible_split():
    corpus = torch.arange(100)  # val split has 10 tokens: room for exactly one window of 9+1
    x, y = next(batches(corpus, batch_size=2, seq_len=9, split="val"))
    assert torch.equal(x[0], torch.arange(90, 99)) and torch.equal(y[1], torch.arange(91, 100))
    with pytest.raises(ValueError, match=r"seq_len=10 is invalid; allowed: seq_len <= 9 .*'val' split has only 10"):
        batches(corpus, batch_size=2, seq_len=10, split="val")


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(batch_size=0, seq_len=8), r"batches: batch_size=0 is invalid; allowed: an int >= 1"),
        (dict(batch_size=2, seq_len=-1), r"batches: seq_len=-1 is invalid; allowed: an int >= 1"),
        (dict(batch_size=2, seq_len=8, split="validation"), r"split='validation'.*'train', 'val'"),
        (dict(batch_size=2, seq_len=900), r"seq_len=900.*allowed: seq_len <= 899"),
    ],
)
def test_batches_errors_are_raised_at_call_time(kwargs, pattern):
    corpus = torch.arange(1000)
    with pytest.raises(ValueError, match=pattern):
        batches(corpus, **kwargs)  # no next(): the checks must not wait for iteration


def test_batches_rejects_2d_corpus():
    with pytest.raises(ValueError, match=r"corpus=\(2, 50\).*1-D"):
        batches(torch.zeros(2, 50, dtype=torch.long), batch_size=1, seq_len=4)


# ---------------------------------------------------------------------------- tokenizer


def test_encode_decode_round_trip():
    text = "def f(x):\n    return x  # café ✓"
    tokens = encode(text)
    assert tokens.dtype == torch.long and tokens.dim() == 1
    assert tokens.tolist() == list(text.encode("utf-8"))
    assert decode(tokens) == text
    assert decode(tokens.tolist()) == text


def test_decode_replaces_invalid_utf8_and_checks_input():
    assert decode(torch.tensor([104, 105, 0xFF])) == "hi\ufffd"
    with pytest.raises(ValueError, match="1-D"):
        decode(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"300.*0\.\.255"):
        decode([104, 300])
