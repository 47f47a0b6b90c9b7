"""Links of chosen speeds between local ranks (``commgate run --link``): parsing, the split of the ranks,
the namespaces' lifetime, and a real run over a shaped link (root, Linux)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from commgate.core.errors import UsageError
from commgate.report import bandwidth
from commgate.run import links
from commgate.run.capture import CapturedCall


def test_a_link_is_a_rate_and_maybe_a_delay() -> None:
    assert links.Link.parse("10gbit") == links.Link(rate_mbit=10_000)
    assert links.Link.parse(" 25Gbit, 20us ") == links.Link(rate_mbit=25_000, delay_us=20)
    assert links.Link.parse("500mbit") == links.Link(rate_mbit=500)
    assert str(links.Link.parse("25gbit,20us")) == "25gbit,20us" and str(links.Link(rate_mbit=500)) == "500mbit"
    for bad in ("10", "fast", "10gbps", "0gbit", "10gbit,20ms", ""):
        with pytest.raises(UsageError, match="--link"):
            links.Link.parse(bad)


def test_a_bad_link_in_the_environment_names_the_variable_not_a_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from commgate.report.plots import _link_order

    monkeypatch.setenv(links.LINK, "garbage")
    with pytest.raises(UsageError) as info:
        links.from_environment()
    assert str(info.value).startswith("COMMGATE_LINK (environment; commgate run --link sets it for its ranks; unset "
                                      "it) 'garbage': expected RATE[kmg]bit")  # fmt: skip
    monkeypatch.setenv(links.LINK, "10gbit")
    assert links.from_environment() == links.Link(rate_mbit=10_000)
    with pytest.raises(UsageError, match=r"^s: capture.stack.link 'garbage': expected"):  # a report's, by hand
        _link_order({"name": "s", "capture": {"stack": {"link": "garbage"}}})


def test_a_bad_namespace_in_the_environment_is_reported_as_what_it_raised(tmp_path: Path) -> None:
    """A rank that cannot enter ``COMMGATE_NETNS``'s namespace raises a one-line error naming it, and the
    run's failure is that error (not "exited without raising")."""
    import os
    import sys

    (tmp_path / "g.yaml").write_text(
        "schema_version: 1\nname: g\nmodel: {preset: 19M-cpu}\nparallelism: {scheme: ddp, dp: 2}\nsteps: 2\n"
    )
    env = os.environ | {links.NETNS: "commgate-no-such-namespace"}
    run = subprocess.run([sys.executable, "-m", "commgate", "run", "g.yaml"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert (
        "raised UsageError: COMMGATE_NETNS 'commgate-no-such-namespace': cannot enter network namespace "
        "/run/netns/commgate-no-such-namespace (No such file or directory); commgate run --link sets it" in run.stdout
    )
    assert "without raising" not in run.stdout and "Traceback" not in run.stdout + run.stderr


def test_the_ranks_split_in_two_halves_one_per_node() -> None:
    assert [links.node_of(r, 2) for r in range(2)] == [0, 1]
    assert [links.node_of(r, 4) for r in range(4)] == [0, 0, 1, 1]
    assert [links.node_of(r, 3) for r in range(3)] == [0, 0, 1]
    net = links.Network(link=links.Link(1000), names=("a", "b"), devices=("va", "vb"), addresses=("x", "y"))
    assert net.env(3, 4) == {
        "COMMGATE_NETNS": "b",
        "GLOO_SOCKET_IFNAME": "vb",
        "NCCL_SOCKET_IFNAME": "vb",
        "COMMGATE_LINK": "1gbit",
    }


def call(op: str, nbytes: int, ns: int, rank: int = 0, group: tuple[int, ...] = (0, 1)) -> CapturedCall:
    return CapturedCall(
        rank=rank, seq=0, step=0, phase="forward", op=op, group=group, peer=None, dtype="fp32",  # type: ignore[arg-type]
        elements=nbytes // 4, bytes=nbytes, tensors=1, start_ns=0, duration_ns=ns,
    )  # fmt: skip


def test_captured_durations_make_curve_samples() -> None:
    calls = [call("all_reduce", 64, t) for t in (10, 30, 20)] + [call("recv", 64, 50), call("send", 64, 99)]
    calls += [call("all_reduce", 64, 999, rank=1), call("all_reduce", 64, 999, group=(0, 1, 2))]  # not rank 0's
    got = {(s.op, s.nbytes): (s.median_s, s.p99_s) for s in bandwidth.samples(calls, world=2)}
    assert got == {("all_reduce", 64): (20e-9, 30e-9), ("send_recv", 64): (50e-9, 50e-9)}


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


needs_root = pytest.mark.skipif(links.refusal() is not None, reason=str(links.refusal()))


@needs_root
def test_the_namespaces_go_away_even_when_the_run_fails() -> None:
    before = namespaces()
    with pytest.raises(RuntimeError), links.shaped(links.Link.parse("100mbit")) as net:
        assert set(net.names) <= namespaces()
        raise RuntimeError("a failing run")
    assert namespaces() == before


@needs_root
def test_a_run_over_a_shaped_link_is_exact_and_names_its_link(tmp_path: Path) -> None:
    """Two ranks on the two sides of a 200 Mbit/s link: the bytes and the traffic matrix are the model's
    (the link changes time, not volume), the capture records the link, and the curve it looks up is the
    link's."""
    from commgate.judge.reconcile import reconcile
    from commgate.model.loader import load_text
    from commgate.model.predict import predict
    from commgate.report.timemodel import curve_key
    from commgate.run.launcher import launch_local

    (s,) = load_text(
        "schema_version: 1\nname: l\nmodel: {preset: 19M-cpu, s: 32}\nparallelism: {scheme: ddp, dp: 2}\nsteps: 2\n"
    )
    with links.shaped(links.Link.parse("200mbit")) as net:
        cap = launch_local(s, workdir=tmp_path, network=net)
    assert cap.stack["link"] == "200mbit" and curve_key(cap.stack).endswith(" | link 200mbit")
    rec = reconcile(predict(s), cap)
    assert rec.ok and rec.traffic_measured == rec.traffic_predicted
    assert not set(net.names) & namespaces()


@needs_root
def test_a_link_that_cannot_be_made_is_one_line_naming_what_is_missing() -> None:
    before = namespaces()
    try:
        with links.shaped(links.Link.parse("1gbit,20us")):
            pass
    except UsageError as err:
        assert "--link 1gbit,20us: a delay needs tc's netem" in str(err) and "\n" not in str(err)
    else:
        pytest.skip("this kernel has netem: the delay was made")
    finally:
        assert namespaces() == before
