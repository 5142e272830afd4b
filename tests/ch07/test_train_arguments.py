"""memlab.train (issue 41.3): every argument of BudgetTrainer, train and run_step gets a bad value of each kind
(wrong type, bool, nan, inf, huge int, negative, empty, unknown string) and is refused with a ValueError or
TypeError in memlab's one format, naming it, before any work: no seed set, no model built, no directory
made, no step run."""
from __future__ import annotations

import re

import pytest
import torch

from memlab.models import TinyGPT, TinyGPTConfig
from memlab.plan import Stack
from memlab.train import BudgetTrainer

CFG = dict(block_size=16, n_layer=1, n_head=2, n_embd=16)
E, T = 4, 16
A = Stack(micro_batch=4, grad_accum=1)
NAN, INF = float("nan"), float("inf")
HUGE = 10**400  # larger than any float: float(HUGE) raises OverflowError

# argument -> bad values, one of each kind that applies
BAD: dict[str, list] = {
    "model": [5, "gpt2", True, [], {"n_layer": 2}],
    "budget": ["", "lots", "nan GiB", "inf MiB", "-5 MiB", "1e300 GiB", 0, -1, True, NAN, INF, HUGE, 2**63, 1.5, [1]],
    "stacks": [[], "A", 5, True, None, [5], [A, "B"]],
    "data": [5, "corpus", True, torch.zeros(400), torch.zeros(20, 20, dtype=torch.long),
             torch.zeros(5, dtype=torch.long), torch.zeros(400, dtype=torch.bool)],
    "effective_batch": [0, -1, True, NAN, INF, HUGE, 10**30, 4.0, "4", None],
    "seq_len": [0, -1, True, NAN, INF, HUGE, 10**30, 16.0, "16", None, 17],  # 17 > the model's block_size
    "ckpt_dir": [5, True, "", "  ", b"dir", [], NAN, "a\0b", "<file>"],
    "seed": [NAN, INF, 10**30, HUGE, -1, 1.5, True, "0", None, 2**32],
    "lr": [HUGE, INF, -INF, NAN, 0, -1e-3, True, "1e-3", None, [1e-3]],
    "weight_decay": [HUGE, INF, NAN, -0.1, True, "0", None],
    "ckpt_interval": [0, -1, HUGE, 10**30, NAN, INF, True, "1", 1.0, None],
    "keep": [1, 0, -2, HUGE, 10**30, NAN, True, 2.0, "2", None],
    "progress": ["no", "", 1, 0, NAN, None, [True]],
    "fresh": ["no", "yes", 1, NAN, None],
}
CASES = [(name, v) for name, values in BAD.items() for v in values]


def _id(case) -> str:
    name, v = case
    text = f"<tensor {tuple(v.shape)} {v.dtype}>" if isinstance(v, torch.Tensor) else repr(v)
    return f"{name}={text[:30]}"


def model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(TinyGPTConfig(**CFG))


@pytest.fixture
def no_work(monkeypatch):
    """Any work at all fails the test: seeding, building a model, making the directory."""
    import memlab.config
    import memlab.models

    def work(*a, **k):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(memlab.config, "seed_everything", work)
    monkeypatch.setattr(memlab.models, "TinyGPTConfig", work)
    monkeypatch.setattr("pathlib.Path.mkdir", work)


def _named(exc: BaseException, name: str) -> None:
    msg = str(exc)
    assert re.search(rf"(^|\W){re.escape(name)}(\W|$)", msg), f"{name} not named in: {msg}"
    assert "allowed" in msg or "expected" in msg, f"no word of what is allowed in: {msg}"
    assert "\n" not in msg


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_every_trainer_argument_is_refused_naming_it_before_any_work(case, tmp_path, no_work):
    name, value = case
    m = model()
    kwargs = dict(model=m, budget=None, stacks=[A], effective_batch=E, seq_len=T, ckpt_dir=tmp_path / "ck")
    if isinstance(value, str) and value == "<file>":
        value = tmp_path / "a-file"
        value.write_text("not a directory")
    kwargs[name] = value
    with pytest.raises((ValueError, TypeError)) as err:
        BudgetTrainer(**kwargs)
    _named(err.value, name)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("bad", [-1, True, NAN, INF, HUGE, 2**63, 1.5, "3", None, []])
@pytest.mark.parametrize("method", ["train", "run_step"])
def test_train_and_run_step_refuse_bad_step_counts_before_any_step(tmp_path, method, bad):
    t = BudgetTrainer(model(), None, stacks=[A], effective_batch=E, seq_len=T, ckpt_dir=tmp_path)
    before = [p.detach().clone() for p in t.model.parameters()]
    name = "steps" if method == "train" else "step"
    with pytest.raises((ValueError, TypeError)) as err:
        getattr(t, method)(bad)
    _named(err.value, name)
    assert not list(tmp_path.glob("step-*.safetensors")) and t.step == 0  # no checkpoint, no step
    assert all(torch.equal(a, b) for a, b in zip(before, t.model.parameters()))


def test_the_default_model_bounds_seq_len_and_the_step_bounds_its_tokens(no_work):
    with pytest.raises(ValueError, match=r"seq_len=100000 is invalid; allowed: an int from 1 to 4,096 for the "
                                         r"default model"):
        BudgetTrainer(None, None, stacks=[A], effective_batch=E, seq_len=100_000)
    big = Stack(micro_batch=2**20, grad_accum=1)
    with pytest.raises(ValueError, match=r"effective_batch=1048576 is invalid; allowed: effective_batch x seq_len <= "
                                         r"2,147,483,648 tokens"):
        BudgetTrainer(None, None, stacks=[big], effective_batch=2**20, seq_len=4096)


def test_the_messages_read_as_the_one_format():
    with pytest.raises(ValueError, match=r"^lr=1000+\.\.\. is invalid; allowed: a finite number > 0$"):
        BudgetTrainer(model(), None, stacks=[A], effective_batch=E, seq_len=T, lr=HUGE)
    with pytest.raises(ValueError, match=r"^progress='no' is invalid; allowed: True or False$"):
        BudgetTrainer(model(), None, stacks=[A], effective_batch=E, seq_len=T, progress="no")
    with pytest.raises(TypeError, match=r"^ckpt_dir=5 is invalid; allowed: None, or a directory path"):
        BudgetTrainer(model(), None, stacks=[A], effective_batch=E, seq_len=T, ckpt_dir=5)
    with pytest.raises(ValueError, match=r"^seed=1000000000000000000000000000000 is invalid; allowed: an int from 0 "
                                         r"to 4,294,967,295$"):
        BudgetTrainer(model(), None, stacks=[A], effective_batch=E, seq_len=T, seed=10**30)
    with pytest.raises(ValueError, match=r"^budget=1000+\.\.\. is invalid; allowed: None, an int number"):
        BudgetTrainer(model(), HUGE, stacks=[A], effective_batch=E, seq_len=T)
