"""Shared memory against TCP loopback for the bulk channel's payloads (issue 30).

    python benchmarks/shm_channel.py [--mb 512] [--array-mb 32] [--repeat 3] [--slots 4] [--chunk-kb 256 ...]

Two processes on one host move `--mb` MB in chunks, the way the bulk channel moves a step's
tensors, each way it could:

* `tcp`: the sender `sendall`s each chunk of its array (a memoryview, nothing joined) on a
  loopback TCP connection (TCP_NODELAY); the receiver `recv_into`s it.
* `shm`: a ring of `--slots` slots of one chunk each in a shared segment (an mmap of a file in
  /dev/shm, mode 0600); the sender copies a chunk into a free slot and sends an 8-byte note
  (slot, length) on the same TCP connection; the receiver reads the chunk straight from the
  slot and sends a 4-byte note giving the slot back.

Both directions of a sync step, with what the receiver does with a chunk in the runtime:

* `up` (a trainer's grad to its pserver, summed on arrival): the receiver adds the chunk
  into an accumulator of `--array-mb` MB (`tcp`: received into a kept chunk buffer first,
  as `ops.rpc.arrival_sum` does; `shm`: added from the slot).
* `down` (a param to the trainer): the receiver puts the chunk into its param array (`tcp`:
  `recv_into` the array's rows; `shm`: a copy from the slot).

Printed per (direction, chunk size): MB/s and the core-ms per MB of both processes (user +
system CPU, `time.process_time` in each), for each way, medians of `--repeat` interleaved
runs, and the share shm saves. The bulk channel's choice of transport rests on these
figures (docs/runtime.md, "Shared memory, measured").
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import os
import secrets
import socket
import statistics
import struct
import time

import numpy as np

HOST = "127.0.0.1"
NOTE = struct.Struct("<IQ")  # slot, length
FREE = struct.Struct("<I")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = sock.recv(n, socket.MSG_WAITALL)
    if len(data) != n:
        raise ConnectionError("the peer closed")
    return data


def _segment(path: str, size: int, create: bool) -> tuple[mmap.mmap, int]:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    if create:
        os.ftruncate(fd, size)
    return mmap.mmap(fd, size), fd


def _receiver(port: int, way: str, direction: str, total: int, array_bytes: int, chunk: int, slots: int,
              path: str, out: multiprocessing.connection.Connection) -> None:
    sock = socket.create_connection((HOST, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    array = np.ones(array_bytes // 4, np.float32)  # the accumulator (up) or the param (down)
    array_bytes_view = array.view(np.uint8)
    buffer = np.empty(chunk, np.uint8)  # tcp up: the kept chunk buffer
    if way == "shm":
        segment, fd = _segment(path, chunk * slots, create=False)
        slot_arrays = [np.frombuffer(segment, np.uint8, chunk, i * chunk) for i in range(slots)]
    _recv_exact(sock, 1)  # go
    cpu = time.process_time()
    got, off = 0, 0
    while got < total:
        if way == "tcp":
            n = min(chunk, total - got, array_bytes - off)
            if direction == "up":
                view = memoryview(buffer)[:n]
                r = 0
                while r < n:
                    r += sock.recv_into(view[r:])
                np.add(array[off // 4:(off + n) // 4], buffer[:n].view(np.float32), out=array[off // 4:(off + n) // 4])
            else:
                view = memoryview(array_bytes_view)[off:off + n]
                r = 0
                while r < n:
                    r += sock.recv_into(view[r:])
        else:
            slot, n = NOTE.unpack(_recv_exact(sock, NOTE.size))
            data = slot_arrays[slot][:n]
            if direction == "up":
                np.add(array[off // 4:(off + n) // 4], data.view(np.float32), out=array[off // 4:(off + n) // 4])
            else:
                array_bytes_view[off:off + n] = data
            sock.sendall(FREE.pack(slot))
        got += n
        off = (off + n) % array_bytes
    cpu = time.process_time() - cpu
    sock.sendall(b"d")
    out.send(cpu)
    if way == "shm":
        del slot_arrays, data
        segment.close()
        os.close(fd)
    sock.close()


def run(way: str, direction: str, total: int, array_bytes: int, chunk: int, slots: int) -> tuple[float, float]:
    """(MB/s, core-ms per MB of both processes)."""
    path = f"/dev/shm/psbench-{secrets.token_hex(8)}"
    segment = fd = None
    if way == "shm":
        segment, fd = _segment(path, chunk * slots, create=True)
        slot_arrays = [np.frombuffer(segment, np.uint8, chunk, i * chunk) for i in range(slots)]
    source = np.full(array_bytes // 4, 0.5, np.float32).view(np.uint8)  # the grad (up) or the param (down)
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    with socket.create_server((HOST, 0)) as server:
        child = ctx.Process(target=_receiver, args=(server.getsockname()[1], way, direction, total, array_bytes,
                                                    chunk, slots, path, theirs))
        child.start()
        sock, _ = server.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        start, cpu = time.perf_counter(), time.process_time()
        sock.sendall(b"g")
        sent, off = 0, 0
        free = list(range(slots))
        while sent < total:
            n = min(chunk, total - sent, array_bytes - off)
            if way == "tcp":
                sock.sendall(memoryview(source)[off:off + n])
            else:
                if not free:
                    free.append(FREE.unpack(_recv_exact(sock, FREE.size))[0])
                slot = free.pop()
                slot_arrays[slot][:n] = source[off:off + n]
                sock.sendall(NOTE.pack(slot, n))
            sent += n
            off = (off + n) % array_bytes
        while True:  # the receiver's last notes, then its done
            b = _recv_exact(sock, 1)
            if b == b"d":
                break
            _recv_exact(sock, FREE.size - 1)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        cpu += mine.recv()
        child.join()
    finally:
        sock.close()
        if way == "shm":
            del slot_arrays
            segment.close()
            os.close(fd)
            os.unlink(path)
    mb = total / (1 << 20)
    return mb / seconds, cpu * 1000 / mb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=512, help="MB moved per run")
    parser.add_argument("--array-mb", type=int, default=32, help="MB of the source and destination arrays")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--chunk-kb", type=int, action="append", help="chunk sizes (default 256, 512, 1024, 2048)")
    args = parser.parse_args()
    chunks = args.chunk_kb or [256, 512, 1024, 2048]
    total, array_bytes = args.mb << 20, args.array_mb << 20
    print(f"{args.mb} MB a run, arrays of {args.array_mb} MB, {args.slots} slots, medians of {args.repeat} interleaved runs")
    print("| direction | chunk | tcp MB/s | shm MB/s | tcp core-ms/MB | shm core-ms/MB | shm saves |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for direction in ("up", "down"):
        for kb in chunks:
            got: dict[str, list[tuple[float, float]]] = {"tcp": [], "shm": []}
            for _ in range(args.repeat):
                for way in ("tcp", "shm"):
                    got[way].append(run(way, direction, total, array_bytes, kb << 10, args.slots))
            rate = {w: statistics.median(r for r, _ in v) for w, v in got.items()}
            cost = {w: statistics.median(c for _, c in v) for w, v in got.items()}
            print(f"| {direction} | {kb} kB | {rate['tcp']:,.0f} | {rate['shm']:,.0f} | {cost['tcp']:.3f} | "
                  f"{cost['shm']:.3f} | {1 - cost['shm'] / cost['tcp']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
