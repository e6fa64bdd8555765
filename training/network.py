"""Which network a run's collectives actually use, and whether it is fast enough for it.

NCCL picks its transport per connection at start-up and says so only in its INFO lines: the
network it loaded (``NET/IB : Using [0]mlx5_0:1/IB``, ``NET/IB : Using [0]mlx5_4:1/RoCE``,
``NET/Socket : Using [0]eth0:10.0.0.1<0>``, ``Using network IB``) and, for every channel, how a
rank reaches its peer (``Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA``, ``via
NET/Socket/0``, ``via P2P/IPC``, ``via SHM/direct/direct``). A multi-node job that silently fell
back to TCP sockets is as slow as one node, or slower, and nothing else says why. So --check and
--profile capture NCCL's INFO lines in a file per process (``capture_nccl_log``, called before
the process group starts, because NCCL reads its environment once, at its first use), and
bandwidth.py reports what ``parse_nccl_log`` reads there as the ``transport=`` key of its
``[BANDWIDTH]`` lines. gloo (the CPU) always talks TCP, over GLOO_SOCKET_IFNAME or the interface
of the host name's address (``gloo_transport``).

A transport is written ``kind[:devices]``, several joined by "+", e.g. ``IB/GDRDMA:mlx5_0``,
``RoCE:mlx5_4``, ``socket:eth0``, ``IB/GDRDMA:mlx5_0+P2P/IPC``, ``gloo-tcp:lo``; ``unknown``
where NCCL's lines were not captured. This module imports no torch: the parsers and tests read
recorded logs without it.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import struct
import tempfile
from collections import Counter
from pathlib import Path

#: Where NCCL's INFO lines go, per process, in the run directory (or the temporary folder).
NCCL_LOG_NAME = "nccl.{host}.{pid}.log"

#: The bus bandwidth (GB/s, as nccl-tests define it) below which a collective is slower than
#: its transport can be, at a message large enough to be bound by bandwidth, not latency
#: (FLOOR_MIN_BYTES). Each is about half of what nccl-tests reach on the slowest link of that
#: kind still in use: InfiniBand EDR and 100 Gb/s RoCE, 12.5 GB/s on the wire, about 12 GB/s
#: busbw (reporting/scaling.py's INTER_NODE_BUSBW_GBS); PCIe 3.0 x16 between two GPUs, about
#: 10-12 GB/s busbw; shared host memory (SHM), two copies over PCIe, half of that; NCCL's TCP
#: sockets over 10 GbE, 1.25 GB/s on the wire. gloo has none: on the CPU its collectives are
#: bound by the processes' own copies and sums, not by the link.
FLOOR_GBS = {"IB": 6.0, "RoCE": 6.0, "P2P": 5.0, "SHM": 2.5, "socket": 0.5}

#: Messages smaller than this (bytes) are bound by latency: no floor is applied to them.
FLOOR_MIN_BYTES = 16 * 2**20

#: Where Linux lists the node's InfiniBand and RoCE devices (mlx5_0, ...).
IB_SYSFS = "/sys/class/infiniband"

_INFO = "NCCL INFO "
_IB_USING = re.compile(r"^NET/IB ?: Using (.*)")
_IB_DEVICE = re.compile(r"\[(\d+)\]([^:\s\[]+):\d+/(IB|RoCE)")
_SOCKET_USING = re.compile(r"^NET/Socket ?: Using (.*)")
_SOCKET_DEVICE = re.compile(r"\[(\d+)\]([^:\s\[]+):")
_NETWORK = re.compile(r"^Using network (\S+)")
_CHANNEL = re.compile(r"^(?:Channel|Ring) \d+(?:/\d+)? : (\d+)\[[0-9a-fA-Fx]+\] -> "
                      r"(\d+)\[[0-9a-fA-Fx]+\](?: \[(send|receive)\])? via (\S+)")
_NET_VIA = re.compile(r"^NET/([^/]+)/(\d+)(?:\(\d+\))?(/GDRDMA)?")


def nccl_log_path(directory, host: str | None = None, pid: int | None = None) -> Path:
    """This process's NCCL log in ``directory``: NCCL_LOG_NAME with its host name (up to the
    first ".", as NCCL's own %h) and process id."""
    host = (host or socket.gethostname()).split(".")[0]
    return Path(directory) / NCCL_LOG_NAME.format(host=host, pid=os.getpid() if pid is None
                                                  else pid)


def capture_nccl_log(environ=os.environ) -> None:
    """Send NCCL's INFO lines of this process to a file of its own, which parse_nccl_log
    reads after the bandwidth test. Before the process group starts: NCCL reads NCCL_DEBUG,
    NCCL_DEBUG_FILE and NCCL_DEBUG_SUBSYS once, at its first use. The file is in $RUN_DIR
    (launch/job.sh sets it), else in the temporary folder. A NCCL_DEBUG_FILE the user set is
    kept (its %h and %p are NCCL's host name and process id); so is a NCCL_DEBUG_SUBSYS, which
    must include INIT for the channel lines. A CPU run never starts NCCL: nothing is written."""
    if "NCCL_DEBUG_FILE" not in environ:
        environ["NCCL_DEBUG_FILE"] = str(nccl_log_path(environ.get("RUN_DIR")
                                                       or tempfile.gettempdir()))
    if environ.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        environ["NCCL_DEBUG"] = "INFO"
    environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")


def captured_log(environ=os.environ) -> Path | None:
    """The file NCCL_DEBUG_FILE names for this process (NCCL's %h, %p and %% expanded), or None
    when NCCL writes its lines to the output (no NCCL_DEBUG_FILE)."""
    pattern = environ.get("NCCL_DEBUG_FILE")
    if not pattern:
        return None
    host = socket.gethostname().split(".")[0]
    expanded = re.sub(r"%[hp%]", lambda m: {"%h": host, "%p": str(os.getpid()),
                                             "%%": "%"}[m.group()], pattern)
    return Path(expanded)


def parse_nccl_log(text: str) -> dict:
    """What one process's NCCL INFO lines say about its network: ``network`` (the one NCCL
    chose: "IB", "Socket", a plugin's name; None if not said), ``ib`` ({index: (device, "IB" or
    "RoCE")}), ``sockets`` ({index: interface}), ``gdr`` (GPUDirect RDMA on some connection)
    and ``connections``: Counter of transports (kind[:device], see the module's docstring) over
    the channel lines, one per connection and direction. Lines of other processes mixed into
    one file (NCCL_DEBUG_FILE without %p) count as well: pass one process's lines to count
    its own."""
    found = {"network": None, "ib": {}, "sockets": {}, "gdr": False, "connections": Counter()}
    channels = []
    for line in text.splitlines():
        at = line.find(_INFO)
        if at < 0:
            continue
        message = line[at + len(_INFO):].strip()
        if m := _IB_USING.match(message):
            found["ib"].update((int(i), (name, link)) for i, name, link
                               in _IB_DEVICE.findall(m.group(1)))
        elif m := _SOCKET_USING.match(message):
            found["sockets"].update((int(i), name) for i, name
                                    in _SOCKET_DEVICE.findall(m.group(1)))
        elif m := _NETWORK.match(message):
            found["network"] = m.group(1)
        elif m := _CHANNEL.match(message):
            channels.append(m.group(4))
    for via in channels:  # after the device lists, which name the devices
        found["connections"][_transport_of(via, found)] += 1
    found["gdr"] = any("/GDRDMA" in via for via in channels)
    return found


def _transport_of(via: str, found: dict) -> str:
    """One channel's "via ..." as a transport: IB or RoCE (/GDRDMA) with the device, socket with
    the interface, P2P with its mode (IPC, CUMEM, direct), SHM, or another network's name."""
    if m := _NET_VIA.match(via):
        net, index, gdr = m.group(1), int(m.group(2)), m.group(3) or ""
        if net == "IB":
            name, link = found["ib"].get(index, (None, "IB"))
            return f"{link}{gdr}" + (f":{name}" if name else "")
        if net == "Socket":
            name = found["sockets"].get(index)
            return "socket" + (f":{name}" if name else "")
        return f"net-{net}{gdr}"
    parts = via.split("/")
    if parts[0] == "P2P" and len(parts) > 1:
        return f"P2P/{parts[1]}"
    return parts[0]


def join_transports(transports) -> str:
    """The ``transport=`` value of a set of transports (kind[:device] each): one entry per kind,
    its devices joined by ",", kinds by "+", in a fixed order; "unknown" for none."""
    devices = {}
    for transport in transports:
        kind, _, device = transport.partition(":")
        devices.setdefault(kind, set())
        if device:
            devices[kind].add(device)
    return "+".join(kind + (":" + ",".join(sorted(devices[kind])) if devices[kind] else "")
                    for kind in sorted(devices)) or "unknown"


def kinds(transport: str) -> list:
    """The kinds of a ``transport=`` value without their devices and GPUDirect mark: "IB",
    "RoCE", "socket", "P2P", "SHM", "gloo-tcp", ... ("unknown" gives [])."""
    if transport in ("", "unknown"):
        return []
    return [part.split(":")[0].split("/")[0] for part in transport.split("+")]


def interface_addresses() -> dict:
    """{interface name: its IPv4 address} of this node (SIOCGIFADDR; an interface without an
    IPv4 address is left out)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def gloo_interface(environ=os.environ) -> str:
    """The interface gloo's TCP uses on this node: GLOO_SOCKET_IFNAME (launch/node.sh sets it
    on every multi-node run), else gloo's own choice, the interface that holds the address of
    the host name (lo where the name resolves to 127.0.x.x); "" where that cannot be told."""
    if environ.get("GLOO_SOCKET_IFNAME"):
        return environ["GLOO_SOCKET_IFNAME"].split(",")[0]
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""
    if address.startswith("127."):
        return "lo"
    return next((name for name, addr in interface_addresses().items() if addr == address), "")


def gloo_transport(environ=os.environ) -> str:
    """gloo's ``transport=`` value: TCP, with the interface where it is known."""
    interface = gloo_interface(environ)
    return "gloo-tcp" + (f":{interface}" if interface else "")


def ib_devices(root: str | os.PathLike | None = None) -> list:
    """This node's InfiniBand and RoCE devices (the names under IB_SYSFS,
    /sys/class/infiniband), sorted; [] where there is none or the folder is missing. ``root``:
    another folder, for tests."""
    try:
        return sorted(p.name for p in Path(root or IB_SYSFS).iterdir())
    except OSError:
        return []


def sockets_despite_ib(transport: str, nodes: int, ib_by_node: dict) -> str | None:
    """One sentence when a multi-node NCCL job's traffic goes over TCP sockets while a node has
    InfiniBand or RoCE devices (``ib_by_node``: {node: its devices}), else None."""
    with_ib = {node: devices for node, devices in ib_by_node.items() if devices}
    if nodes < 2 or "socket" not in kinds(transport) or not with_ib:
        return None
    node, devices = sorted(with_ib.items())[0]
    return (f"warning: this {nodes}-node job's NCCL traffic goes over TCP sockets "
            f"(transport={transport}) although {node} has InfiniBand/RoCE devices "
            f"({', '.join(devices)}): NCCL could not use them, so expect one node's speed or "
            f"less; look in NCCL's log for 'NET/IB' and check NCCL_IB_DISABLE, NCCL_NET, "
            f"NCCL_IB_HCA and that the job (or its container) sees /dev/infiniband")


def below_floor(op: str, nbytes: int, busbw_gbs: float, transport: str) -> str | None:
    """One sentence when ``op``'s bus bandwidth at ``nbytes`` is under the floor of its slowest
    transport (FLOOR_GBS), for a message of at least FLOOR_MIN_BYTES; else None."""
    floors = {kind: FLOOR_GBS[kind] for kind in kinds(transport) if kind in FLOOR_GBS}
    if nbytes < FLOOR_MIN_BYTES or not floors:
        return None
    kind = min(floors, key=floors.get)
    if busbw_gbs >= floors[kind]:
        return None
    return (f"warning: {op} reached {busbw_gbs:.2f} GB/s bus bandwidth at "
            f"{nbytes / 2**20:.1f} MiB over {transport}, under the {floors[kind]:g} GB/s floor "
            f"of {kind} (about half of what nccl-tests reach on its slowest common link): "
            f"another job on the link, a wrong interface (NCCL_SOCKET_IFNAME, NCCL_IB_HCA) or "
            f"a degraded link; compare with nccl-tests' all_reduce_perf on the same nodes")
