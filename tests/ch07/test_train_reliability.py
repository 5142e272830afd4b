"""memlab.train, issue 41 (points 2 and 3): crafted tensor tables are CheckpointErrors and the trainer
falls back to the newest valid checkpoint; a checkpoint of another model config is refused naming the
difference; one trainer per directory (lock file); token ids checked against the vocabulary at start;
every BudgetTrainer argument refused before any work, naming it."""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
import warnings

import pytest
import torch

from memlab.models import TinyGPT, TinyGPTConfig
from memlab.plan import Stack
from memlab.train import BudgetTrainer
from memlab.train import state as ckpt
from memlab.train.lock import LOCK_NAME, DirectoryInUseError
from memlab.train.resume import ForeignCheckpointError
from memlab.train.state import CheckpointError

CFG = dict(block_size=16, n_layer=1, n_head=2, n_embd=16)
E, T = 4, 16
B = Stack(micro_batch=2, grad_accum=2)
RESUMED_MUTANTS = 15  # accepted mutated states that the test resumes and trains (all 60 do)
needs_fork = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs os.fork (Linux)")


def model(**over) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(TinyGPTConfig(**{**CFG, **over}))


def trainer(d, m=None, **kw) -> BudgetTrainer:
    return BudgetTrainer(m if m is not None else model(), None, stacks=[B], effective_batch=E, seq_len=T,
                         ckpt_dir=d, **kw)


# ----------------------------------------------------------------------------- crafted files
def _signed(table: dict, state_json: str, body: bytes) -> bytes:
    """A file whose checksum is right for whatever ``table`` holds: what a crafted (or foreign) file looks
    like to the reader -- the SHA-256 is over the file's own header, so it only proves the bytes unchanged."""
    meta = {"memlab.format": ckpt.FORMAT, "memlab.state": state_json}
    canonical = json.dumps({**table, "__metadata__": meta}, sort_keys=True, separators=(",", ":"),
                           ensure_ascii=True).encode()
    digest = hashlib.sha256(canonical)
    digest.update(body)
    raw = json.dumps({"__metadata__": {**meta, "memlab.sha256": digest.hexdigest()}, **table},
                     separators=(",", ":")).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _split(data: bytes) -> tuple[dict, str, bytes]:
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + hlen])
    meta = header.pop("__metadata__")
    return header, meta["memlab.state"], data[8 + hlen:]


ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
STATE = json.dumps({"w": {"__tensor__": "w"}})
# (what, the entry of tensor "w") -- every one a table a reader must refuse
BAD_ENTRIES = [
    ("a list as a dtype", {**ENTRY, "dtype": ["F32"]}),
    ("a dict as a dtype", {**ENTRY, "dtype": {"F32": 1}}),
    ("a number as a dtype", {**ENTRY, "dtype": 5}),
    ("an unknown dtype", {**ENTRY, "dtype": "F33"}),
    ("no dtype", {"shape": [2], "data_offsets": [0, 8]}),
    ("no shape", {"dtype": "F32", "data_offsets": [0, 8]}),
    ("no data_offsets", {"dtype": "F32", "shape": [2]}),
    ("an extra key", {**ENTRY, "extra": 1}),
    ("a negative dimension", {**ENTRY, "shape": [-2]}),
    ("a bool dimension", {**ENTRY, "shape": [True, 2]}),
    ("a float dimension", {**ENTRY, "shape": [2.0]}),
    ("a string shape", {**ENTRY, "shape": "2"}),
    ("a 4000-digit dimension", {**ENTRY, "shape": [10**3999]}),
    ("65 dimensions", {**ENTRY, "shape": [1] * 64 + [2]}),
    ("an empty tensor of 2**80 nominal elements", {**ENTRY, "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}),
    ("negative offsets", {**ENTRY, "data_offsets": [-8, 0]}),
    ("reversed offsets", {**ENTRY, "data_offsets": [8, 0]}),
    ("one offset", {**ENTRY, "data_offsets": [0]}),
    ("three offsets", {**ENTRY, "data_offsets": [0, 8, 8]}),
    ("string offsets", {**ENTRY, "data_offsets": ["0", "8"]}),
    ("a huge offset", {**ENTRY, "data_offsets": [0, 10**30]}),
    ("offsets beyond the file", {**ENTRY, "shape": [4], "data_offsets": [0, 16]}),
    ("a list entry", [1, 2]),
    ("a string entry", "F32"),
    ("a null entry", None),
    ("a deeply nested entry", json.loads("[" * 500 + "]" * 500)),
]


@pytest.mark.parametrize("what,entry", BAD_ENTRIES, ids=[w for w, _ in BAD_ENTRIES])
def test_a_malformed_tensor_table_is_a_checkpoint_error(tmp_path, what, entry):
    p = tmp_path / "crafted.safetensors"
    p.write_bytes(_signed({"w": entry}, STATE, b"\0" * 8))
    for read in (ckpt.load, ckpt.read_state_json):
        with pytest.raises(CheckpointError, match=r"crafted\.safetensors.*refusing to load"):
            read(p)


def test_a_5000_digit_dimension_is_a_checkpoint_error(tmp_path):
    """More digits than Python converts to an int (sys.get_int_max_str_digits): json.loads raises a
    ValueError that is not a JSONDecodeError."""
    p = tmp_path / "digits.safetensors"
    raw = b'{"__metadata__":{"memlab.format":"memlab.train.state/1","memlab.state":"{}"},"w":{"dtype":"F32",' \
          b'"shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}'
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(CheckpointError, match=r"digits\.safetensors: corrupted header"):
        ckpt.load(p)


def test_overlapping_or_gapped_byte_ranges_are_refused(tmp_path):
    p = tmp_path / "ranges.safetensors"
    state = json.dumps({"a": {"__tensor__": "a"}, "b": {"__tensor__": "b"}})
    for ranges, size in (([[0, 8], [0, 8]], 8), ([[0, 8], [16, 24]], 24)):
        table = {n: {"dtype": "F32", "shape": [2], "data_offsets": r} for n, r in zip("ab", ranges)}
        p.write_bytes(_signed(table, state, b"\0" * size))
        with pytest.raises(CheckpointError, match="overlap or leave a gap"):
            ckpt.load(p)


def test_random_mutations_of_a_real_table_never_escape_as_another_error(tmp_path):
    """300 crafted files: a real checkpoint's table with one field replaced by a hostile JSON value and
    the checksum recomputed. Each loads (a harmless change) or raises CheckpointError, nothing else."""
    good = tmp_path / "good.safetensors"
    ckpt.save({"m": {"w": torch.randn(3, 2), "b": torch.zeros(2, dtype=torch.bfloat16)}, "k": [1, 2]}, good)
    table, state_json, body = _split(good.read_bytes())
    hostile = [None, True, False, -1, 0, 1, 2**63, 10**40, 1.5, float("nan"), "", "F32", "BF16", [], [0], [-1, 2],
               [0, 0], [[1]], {}, {"dtype": "F32"}, [2**31, 2**31, 0], list(range(70)), "x" * 300]
    rng = random.Random(41)
    p = tmp_path / "mutant.safetensors"
    outcomes = {"refused": 0, "loaded": 0}
    for _ in range(300):
        t = json.loads(json.dumps(table))
        name = rng.choice(sorted(t))
        field = rng.choice(["dtype", "shape", "data_offsets", "<entry>", "<new key>"])
        value = rng.choice(hostile)
        if field == "<entry>":
            t[name] = value
        elif field == "<new key>":
            t[name][rng.choice(["extra", "dtype "])] = value
        elif isinstance(t[name][field], list) and t[name][field] and rng.random() < 0.5:
            t[name][field][rng.randrange(len(t[name][field]))] = value
        else:
            t[name][field] = value
        p.write_bytes(_signed(t, state_json, body))
        try:
            ckpt.load(p)
            outcomes["loaded"] += 1
        except CheckpointError:
            outcomes["refused"] += 1
    print(f"300 mutated tables: {outcomes}")
    assert outcomes["refused"] >= 250


# ----------------------------------------------------------------------------- the trainer falls back
def _poison_table(path):
    # the file's first tensor gets a list as its dtype; the checksum recomputed (the file "verifies" as bytes)
    table, state_json, body = _split(path.read_bytes())
    first = sorted(table)[0]
    table[first]["dtype"] = [table[first]["dtype"]]
    path.write_bytes(_signed(table, state_json, body))


def _resave(path, change):
    st = ckpt.load(path)
    change(st)
    ckpt.save(st, path)


MALFORMED_STATES = [
    ("a list as a tensor dtype", _poison_table),
    ("a string loss", lambda p: _resave(p, lambda s: s["losses"].__setitem__(0, "x"))),
    ("a truncated torch RNG state",
     lambda p: _resave(p, lambda s: s["rng"].__setitem__("torch", s["rng"]["torch"][:9]))),
    ("a python RNG state of the wrong length",
     lambda p: _resave(p, lambda s: s["rng"].__setitem__("python", (3, (1, 2, 3), None)))),
    ("an optimizer moment of another shape",
     lambda p: _resave(p, lambda s: s["optimizer"]["state"][0].__setitem__("exp_avg", torch.zeros(3)))),
    ("betas as a string", lambda p: _resave(p, lambda s: s["optimizer"]["param_groups"][0].__setitem__("betas", "x"))),
    ("a stack of another kind", lambda p: _resave(p, lambda s: s["stack"].__setitem__("micro_batch", "two"))),
    ("no model config", lambda p: _resave(p, lambda s: s.pop("model_config"))),
    ("a truncated file", lambda p: p.write_bytes(p.read_bytes()[:-100])),
]


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    d = tmp_path_factory.mktemp("three")
    t = trainer(d)
    losses = t.train(3)
    del t  # a trainer collected gives its directory up
    return d, losses


@pytest.mark.parametrize("what,poison", MALFORMED_STATES, ids=[w for w, _ in MALFORMED_STATES])
def test_the_trainer_falls_back_past_a_malformed_newest_checkpoint(tmp_path, three_steps, what, poison):
    src, losses = three_steps
    for f in src.glob("step-*.safetensors"):  # step 2 and step 3
        (tmp_path / f.name).write_bytes(f.read_bytes())
    poison(tmp_path / "step-00000003.safetensors")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t = trainer(tmp_path)
    assert t.step == 2 and t.losses == losses[:2]
    assert [p.name for p, _ in t.rejected] == ["step-00000003.safetensors"]
    assert [p.name for p in t.set_aside] == ["step-00000003.safetensors.corrupt"]
    assert any("step-00000003" in str(x.message) for x in w)
    assert t.train(3) == losses  # the step is re-run, bitwise


def test_random_mutations_of_a_trainer_state_are_refused_or_resume_and_train(tmp_path, three_steps):
    """300 states with one node replaced by a hostile value: each is refused as a CheckpointError or, if
    accepted, resumes and trains on -- never another exception, never a crash in a later step."""
    import copy

    from memlab.train.resume import check_trainer_state

    src, _ = three_steps
    good = ckpt.load(src / "step-00000003.safetensors")
    hostile = [None, True, -1, 0, 10**40, 1.5, float("nan"), "", "x", [], [1, "a"], {}, {"a": 1}, torch.zeros(3),
               torch.zeros(2, 2, dtype=torch.bool)]
    rng = random.Random(7)
    m = model()
    outcomes = {"accepted": 0, "another run's": 0, "malformed": 0}
    accepted = []
    for _ in range(300):
        st = copy.deepcopy(good)
        node = st
        while True:  # down a random path; replace a node on it
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            k = rng.choice(keys)
            child = node[k]
            if isinstance(child, (dict, list)) and child and rng.random() < 0.7:
                node = child
                continue
            node[k] = rng.choice(hostile)
            break
        try:
            check_trainer_state(st, model=m, effective_batch=E, seq_len=T, seed=0, where="mutant")
            outcomes["accepted"] += 1
            accepted.append(st)
        except ForeignCheckpointError:
            outcomes["another run's"] += 1
        except CheckpointError:
            outcomes["malformed"] += 1
    print(f"300 mutated trainer states: {outcomes}")
    assert outcomes["malformed"] >= 100
    for i, st in enumerate(accepted[:RESUMED_MUTANTS]):  # accepted means resumable
        d = tmp_path / f"a{i}"
        d.mkdir()
        ckpt.save(st, d / "step-00000003.safetensors")
        t = trainer(d)
        assert t.step == 3
        assert len(t.train(4)) == 4
        del t


# ----------------------------------------------------------------------------- another model's config
def test_a_4_head_checkpoint_is_refused_by_a_2_head_model_of_the_same_shapes(tmp_path):
    four, two = model(n_head=4), model(n_head=2)
    assert {k: v.shape for k, v in four.state_dict().items()} == {k: v.shape for k, v in two.state_dict().items()}
    t = trainer(tmp_path, four)
    t.train(1)
    del t
    with pytest.raises(ForeignCheckpointError) as err:
        trainer(tmp_path, two)
    msg = str(err.value)
    assert "\n" not in msg and "step-00000001.safetensors: checkpoint of another model config" in msg
    assert "n_head=4 in the checkpoint, n_head=2 in this model" in msg
    assert sorted(f.name for f in tmp_path.glob("step-*")) == ["step-00000000.safetensors",
                                                               "step-00000001.safetensors"]  # nothing touched
    assert trainer(tmp_path, model(n_head=4)).step == 1  # its own model resumes


def test_a_transformers_checkpoint_of_another_head_count_is_refused(tmp_path):
    pytest.importorskip("transformers")
    from memlab.models import tiny_llama

    def llama(heads, kv):
        torch.manual_seed(0)
        return tiny_llama(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=heads,
                          num_key_value_heads=kv)

    a, b = llama(4, 2), llama(2, 1)  # q: 4 x 8 = 2 x 16; k, v: 2 x 8 = 1 x 16: the same shapes
    assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}
    s = Stack(micro_batch=2, grad_accum=1)
    BudgetTrainer(a, None, stacks=[s], effective_batch=2, seq_len=8, ckpt_dir=tmp_path).train(1)
    with pytest.raises(ForeignCheckpointError, match=r"num_attention_heads=4 in the checkpoint, "
                                                     r"num_attention_heads=2 in this model"):
        BudgetTrainer(b, None, stacks=[s], effective_batch=2, seq_len=8, ckpt_dir=tmp_path)


# ----------------------------------------------------------------------------- one trainer per directory
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@needs_fork
def test_a_second_live_trainer_is_refused_and_the_first_ones_temp_file_survives(tmp_path):
    ready = tmp_path / "ready"
    d = tmp_path / "run"
    pid = os.fork()
    if pid == 0:  # the first trainer: opens the directory, then writes a checkpoint "for a long time"
        try:
            torch.set_num_threads(1)
            first = trainer(d)  # noqa: F841 (held: a trainer collected gives its directory up)
            (d / f".step-00000005.safetensors.tmp-{os.getpid()}-0badcafe").write_bytes(b"in flight")
            ready.write_text("ok")
            time.sleep(120)
        finally:
            os._exit(0)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ready.exists(), "the first trainer did not start"
        with pytest.raises(DirectoryInUseError) as err:
            trainer(d)
        msg = str(err.value)
        assert str(d) in msg and f"pid {pid}" in msg
        assert len(ckpt.temp_files(d)) == 1  # the second trainer removed nothing
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    t = trainer(d)  # the first one is dead: its lock is stale, taken over; its torn temp file removed
    assert t.stale_temps_removed == 1 and (d / LOCK_NAME).read_text().strip() == str(os.getpid())


@needs_fork
@pytest.mark.parametrize("start", ["no lock", "a stale lock"])
def test_of_six_processes_racing_for_a_directory_exactly_one_gets_it(tmp_path, start):
    from memlab.train.lock import DirectoryLock

    d = tmp_path / "d"
    d.mkdir()
    if start == "a stale lock":
        (d / LOCK_NAME).write_text(f"{_dead_pid()}\n")
    t0 = time.time() + 0.5
    pids = []
    for i in range(6):
        pid = os.fork()
        if pid == 0:
            try:
                while time.time() < t0:  # a simultaneous start
                    pass
                try:
                    held = DirectoryLock(d).acquire()  # noqa: F841 (collected, it would be released)
                    (tmp_path / f"{i}.won").write_text("")
                    deadline = time.monotonic() + 60
                    while len(list(tmp_path.glob("*.won")) + list(tmp_path.glob("*.lost"))) < 6 and \
                            time.monotonic() < deadline:
                        time.sleep(0.01)  # hold it until every other one has tried
                except DirectoryInUseError:
                    (tmp_path / f"{i}.lost").write_text("")
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    assert len(list(tmp_path.glob("*.won"))) == 1 and len(list(tmp_path.glob("*.lost"))) == 5
    assert not list(d.glob(LOCK_NAME + ".*"))  # no takeover guard left behind


def test_stale_locks_are_taken_over(tmp_path):
    dead = _dead_pid()
    (tmp_path / LOCK_NAME).write_text(f"{dead}\n")
    t = trainer(tmp_path)
    assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())
    t.close()
    assert not (tmp_path / LOCK_NAME).exists()
    (tmp_path / LOCK_NAME).write_text("")  # a creator killed before it wrote its pid, long ago
    os.utime(tmp_path / LOCK_NAME, (time.time() - 60, time.time() - 60))
    trainer(tmp_path).close()


@needs_fork
def test_a_zombie_holds_no_lock(tmp_path):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        time.sleep(0.2)  # exited, not reaped: os.kill(pid, 0) still finds it
        (tmp_path / LOCK_NAME).write_text(f"{pid}\n")
        trainer(tmp_path).close()
    finally:
        os.waitpid(pid, 0)


def test_in_one_process_the_newest_trainer_owns_the_directory(tmp_path):
    old = trainer(tmp_path / "a")
    new = trainer(tmp_path / "a")  # a notebook cell run again: the idle old object is superseded
    with pytest.raises(DirectoryInUseError, match="taken over by a newer BudgetTrainer"):
        old.train(1)
    assert len(new.train(1)) == 1 and new.step == 1
    # while a trainer of this process is training, another one on its directory is refused
    refusals = []

    def data(step):
        if step == 1:  # drawn inside v.train()
            try:
                trainer(tmp_path / "b")
            except DirectoryInUseError as exc:
                refusals.append(str(exc))
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, 256, (E, T + 1), generator=g)
        return x[:, :-1], x[:, 1:]

    v = trainer(tmp_path / "b", data=data)
    v.train(2)
    assert len(refusals) == 1 and f"this process (pid {os.getpid()})" in refusals[0] and "b'" in refusals[0]
    assert v.step == 2


# ----------------------------------------------------------------------------- data against the vocabulary
def test_a_corpus_id_beyond_the_vocabulary_is_refused_naming_it():
    corpus = torch.randint(0, 256, (5000,))
    corpus[1234] = 300
    with pytest.raises(ValueError, match=r"data\[1234\]=300 is invalid; allowed: token ids 0 to 255"):
        BudgetTrainer(model(), None, stacks=[B], effective_batch=E, seq_len=T, data=corpus)
    corpus[1234] = -1
    with pytest.raises(ValueError, match=r"data\[1234\]=-1 is invalid"):
        BudgetTrainer(model(), None, stacks=[B], effective_batch=E, seq_len=T, data=corpus)


def test_a_data_function_with_an_id_beyond_the_vocabulary_is_refused_naming_step_row_position():
    def data(bad_step):
        def batch(step):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, 256, (E, T + 1), generator=g)
            if step == bad_step:
                x[1, 3] = 999
            return x[:, :-1].clone(), x[:, 1:].clone()
        return batch

    with pytest.raises(ValueError, match=r"data\(0\): x\[1, 3\]=999 is invalid; allowed: token ids 0 to 255"):
        BudgetTrainer(model(), None, stacks=[B], effective_batch=E, seq_len=T, data=data(0))
    t = BudgetTrainer(model(), None, stacks=[B], effective_batch=E, seq_len=T, data=data(2))  # starts: step 0 is fine
    with pytest.raises(ValueError, match=r"data\(2\): x\[1, 3\]=999 is invalid.*vocabulary has 256 ids"):
        t.train(3)
    assert t.step == 2  # the steps before it ran

    def ignored(step):  # targets of -100 are F.cross_entropy's ignore_index: allowed
        x, y = data(-1)(step)
        y[:, 0] = -100
        return x, y

    assert len(BudgetTrainer(model(), None, stacks=[B], effective_batch=E, seq_len=T, data=ignored).train(1)) == 1
