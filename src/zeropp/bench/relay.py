"""Link delay for the emulated cluster: a userspace switch over TUN devices.

The kernel here has no `netem`, so a link with a delay cannot be a veth. Instead
each node's `cl0` is a TUN device: what the node sends leaves through its uplink
(`tbf` at the link rate, in the kernel, as on a veth) into this process, which
holds every packet for `delay` seconds and then writes it into the destination
node's TUN, serialized at the link rate per destination (the downlink, with a
short drop-tail queue as tbf's `latency 20ms`). A constant delay and a FIFO per
destination keep every TCP stream in order.

Run by `Cluster` as `python -m zeropp.bench.relay PREFIX NODES DELAY_S RATE_BYTES_S`;
it prints `ready` once it holds every node's TUN, the bytes it has carried per flow as
one JSON line for each line it reads on stdin, and stops when stdin closes (printing
them once more).
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import json
import math
import os
import select
import struct
import sys
import time

from .cluster import BURST, CLONE_NEWNET, LATENCY_S, enter_netns

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def open_tun(netns: str, dev: str = "cl0") -> int:
    """Attach to the persistent TUN `dev` inside network namespace `netns`."""
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        enter_netns(netns)
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI))
    finally:
        ctypes.CDLL(None).setns(own, CLONE_NEWNET)  # back home for the next node
        os.close(own)
    return fd


def relay(fds: list[int], delay: float, rate: float, stop_fd: int, flows: dict) -> None:
    """Forward IPv4 packets between the nodes' TUNs (node i is 10.77.0.<i+1>), adding
    each packet's bytes and TCP payload bytes to `flows[(source node, destination node,
    sport, dport)]` (ports 0 for anything but TCP)."""
    poller = select.poll()
    for fd in fds + [stop_fd]:
        poller.register(fd, select.POLLIN)
    due: list = []           # (deliver at, sequence, destination, packet)
    free_at = [0.0] * len(fds)
    seq = 0
    queue_s = LATENCY_S + BURST / rate  # the downlink's queue bound, as the uplink's tbf
    while True:
        wait_ms = 1000 if not due else max(0, math.ceil((due[0][0] - time.monotonic()) * 1000))
        for fd, _ in poller.poll(wait_ms):
            if fd == stop_fd:
                if not os.read(stop_fd, 4096):
                    return  # stdin closed: stop
                print(json.dumps([[*k, *v] for k, v in flows.items()]), flush=True)
                continue
            while True:
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if len(pkt) < 20 or pkt[0] >> 4 != 4:
                    continue  # IPv4 only
                dst = pkt[19] - 1
                if not 0 <= dst < len(fds):
                    continue
                now = time.monotonic()
                start = max(now, free_at[dst])
                if start - now > queue_s:
                    continue  # the downlink's queue is full: dropped, TCP backs off
                ihl = (pkt[0] & 0x0F) * 4
                tcp = pkt[9] == 6 and len(pkt) >= ihl + 20
                ports = struct.unpack_from("!HH", pkt, ihl) if tcp else (0, 0)
                key = (pkt[15] - 1, dst, *ports)
                f = flows.setdefault(key, [0, 0])  # what is delivered (drops and
                f[0] += len(pkt)                   # retransmissions: once)
                f[1] += len(pkt) - ihl - (pkt[ihl + 12] >> 4) * 4 if tcp else 0
                free_at[dst] = start + len(pkt) / rate
                heapq.heappush(due, (free_at[dst] + delay, seq, dst, pkt))
                seq += 1
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, dst, pkt = heapq.heappop(due)
            try:
                os.write(fds[dst], pkt)
            except OSError:
                pass  # the destination's queue is full or it went down: the packet is lost


def main(argv: list[str]) -> None:
    prefix, nodes, delay, rate = argv[0], int(argv[1]), float(argv[2]), float(argv[3])
    fds = [open_tun(f"{prefix}{i}") for i in range(nodes)]
    print("ready", flush=True)
    flows: dict = {}
    relay(fds, delay, rate, sys.stdin.fileno(), flows)
    print(json.dumps([[*k, *v] for k, v in flows.items()]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
