"""Planted faults, as bring-your-own workloads, to prove the launcher and the gate catch them.

Each all-reduces a small tensor every step; at step 1, rank 1 misbehaves:

* ``crash``: raises ``RuntimeError``;
* ``refuse``: raises commgate's own one-line ``CommgateError`` (what a trainer's check after its run raises
  when the job was not its scenario's), which the launcher reports as that line, without a traceback;
* ``die``: is killed by SIGKILL (an OOM killer, a segfault);
* ``exit_without_raising``: leaves with ``os._exit(3)``, raising nothing (a library calling ``exit``),
  so that rank 0's all-reduce then fails with a connection error of its own;
* ``hang``: skips the step's all-reduce and waits for a message nobody sends, so that rank 0 is stuck
  in the all-reduce and rank 1 in the receive until the deadline;
* ``skip``: skips the step's all-reduce and goes on, so that its later all-reduces meet rank 0's earlier
  ones and rank 0 is left waiting in its last while rank 1 has finished (the stall watchdog's case);
* ``wedge``: blocks outside any collective (as a rank stuck in a rendezvous, or building a process
  group its peers never build), so that rank 0 waits in the all-reduce alone;
* ``spawn``: starts a process that would sleep for an hour (a workload's ``subprocess.Popen`` nobody waits
  for) and goes on: the run passes, and the process must not outlive it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import torch
import torch.distributed as dist

from commgate.core.errors import CommgateError
from commgate.model.scenario import Scenario


class _Faulty:
    fault = ""

    def __init__(self, scenario: Scenario, *, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device

    def step(self, k: int) -> float:
        if k == 1 and self.rank == 1:
            self.misbehave()
        else:
            dist.all_reduce(torch.ones(4, device=self.device))
        return 0.0

    def misbehave(self) -> None:
        raise NotImplementedError


class _Crash(_Faulty):
    def misbehave(self) -> None:
        raise RuntimeError("planted crash on rank 1 at step 1")


class _Refuse(_Faulty):
    def misbehave(self) -> None:
        raise CommgateError("planted refusal on rank 1 at step 1: what a user can mend, in one line")


class _Die(_Faulty):
    def misbehave(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class _Exit(_Faulty):
    def misbehave(self) -> None:
        os._exit(3)


class _Skip(_Faulty):
    def misbehave(self) -> None:
        pass


class _Wedge(_Faulty):
    def misbehave(self) -> None:
        threading.Event().wait()  # forever, in no call


class _Hang(_Faulty):
    def misbehave(self) -> None:
        dist.recv(torch.empty(1, device=self.device), src=0)


class _Spawn(_Faulty):
    def misbehave(self) -> None:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        dist.all_reduce(torch.ones(4, device=self.device))


def crash(scenario: Scenario, *, rank: int, device: torch.device) -> _Faulty:
    return _Crash(scenario, rank=rank, device=device)


def refuse(scenario: Scenario, *, rank: int, device: torch.device) -> _Faulty:
    return _Refuse(scenario, rank=rank, device=device)


def die(scenario: Scenario, *, rank: int, device: torch.device) -> _Faulty:
    return _Die(scenario, rank=rank, device=device)


def exit_without_raising(scenario: Scenario, *, rank: int, device: torch.device) -> _Faulty:
    return _Exit(scenario, rank=rank, device=device)


def skip(scenario: Scenario, *, rank: int, device: torch.device) -> _Faulty:
    return _Skip(scenario, rank=rank, device=device)


def hang(scenario: Scenario, *, rank: int, device: torch.device) -> _Faulty:
    return _Hang(scenario, rank=rank, device=device)


def wedge(scenario: Scenario, *, rank: int, device: torch.device) -> _Faulty:
    return _Wedge(scenario, rank=rank, device=device)


def spawn(scenario: Scenario, *, rank: int, device: torch.device) -> _Faulty:
    return _Spawn(scenario, rank=rank, device=device)
