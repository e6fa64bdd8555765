"""Which network the collectives use (training/network.py): NCCL's transport per connection read
from its INFO lines, recorded in fixtures written after NCCL's own lines (an InfiniBand run with
GPUDirect RDMA, a fallback to TCP sockets, a RoCE node that also talks over P2P and shared
memory, whose log was cut mid-line), gloo's TCP interface, and the two warnings: sockets on a
multi-node job beside InfiniBand devices, a bandwidth under its transport's floor. One more
fixture is a real log, of one rank on a GPU."""

from __future__ import annotations

import os
import socket

import pytest

from conftest import TESTS

from training import network

NCCL_LOGS = TESTS / "fixtures" / "nccl"


@pytest.mark.parametrize("name, chosen, transport, connections", [
    ("ib_gdr.log", "IB", "IB/GDRDMA:mlx5_0,mlx5_1+P2P/IPC",
     {"IB/GDRDMA:mlx5_0": 2, "IB/GDRDMA:mlx5_1": 2, "P2P/IPC": 2}),
    ("socket_fallback.log", "Socket", "socket:eth0", {"socket:eth0": 4}),
    # the cut last channel line is not counted; "NET/IB/0(3)": through a proxy rank (PXN)
    ("mixed.log", "IB", "P2P/CUMEM+RoCE/GDRDMA:mlx5_4+SHM",
     {"P2P/CUMEM": 2, "SHM": 2, "RoCE/GDRDMA:mlx5_4": 2}),
])
def test_nccl_log_says_the_transport_of_every_connection(name, chosen, transport, connections):
    found = network.parse_nccl_log((NCCL_LOGS / name).read_text())
    assert found["network"] == chosen
    assert dict(found["connections"]) == connections
    assert network.join_transports(found["connections"]) == transport


def test_a_log_without_channel_lines_is_unknown_not_guessed():
    """A real log (NCCL 2.28.9, one rank on an H200, captured the way capture_nccl_log does):
    the network NCCL chose is read, but one rank has no connection, so no transport is said."""
    found = network.parse_nccl_log((NCCL_LOGS / "one_rank_h200_2.28.9.log").read_text())
    assert (found["network"], found["sockets"], found["ib"]) == ("Socket", {0: "eth0"}, {})
    assert network.join_transports(found["connections"]) == "unknown"
    assert network.kinds("unknown") == []


def test_capture_sends_info_lines_to_a_file_per_process(tmp_path):
    env = {"RUN_DIR": str(tmp_path), "NCCL_DEBUG": "WARN"}  # launch/job.sh's default level
    network.capture_nccl_log(env)
    host = socket.gethostname().split(".")[0]
    assert env["NCCL_DEBUG_FILE"] == str(tmp_path / f"nccl.{host}.{os.getpid()}.log")
    assert (env["NCCL_DEBUG"], env["NCCL_DEBUG_SUBSYS"]) == ("INFO", "INIT,NET")
    assert network.captured_log(env) == tmp_path / f"nccl.{host}.{os.getpid()}.log"
    # the user's own file and subsystems are kept; NCCL's %h and %p are expanded to find it
    mine = {"NCCL_DEBUG_FILE": f"{tmp_path}/n.%h.%p.log", "NCCL_DEBUG_SUBSYS": "INIT"}
    network.capture_nccl_log(mine)
    assert mine["NCCL_DEBUG_SUBSYS"] == "INIT"
    assert network.captured_log(mine) == tmp_path / f"n.{host}.{os.getpid()}.log"
    assert network.captured_log({}) is None


def test_gloo_transport_names_its_interface():
    assert network.gloo_transport({"GLOO_SOCKET_IFNAME": "ib0"}) == "gloo-tcp:ib0"
    chosen = network.gloo_interface({})  # gloo's own choice: the host name's address
    assert chosen == "" or chosen in {name for _, name in socket.if_nameindex()}


def test_sockets_beside_infiniband_on_several_nodes_are_warned(tmp_path):
    root = tmp_path / "infiniband"
    (root / "mlx5_0").mkdir(parents=True)
    (root / "mlx5_1").mkdir()
    ib = network.ib_devices(root)
    assert ib == ["mlx5_0", "mlx5_1"] and network.ib_devices(tmp_path / "none") == []
    warning = network.sockets_despite_ib("socket:eth0", 2, {"gpu-b07": ib, "gpu-b08": ib})
    assert warning.startswith("warning: this 2-node job's NCCL traffic goes over TCP sockets "
                              "(transport=socket:eth0) although gpu-b07 has InfiniBand/RoCE "
                              "devices (mlx5_0, mlx5_1)")
    assert "NCCL_IB_DISABLE" in warning
    # one node (sockets never leave it), no IB device, or IB in use: nothing to say
    assert network.sockets_despite_ib("socket:eth0", 1, {"gpu-b07": ib}) is None
    assert network.sockets_despite_ib("socket:eth0", 2, {"a": [], "b": []}) is None
    assert network.sockets_despite_ib("IB/GDRDMA:mlx5_0+P2P/IPC", 2, {"a": ib}) is None


def test_bandwidth_under_its_transports_floor_is_warned():
    big = 100 * 2**20
    warning = network.below_floor("all_reduce", big, 1.2, "IB/GDRDMA:mlx5_0+P2P/IPC")
    assert warning.startswith("warning: all_reduce reached 1.20 GB/s bus bandwidth at 100.0 MiB "
                              "over IB/GDRDMA:mlx5_0+P2P/IPC, under the 5 GB/s floor of P2P")
    assert network.below_floor("all_reduce", big, 11.0, "IB/GDRDMA:mlx5_0") is None
    assert network.below_floor("all_reduce", big, 0.3, "socket:eth0") is not None
    # a small message is bound by latency; gloo (its CPU's copies) and an unknown transport
    # have no floor
    assert network.below_floor("all_reduce", big, 0.3, "gloo-tcp:lo") is None
    assert network.below_floor("all_reduce", 2**20, 0.01, "IB:mlx5_0") is None
    assert network.below_floor("all_reduce", big, 0.01, "unknown") is None


def test_the_run_reads_its_own_nccl_log_and_warns_for_sockets_beside_infiniband(
        tmp_path, monkeypatch, capsys):
    """bandwidth.transport on NCCL (its backend and a second node faked, since the CPU has no
    NCCL): this process's captured log is read, and the socket fallback on two nodes that have
    InfiniBand devices is warned; without a captured log the transport is unknown, not guessed."""
    from training import bandwidth
    monkeypatch.setattr(bandwidth.dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(bandwidth, "every_rank", lambda mine: [mine, ("gpu-b08", *mine[1:])])
    (tmp_path / "infiniband" / "mlx5_0").mkdir(parents=True)
    monkeypatch.setattr(network, "IB_SYSFS", str(tmp_path / "infiniband"))
    env = {"RUN_DIR": str(tmp_path)}
    network.capture_nccl_log(env)
    monkeypatch.setenv("NCCL_DEBUG_FILE", env["NCCL_DEBUG_FILE"])
    network.captured_log().write_text((NCCL_LOGS / "socket_fallback.log").read_text())
    used, warnings = bandwidth.transport()
    assert used == "socket:eth0"
    assert warnings[0].startswith("warning: this 2-node job's NCCL traffic goes over TCP sockets")
    assert f"transport: socket:eth0 (NCCL's INFO lines: {network.captured_log()}" in \
        capsys.readouterr().out
    monkeypatch.delenv("NCCL_DEBUG_FILE")
    assert bandwidth.transport()[0] == "unknown"
    assert "NCCL's INFO lines were not captured" in capsys.readouterr().out
