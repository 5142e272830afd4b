"""The speed paths of ``memlab estimate`` give the answers of the slow ones (issue 42, point 1).

* A fake trace of 8-bit AdamW runs :class:`memlab.estimate.optim.AdamW8bitLayout` (bitsandbytes' state layout,
  without importing bitsandbytes): its state equals bitsandbytes' own ``AdamW8bit``'s tensor by tensor, and every
  number of an estimate equals the one traced with bitsandbytes' optimizer, on every preset family, on CUDA targets
  (the caching allocator's replay included) and on a CPU, with checkpointing and with the optimizer in backward.
* The suggestions traced in two processes (:func:`memlab.estimate.suggest.suggestions`, ``jobs=2``) are the rows
  traced in one, and a child that fails leaves its rows to the parent.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memlab.estimate import estimate_training_memory, optim, suggest
from memlab.estimate.recipes import BNB_BLOCKSIZE, BNB_MIN_8BIT_SIZE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from estimate_golden import numbers  # noqa: E402

bnb = pytest.importorskip("bitsandbytes")

#: small dimensions of each preset family (8 layers: extrapolated by depth from traces at 3, 4 and 5)
SMALL = {
    "llama-2-7b": dict(num_hidden_layers=8, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=1000),
    "mistral-7b": dict(num_hidden_layers=8, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1000),
    "qwen2.5-0.5b": dict(num_hidden_layers=8, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000),
    "gpt2": dict(n_layer=8, n_embd=64, n_head=4, vocab_size=1000),
}


def _bnb_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    # the fake trace runs bitsandbytes' own AdamW8bit where it would run the layout
    monkeypatch.setattr(optim, "AdamW8bitLayout", lambda params, **kw: bnb.optim.AdamW8bit(params, **kw))


def _state(opt: torch.optim.Optimizer) -> list[list[tuple]]:
    # each parameter's state in order: (key, dtype, shape) or (key, value) for a number; and which tensors are shared
    ids: dict[int, int] = {}
    out = []
    for p in opt.param_groups[0]["params"]:
        out.append([(k, v.dtype, tuple(v.shape), ids.setdefault(id(v), len(ids))) if isinstance(v, torch.Tensor)
                    else (k, v) for k, v in opt.state[p].items()])
    return out


def test_the_layout_makes_bitsandbytes_state_tensor_by_tensor():
    # below the 8-bit threshold, at it, blocks that do not divide the size, a 2-D weight (real tensors on the CPU:
    # bitsandbytes' own step runs)
    shapes = [(10,), (BNB_MIN_8BIT_SIZE - 1,), (BNB_MIN_8BIT_SIZE,), (BNB_BLOCKSIZE * 17 + 3,), (96, 80)]
    got = {}
    for name, make in (("bitsandbytes", bnb.optim.AdamW8bit), ("layout", optim.AdamW8bitLayout)):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        opt = make(params, lr=1e-3)
        for _ in range(2):
            for p in params:
                p.grad = torch.zeros_like(p)
            opt.step()
        got[name] = _state(opt)
    assert got["layout"] == got["bitsandbytes"]
    assert [k for k, *_ in got["layout"][-1]] == ["step", "state1", "qmap1", "state2", "qmap2", "absmax1", "absmax2"]
    assert got["layout"][-1][0] == ("step", 2)


@pytest.mark.parametrize("kw", [dict(amsgrad=True), dict(optim_bits=8)])
def test_the_layout_refuses_what_bitsandbytes_refuses(kw):
    params = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError):
        bnb.optim.AdamW8bit(params, **kw)
    with pytest.raises(ValueError):
        optim.AdamW8bitLayout(params, **kw)
    with pytest.raises(TypeError):
        optim.AdamW8bitLayout(params, no_such_keyword=1)


def test_a_fake_8bit_optimizer_imports_no_bitsandbytes():
    code = ("import sys, torch; from memlab.estimate.optim import make_optimizer, bitsandbytes_installed; "
            "o = make_optimizer('adamw8bit', [torch.nn.Parameter(torch.zeros(8))], fake=True); "
            "print(type(o).__name__, 'bitsandbytes' in sys.modules, bitsandbytes_installed())")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["AdamW8bitLayout", "False", "True"]


def test_a_step_with_adapters_is_made_and_checked_without_torch():
    code = ("import sys; from memlab.estimate.api import make_step; "
            "s = make_step(batch_size=1, seq_len=8, adapter='qlora', lora_r=4, adapter_dtype='bf16'); "
            "print('torch' in sys.modules, s.adapter.r, s.adapter.dtype); "
            "from memlab.estimate import adapters; import torch; print(adapters.ADAPTER_DTYPES['bf16'] is torch.bfloat16)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "4", "bf16", "True"]
    with pytest.raises(ValueError, match="adapter_dtype='int8' is invalid; allowed: 'fp32', 'bf16', 'fp16'"):
        from memlab.estimate.adapters import adapter_spec

        adapter_spec("lora", adapter_dtype="int8")


CASES = [(m, dict(batch_size=2, seq_len=64, gpu="rtx4090")) for m in SMALL] + [
    ("llama-2-7b", dict(batch_size=2, seq_len=64, checkpointing=True, gpu="rtx4090")),
    ("llama-2-7b", dict(batch_size=2, seq_len=64, optimizer_in_backward=True)),
    ("qwen2.5-0.5b", dict(batch_size=2, seq_len=64, dtype="bf16-pure")),
    ("gpt2", dict(batch_size=2, seq_len=64, device="cpu")),
    ("llama-2-7b", dict(batch_size=2, seq_len=64, device="cpu", extrapolate=False)),
]


@pytest.mark.parametrize("model,kw", CASES, ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in kw.items())}"
                                                 for m, kw in CASES])
def test_an_8bit_estimate_equals_the_one_traced_with_bitsandbytes(model, kw, monkeypatch):
    args = dict(kw, optimizer="adamw8bit", config_overrides=SMALL[model])
    layout = estimate_training_memory(model, **args)
    _bnb_traced(monkeypatch)
    traced = estimate_training_memory(model, **args)
    assert numbers(layout) == numbers(traced)
    assert layout.notes == traced.notes and layout.optimizer_impl.startswith("bitsandbytes")
    assert layout.breakdown["optimizer"] > 0


# ---- the suggestions in two processes

def _rows(rows):
    return [dataclasses.asdict(r) for r in rows]


@pytest.fixture(scope="module")
def base():
    return estimate_training_memory("llama-2-7b", batch_size=2, seq_len=64, config_overrides=SMALL["llama-2-7b"],
                                    gpu="rtx4090")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_the_suggestions_in_two_processes_are_the_rows_of_one(base):
    kw = dict(config_overrides=SMALL["llama-2-7b"], gpu="rtx4090")
    one = suggest.suggestions(base, "llama-2-7b", jobs=1, **kw)
    two = suggest.suggestions(base, "llama-2-7b", jobs=2, **kw)
    assert _rows(two) == _rows(one)
    assert len([r for r in one if r.how == "traced"]) >= 10


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_failed_child_leaves_its_rows_to_the_parent(base, monkeypatch):
    kw = dict(config_overrides=SMALL["llama-2-7b"], gpu="rtx4090")
    one = suggest.suggestions(base, "llama-2-7b", jobs=1, **kw)
    parent = os.getpid()
    real = suggest.estimate_training_memory

    def dies_in_the_child(*a, **k):
        if os.getpid() != parent:
            os._exit(3)  # as a child killed would
        return real(*a, **k)

    monkeypatch.setattr(suggest, "estimate_training_memory", dies_in_the_child)
    assert _rows(suggest.suggestions(base, "llama-2-7b", jobs=2, **kw)) == _rows(one)


def test_an_error_of_a_row_is_raised_in_the_order_tried(base, monkeypatch):
    def refuses(model, **kw):
        raise ValueError(f"refused {sorted(k for k in kw if kw[k] is True)}")

    monkeypatch.setattr(suggest, "estimate_training_memory", refuses)
    for jobs in (1, 2):  # the first row tried (checkpointing) names the error, in one process or two
        with pytest.raises(ValueError, match=r"refused \['checkpointing'\]"):
            suggest.suggestions(base, "llama-2-7b", jobs=jobs)


def test_the_split_gives_the_child_the_last_rows_about_half_the_work():
    w = [1.2, 1, 1, 2, 1, 1, 1, 1, 1, 2.5, 2.5]
    theirs = suggest._split(w)
    assert theirs == set(range(6, 11))  # the adapters stay together, in the child
    assert abs(sum(w[i] for i in theirs) - sum(w) / 2) <= max(w)
    assert suggest._split([1.0, 1.0]) == {1}


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True, "2"])
def test_jobs_is_checked(base, jobs):
    with pytest.raises(ValueError, match=rf"jobs={jobs!r} is invalid; allowed: None .* an int >= 1"):
        suggest.suggestions(base, "llama-2-7b", jobs=jobs)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_rows_read_from_the_trace_cache_are_read_in_one_process(base, tmp_path, monkeypatch):
    from memlab.estimate import trace_cache

    monkeypatch.setenv("MEMLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(trace_cache, "_DISK_CACHE", [True])
    kw = dict(config_overrides=SMALL["llama-2-7b"], gpu="rtx4090")
    first = suggest.suggestions(base, "llama-2-7b", jobs=2, **kw)  # traced in two processes, each writes its rows
    assert len(list((tmp_path / "estimates").glob("*.pkl"))) == len([r for r in first if r.how == "traced"])

    def no_fork():
        raise AssertionError("forked for rows the trace cache holds")

    monkeypatch.setattr(os, "fork", no_fork)
    assert _rows(suggest.suggestions(base, "llama-2-7b", jobs=2, **kw)) == _rows(first)


def test_the_collector_is_left_as_it_was(base):
    import gc

    before = gc.get_freeze_count()
    suggest.suggestions(base, "llama-2-7b", jobs=1, config_overrides=SMALL["llama-2-7b"], gpu="rtx4090")
    assert gc.get_freeze_count() == before


def test_an_8bit_estimate_imports_no_bitsandbytes():
    """A fake trace of 8-bit AdamW runs memlab's layout of bitsandbytes' state: bitsandbytes (about 1-2 s to import)
    stays out of the process."""
    code = ("import sys; from memlab.estimate import estimate_training_memory as E; "
            "E('llama-2-7b', batch_size=1, seq_len=64, optimizer='adamw8bit', config_overrides=dict(num_hidden_layers=2, "
            "hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)); "
            "print('bitsandbytes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1", "MEMLAB_CACHE_DIR": "none"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[-1] == "False"


def test_an_estimate_read_from_the_trace_cache_imports_no_torch(tmp_path):
    """A repeated ``memlab estimate`` of a preset answers from the trace cache without importing torch, transformers
    or peft (about 0.1 s instead of 1 s of imports), a QLoRA one included (memlab.quant's codebooks are built by the
    trace, not by resolving the model: the suggestions' QLoRA rows read from the cache the same way), and prints what
    the first run printed. (``--set`` overrides are checked against transformers' config class: that imports it.)"""
    import json

    args = ["qwen2.5-0.5b", "--adapter", "qlora", "--batch-size", "1", "--seq-len", "128"]
    code = ("import io, sys, json, contextlib; from memlab.cli.estimate import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out): rc = main(json.loads(sys.argv[1]))\n"
            "print(json.dumps([rc, out.getvalue(), sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'peft'))]))")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEMLAB_CACHE_DIR": str(tmp_path)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", code, json.dumps(args)], env=env, capture_output=True,
                                      text=True, check=True).stdout.splitlines()[-1]) for _ in range(2)]
    (rc1, first, mods1), (rc2, again, mods2) = runs
    assert rc1 == rc2 == 0 and "torch" in mods1 and "NF4" in first
    assert mods2 == [], mods2[:5]
    assert "read from the trace cache" in again and "read from the trace cache" not in first

    def answer(text):  # every line but the timing and the cache's own note
        return [ln for ln in text.splitlines() if not ln.startswith("estimated in") and "trace cache" not in ln]

    assert answer(again) == answer(first)
