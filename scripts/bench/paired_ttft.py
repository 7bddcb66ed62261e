#!/usr/bin/env python3
"""The latency a proxy adds, measured in pairs: each pair sends one streaming completion to the
server directly and one through the proxy (in alternating order, back to back, at concurrency
1), so the machine's drift hits both sides alike; TTFT is the time to the first streamed chunk.
Prints the medians, the median of the per-pair differences and its 95 % bootstrap interval.

  paired_ttft.py DIRECT_URL PROXY_URL [--pairs 200] [--input-len 32] [--model NAME] [--out F]

Prompts are random token ids (the server must not cache prefixes, or every pair would hit).
"""

import argparse
import http.client
import json
import random
import statistics
import time
import urllib.parse


def ttft_ms(url, model, prompt):
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, "stream": True,
                       "ignore_eos": True, "temperature": 0})
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"{url}: status {resp.status}: {resp.read()[:200]!r}")
    first = None
    while True:
        line = resp.readline()
        if not line:
            break
        if first is None and line.startswith(b"data: {"):
            first = time.perf_counter()
        if line.startswith(b"data: [DONE]"):
            break
    conn.close()
    if first is None:
        raise SystemExit(f"{url}: no streamed chunk")
    return (first - start) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("direct")
    ap.add_argument("proxy")
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompt = lambda: [rng.randrange(10, 20000) for _ in range(args.input_len)]
    for url in (args.direct, args.proxy):  # warm-up
        ttft_ms(url, args.model, prompt())
    direct, proxy = [], []
    for i in range(args.pairs):
        order = [(args.direct, direct), (args.proxy, proxy)]
        if i % 2:
            order.reverse()
        for url, out in order:
            out.append(ttft_ms(url, args.model, prompt()))
    diffs = [p - d for p, d in zip(proxy, direct)]
    boot = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(2000))
    result = {
        "pairs": args.pairs,
        "direct_p50_ms": statistics.median(direct),
        "proxy_p50_ms": statistics.median(proxy),
        "diff_p50_ms": statistics.median(diffs),
        "diff_p50_ci95_ms": [boot[50], boot[1949]],
    }
    print(f"direct TTFT p50 {result['direct_p50_ms']:.2f} ms, proxy {result['proxy_p50_ms']:.2f} ms; "
          f"paired difference p50 {result['diff_p50_ms']:+.2f} ms "
          f"(95 % CI {boot[50]:+.2f} .. {boot[1949]:+.2f}) over {args.pairs} pairs")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**result, "direct_ms": direct, "proxy_ms": proxy}, f)


if __name__ == "__main__":
    main()
