"""Every way torch hands a collective to a process group is recorded by commgate's capturing group.

torch has renamed the process group's methods between versions: before 2.13 ``dist.all_gather_into_tensor``
called ``_allgather_base``, ``reduce_scatter_tensor`` ``_reduce_scatter_base`` and ``all_to_all_single``
``alltoall_base``; 2.13 calls ``all_gather_single``, ``reduce_scatter_single`` and ``all_to_all_single``, and
its coalescing manager ``all_gather_single_coalesced`` and ``reduce_scatter_single_coalesced``. A capture on
torch 2.11 (a GPU machine's) recorded none of the first three (found on an H200 while writing
``tests/test_capture_nccl.py``), so each name is called here as the torch that uses it calls it, and a method
torch adds later fails the last test until it is bound or said not to be a collective.
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from commgate.model.collectives import OPS  # noqa: E402
from commgate.run import interpose  # noqa: E402
from test_capture_timing import world  # noqa: E402, F401  (the one-rank capturing group over gloo)


def _calls(rec: interpose.Recorder) -> list[tuple[str, int, int]]:
    rec.poll()
    return [(str(c.op), c.bytes, c.tensors) for c in rec.take()]


@pytest.mark.parametrize("world", ["poller"], indirect=True)
def test_the_methods_older_torch_calls_are_recorded(world: interpose.Recorder) -> None:  # noqa: F811
    """As torch 2.4 to 2.12's ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and ``all_to_all_single``
    call the group: one call each, its bytes, and the op run (the output holds the input)."""
    c10d = torch._C._distributed_c10d
    group = dist.group.WORLD
    inp, out = torch.arange(4, dtype=torch.float32), torch.zeros(4)
    group._allgather_base(out, inp, c10d.AllgatherOptions()).wait()
    assert out.tolist() == inp.tolist()
    out.zero_()
    group._reduce_scatter_base(out, inp, c10d.ReduceScatterOptions()).wait()
    assert out.tolist() == inp.tolist()
    out.zero_()
    group.alltoall_base(out, inp, [], [], c10d.AllToAllOptions()).wait()
    assert out.tolist() == inp.tolist()
    assert _calls(world) == [("all_gather", 16, 1), ("reduce_scatter", 16, 1), ("all_to_all", 16, 1)]


@pytest.mark.parametrize("world", ["poller"], indirect=True)
def test_the_coalescing_manager_s_calls_are_recorded(world: interpose.Recorder) -> None:  # noqa: F811
    """torch 2.13's ``_coalescing_manager`` hands a batch of all-gathers (reduce-scatters) to the group as one
    ``all_gather_single_coalesced`` (``reduce_scatter_single_coalesced``), called here as it calls them: one
    call of both tensors, each run, recorded once (bound, the backend's own coalesced call runs; unbound, the
    base class's would call the group's ``allgather_into_tensor_coalesced``, recorded there, under the GIL)."""
    c10d = torch._C._distributed_c10d
    group = dist.group.WORLD
    outs, ins = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.full((3,), 2.0)]
    group.all_gather_single_coalesced(outs, ins, c10d.AllgatherOptions()).wait()
    assert [o.tolist() for o in outs] == [[1.0, 1.0], [2.0, 2.0, 2.0]]
    for o in outs:
        o.zero_()
    group.reduce_scatter_single_coalesced(outs, ins, c10d.ReduceScatterOptions()).wait()
    assert [o.tolist() for o in outs] == [[1.0, 1.0], [2.0, 2.0, 2.0]]
    assert _calls(world) == [("all_gather", 20, 2), ("reduce_scatter", 20, 2)]


@pytest.mark.parametrize("world", ["stamps"], indirect=True)
def test_a_call_posted_as_several_works_is_waited_until_its_end_is_stamped(world: interpose.Recorder) -> None:  # noqa: F811
    """DTensor's all-gather reaches the group as ``allgather_into_tensor_coalesced``, which gloo lacks: the
    group posts one work per tensor and joins them. Waiting on the joined work must return only after the
    callbacks of its future have run, the C++ stamp of the call's end among them: else a call the caller has
    waited on reads as still running when the capture is gathered (``duration_ns`` null; 1 run in 3 to 9 of
    ``test_run.py::test_capture_sees_every_path``). A slow callback is added to the call's future while the
    call runs (64 MiB copied: the call outlasts adding it); ``wait`` must not return before it has run."""
    c10d = torch._C._distributed_c10d
    group, main = dist.group.WORLD, threading.get_ident()
    for _ in range(20):
        out, inp = torch.empty(1 << 24), torch.ones(1 << 24)
        work = group.allgather_into_tensor_coalesced([out], [inp], c10d.AllgatherOptions())
        ran: list[int] = []

        def slow(_: object, ran: list[int] = ran) -> None:
            if threading.get_ident() != main:
                time.sleep(0.05)  # on the thread that completed the call: the waiter must still be waiting
            ran.append(threading.get_ident())

        work.get_future().add_done_callback(slow)
        work.wait()
        assert ran, "wait() returned before the call's future had run its callbacks"
        if ran[0] != main:
            break  # the callback ran on the completing thread: the case that matters was seen
    else:
        pytest.fail("each call had ended before its callback was added (20 tries): the race was never set up")
    assert work.is_completed() and out[:4].tolist() == [1.0] * 4
    calls = [c for c in world.drain() if c.op == "all_gather"]
    assert calls and all(c.duration_ns is not None for c in calls)


NOT_COLLECTIVES = frozenset(
    {
        *("BackendType", "CUSTOM", "GLOO", "MPI", "NCCL", "UCC", "UNDEFINED", "XCCL"),
        *("_backend_id", "_device_types", "_enable_collectives_timing", "_end_coalescing", "_get_backend"),
        *("_get_backend_name", "_get_sequence_number_for_group", "_has_hooks", "_id", "_pybind11_conduit_v1_"),
        *("_register_backend", "_register_on_completion_hook", "_set_default_backend", "_set_group_desc"),
        *("_set_group_name", "_set_sequence_number_for_group", "_start_coalescing", "_wait_for_pending_works"),
        *("abort", "bound_device_id", "boxed", "get_group_store", "group_desc", "group_name", "merge_remote_group"),
        *("name", "rank", "set_timeout", "shutdown", "size", "split_group", "unbox"),
        *("use_pg_for_symm_mem_rendezvous", "monitored_barrier"),
        # collectives, bound elsewhere in the capturing group (point-to-point, barrier) or not a call of a job
        *("send", "recv", "barrier", "recv_anysource"),
    }
)
"""The installed torch's ProcessGroup attributes that are not a collective commgate binds by name in ``OPS``.
(``monitored_barrier`` is gloo's debugging barrier, not a job's communication; ``recv_anysource`` would be
recorded as nothing: no job of the suite uses it.)"""


def test_every_collective_method_of_the_installed_torch_is_bound() -> None:
    """A method torch adds to ``ProcessGroup`` is either bound (``OPS``' bindings) or listed above: a torch
    upgrade that adds a way to call a collective fails here, naming it, instead of leaving it unrecorded. (A
    bound name the installed torch lacks is another version's: the older names are bound for older torch.)"""
    bound = {b.name for spec in OPS.values() for b in spec.bindings}
    methods = {n for n in dir(torch._C._distributed_c10d.ProcessGroup) if not n.startswith("__")}
    assert sorted(methods - bound - NOT_COLLECTIVES) == [], "bind these in commgate.model.collectives.OPS"


@pytest.mark.parametrize(
    ("backend", "both"),
    [(None, True), ("undefined", True), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl,cpu:gloo", True), ("nccl", False)],
)
def test_a_job_s_nccl_group_has_gloo_for_cpu_tensors_where_torch_would_give_it(backend: str | None, both: bool) -> None:
    """torch gives a group gloo beside NCCL where the job names no backend or names ``cpu:gloo``; the capture
    gives its NCCL group the same (``tests/test_capture_nccl.py`` runs such a group's CPU and CUDA calls)."""
    from commgate.run.external import _cpu_too

    assert _cpu_too(backend) is both
