#!/usr/bin/env python3
"""What a burst of prompts too long for the context costs the other clients of a server.

Sends BURST concurrent completions of SIZE-byte prompts (each far past the context, so each
must be refused) while one client sends short greedy completions one after another; prints
how long the huge ones took to be answered and the short ones' latency (median, max) during
the burst and alone. Any OpenAI-compatible server (kiln, vLLM, llama-server):

    scripts/bench/huge_prompts.py http://127.0.0.1:8000 [BURST=16] [SIZE=4000000] [ROUNDS=3]
"""

import http.client
import json
import statistics
import sys
import threading
import time
from urllib.parse import urlparse


def post(url, body, timeout=600):
    u = urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    start = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    return r.status, time.perf_counter() - start


def short(url):
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    status, took = post(url, body)
    assert status == 200, status
    return took


def main():
    url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000"
    burst = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    size = int(sys.argv[3]) if len(sys.argv) > 3 else 4_000_000
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    huge = {"prompt": ("lorem ipsum " * (size // 12 + 1))[:size], "max_tokens": 1}
    alone = [short(url) for _ in range(8)]
    for r in range(rounds):
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(post(url, huge)))
                   for _ in range(burst)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        during = []
        while any(t.is_alive() for t in threads):
            during.append(short(url))
        for t in threads:
            t.join()
        burst_s = time.perf_counter() - start
        statuses = sorted({s for s, _ in answers})
        print(f"round {r}: {burst} x {size} B answered {statuses} in {burst_s:.2f} s "
              f"(slowest {max(t for _, t in answers):.2f} s); short requests during it: "
              f"{len(during)}, median {statistics.median(during) * 1000:.0f} ms, "
              f"max {max(during) * 1000:.0f} ms")
    print(f"short requests alone: median {statistics.median(alone) * 1000:.0f} ms, "
          f"max {max(alone) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
