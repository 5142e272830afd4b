"""``memlab plan``'s output (issue 40.5): the parameter count in human units, a rank column that follows the rows,
a legend for every column, a plain statement of whose cost model ranks a CPU plan, and plan()'s arguments
checked with memlab.core.validation's one error format."""
from __future__ import annotations

import re

import pytest

from memlab import plan as P
from memlab.cli import plan as plan_cli
from memlab.models import tiny_llama_config
from memlab.plan.result import COLUMNS, format_count

SEQ = 32
NARROW = ["--allow", "precision=fp32", "--allow", "optimizer=adamw", "--allow", "adapter=full"]


@pytest.fixture(autouse=True)
def _trace_cache_in_tmp(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MEMLAB_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "memlab-traces"))


def tiny_cfg():
    return tiny_llama_config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def cli_out(tmp_path_factory):
    """The CLI on a tiny config file, for the CPU, at a budget some stacks fit and some do not, every row printed."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MEMLAB_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "memlab-traces"))
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    tiny_cfg().to_json_file(str(path))
    import contextlib
    import io

    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            code = plan_cli.main([str(path), "--budget", "1000000", "--batch-size", "4", "--seq-len", str(SEQ), "--device",
                                  "cpu", "--no-progress", "--all", "--top", "3", *NARROW])
    finally:
        mp.undo()
    return code, buf.getvalue()


def test_counts_in_human_units():
    assert format_count(871_552) == "871.55k"
    assert format_count(8_030_261_248) == "8.03B" and format_count(124_439_808) == "124.44M"
    assert format_count(999) == "999" and format_count(70_553_706_496) == "70.55B"


def test_the_parameter_count_is_printed_in_human_units(cli_out):
    code, out = cli_out
    n = sum(p.numel() for p in __import__("transformers").LlamaForCausalLM(tiny_cfg()).parameters())
    assert code == 0, out
    assert f"({format_count(n)} params)" in out.splitlines()[0] and n < 10**6
    assert "0.00B params" not in out


def _table(out):
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("rank "))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.strip() or ln.startswith("..."):
            break
        rows.append(ln)
    return lines[start], rows


def test_rank_follows_the_row_order(cli_out):
    _, out = cli_out
    header, rows = _table(out)
    assert header.split()[:2] == ["rank", "id"]
    ranks = [r.split()[0] for r in rows]
    fits = [" yes " in r for r in rows]
    assert sum(fits) >= 2 and not all(fits)  # the budget splits the candidates
    # the stacks that fit come first, ranked 1, 2, 3, ... in the order printed; the others have no rank
    assert ranks[:sum(fits)] == [str(i) for i in range(1, sum(fits) + 1)] and all(fits[:sum(fits)])
    assert set(ranks[sum(fits):]) == {"-"}
    # the pick is rank 1
    pick = re.search(r"^pick: (.*?): ", out, re.M).group(1)
    assert pick in rows[0]


def test_every_column_is_explained(cli_out):
    _, out = cli_out
    header, _ = _table(out)
    legend = out[out.index("columns:"):].splitlines()[1:len(COLUMNS) + 1]
    assert list(COLUMNS) == re.split(r"\s{2,}", header.strip())  # the table's columns are COLUMNS
    assert [next((c for c in COLUMNS if ln.strip().startswith(c + " ")), None) for ln in legend] == list(COLUMNS)
    stack_line = next(ln for ln in legend if ln.strip().startswith("stack"))
    assert "'mb MxA': micro-batches of M sequences, A accumulated per optimizer step" in stack_line
    assert "'ckpt 1/k': every k-th block" in stack_line
    peak_line = next(ln for ln in legend if ln.strip().startswith("peak"))
    assert "the traced tensor peak" in peak_line  # the CPU's quantity, not the CUDA reserved estimate


def test_a_cpu_plan_says_its_costs_are_a_gpus(cli_out):
    _, out = cli_out
    costs = next(ln for ln in out.splitlines() if ln.startswith("costs: "))
    assert "the cost model is a GPU's (memlab has none for a CPU)" in costs and "H100" in costs
    assert "name a card with gpu=" not in out  # a card cannot be named with --device cpu
    res = P.plan(tiny_cfg(), "1GiB", batch_size=2, seq_len=SEQ, device="cpu", lora_r=4, top=1,
                 allow={"precision": ["fp32"], "optimizer": ["adamw"], "adapter": ["full"], "micro_batch": [2],
                        "checkpointing": ["none"]})
    assert "a GPU's" in res.cost_basis
    gpu = P.plan(tiny_cfg(), gpu="rtx4090", batch_size=2, seq_len=SEQ, lora_r=4, top=1,
                 allow={"precision": ["bf16-mixed"], "optimizer": ["adamw"], "adapter": ["full"], "micro_batch": [2],
                        "checkpointing": ["none"]})
    assert gpu.cost_basis == "GeForce RTX 4090's constants"


@pytest.mark.parametrize("kwargs,match", [
    (dict(progress="yes"), r"progress='yes' is invalid; allowed: True or False"),
    (dict(prune=1), r"prune=1 is invalid; allowed: True or False"),
    (dict(cost="h100"), r"cost='h100' is invalid; allowed: a memlab.plan.CostModel"),
    (dict(config_overrides=["num_hidden_layers"]), r"config_overrides=\['num_hidden_layers'\] is invalid; allowed: a dict"),
    (dict(gpu=4090, device="cuda"), r"gpu=4090 is invalid; allowed: a card name"),
    (dict(budget=1.5), r"budget=1.5 is invalid; allowed: bytes \(an int\)"),
    (dict(host_budget=True), r"host_budget=True is invalid; allowed: bytes"),
    (dict(top=0), r"top=0 is invalid; allowed: an int >= 1"),
    (dict(lora_r=True), r"lora_r=True is invalid; allowed: an int >= 1"),
])
def test_arguments_are_checked_before_any_work(kwargs, match, monkeypatch):
    import memlab.plan.planner as planner

    def no_work(*a, **k):
        raise AssertionError("resolved a model before checking the arguments")

    monkeypatch.setattr(planner, "resolve_config", no_work)
    args = dict(budget="1GiB", batch_size=4, seq_len=SEQ, device="cpu")
    args.update(kwargs)
    budget = args.pop("budget")
    with pytest.raises(ValueError, match=match):
        P.plan(tiny_cfg(), budget, **args)
