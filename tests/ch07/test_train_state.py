"""memlab.train.state (was memlab.train.state): one safetensors file, atomic, verified; a killed writer never leaves a torn checkpoint."""
from __future__ import annotations

import os
import random
import signal
import sys
import time

import pytest
import torch

from memlab.train import state as ckpt
from memlab.train.state import CheckpointError


def _state(k: int = 0) -> dict:
    torch.manual_seed(k)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(4, 6)).sum().backward()
    opt.step()
    return {"step": k, "model": m.state_dict(), "optimizer": opt.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "misc": {"bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16), "empty": torch.empty(0, 3),
                     "mask": torch.tensor([True, False]), "tuple": (1, 2.5, "x", None), "nan": float("nan")}}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


def test_roundtrip_keeps_every_value_type_and_key(tmp_path):
    st = _state(3)
    p = ckpt.save(st, tmp_path / "a.safetensors")
    back = ckpt.load(p)
    assert _same(st, back)
    assert list(back["optimizer"]["state"]) == [0, 1, 2, 3]  # int keys stay ints
    # the optimizer accepts its state back and the RNG state restores
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    torch.optim.AdamW(m.parameters()).load_state_dict(back["optimizer"])
    random.setstate(back["rng"]["python"])
    assert not ckpt.temp_files(tmp_path)


def test_files_load_with_the_safetensors_package(tmp_path):
    st_torch = pytest.importorskip("safetensors.torch")
    st = _state(1)
    p = ckpt.save(st, tmp_path / "a.safetensors")
    tensors = st_torch.load_file(str(p))
    assert torch.equal(tensors["model.0.weight"], st["model"]["0.weight"])
    assert torch.equal(tensors["misc.bf16"], st["misc"]["bf16"])


def test_truncated_files_are_rejected_naming_the_file(tmp_path):
    good = tmp_path / "good.safetensors"
    ckpt.save(_state(2), good)
    data = good.read_bytes()
    bad = tmp_path / "bad.safetensors"
    cuts = sorted({0, 1, 7, 8, 9, 50, len(data) // 3, len(data) // 2, len(data) - 100, len(data) - 1}
                  | set(random.Random(0).sample(range(len(data)), 20)))
    for cut in cuts:
        bad.write_bytes(data[:cut])
        with pytest.raises(ckpt.CheckpointError, match="bad.safetensors.*refusing to load"):
            ckpt.load(bad)
    bad.write_bytes(data + b"\0")
    with pytest.raises(ckpt.CheckpointError, match="trailing"):
        ckpt.load(bad)


def test_corrupted_files_are_rejected(tmp_path):
    good = tmp_path / "good.safetensors"
    ckpt.save(_state(2), good)
    data = good.read_bytes()
    hlen = int.from_bytes(data[:8], "little")
    rng = random.Random(1)
    # a bit flipped in the header (tensor table, state JSON, checksum) or in the tensor bytes
    positions = [9, 20, 8 + hlen // 2, 8 + hlen - 10, 8 + hlen + 1, len(data) - 1] + \
        [rng.randrange(8, len(data)) for _ in range(20)]
    bad = tmp_path / "bad.safetensors"
    rejected = 0
    for pos in positions:
        b = bytearray(data)
        b[pos] ^= 1 << rng.randrange(8)
        if data[pos:pos + 1] == b" " and pos < 8 + hlen:  # the header's padding: flipping it may still be a space
            continue
        bad.write_bytes(bytes(b))
        with pytest.raises(ckpt.CheckpointError, match="bad.safetensors"):
            ckpt.load(bad)
        rejected += 1
    assert rejected >= 20


def test_a_pickle_is_never_unpickled(tmp_path):
    p = tmp_path / "pickle.pt"
    torch.save({"w": torch.ones(3)}, p)
    with pytest.raises(ckpt.CheckpointError, match="pickle.pt"):
        ckpt.load(p)


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    p = tmp_path / "c.safetensors"
    ckpt.save(_state(0), p)
    before = p.read_bytes()

    def chunks():
        yield b"partial"
        raise OSError("disk full (simulated)")

    with pytest.raises(OSError, match="disk full"):
        ckpt.atomic_write(p, chunks())
    assert p.read_bytes() == before
    assert not ckpt.temp_files(tmp_path)


def _fork(child) -> int:
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 0
        try:
            child()
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    return pid


needs_fork = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs os.fork (Linux)")


@needs_fork
def test_kill_9_mid_write_at_a_known_point_leaves_the_good_file(tmp_path):
    p = tmp_path / "c.safetensors"
    ckpt.save({"k": 0, "w": torch.zeros(1000)}, p)
    chunks = ckpt.serialize({"k": 1, "w": torch.ones(1000)})

    def child():
        def gen():
            yield chunks[0]
            os.kill(os.getpid(), signal.SIGKILL)  # dies after the header, before the tensor bytes
            yield from chunks[1:]

        ckpt.atomic_write(p, gen())

    _, status = os.waitpid(_fork(child), 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert len(ckpt.temp_files(tmp_path)) == 1  # the torn temp file is there ...
    assert ckpt.load(p)["k"] == 0  # ... and the checkpoint is the old, complete one
    assert ckpt.remove_stale_temps(tmp_path) == 1


@needs_fork
def test_kill_9_at_random_points_always_leaves_a_complete_checkpoint(tmp_path):
    """20 writers killed at random instants while saving in a loop: the file under the name is
    always a complete checkpoint of some step (never torn), and most kills hit a write."""
    p = tmp_path / "c.safetensors"
    n = 256 * 1024  # 1 MiB of float32 per checkpoint
    mid_write = 0
    last_seen = -1
    rng = random.Random(7)
    for trial in range(20):
        def child():
            for k in range(trial * 10**6, (trial + 1) * 10**6):
                ckpt.save({"k": k, "w": torch.full((n,), float(k % 4096)), "tail": [k] * 3}, p)

        pid = _fork(child)
        time.sleep(rng.uniform(0.002, 0.08))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status), f"trial {trial}: the writer exited by itself ({status})"
        mid_write += bool(ckpt.temp_files(tmp_path))
        ckpt.remove_stale_temps(tmp_path)
        if p.exists():  # nothing yet if the first save had not finished: that is allowed
            st = ckpt.load(p)  # must not raise
            k = st["k"]
            assert torch.equal(st["w"], torch.full((n,), float(k % 4096))) and st["tail"] == [k] * 3
            assert k >= last_seen
            last_seen = k
    assert mid_write >= 1, "no kill landed during a write: the test did not test anything"
    print(f"kill -9 trials: 20, killed mid-write: {mid_write}, torn checkpoints loaded: 0")


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="model.w.*set"):
        ckpt.save({"model": {"w": {1, 2}}}, tmp_path / "x")
    with pytest.raises(TypeError, match="dtype"):
        ckpt.save({"w": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.save({"a": 1}, tmp_path / "nope" / "x")
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        ckpt.load(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="not a file name"):
        ckpt.atomic_write(tmp_path / "..", [b""])


def test_hostile_headers_are_checkpoint_errors(tmp_path):
    import struct

    def file(name, header: bytes, body=b""):
        p = tmp_path / name
        p.write_bytes(struct.pack("<Q", len(header)) + header + body)
        return p

    nested = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(CheckpointError, match=r"deep\.safetensors: malformed header \(JSON nested too deeply"):
        ckpt.load(file("deep.safetensors", nested))
    # a valid safetensors file of other content (no memlab metadata)
    other = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    with pytest.raises(CheckpointError, match=r"other\.safetensors: not a memlab checkpoint"):
        ckpt.load(file("other.safetensors", other, b"\0" * 4))
    with pytest.raises(CheckpointError, match=r"adir: unreadable"):
        (tmp_path / "adir").mkdir()
        ckpt.load(tmp_path / "adir")


def test_iter_checkpoints_orders_by_step_number(tmp_path):
    for name in ("step-99999999.safetensors", "step-100000000.safetensors", "step-00000002.safetensors"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "step-x.safetensors").mkdir()  # not a file: not listed
    assert [p.name for p in ckpt.iter_checkpoints(tmp_path)] == [
        "step-100000000.safetensors", "step-99999999.safetensors", "step-00000002.safetensors"]
