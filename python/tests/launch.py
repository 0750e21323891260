"""Runs a multi-process launcher (mpiexec, torchrun) for the tests: a run
past its time limit (a deadlock) is killed with all its processes and
fails the test."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest


def run(command: list, env: dict, timeout: float, cwd) -> subprocess.CompletedProcess:
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{' '.join(command)} ran past {timeout} s (a deadlock?)\n{stdout}\n"
                    f"{stderr[-4000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
