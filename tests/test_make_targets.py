"""The Makefile's clean targets: `make clean` removes what a checkout made, `make clean-cache` the cache ftctl uses."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def dry_run(target, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("FTCTL_HOME", "MAKEFLAGS", "MAKELEVEL")}
    done = subprocess.run(["make", "-s", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60, env={**base, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_clean_removes_the_checkouts_outputs_and_clean_cache_ftctls_cache(tmp_path, monkeypatch):
    from ftctl.paths import ftctl_home

    assert dry_run("clean") == ["rm", "-rf", ".venv", "runs", ".pytest_cache"]
    assert dry_run("clean-cache", FTCTL_HOME=str(tmp_path / "home")) == ["rm", "-rf", str(tmp_path / "home")]
    monkeypatch.delenv("FTCTL_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dry_run("clean-cache", HOME=str(tmp_path)) == ["rm", "-rf", str(ftctl_home())]  # the dir ftctl itself uses
