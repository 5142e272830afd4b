"""memlab estimate ORG/NAME: only config.json, through transformers' cache and offline switch; no network."""
from __future__ import annotations

import json

import pytest

from memlab import estimate as E
from memlab.cli import estimate as estimate_cli
from memlab.estimate import hub
from memlab.models import preset_config

SHA = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(home, repo="memlab-test/Tiny-Llama", config=None):
    """A hub-style cache with config.json and no weights: HF_HOME/hub/models--org--name/{refs,snapshots}."""
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(SHA)
    snap = root / "snapshots" / SHA
    snap.mkdir(parents=True)
    cfg = config or dict(preset_config("llama-2-7b").to_dict(), num_hidden_layers=2, hidden_size=64,
                         intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, vocab_size=256)
    (snap / "config.json").write_text(json.dumps(cfg))
    return repo


@pytest.fixture
def offline_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def test_hub_id_reads_the_cached_config_only(offline_home, capsys):
    repo = _hub_cache(offline_home)
    est = E.estimate_training_memory(repo, batch_size=1, seq_len=16, device="cpu")
    cfg = hub.load_hub_config(repo)
    same = E.estimate_training_memory(cfg, batch_size=1, seq_len=16, device="cpu")
    assert est.peak_bytes == same.peak_bytes and est.model.startswith(repo)
    assert estimate_cli.main([repo, "--seq-len", "16", "--no-suggest"]) == 0
    assert repo in capsys.readouterr().out
    files = sorted(p.name for p in offline_home.rglob("*") if p.is_file())
    assert files == ["config.json", "main"]  # nothing else was fetched or written


def test_offline_without_a_cached_copy_is_one_line(offline_home, capsys):
    with pytest.raises(hub.HubConfigError) as exc:
        E.estimate_training_memory("meta-llama/Llama-3.1-8B", batch_size=1, seq_len=16)
    msg = str(exc.value)
    assert "\n" not in msg and "offline" in msg and "llama-2-7b" in msg and "config.json" in msg
    assert estimate_cli.main(["meta-llama/Llama-3.1-8B"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model='meta-llama/Llama-3.1-8B'" in err[0] and "the path of a config.json" in err[0]


def test_repo_id_shape():
    assert hub.looks_like_repo_id("meta-llama/Llama-3.1-8B")
    assert not hub.looks_like_repo_id("llama-2-7b") and not hub.looks_like_repo_id("a/b/config.json")
    assert not hub.looks_like_repo_id("dir/config.json")


def test_plan_takes_a_hub_id_through_the_same_resolver(offline_home, monkeypatch, capsys):
    from memlab import plan as P
    from memlab.cli import plan as plan_cli

    monkeypatch.setenv("MEMLAB_CACHE_DIR", "none")
    repo = _hub_cache(offline_home)
    kw = dict(batch_size=2, seq_len=16, device="cpu", lora_r=4, host_budget=None,
              allow={"precision": ["bf16-mixed"], "adapter": ["full", "lora"], "optimizer": ["adamw"],
                     "checkpointing": ["none"], "micro_batch": [2]})
    P.stacks._CACHE.clear()
    res = P.plan(repo, "1GiB", **kw)
    P.stacks._CACHE.clear()
    same = P.plan(hub.load_hub_config(repo), "1GiB", **kw)
    assert res.model.startswith(repo) and res.traces >= 1
    assert [(r.stack, r.peak_bytes) for r in res.rows] == [(r.stack, r.peak_bytes) for r in same.rows]
    assert plan_cli.main([repo, "--budget", "1GiB", "--batch-size", "2", "--seq-len", "16", "--device", "cpu",
                   "--allow", "adapter=full", "--allow", "micro_batch=2", "--host-budget", "none",
                   "--no-progress"]) == 0
    assert repo in capsys.readouterr().out
    files = sorted(p.name for p in offline_home.rglob("*") if p.is_file())
    assert files == ["config.json", "main"]  # only the config was read; nothing fetched or written
    with pytest.raises(hub.HubConfigError):
        P.plan("meta-llama/Llama-3.1-8B", "1GiB", **kw)
