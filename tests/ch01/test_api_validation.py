"""Issue 41.3: one validated schema per public entry point of the estimator (estimate_training_memory,
measure_training_memory, ``memlab estimate`` and its ``--set``). Every argument gets a bad value of each kind
(wrong type, bool, nan, inf, huge int, negative, empty, unknown string); the API raises a ValueError / TypeError
naming it, the CLI prints one line on stderr and exits 2, and neither builds or traces anything first (the
builders and tracers below raise AssertionError if they are reached)."""
from __future__ import annotations

import json

import pytest

from memlab import cli
from memlab import estimate as E
from memlab.estimate import api

KINDS = {
    "wrong type": object(),
    "bool": True,
    "nan": float("nan"),
    "inf": float("inf"),
    "huge int": 10**400,
    "negative": -1,
    "empty": "",
    "unknown string": "nope",
}
BOOL_ARGS = {"checkpointing", "kernel_scratch", "offload_checkpoints", "optimizer_in_backward", "allow_longer_seq",
             "extrapolate", "keep_previous_outputs", "zero_grad_set_to_none"}
# target_modules: module names are free-form ("nope" may be a layer of your model): checked when the model is built
FREE_FORM = {"target_modules": {"unknown string"}}
ADAPTER_ARGS = set(api.ADAPTER_KEYWORDS)


def never_built():
    raise AssertionError("the model was built before the arguments were checked")


@pytest.fixture(autouse=True)
def no_tracing(monkeypatch):
    """Validation comes before any work: reaching a tracer fails the test."""
    from memlab.estimate import extrapolate, sharding, trace

    def boom(*a, **k):
        raise AssertionError("traced before the arguments were checked")

    monkeypatch.setattr(extrapolate, "estimate_one_rank", boom)
    monkeypatch.setattr(sharding, "trace_fsdp", boom)
    monkeypatch.setattr(trace, "trace_step", boom)


def _cases(schema_names, skip=()):
    for name in schema_names:
        for kind, value in KINDS.items():
            if (kind == "bool" and name in BOOL_ARGS) or kind in FREE_FORM.get(name, ()) or name in skip:
                continue
            yield pytest.param(name, value, id=f"{name}-{kind}")


ARGS = sorted(set(api.STEP_SCHEMA) | set(api.ENTRY_SCHEMA))


@pytest.mark.parametrize("name,value", list(_cases(ARGS)))
def test_estimate_refuses_every_bad_argument_by_name(name, value):
    kw = dict(batch_size=1, seq_len=8, device="cpu")
    if name in ADAPTER_ARGS:
        kw["adapter"] = "lora"
    kw[name] = value
    with pytest.raises((ValueError, TypeError)) as exc:
        E.estimate_training_memory(never_built, **kw)
    msg = str(exc.value)
    assert f"{name}=" in msg and "allowed" in msg and "\n" not in msg, msg


MEASURED = [a for a in ARGS if a not in ("extrapolate", "kernel_scratch", "world_size", "zero_stage", "gpu")]


@pytest.mark.parametrize("name,value", list(_cases(MEASURED)))
def test_measure_refuses_every_bad_argument_by_name(name, value):
    kw = dict(batch_size=1, seq_len=8)
    if name in ADAPTER_ARGS:
        kw["adapter"] = "lora"
    kw[name] = value
    with pytest.raises((ValueError, TypeError)) as exc:
        E.measure_training_memory(never_built, **kw)
    assert f"{name}=" in str(exc.value), str(exc.value)


@pytest.mark.parametrize("name,value", [
    ("lora_alpha", 10**400), ("lora_alpha", float("inf")), ("zero_stage", 1.0), ("seed", 10**30),
    ("seed", float("nan")), ("warmup_steps", 10**9), ("checkpointing", "no"), ("device", 5),
    ("optimizer_kwargs", 5), ("optimizer_kwargs", {"betas": "x"}), ("optimizer_kwargs", {"lr": 10**400}),
    ("optimizer_kwargs", {"eps": 0.0}), ("config_overrides", [1]), ("gpu", "24"), ("gpu", 0.4),
])
def test_the_probes_of_the_issue(name, value):
    """The failures issue 41 names, each refused by name before any work."""
    kw = dict(batch_size=1, seq_len=8, world_size=2) if name == "zero_stage" else dict(batch_size=1, seq_len=8)
    if name == "lora_alpha":
        kw["adapter"] = "lora"
    with pytest.raises((ValueError, TypeError), match=name):
        E.estimate_training_memory(never_built, **{**kw, name: value})


def test_a_step_spec_built_directly_is_checked_too():
    spec = E.StepSpec(batch_size=1, seq_len=8, seed=float("nan"))
    with pytest.raises(ValueError, match="seed=nan"):
        E.estimate_training_memory(never_built, spec)
    with pytest.raises(TypeError, match="spec="):
        E.estimate_training_memory(never_built, "not a spec")


# ---------------------------------------------------------------- config overrides, whatever the model's source

TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], _name_or_path="acme/tiny-llama", hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
            attention_dropout=0.0)
OVERRIDE_KEYS = ["hidden_size", "num_hidden_layers", "vocab_size", "tie_word_embeddings", "hidden_act",
                 "rms_norm_eps", "torch_dtype", "attention_dropout", "initializer_range", "use_cache", "pad_token_id"]
BOOL_FIELDS = {"tie_word_embeddings", "use_cache"}


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """The four routes to a model: a preset, a config.json path, a Hub id (cached, offline), a transformers config."""
    from transformers import AutoConfig

    path = tmp_path / "myproj" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY))
    sha = "0123456789abcdef0123456789abcdef01234567"
    root = tmp_path / "hf" / "hub" / "models--acme--tiny-llama"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)
    (root / "snapshots" / sha).mkdir(parents=True)
    (root / "snapshots" / sha / "config.json").write_text(json.dumps(TINY))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = AutoConfig.for_model(**{k: v for k, v in TINY.items() if k not in ("_name_or_path",)})
    return {"preset": "llama-2-7b", "config.json": str(path), "hub id": "acme/tiny-llama", "config": cfg}


@pytest.mark.parametrize("source", ["preset", "config.json", "hub id", "config"])
@pytest.mark.parametrize("key", OVERRIDE_KEYS)
def test_config_overrides_follow_memlabs_rules_for_every_source(sources, source, key):
    model = sources[source]
    for kind, value in KINDS.items():
        if kind == "bool" and key in BOOL_FIELDS:
            continue
        with pytest.raises(ValueError) as exc:
            E.estimate_training_memory(model, batch_size=1, seq_len=8, device="cpu", config_overrides={key: value})
        msg = str(exc.value)
        assert f"config_overrides[{key!r}]=" in msg and "allowed" in msg and "\n" not in msg, (kind, msg)


def test_big_work_is_bounded_before_it_starts(sources):
    for model in sources.values():
        with pytest.raises(ValueError, match="num_hidden_layers.*1,024"):
            E.estimate_training_memory(model, batch_size=1, seq_len=8, config_overrides={"num_hidden_layers": 10**6})
    with pytest.raises(ValueError, match="warmup_steps"):
        E.estimate_training_memory(sources["preset"], batch_size=1, seq_len=8, warmup_steps=10**9)


def test_tracing_every_layer_is_bounded_before_it_starts():
    with pytest.raises(ValueError, match=r"extrapolate=False with num_hidden_layers=1000 is invalid.*at most 128"):
        E.estimate_training_memory("llama-2-7b", batch_size=1, seq_len=8, extrapolate=False,
                                   config_overrides={"num_hidden_layers": 1000})


def test_good_overrides_still_pass_the_checks():
    cfg = E.resolve_model("llama-2-7b", None).config
    api.check_config_overrides(cfg, {"num_hidden_layers": 2, "hidden_act": "gelu", "rms_norm_eps": 1e-6,
                                     "tie_word_embeddings": True, "torch_dtype": "bfloat16", "attention_dropout": 0.1,
                                     "num_key_value_heads": None, "rope_theta": 500000.0,
                                     "pad_token_id": 0, "eos_token_id": [1, 2]})


# ---------------------------------------------------------------- the CLI: one line on stderr, exit 2


def _run(argv, capsys):
    """``memlab ARGV`` in-process: (exit code, stderr lines)."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()


FLAG_VALUES = ["nan", "inf", "1" * 400, "-1", "", "nope", "1.5", "true"]
FLAGS = {"--batch-size": (), "--seq-len": (), "--dtype": (), "--optimizer": (), "--optimizer-impl": (), "--loss": (),
         "--attn": (), "--device": (), "--gpu": (), "--world-size": (), "--zero-stage": (), "--adapter": (),
         "--lora-r": (), "--lora-alpha": ("1.5",), "--lora-dropout": (), "--adapter-dtype": (), "--step": (),
         "--collator": (), "--shuffle-seed": (),
         # free-form names (the model's layers), checked when the model is built: only the empty one here
         "--target-modules": ("nan", "inf", "1" * 400, "-1", "nope", "1.5", "true")}


@pytest.mark.parametrize("flag,value", [pytest.param(f, v, id=f"{f}={v[:8]}") for f, skip in FLAGS.items()
                                        for v in FLAG_VALUES if v not in skip])
def test_cli_refuses_every_bad_flag_in_one_line(flag, value, capsys):
    extra = ["--adapter", "lora"] if flag in ("--lora-r", "--lora-alpha", "--lora-dropout", "--adapter-dtype",
                                              "--target-modules") else []
    code, err = _run(["estimate", "llama-2-7b", "--seq-len", "8", *extra, flag, value], capsys)
    assert code == 2 and len(err) == 1, err
    name = flag.lstrip("-").replace("-", "_")
    assert flag in err[0] or f"{name}=" in err[0] or name == "attn" and "attn_implementation" in err[0], err


SET_VALUES = ["NaN", "Infinity", "-Infinity", "1" * 400, "-1", '""', '"nope"', "2.5", '"100"', "true", '"no"', "[1]"]


@pytest.mark.parametrize("source", ["preset", "config.json", "hub id"])
@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "vocab_size", "tie_word_embeddings",
                                 "hidden_act", "rms_norm_eps", "torch_dtype"])
def test_cli_set_is_checked_by_memlabs_rules_for_every_source(sources, source, key, capsys):
    for value in SET_VALUES:
        if key == "tie_word_embeddings" and value == "true":
            continue
        code, err = _run(["estimate", sources[source], "--seq-len", "8", "--set", f"{key}={value}"], capsys)
        assert code == 2 and len(err) == 1 and f"--set {key}=" in err[0] and "allowed" in err[0], (value, err)


def test_plan_set_refuses_what_no_config_holds_in_one_line(capsys):
    """memlab plan's --set has the same parser: NaN, Infinity and numbers no float holds are one line, exit 2."""
    for value in ("NaN", "Infinity", "-Infinity", "1e400"):
        code, err = _run(["plan", "llama-2-7b", "--batch-size", "1", "--seq-len", "8", "--set", f"hidden_size={value}"],
                         capsys)
        assert code == 2 and len(err) == 1 and "--set hidden_size=" in err[0], err
