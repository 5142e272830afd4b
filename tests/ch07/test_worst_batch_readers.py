"""The worst batch's data readers (memlab.estimate.batches.read_lengths): a tokenized Hugging Face data set saved with
``save_to_disk``, and a JSONL of texts counted with a LOCAL tokenizer (a tokenizer.json or a save_pretrained folder).
Everything is built here in tmp_path: a WordLevel tokenizer of the ``tokenizers`` library and a tiny data set;
nothing is downloaded. Bad input (a data set without input_ids, a missing tokenizer) is one line naming what was
expected."""
from __future__ import annotations

import json

import pytest

from memlab.estimate.batches import load_tokenizer, read_lengths

datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["the cat sat on the mat", "the cat", "a dog sat", "the mat the mat the mat the mat", "cat"]
VOCAB = {"[UNK]": 0, "[BOS]": 1, "the": 2, "cat": 3, "sat": 4, "on": 5, "mat": 6}


def _tokenizer(bos: bool = False) -> "tokenizers.Tokenizer":
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:  # a post-processor that adds a BOS token, as Llama's tokenizers do
        tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    return tok


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_a_saved_data_set_gives_its_input_ids_lengths(tmp_path):
    ids = [[1] * n for n in (5, 2, 9, 1, 4)]
    ds = datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})
    ds.save_to_disk(str(tmp_path / "ds"))
    assert read_lengths(tmp_path / "ds") == [5, 2, 9, 1, 4]
    # a selection (an indices mapping over the same arrow table) counts the rows it selects, in its order
    ds.select([2, 0]).save_to_disk(str(tmp_path / "sel"))
    assert read_lengths(tmp_path / "sel") == [9, 5]
    # a DatasetDict: its train split
    datasets.DatasetDict({"train": ds.select([3, 4]), "test": ds}).save_to_disk(str(tmp_path / "dd"))
    assert read_lengths(tmp_path / "dd") == [1, 4]


def test_a_data_set_without_input_ids_is_one_line(tmp_path):
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "raw"))
    with pytest.raises(ValueError) as err:
        read_lengths(tmp_path / "raw")
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path / 'raw'}: ") and "columns ['text'] and no input_ids" in msg and "\n" not in msg
    assert "expected a tokenized data set saved with datasets.Dataset.save_to_disk" in msg
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a data set saved with save_to_disk"):
        read_lengths(tmp_path / "plain")
    datasets.DatasetDict({"a": datasets.Dataset.from_dict({"input_ids": [[1]]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"splits \['a'\] and no 'train'"):
        read_lengths(tmp_path / "dd")
    datasets.Dataset.from_dict({"input_ids": [[1, 2], []]}).save_to_disk(str(tmp_path / "empty_row"))
    with pytest.raises(ValueError, match="row 1's input_ids is empty"):
        read_lengths(tmp_path / "empty_row")


def test_texts_with_a_local_tokenizer_json(tmp_path):
    tok = _tokenizer(bos=True)
    tok.save(str(tmp_path / "tokenizer.json"))
    p = _jsonl(tmp_path / "texts.jsonl", [{"text": t, "id": i} for i, t in enumerate(TEXTS)])
    expected = [len(tok.encode(t).ids) for t in TEXTS]
    assert expected == [len(t.split()) + 1 for t in TEXTS]  # the BOS the post-processor adds is counted
    assert read_lengths(p, tokenizer=tmp_path / "tokenizer.json") == expected
    # a folder holding only tokenizer.json is read as that file
    (tmp_path / "only").mkdir()
    tok.save(str(tmp_path / "only" / "tokenizer.json"))
    assert read_lengths(p, tokenizer=tmp_path / "only") == expected
    # another text field
    q = _jsonl(tmp_path / "q.jsonl", [{"content": t} for t in TEXTS])
    assert read_lengths(q, tokenizer=tmp_path / "tokenizer.json", text_field="content") == expected


def test_texts_with_a_save_pretrained_folder_in_batches(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from transformers import PreTrainedTokenizerFast

    from memlab.estimate import batches

    hf = PreTrainedTokenizerFast(tokenizer_object=_tokenizer(bos=True), unk_token="[UNK]", bos_token="[BOS]")
    hf.save_pretrained(str(tmp_path / "tok"))
    rows = [{"text": TEXTS[i % len(TEXTS)]} for i in range(23)]
    p = _jsonl(tmp_path / "texts.jsonl", rows)
    monkeypatch.setattr(batches, "_BATCH", 4)  # 23 lines in batches of 4: the last batch is partial
    calls = []
    real = batches.load_tokenizer

    def counting(path):
        count = real(path)
        return lambda texts: calls.append(len(texts)) or count(texts)

    monkeypatch.setattr(batches, "load_tokenizer", counting)
    assert read_lengths(p, tokenizer=tmp_path / "tok") == [len(hf(r["text"])["input_ids"]) for r in rows]
    assert calls == [4, 4, 4, 4, 4, 3]


def test_a_missing_or_wrong_tokenizer_is_one_line(tmp_path):
    p = _jsonl(tmp_path / "texts.jsonl", [{"text": t} for t in TEXTS])
    with pytest.raises(FileNotFoundError) as err:
        read_lengths(p, tokenizer=tmp_path / "nope")
    msg = str(err.value)
    assert msg.startswith(f"tokenizer='{tmp_path / 'nope'}': no such file or folder") and "\n" not in msg
    assert "a local tokenizer" in msg and "nothing is downloaded" in msg
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="a folder without tokenizer_config.json or tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a readable tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")
    # texts without a tokenizer: the line says a tokenizer is wanted
    with pytest.raises(ValueError, match=r"line 1 has no input_ids \(has \['text'\]\).*--tokenizer PATH"):
        read_lengths(p)
    # a tokenizer with something that is not a JSONL of texts
    (tmp_path / "l.txt").write_text("3\n")
    with pytest.raises(ValueError, match="tokenizer=.* is invalid; allowed: given only with a .jsonl of texts"):
        read_lengths(tmp_path / "l.txt", tokenizer=tmp_path / "nope")
    _tokenizer().save(str(tmp_path / "tokenizer.json"))
    q = _jsonl(tmp_path / "q.jsonl", [{"text": "the cat"}, {"body": "no text"}])
    with pytest.raises(ValueError, match=r"line 2 has no string 'text' \(has \['body'\]\)"):
        read_lengths(q, tokenizer=tmp_path / "tokenizer.json")


def test_command_line_reads_a_data_set_folder(tmp_path, capsys):
    pytest.importorskip("transformers")
    from memlab.cli import main as memlab_main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                                   max_position_embeddings=256)))
    lengths = [5, 40, 7, 12, 33, 2, 18]
    datasets.Dataset.from_dict({"input_ids": [[3] * n for n in lengths]}).save_to_disk(str(tmp_path / "ds"))
    argv = ["estimate", str(cfg), "--lengths", str(tmp_path / "ds"), "--batch-size", "2", "--device", "cpu",
            "--optimizer", "sgd"]
    assert memlab_main(argv) == 0
    out = capsys.readouterr().out
    assert "7 samples, tokens min 2 / median 12 / max 40" in out and "worst batch: #0 of 4, 2 x 40 tokens padded" in out
    datasets.Dataset.from_dict({"text": ["a"]}).save_to_disk(str(tmp_path / "raw"))
    argv[3] = str(tmp_path / "raw")
    capsys.readouterr()  # save_to_disk's progress bar
    assert memlab_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no input_ids" in err and str(tmp_path / "raw") in err


def test_command_line_passes_a_tokenizer_when_the_flag_is_there(tmp_path, capsys):
    """``--tokenizer`` is registered in memlab.cli.args; run_worst_batch reads ``args.tokenizer``."""
    pytest.importorskip("transformers")
    import argparse

    from memlab.cli.worst_batch import run_worst_batch

    _tokenizer().save(str(tmp_path / "tokenizer.json"))
    p = _jsonl(tmp_path / "texts.jsonl", [{"text": t} for t in TEXTS])
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=128, max_position_embeddings=256)
    args = argparse.Namespace(model=cfg, lengths=str(p), tokenizer=str(tmp_path / "tokenizer.json"), batch_size=2,
                              collator="pad-longest", shuffle_seed=None, exact_shapes=False, max_batch_size=False,
                              gpu=None, step=None, dtype="fp32", optimizer="sgd", checkpointing=False,
                              world_size=1, zero_stage=0, offload_gradients=False)
    assert run_worst_batch(args, {"device": "cpu"}, {}, None) == 0
    out = capsys.readouterr().out
    assert "5 samples, tokens min 1 / median 3 / max 8" in out and "2 x 8 tokens padded" in out


def test_command_line_tokenizes_a_jsonl_of_texts_with_a_local_tokenizer(tmp_path, capsys):
    """``memlab estimate CONFIG --lengths texts.jsonl --tokenizer tokenizer.json`` end to end, offline."""
    pytest.importorskip("transformers")
    from memlab.cli import main as memlab_main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                                   max_position_embeddings=256)))
    _tokenizer().save(str(tmp_path / "tokenizer.json"))
    p = _jsonl(tmp_path / "texts.jsonl", [{"text": t} for t in TEXTS])
    argv = ["estimate", str(cfg), "--lengths", str(p), "--tokenizer", str(tmp_path / "tokenizer.json"),
            "--batch-size", "2", "--device", "cpu", "--optimizer", "sgd"]
    assert memlab_main(argv) == 0
    out = capsys.readouterr().out
    assert "5 samples, tokens min 1 / median 3 / max 8" in out and "2 x 8 tokens padded" in out
    argv[argv.index("--tokenizer") + 1] = str(tmp_path / "no-such-tokenizer.json")
    assert memlab_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-tokenizer.json" in err
