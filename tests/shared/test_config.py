"""memlab.config and memlab.core.env: MEMLAB_DEVICE / MEMLAB_SMALL parsed once, in one error format."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memlab.core import env


@pytest.mark.parametrize("raw,device_type,small", [
    (None, "cpu", True), (None, "cuda", False),
    ("1", "cuda", True), (" Yes ", "cuda", True), ("on", "cpu", True),
    ("0", "cuda", False), ("false", "cpu", True), ("", "cuda", False), ("OFF", "cuda", False),
])
def test_parse_small(raw, device_type, small):
    assert env.parse_small(raw, device_type=device_type) is small


def test_parse_small_refuses_other_words():
    with pytest.raises(ValueError, match=r"^MEMLAB_SMALL='maybe' is invalid; allowed: 1/0, true/false, yes/no, on/off$"):
        env.parse_small("maybe", device_type="cpu")


def test_parse_device():
    assert env.parse_device(None, cuda_available=False) == torch.device("cpu")
    assert env.parse_device("  ", cuda_available=True) == torch.device("cuda")
    assert env.parse_device("cpu", cuda_available=True) == torch.device("cpu")
    assert env.parse_device("cuda:1", cuda_available=True) == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"^MEMLAB_DEVICE='gpu0' is invalid; allowed: a device torch understands"):
        env.parse_device("gpu0", cuda_available=True)
    with pytest.raises(ValueError, match=r"^MEMLAB_DEVICE='cuda' is invalid; allowed: 'cpu' \(it asks for CUDA"):
        env.parse_device("cuda", cuda_available=False)


def test_read_env_reads_the_mapping_it_is_given():
    assert env.read_env({}, cuda_available=False) == (torch.device("cpu"), True)
    assert env.read_env({"MEMLAB_DEVICE": "cuda"}, cuda_available=True) == (torch.device("cuda"), False)
    assert env.read_env({"MEMLAB_DEVICE": "cuda", "MEMLAB_SMALL": "1"}, cuda_available=True) == (torch.device("cuda"), True)


def test_memlab_core_env_imports_without_torch():
    """doctor reports on the variables where torch is broken or missing: the module must not need it to import."""
    code = ("import sys\nsys.modules['torch'] = None\nfrom memlab.core import env\n"
            "assert env.parse_small('1', device_type='cpu') is True\nprint('ok')")
    utils = str(Path(env.__file__).resolve().parents[2])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": utils})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-1500:]


@pytest.mark.parametrize("var,value,message", [
    ("MEMLAB_SMALL", "maybe", "MEMLAB_SMALL='maybe' is invalid"),
    ("MEMLAB_DEVICE", "gpu0", "MEMLAB_DEVICE='gpu0' is invalid"),
])
def test_import_memlab_config_refuses_a_bad_value(var, value, message):
    utils = str(Path(env.__file__).resolve().parents[2])
    r = subprocess.run([sys.executable, "-c", "import memlab.config"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": utils, var: value})
    assert r.returncode != 0 and message in r.stderr


def test_config_uses_the_shared_parser():
    import memlab.config as config

    assert config.read_env is env.read_env and config.parse_small is env.parse_small
    assert (config.DEVICE, config.SMALL) == env.read_env()


def test_seed_everything_refuses_a_negative_seed():
    from memlab.config import seed_everything

    with pytest.raises(ValueError, match=r"^seed=-1 is invalid; allowed: an int >= 0$"):
        seed_everything(-1)
