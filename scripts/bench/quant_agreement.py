#!/usr/bin/env python3
"""kiln against llama.cpp on one quantized GGUF, teacher-forced: llama-server greedy-decodes
the default model's reference prompts (tests/fixtures/reference/gemma3-270m-greedy.json) and
the texts of EXTRA_PROMPTS (tokenized by llama-server) with its top 5 log-probabilities per step, then kiln serves the same file and scores llama.cpp's
tokens through `prompt_logprobs`. Prints the top-1 agreement (and how many of the
disagreements are where llama.cpp's top 1 leads its top 2 by more than 1 nat) and the mean
|Δ logprob| over llama.cpp's top 5.

    python3 scripts/bench/quant_agreement.py KILN LLAMA_SERVER FILE.gguf [STEPS]

Steps where llama-server reports no probabilities of its own (a byte token ending incomplete
UTF-8) are skipped, as in scripts/fixtures/llama_server_reference.py. KILN_ARGS adds arguments
to `kiln serve` (`--quantization f32` scores with the weights dequantized exactly, no int8
activations). Standard library only.
"""

import json
import os
import subprocess
import sys
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "fixtures"))
from llama_server_reference import aligned, free_port, post, wait_ready  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
EXTRA_PROMPTS = [
    "The three primary colors of light are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<start_of_turn>user\nWhat is the capital of Australia? Answer in one sentence."
    "<end_of_turn>\n<start_of_turn>model\n",
    "Water boils at 100 degrees Celsius at sea level, but on a high mountain",
    "List five animals that live in the ocean:\n1.",
]


def serve(cmd, port):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(port, proc)
    return proc


def main():
    kiln, server, path = sys.argv[1:4]
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 48
    ref = json.load(open(os.path.join(ROOT, "tests/fixtures/reference/gemma3-270m-greedy.json")))
    prompts = [c["prompt_ids"] for c in ref["cases"]]

    port = free_port()
    proc = serve([server, "-m", path, "-t", "2", "-c", "4096", "--host", "127.0.0.1",
                  "--port", str(port), "--no-webui"], port)
    try:
        for text in EXTRA_PROMPTS:
            r = post(port, "/tokenize", {"content": text, "add_special": True,
                                         "parse_special": True})
            prompts.append(r["tokens"])
        llama = []
        for prompt in prompts:
            r = post(port, "/completion", {
                "prompt": prompt, "n_predict": steps, "temperature": 0.0, "n_probs": 5,
                "cache_prompt": False, "return_tokens": True, "seed": 0, "ignore_eos": True,
                "post_sampling_probs": False,
            })
            llama.append((r["tokens"], aligned(r["tokens"], r["completion_probabilities"])))
    finally:
        proc.terminate()
        proc.wait()

    port = free_port()
    extra = os.environ.get("KILN_ARGS", "").split()
    proc = serve([kiln, "serve", path, "--host", "127.0.0.1", "--port", str(port),
                  "--threads", "2", *extra], port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        agree = total = clear_misses = 0
        dsum = dcount = 0
        for prompt, (tokens, top5) in zip(prompts, llama):
            r = post(port, "/v1/completions", {
                "model": model, "prompt": prompt + tokens, "max_tokens": 1,
                "prompt_logprobs": 20, "temperature": 0.0,
            })
            plp = r["choices"][0]["prompt_logprobs"]
            for i, ref_top in enumerate(top5):
                if ref_top is None:
                    continue
                # The distribution after position len(prompt) + i - 1 scores token i.
                ours = plp[len(prompt) + i]
                if ours is None:
                    continue
                best = next(int(k) for k, v in ours.items() if v["rank"] == 1)
                ours = {int(k): v["logprob"] for k, v in ours.items()}
                total += 1
                agree += best == ref_top[0][0]
                clear_misses += best != ref_top[0][0] and ref_top[0][1] - ref_top[1][1] > 1.0
                for tid, lp in ref_top:
                    if tid in ours:
                        dsum += abs(ours[tid] - lp)
                        dcount += 1
        print(f"{os.path.basename(path)}: top-1 {agree}/{total} ({100 * agree / total:.1f} %), "
              f"mean |dlogprob| over llama.cpp's top 5 {dsum / dcount:.4f} "
              f"({dcount} of {5 * total} in kiln's top 20); {clear_misses} disagreements where "
              f"llama.cpp leads by more than 1 nat")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
