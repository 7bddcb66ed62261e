#!/usr/bin/env python3
"""KV transfer cost between a kiln prefill worker and a kiln decode worker.

For each of N unique random prompts of LEN token ids: a prefill on the prefill worker
(max_tokens 1, kv_transfer_params do_remote_decode), then the same prompt on the decode worker
with the prefill's kv_transfer_params (max_tokens 1), which fetches the blocks; then the decode
worker computes another unique prompt of the same length itself (max_tokens 1), which is what a
transfer saves. Reports, from the decode worker's metrics, the fetch time per prompt
(kiln:kv_transfer_seconds), the bytes moved and their rate, and the recompute time per prompt
(wall time of the request, median).

  pd_transfer.py PREFILL_URL DECODE_URL [N] [LEN]
"""
import json
import random
import statistics
import sys
import time
import urllib.request


def post(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def metrics(url):
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kiln:kv_transfer_seconds_sum") or line.startswith("kiln:kv_transfer_seconds_count"):
            out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("kiln:kv_transfer_bytes_total") and 'direction="received"' in line:
            out["bytes"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("kiln:kv_transfer_blocks_total") and 'direction="received"' in line:
            out["blocks"] = float(line.rsplit(" ", 1)[1])
    return out


def main():
    prefill, decode = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    length = int(sys.argv[4]) if len(sys.argv) > 4 else 1000
    rng = random.Random(7)
    # Ids inside every vocabulary measured (Llama 3's 128,256; Gemma 3's 262,144).
    prompt = lambda: [rng.randrange(1000, 100000) for _ in range(length)]
    body = lambda p: {"prompt": p, "max_tokens": 1, "temperature": 0}
    # Warm both workers (first requests pay page faults).
    for url in (prefill, decode):
        post(url, body(prompt()))
    before = metrics(decode)
    recompute = []
    for _ in range(n):
        p = prompt()
        kv = post(prefill, dict(body(p), kv_transfer_params={"do_remote_decode": True}))
        params = kv["kv_transfer_params"]
        got = post(decode, dict(body(p), kv_transfer_params=params))
        cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (length // 16 - 1) * 16, got["usage"]
        q = prompt()
        t = time.perf_counter()
        post(decode, body(q))
        recompute.append(time.perf_counter() - t)
    after = metrics(decode)
    d = lambda k: after[k] - before.get(k, 0.0)
    fetches = d("kiln:kv_transfer_seconds_count")
    seconds = d("kiln:kv_transfer_seconds_sum")
    moved = d("bytes")
    print(json.dumps({
        "prompts": n,
        "prompt_tokens": length,
        "blocks_per_prompt": d("blocks") / fetches,
        "bytes_per_prompt": moved / fetches,
        "fetch_ms_per_prompt": 1e3 * seconds / fetches,
        "fetch_gb_per_s": moved / seconds / 1e9,
        "recompute_ms_per_prompt_median": 1e3 * statistics.median(recompute),
    }, indent=1))


if __name__ == "__main__":
    main()
