"""End-to-end check of `kiln serve`'s /v1/messages with the official `anthropic` Python SDK.

Usage: python anthropic_sdk.py BASE_URL API_KEY MODEL
Run by crates/kiln/tests/anthropic_sdk.rs against the tiny llama3 fixture; exits non-zero on
the first failed check.
"""

import sys
import typing

from typing import Literal

import anthropic
from anthropic import Anthropic
from anthropic.types import RawMessageStreamEvent
from pydantic import BaseModel

base_url, api_key, model = sys.argv[1], sys.argv[2], sys.argv[3]
client = Anthropic(base_url=base_url, api_key=api_key, max_retries=0)
messages = [{"role": "user", "content": "Hello there"}]
# This SDK has no sampling parameters (newer Claude models take none); kiln still reads them.
greedy = {"temperature": 0}


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")
    print(f"ok: {what}")


# Whole: a text block, Anthropic's usage and stop reason.
msg = client.messages.create(
    model=model, system="Be brief.", messages=messages, max_tokens=8, extra_body=greedy
)
check(msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "text", "messages.create")
check(msg.usage.output_tokens <= 8 and msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 0,
      "messages usage")
check(msg.stop_reason == ("max_tokens" if msg.usage.output_tokens == 8 else "end_turn"), "messages stop_reason")

# count_tokens counts the prompt the message was computed from.
counted = client.messages.count_tokens(model=model, system="Be brief.", messages=messages)
check(counted.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0),
      "messages.count_tokens")

# Streamed: every event one of the SDK's typed events; the SDK's accumulator builds the same
# message.
event_types = typing.get_args(typing.get_args(RawMessageStreamEvent)[0])
raw = list(client.messages.create(
    model=model, system="Be brief.", messages=messages, max_tokens=8, extra_body=greedy, stream=True
))
check(all(isinstance(e, event_types) for e in raw), "stream events are typed events")
check(raw[0].type == "message_start" and raw[-1].type == "message_stop", "stream event order")
with client.messages.stream(
    model=model, system="Be brief.", messages=messages, max_tokens=8, extra_body=greedy
) as stream:
    streamed = stream.get_final_message()
check([b.model_dump() for b in streamed.content] == [b.model_dump() for b in msg.content],
      "messages.stream final message == whole message")
check(streamed.stop_reason == msg.stop_reason, "stream stop_reason")

# A forced tool: a tool_use block with a parsed input, and its result sent back.
tools = [{
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
    },
}]
forced = {"type": "tool", "name": "get_weather"}
called = client.messages.create(
    model=model, messages=messages, tools=tools, tool_choice=forced, max_tokens=120, extra_body=greedy
)
use = [b for b in called.content if b.type == "tool_use"][0]
check(use.name == "get_weather" and 1 <= use.input["days"] <= 7, "forced tool_use block")
with client.messages.stream(
    model=model, messages=messages, tools=tools, tool_choice=forced, max_tokens=120, extra_body=greedy
) as stream:
    streamed_use = [b for b in stream.get_final_message().content if b.type == "tool_use"][0]
check(streamed_use.input == use.input, "streamed tool_use input == whole")
after = client.messages.create(
    model=model, max_tokens=4, extra_body=greedy, tools=tools, tool_choice={"type": "none"},
    messages=messages + [
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "4 degrees"}]},
    ],
)
check(after.usage.output_tokens <= 4, "tool_result round trip")

# Structured output: the SDK's pydantic model as output_config.format, parsed back. (The SDK
# moves numeric bounds into descriptions, as Claude takes no `minimum`: none here.)
class Small(BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


parsed = client.messages.parse(
    model=model, messages=[{"role": "user", "content": "Is 7 prime?"}], output_format=Small,
    max_tokens=60, extra_body=greedy,
)
check(isinstance(parsed.parsed_output, Small), "messages.parse with pydantic")

# Errors the SDK maps to its exception types.
try:
    client.messages.create(model="claude-nope", messages=messages, max_tokens=4)
    check(False, "unknown model is refused")
except anthropic.NotFoundError:
    check(True, "NotFoundError for an unknown model")
try:
    client.messages.create(model=model, messages=messages, max_tokens=4, extra_body={"top_k": -3})
    check(False, "a bad top_k is refused")
except anthropic.BadRequestError:
    check(True, "BadRequestError for a bad value")
try:
    Anthropic(base_url=base_url, api_key="wrong", max_retries=0).messages.create(
        model=model, messages=messages, max_tokens=4
    )
    check(False, "wrong key is refused")
except anthropic.AuthenticationError:
    check(True, "AuthenticationError for a wrong key")
print("all anthropic SDK checks passed")
