"""Emulated nodes (issue 18): namespaces joined by shaped links, always torn down, and a
real two-node training run across them equal to the same run on one machine."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from partrain.testing import netns
from partrain.testing.netns import EmulatedNodes, Link, torchrun_across

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def _ours() -> set[str]:
    return {n for n in _namespaces() if n.startswith(f"{netns.PREFIX}{__import__('os').getpid()}-")}


def test_nodes_are_made_and_always_torn_down():
    with EmulatedNodes(3, Link(rate_mbit=100), tag="t") as nodes:
        assert len(_ours()) == 4  # three nodes and the hub
        shown = nodes.run(1, ["ip", "-o", "-4", "addr", "show", "eth0"], capture_output=True, text=True).stdout
        assert "192.0.2.2/24" in shown
    assert not _ours()
    with pytest.raises(KeyError):
        with EmulatedNodes(2, tag="e"):
            raise KeyError("a run that fails")
    assert not _ours()


def test_a_nodes_collectives_use_its_eth0_whatever_the_environment_passed_on(monkeypatch):
    """A local run in this process binds gloo to loopback in its environment (``launch``); a
    copy of that environment passed to a node must not send the node's gloo to 127.0.0.1,
    where its peer in another namespace is not (a cell across nodes then timed out connecting)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    with EmulatedNodes(2, tag="v") as nodes:
        env = nodes.env({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "PYTHONPATH": "x"})
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"], env["PYTHONPATH"]) == ("eth0", "eth0", "x")


def test_namespaces_of_a_killed_harness_are_removed_at_the_next_start():
    dead = f"{netns.PREFIX}999999999-x0"  # a pid no process has
    subprocess.run(["ip", "netns", "add", dead], check=True)
    assert dead in netns.remove_stale()
    assert dead not in _namespaces()


def test_what_crosses_a_link_goes_through_its_rate_shaper():
    """20 MB from node 0 to node 1: every byte passes node 0's token bucket at the link's rate,
    which had to hold packets back (its overlimit counter), not a timing: a busy machine is slower.
    The bucket meters whole frames: 1514 bytes for every 1448 of the message (``payload_share``),
    which is why a link profile's payload rate reads 4.4% under the shaped rate."""
    server = ("import socket;s=socket.socket();s.bind(('0.0.0.0',5001));s.listen();print('ready',flush=True)\n"
              "c,_=s.accept();n=0\nwhile (d:=c.recv(1<<20)): n+=len(d)\nprint(n)")
    with EmulatedNodes(2, Link(rate_mbit=50), tag="r") as nodes:
        srv = nodes.popen(1, [sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
        assert srv.stdout.readline().strip() == "ready"  # listening: however long Python took to start
        nodes.run(0, [sys.executable, "-c", f"import socket;socket.create_connection(('{nodes.address(1)}',5001))"
                      ".sendall(b'x'*(20<<20))"], check=True)
        received = int(srv.communicate(timeout=60)[0].strip())
        stats = nodes.run(0, ["tc", "-s", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
        device = nodes.run(0, ["ip", "-d", "link", "show", "eth0"], capture_output=True, text=True).stdout
    assert received == 20 << 20
    assert "tbf" in stats and "rate 50Mbit" in stats and "burst 6250b" in stats  # the bucket: 1 ms at 50 Mbit/s
    assert "gso_max_size 6250 " in device  # TCP's segments cut to fit it
    sent = int(re.search(r"Sent (\d+) bytes", stats).group(1))
    overlimits = int(re.search(r"overlimits (\d+)", stats).group(1))
    assert overlimits > 0
    # every 1448 bytes sent in a frame of 1514: 1.0456 (TCP without its timestamps would read 1.037)
    assert sent / received == pytest.approx(1 / netns.payload_share(), rel=0.002)


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_emulated_nodes_train_ddp_to_the_losses_of_one_machine(data_dir):
    args = ["train", "--model", "mlp", "--strategy", "ddp", "--steps", "6", "--limit", "512", "--eval-limit", "64",
            "--threads", "1", "--data-dir", str(data_dir), "--json", "--quiet"]
    local = subprocess.run([sys.executable, "-P", "-m", "partrain", *args, "--workers", "2"], capture_output=True,
                           text=True, timeout=300)
    assert local.returncode == 0, local.stderr
    with EmulatedNodes(2, Link(rate_mbit=1000), tag="d") as nodes:
        procs = [subprocess.Popen(cmd, env=nodes.env({"PYTHONPATH": ":".join(p for p in sys.path if p)}),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for cmd in torchrun_across(nodes, 1, args)]
        outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    across = json.loads(outs[0][0].strip().splitlines()[-1])
    assert across["world_size"] == 2
    assert across["step_losses"] == pytest.approx(json.loads(local.stdout)["step_losses"], abs=1e-6)
