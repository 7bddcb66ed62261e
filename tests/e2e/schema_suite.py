"""Structured-output suite against `kiln serve`, checked by libraries kiln does not contain.

Usage: python schema_suite.py BASE_URL API_KEY MODEL SUITE.json [--compact]

Every JSON-schema case is asked for through the official `openai` SDK with OpenAI's
`response_format` (`json_schema`, strict); every output must end with `finish_reason: "stop"`
and validate against its schema with Python's `jsonschema` (the validator of the schema's
draft). Regex cases (vLLM's `structured_outputs.regex`) must match with Python's `re`, choice
cases (`structured_outputs.choice`) must be one of the choices. `--compact` asks for JSON
without free whitespace (`structured_outputs.disable_any_whitespace`), which random-weight
fixtures need: they would pick whitespace between JSON tokens for ever (a real model gets
kiln's bounded whitespace). Requests are greedy and run 8 at a time, so the server batches
them. Exits non-zero when any case fails, after listing them all.
"""

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
from openai import OpenAI

base_url, api_key, model, suite_path = sys.argv[1:5]
compact = "--compact" in sys.argv[5:]
client = OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=600)
cases = json.load(open(suite_path, encoding="utf-8"))["cases"]


def run(case):
    name, kind, spec = case["name"], case["kind"], case["spec"]
    extra = {}
    kwargs = {}
    if kind == "json_schema":
        kwargs["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": spec, "strict": True},
        }
        if compact:
            extra["structured_outputs"] = {"disable_any_whitespace": True}
        ask = f"Write one JSON value for a '{name.replace('_', ' ')}' record."
    else:
        extra["structured_outputs"] = {kind: spec}
        ask = f"Answer with a {name.split('_', 1)[1]}."
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": ask}],
        max_tokens=400,
        temperature=0,
        extra_body=extra,
        **kwargs,
    )
    choice = r.choices[0]
    text = choice.message.content
    if choice.finish_reason != "stop":
        return f"{name}: finish_reason {choice.finish_reason!r} after {r.usage.completion_tokens} tokens: {text!r}"
    try:
        if kind == "json_schema":
            value = json.loads(text)
            validator = jsonschema.validators.validator_for(spec)
            validator(spec).validate(value)
        elif kind == "regex":
            if not re.fullmatch(spec, text):
                return f"{name}: {text!r} does not match {spec!r}"
        elif text not in spec:
            return f"{name}: {text!r} is not one of {spec!r}"
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{name}: {text!r}: {e}"
    return f"ok: {name}: {text}"


with ThreadPoolExecutor(max_workers=8) as pool:
    results = list(pool.map(run, cases))
failures = [r for r in results if not r.startswith("ok: ")]
for r in results:
    if r.startswith("ok: "):
        print(r)
num_schemas = sum(c["kind"] == "json_schema" for c in cases)
print(f"{len(cases) - len(failures)} of {len(cases)} cases passed ({num_schemas} JSON schemas)")
for f in failures:
    print(f"FAILED: {f}")
sys.exit(1 if failures else 0)
