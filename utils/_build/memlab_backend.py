"""memlab's build backend: setuptools', run on a temporary copy of utils/ for wheels and sdists.

setuptools builds in the source folder, so ``pip install ./utils`` would leave ``utils/build/``
and ``utils/memlab.egg-info/`` in the course's checkout. Here ``build_wheel``, ``build_sdist`` and
``prepare_metadata_for_build_wheel`` copy utils/ to a temporary folder first and build there;
the wheel (or sdist, or metadata) still lands where pip asks. Editable installs (``pip install -e
./utils``) build in place as setuptools always does: they need ``memlab.egg-info`` next to the
code (git-ignored). Every other hook is setuptools' own.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 -- the hooks not redefined here

_LEAVE_OUT = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")


@contextmanager
def _in_a_copy():
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="memlab-build-") as tmp:
        copy = os.path.join(tmp, "utils")
        shutil.copytree(here, copy, ignore=_LEAVE_OUT)
        os.chdir(copy)
        try:
            yield
        finally:
            os.chdir(here)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    wheel_directory = os.path.abspath(wheel_directory)
    metadata_directory = os.path.abspath(metadata_directory) if metadata_directory else None
    with _in_a_copy():
        return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    sdist_directory = os.path.abspath(sdist_directory)
    with _in_a_copy():
        return _setuptools.build_sdist(sdist_directory, config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    metadata_directory = os.path.abspath(metadata_directory)
    with _in_a_copy():
        return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def get_requires_for_build_wheel(config_settings=None):  # setuptools runs egg_info to answer
    with _in_a_copy():
        return _setuptools.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_sdist(config_settings=None):
    with _in_a_copy():
        return _setuptools.get_requires_for_build_sdist(config_settings)
