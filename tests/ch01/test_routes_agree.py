"""Issue 40.4: one answer per question across routes. Sizes and card names accepted by the CLI and the API alike
and named in the output; one card list (memlab.core.gpus.GPUS) in --help, errors and the API; a Hub id fails at
once without network (no retries) and names the nearest preset; QLoRA and chapter 09's options among the
suggestions; a config file's model named from its contents, not its folder."""
from __future__ import annotations

import json
import re

import pytest

from memlab import cli
from memlab import estimate as E
from memlab.cli import args as cli_args
from memlab.core import gpus
from memlab.estimate import hub, suggestions

TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], _name_or_path="acme/tiny-llama", hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "myproj" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY))
    return str(path)


def _run(argv, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------- sizes and cards: CLI and API alike


def test_a_size_is_a_gpu_for_the_cli_and_the_api_and_the_output_names_it(tiny, capsys):
    code, out, err = _run(["estimate", tiny, "--seq-len", "16", "--gpu", "24GB", "--no-suggest"], capsys)
    assert code == 0, err
    assert "no card given" not in out and "gpu='24GB' is a size" in out and "24GB, decimal units" in out
    est = E.estimate_training_memory(tiny, batch_size=1, seq_len=16, gpu="24GB")
    assert "no card given" not in " ".join(est.notes) and any("gpu='24GB'" in k for k in est.extras)
    assert est.fits("24GB") and est.fits("24GiB")  # the same sizes the estimate took


@pytest.mark.parametrize("card", gpus.gpu_names())
def test_every_card_of_the_table_is_a_gpu_everywhere(card):
    label, usable = E.resolve_gpu(card)
    assert usable == gpus.GPUS[card].usable_bytes and gpus.GPUS[card].name in label
    assert gpus.capability(card) is not None and gpus.parse_gpu(card) == (card, gpus.GPUS[card].total_bytes)
    E.StepSpec(batch_size=1, seq_len=8, gpu=card)  # the API's gpu= takes it
    assert cli_args.estimate_parser().parse_args(["gpt2", "--gpu", card]).gpu.card == card


def _listed(text):
    m = re.search(r"a card[^(]*\(([^)]*)\)", text)
    assert m, text
    return m.group(1).split(", ")


def test_one_card_list_in_help_errors_and_api(capsys):
    names = gpus.gpu_names()
    assert {"v100", "rtx2080ti"} <= set(names) and set(gpus.CAPABILITIES) == set(names)
    help_text = cli_args.estimate_parser().format_help()
    assert _listed(" ".join(help_text.split())) == names
    with pytest.raises(ValueError) as api_err:
        E.estimate_training_memory("gpt2", batch_size=1, seq_len=8, gpu="nope")
    with pytest.raises(ValueError) as resolve_err:
        E.resolve_gpu("nope")
    code, _, err = _run(["estimate", "gpt2", "--gpu", "nope"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert _listed(str(api_err.value)) == _listed(str(resolve_err.value)) == _listed(err) == names


# ---------------------------------------------------------------- Hub ids without network


def test_hub_id_without_network_reads_the_cache_only_and_names_the_nearest_preset(monkeypatch, tmp_path):
    import transformers

    calls = []
    real = transformers.AutoConfig.from_pretrained.__func__

    def from_pretrained(cls, repo, **kw):
        calls.append(kw)
        return real(cls, repo, **kw)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr(hub, "_offline", lambda: False)
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=hub.CONNECT_TIMEOUT_S: False)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", classmethod(from_pretrained))
    with pytest.raises(hub.HubConfigError) as exc:
        E.estimate_training_memory("meta-llama/Llama-3.1-8B", batch_size=1, seq_len=8)
    msg = str(exc.value)
    assert calls == []  # no copy in the cache: refused before the Hub client (or transformers) is asked
    assert "cannot be reached" in msg and "nearest preset: llama-3-8b" in msg and "\n" not in msg
    sha = "0123456789abcdef0123456789abcdef01234567"  # a cached copy: read from the cache, no request
    root = tmp_path / "hub" / "models--acme--tiny-llama"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)
    (root / "snapshots" / sha).mkdir(parents=True)
    (root / "snapshots" / sha / "config.json").write_text(json.dumps(TINY))
    cfg = hub.load_hub_config("acme/tiny-llama")
    assert cfg.hidden_size == 64 and len(calls) == 1 and calls[0]["local_files_only"] is True


def test_hub_reachable_probes_one_connection(monkeypatch):
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens, refused at once
    hub._REACHABLE.clear()
    try:
        assert hub.hub_reachable() is False and hub._hub_address() == ("127.0.0.1", 9)
    finally:
        hub._REACHABLE.clear()


@pytest.mark.parametrize("repo,preset", [("meta-llama/Llama-3.1-8B", "llama-3-8b"),
                                         ("meta-llama/Meta-Llama-3-8B", "llama-3-8b"),
                                         ("meta-llama/Llama-2-7b-hf", "llama-2-7b"),
                                         ("Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5-0.5b"),
                                         ("mistralai/Mistral-7B-v0.3", "mistral-7b"),
                                         ("no-such-org/zzzz", None)])
def test_nearest_preset(repo, preset):
    assert hub.nearest_preset(repo) == preset


# ---------------------------------------------------------------- suggestions


def test_qlora_and_chapter_09_options_are_suggested(tiny):
    lora = dict(device="cpu", adapter="lora", lora_r=4)
    base = E.estimate_training_memory(tiny, batch_size=1, seq_len=16, **lora)
    rows = suggestions(base, tiny, **lora)
    names = [s.technique for s in rows]
    assert any(n.startswith("QLoRA") for n in names), names
    assert any(n.startswith("fused linear cross-entropy") for n in names), names
    assert any(n.startswith("chunked cross-entropy") for n in names), names
    assert any(n.startswith("optimizer step in backward") for n in names), names
    qlora = next(s for s in rows if s.technique.startswith("QLoRA"))
    assert "--adapter qlora" in qlora.command and "--lora-r 4" in qlora.command


# ---------------------------------------------------------------- a config file's model, named from its contents


def test_a_config_file_is_named_from_its_contents_not_its_folder(tiny, tmp_path, capsys):
    est = E.estimate_training_memory(tiny, batch_size=1, seq_len=16, device="cpu")
    assert est.model.startswith("acme/tiny-llama (llama") and not est.model.startswith("myproj")
    local = tmp_path / "ckpt" / "config.json"
    local.parent.mkdir()
    local.write_text(json.dumps({**TINY, "_name_or_path": "/home/me/checkpoints/run3"}))
    est = E.estimate_training_memory(str(local), batch_size=1, seq_len=16, device="cpu")
    assert est.model.startswith("LlamaForCausalLM (llama") and str(local) in est.model
    code, out, _ = _run(["estimate", tiny, "--seq-len", "16", "--device", "cpu"], capsys)
    assert code == 0 and "acme/tiny-llama (llama" in out
