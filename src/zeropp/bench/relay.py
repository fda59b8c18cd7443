"""Link delay for the emulated cluster: a userspace switch over TUN devices.

The kernel here has no `netem`, so a link with a delay cannot be a veth. Instead
each node's `cl0` is a TUN device: what the node sends leaves through its uplink
(`tbf` at the link rate, in the kernel, as on a veth) into this process, which
holds every packet for `delay` seconds and then writes it into the destination
node's TUN, serialized at the link rate per destination (the downlink, with a
short drop-tail queue as tbf's `latency 20ms`). A constant delay and a FIFO per
destination keep every TCP stream in order.

Run by `Cluster` as `python -m zeropp.bench.relay PREFIX NODES DELAY_S RATE_BYTES_S`;
it prints `ready` once it holds every node's TUN and runs until stdin closes.
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import math
import os
import select
import struct
import sys
import time

from .cluster import enter_netns

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
QUEUE_S = 0.02  # downlink queue bound, as `tbf ... latency 20ms`


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


def relay(fds: list[int], delay: float, rate: float, stop_fd: int) -> None:
    """Forward IPv4 packets between the nodes' TUNs (node i is 10.77.0.<i+1>)."""
    poller = select.poll()
    for fd in fds + [stop_fd]:
        poller.register(fd, select.POLLIN)
    due: list = []           # (deliver at, sequence, destination, packet)
    free_at = [0.0] * len(fds)
    seq = 0
    while True:
        wait_ms = 1000 if not due else max(0, math.ceil((due[0][0] - time.monotonic()) * 1000))
        for fd, _ in poller.poll(wait_ms):
            if fd == stop_fd:
                return
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
                if start - now > QUEUE_S:
                    continue  # the downlink's queue is full: dropped, TCP backs off
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
    relay(fds, delay, rate, sys.stdin.fileno())


if __name__ == "__main__":
    main(sys.argv[1:])
