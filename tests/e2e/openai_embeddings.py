"""End-to-end check of `kiln serve --runner pooling` with the official `openai` Python SDK.

Usage: python openai_embeddings.py BASE_URL API_KEY MODEL REFERENCE_JSON
Run by crates/kiln/tests/openai_sdk.rs against the tiny qwen3-embed fixture, whose
reference.json holds sentence-transformers' embeddings; exits non-zero on the first failed
check.
"""

import json
import math
import sys

import openai
from openai import OpenAI

base_url, api_key, model, reference_path = sys.argv[1:5]
client = OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0)
reference = json.load(open(reference_path))


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    print(f"ok: {what}")


def close(a, b, tol=1e-4):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol


texts = reference["texts"]
# The SDK asks for base64 by default and decodes it into floats.
r = client.embeddings.create(model=model, input=texts)
check(r.object == "list" and r.model == model, "embeddings.create: a list for the model")
check([d.index for d in r.data] == list(range(len(texts))), "one embedding per input, in order")
check(
    all(close(d.embedding, want) for d, want in zip(r.data, reference["embeddings"])),
    "embeddings (base64, decoded by the SDK) are sentence-transformers' within 1e-4",
)
check(r.usage.prompt_tokens == sum(map(len, reference["prompt_ids"])), "usage counts the tokens")

floats = client.embeddings.create(model=model, input=texts[0], encoding_format="float")
check(floats.data[0].embedding == r.data[0].embedding, "float and base64 give the same vector")

short = client.embeddings.create(model=model, input=texts, dimensions=16)
check(
    all(close(d.embedding, want) for d, want in zip(short.data, reference["embeddings_16"])),
    "dimensions=16 gives the truncated, normalised vectors",
)
check(abs(math.hypot(*short.data[0].embedding) - 1) < 1e-5, "the short vector has unit length")

ids = client.embeddings.create(model=model, input=reference["prompt_ids"])
check([d.embedding for d in ids.data] == [d.embedding for d in r.data], "token ids as input")

try:
    client.embeddings.create(model=model, input="")
    check(False, "an empty input is refused")
except openai.BadRequestError as e:
    check("empty" in str(e), "an empty input is a BadRequestError")

try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    check(False, "a pooling server refuses chat")
except openai.BadRequestError as e:
    check("pooling model" in str(e), "chat on a pooling server is a BadRequestError")
