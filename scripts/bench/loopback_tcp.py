#!/usr/bin/env python3
"""Loopback TCP throughput between two sockets (8 MiB writes, 2 GiB): the ceiling of a KV
transfer between two workers on one machine (scripts/bench/pd.sh)."""
import socket, threading, time
N = 2 << 30; CH = 8 << 20
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1); port = srv.getsockname()[1]
def sink():
    c, _ = srv.accept(); buf = bytearray(CH); mv = memoryview(buf); got = 0
    while got < N:
        n = c.recv_into(mv); got += n
threading.Thread(target=sink, daemon=True).start()
s = socket.create_connection(("127.0.0.1", port)); data = b"\0" * CH
t = time.perf_counter(); sent = 0
while sent < N: s.sendall(data); sent += CH
time.sleep(0.05); print(f"loopback TCP {N / (time.perf_counter() - t) / 1e9:.2f} GB/s")
