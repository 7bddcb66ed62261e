"""End-to-end check of `kiln serve` with the official `openai` Python SDK.

Usage: python openai_sdk.py BASE_URL API_KEY MODEL
Run by crates/kiln/tests/openai_sdk.rs against the tiny llama3 fixture; exits non-zero on the
first failed check.
"""

import json
import sys
import typing
from typing import Literal

import openai
from openai import OpenAI
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel, Field

base_url, api_key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0)
greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}
messages = [{"role": "user", "content": "Hello there"}]


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    print(f"ok: {what}")


check([m.id for m in client.models.list().data] == [model], "models.list")
check(client.models.retrieve(model).id == model, "models.retrieve")
try:
    client.models.retrieve("no-such-model")
    check(False, "models.retrieve of an unknown name fails")
except openai.NotFoundError:
    check(True, "models.retrieve of an unknown name is NotFoundError")

# Chat, not streaming.
chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, **greedy)
text = chat.choices[0].message.content
check(chat.choices[0].finish_reason == "length", "chat finish_reason length")
check(chat.usage.completion_tokens == 8 and chat.usage.prompt_tokens > 0, "chat usage")

# Chat, streaming with usage: same text, a final usage chunk with no choices.
chunks = list(
    client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, stream=True,
        stream_options={"include_usage": True}, **greedy,
    )
)
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
check(streamed == text, "chat stream text == non-stream text")
check(chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8, "stream usage chunk")
check([c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length", "stream finish")

# Completions with logprobs, and chat with top_logprobs.
comp = client.completions.create(model=model, prompt="Once upon", max_tokens=6, logprobs=2, **greedy)
lp = comp.choices[0].logprobs
check(len(lp.tokens) == 6 and len(lp.token_logprobs) == 6, "completion logprobs length")
check(all(len(t) <= 2 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs), "completion top_logprobs")
chat_lp = client.chat.completions.create(
    model=model, messages=messages, max_tokens=4, logprobs=True, top_logprobs=2, **greedy
)
content = chat_lp.choices[0].logprobs.content
check(len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content), "chat top_logprobs")

# n=2 with a seed: two choices, reproducible.
def sample():
    r = client.completions.create(
        model=model, prompt="The cat", n=2, seed=1234, temperature=1.0, max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    return [c.text for c in sorted(r.choices, key=lambda c: c.index)]


first = sample()
check(len(first) == 2 and sample() == first, "n=2 with seed is reproducible")

# Stop strings: the output ends right before the stop string.
full = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, **greedy).choices[0].text
mid = len(full) // 2
stop = full[mid : mid + 3]
cut = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, stop=[stop], **greedy)
check(cut.choices[0].text == full[: full.index(stop)], "stop string cut")
check(cut.choices[0].finish_reason == "stop", "stop finish_reason")

# Structured output parsed by the SDK into a pydantic model. Compact JSON: the fixture's random
# weights would otherwise pick whitespace between JSON tokens for ever.
class Verdict(BaseModel):
    answer: Literal["yes", "no", "maybe"]
    confidence: int = Field(ge=0, le=9)
    tags: list[Literal["a", "b"]] = Field(max_length=2)


compact = {"structured_outputs": {"disable_any_whitespace": True}}
parsed = client.chat.completions.parse(
    model=model, messages=messages, response_format=Verdict, max_tokens=120, temperature=0,
    extra_body=compact,
)
verdict = parsed.choices[0].message.parsed
check(isinstance(verdict, Verdict) and 0 <= verdict.confidence <= 9, "chat.completions.parse with pydantic")

# A tool call forced by a named tool_choice, whole and streamed (assembled by the SDK).
tools = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}]
forced = {"type": "function", "function": {"name": "get_weather"}}
whole = client.chat.completions.create(
    model=model, messages=messages, tools=tools, tool_choice=forced, max_tokens=120, temperature=0
)
call = whole.choices[0].message.tool_calls[0]
args = json.loads(call.function.arguments)
check(call.function.name == "get_weather" and 1 <= args["days"] <= 7 and len(args["city"]) <= 6, "forced tool call")
with client.chat.completions.stream(
    model=model, messages=messages, tools=tools, tool_choice=forced, max_tokens=120, temperature=0
) as stream:
    final = stream.get_final_completion()
streamed_call = final.choices[0].message.tool_calls[0]
check(
    (streamed_call.function.name, streamed_call.function.arguments) == (call.function.name, call.function.arguments),
    "streamed tool call assembled by the SDK == whole",
)
# The round trip: the call and its result go back into the conversation.
history = messages + [
    {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 4})},
]
after = client.chat.completions.create(model=model, messages=history, tools=tools, tool_choice="none", max_tokens=4, **greedy)
check(after.choices[0].message.content is not None and after.usage.completion_tokens == 4, "tool result round trip")

# The Responses API. Whole: a message item the SDK reads as output_text.
resp = client.responses.create(
    model=model, instructions="Be brief.", input="Hello there", max_output_tokens=8, temperature=0
)
check(resp.object == "response" and resp.output[-1].type == "message", "responses.create")
check(resp.usage.output_tokens <= 8 and resp.usage.input_tokens > 0, "responses usage")
check(resp.status == ("incomplete" if resp.usage.output_tokens == 8 else "completed"), "responses status")
check(client.responses.retrieve(resp.id).output_text == resp.output_text, "responses.retrieve")

# Streamed: every event one of the SDK's typed events, the text deltas adding up to the
# whole response's text, the last event carrying that response.
event_types = typing.get_args(typing.get_args(ResponseStreamEvent)[0])
events = list(client.responses.create(
    model=model, instructions="Be brief.", input="Hello there", max_output_tokens=8, temperature=0,
    stream=True,
))
check(all(isinstance(e, event_types) for e in events), "responses stream events are typed events")
check([e.sequence_number for e in events] == list(range(len(events))), "responses sequence numbers")
streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
check(streamed == resp.output_text, "responses stream text == whole text")
check(events[-1].type in ("response.completed", "response.incomplete") and events[-1].response.output_text == streamed,
      "responses final event")

# A forced function tool, streamed and assembled by the SDK's accumulator; the result goes
# back by previous_response_id.
fn_tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
             "parameters": t["function"]["parameters"], "strict": True} for t in tools]
fn_choice = {"type": "function", "name": "get_weather"}
with client.responses.stream(
    model=model, input="Weather in Oslo for 2 days?", tools=fn_tools, tool_choice=fn_choice,
    max_output_tokens=120, temperature=0,
) as stream:
    final = stream.get_final_response()
fn_call = [item for item in final.output if item.type == "function_call"][0]
fn_args = json.loads(fn_call.arguments)
check(fn_call.name == "get_weather" and 1 <= fn_args["days"] <= 7, "responses.stream forced function call")
whole_call = client.responses.create(
    model=model, input="Weather in Oslo for 2 days?", tools=fn_tools, tool_choice=fn_choice,
    max_output_tokens=120, temperature=0,
).output[0]
check(whole_call.arguments == fn_call.arguments, "responses streamed call == whole call")
after = client.responses.create(
    model=model, previous_response_id=final.id, tools=fn_tools, tool_choice="none",
    input=[{"type": "function_call_output", "call_id": fn_call.call_id, "output": json.dumps({"temp": 4})}],
    max_output_tokens=4, temperature=0,
)
check(after.previous_response_id == final.id and after.usage.input_tokens > final.usage.input_tokens,
      "responses previous_response_id continues the conversation")

# Structured output parsed by the SDK, and log-probabilities.
class Small(BaseModel):
    answer: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=9)


parsed = client.responses.parse(
    model=model, input="Is 7 prime?", text_format=Small, max_output_tokens=60, temperature=0
)
check(isinstance(parsed.output_parsed, Small), "responses.parse with pydantic")
lp = client.responses.create(
    model=model, input="Hello there", max_output_tokens=4, temperature=0,
    include=["message.output_text.logprobs"], top_logprobs=2,
)
lps = lp.output[0].content[0].logprobs
check(len(lps) == lp.usage.output_tokens and all(len(t.top_logprobs) == 2 for t in lps), "responses logprobs")
client.responses.delete(resp.id)
try:
    client.responses.retrieve(resp.id)
    check(False, "a deleted response is gone")
except openai.NotFoundError:
    check(True, "responses.delete")

# Errors the SDK maps to its exception types.
try:
    client.completions.create(model=model, prompt="x", max_tokens=10**9)
    check(False, "too long is refused")
except openai.BadRequestError as e:
    check("maximum context length" in str(e), "BadRequestError for too long")
try:
    client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    check(False, "unknown model is refused")
except openai.NotFoundError:
    check(True, "NotFoundError for an unknown model")
try:
    OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    check(False, "wrong key is refused")
except openai.AuthenticationError:
    check(True, "AuthenticationError for a wrong key")
print("all openai SDK checks passed")
