"""The worst batch of a data set (memlab.estimate.batches, ``memlab estimate --lengths``): equal to a brute-force trace
of every batch on a tiny model and data set; the epoch's order is a DataLoader's; bad lengths files get one line."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402

from memlab.estimate import estimate_training_memory  # noqa: E402
from memlab.estimate.batches import batch_shapes, max_batch_size, read_lengths, worst_batch  # noqa: E402

KW = dict(device="cpu", optimizer="sgd", checkpointing=False)


@pytest.fixture(scope="module")
def cfg():
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=128, max_position_embeddings=256)


@pytest.fixture(scope="module")
def lengths():
    rng = random.Random(3)
    return [rng.randint(3, 90) for _ in range(27)]


def test_shapes_follow_a_dataloader(lengths):
    g = torch.Generator().manual_seed(7)
    loader = torch.utils.data.DataLoader(list(range(len(lengths))), batch_size=4, shuffle=True, generator=g)
    expected = [(len(b), max(lengths[i] for i in b.tolist())) for b in loader]
    assert batch_shapes(lengths, 4, "pad-longest", shuffle_seed=7) == expected
    assert batch_shapes(lengths, 4, "pad-multiple:16", shuffle_seed=7) == [(r, -(-s // 16) * 16) for r, s in expected]
    assert batch_shapes(lengths, 4, "pad-longest") == [
        (len(lengths[i:i + 4]), max(lengths[i:i + 4])) for i in range(0, len(lengths), 4)]
    rows = -(-sum(lengths) // 64)
    packed = batch_shapes(lengths, 4, "pack:64", shuffle_seed=7)
    assert sum(r for r, _ in packed) == rows and {s for _, s in packed} == {64} and packed[0] == (4, 64)
    assert batch_shapes(lengths, 4, "pad-longest", drop_last=True)[-1][0] == 4


@pytest.mark.parametrize("collator", ["pad-longest", "pad-multiple:32", "pack:48"])
def test_worst_batch_equals_brute_force(cfg, lengths, collator):
    shapes = batch_shapes(lengths, 4, collator, shuffle_seed=1)
    brute = [estimate_training_memory(cfg, batch_size=r, seq_len=s, **KW).peak_bytes for r, s in shapes]
    w = worst_batch(cfg, lengths, 4, collator, shuffle_seed=1, **KW)
    assert w.peak == max(brute) and w.estimate.peak_bytes == max(brute)
    assert brute[w.index] == max(brute) and shapes[w.index] == w.shape
    assert sum(w.shapes.values()) == len(shapes) == w.batches
    exact = worst_batch(cfg, lengths, 4, collator, shuffle_seed=1, exact=True, **KW)
    assert exact.peak == w.peak and not exact.skipped and len(exact.peaks) == len(set(shapes))


def test_max_batch_size(cfg, lengths):
    w4 = worst_batch(cfg, lengths, 4, "pad-longest", shuffle_seed=1, **KW)
    b, w = max_batch_size(cfg, lengths, w4.peak, "pad-longest", shuffle_seed=1, **KW)
    assert b >= 4 and w.peak <= w4.peak
    assert worst_batch(cfg, lengths, b + 1, "pad-longest", shuffle_seed=1, **KW).peak > w4.peak
    assert max_batch_size(cfg, lengths, 1000, "pad-longest", **KW) == (0, None)


def test_read_lengths(tmp_path):
    p = tmp_path / "l.txt"
    p.write_text("12\n\n7\n300\n")
    assert read_lengths(p) == [12, 7, 300]
    np.save(tmp_path / "l.npy", np.array([5, 6], dtype=np.int32))
    assert read_lengths(tmp_path / "l.npy") == [5, 6]
    for text, why in (("12\n-3\n", "line 2 is '-3'"), ("12\nhello\n", "line 2 is 'hello'"), ("\n", "no lengths"),
                      ("1.5\n", "line 1 is '1.5'")):
        p.write_text(text)
        with pytest.raises(ValueError) as err:
            read_lengths(p)
        assert str(err.value).startswith(f"{p}: ") and why in str(err.value) and "\n" not in str(err.value)
    np.save(tmp_path / "f.npy", np.array([1.5]))
    with pytest.raises(ValueError, match="dtype float64"):
        read_lengths(tmp_path / "f.npy")
    with pytest.raises(FileNotFoundError):
        read_lengths(tmp_path / "none.txt")
    with pytest.raises(ValueError, match="collator='pad' is invalid"):
        batch_shapes([1, 2], 1, "pad")


def test_covered_shapes_are_the_brute_force_ones():
    from memlab.estimate.batches import _uncovered

    rng = random.Random(0)
    for _ in range(200):
        shapes = {(rng.randint(1, 5), rng.randint(1, 9)) for _ in range(rng.randint(1, 12))}
        brute = sorted(s for s in shapes if not any(o != s and o[0] >= s[0] and o[1] >= s[1] for o in shapes))
        assert _uncovered(shapes) == brute, shapes


def test_command_line(tmp_path, lengths, capsys):
    import json

    from memlab.cli import main as memlab_main

    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                                        max_position_embeddings=256)))
    lp = tmp_path / "lengths.txt"
    lp.write_text("\n".join(map(str, lengths)) + "\n")
    argv = ["estimate", str(cfg_path), "--lengths", str(lp), "--batch-size", "4", "--shuffle-seed", "1",
            "--device", "cpu", "--optimizer", "sgd"]
    assert memlab_main(argv) == 0
    out = capsys.readouterr().out
    w = worst_batch(str(cfg_path), lengths, 4, "pad-longest", shuffle_seed=1, **KW)
    assert f"worst batch: #{w.index} of 7, {w.shape[0]} x {w.shape[1]} tokens padded" in out
    assert f"peak: {w.estimate.peak_bytes:,} bytes of tensors" in out and "27 samples" in out
    assert memlab_main(argv + ["--gpu", "1GiB", "--max-batch-size"]) == 0
    assert "max batch size: " in capsys.readouterr().out
    lp.write_text("4\n-1\n")
    assert memlab_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "line 2 is '-1'" in err
    with pytest.raises(SystemExit):
        memlab_main(argv + ["--collator", "pack"])
    assert "--collator" in capsys.readouterr().err


def test_read_lengths_of_a_tokenized_jsonl(tmp_path):
    import json

    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(json.dumps({"input_ids": list(range(n)), "text": "x"}) for n in (3, 9, 1)) + "\n")
    assert read_lengths(p) == [3, 9, 1]
    p.write_text(json.dumps({"input_ids": [1, 2]}) + "\n" + json.dumps({"text": "no ids"}) + "\n")
    with pytest.raises(ValueError, match=r"line 2 has no input_ids \(has \['text'\]\)"):
        read_lengths(p)
    p.write_text("{oops\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        read_lengths(p)
