"""Drives the proxy with the official OpenAI and Anthropic Python SDKs.

Run by proxy/tests/sdk.rs with CRAB_BASE=http://127.0.0.1:PORT, and by
proxy/tests/sdk_in_sandbox.rs inside a crab sandbox with no CRAB_BASE: the
SDKs then find the proxy through OPENAI_BASE_URL/ANTHROPIC_BASE_URL, which
the shim put into the sandbox. Prints one JSON object with what each call
returned. Any SDK error fails the script.
"""

import json
import os
import sys

import anthropic
import openai

base = os.environ.get("CRAB_BASE")
out = {"openai_version": openai.__version__, "anthropic_version": anthropic.__version__}

oa = openai.OpenAI(base_url=base + "/v1" if base else None, api_key="sk-test-openai", max_retries=0)
msgs = [{"role": "user", "content": "hi"}]

r = oa.chat.completions.create(model="gpt-test", messages=msgs)
out["chat"] = r.choices[0].message.content

parts = []
for chunk in oa.chat.completions.create(model="gpt-test", messages=msgs, stream=True):
    if chunk.choices and chunk.choices[0].delta.content:
        parts.append(chunk.choices[0].delta.content)
out["chat_stream"] = "".join(parts)

tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
r = oa.chat.completions.create(model="gpt-test", messages=msgs, tools=tools)
out["chat_tool_call"] = r.choices[0].message.tool_calls[0].function.name

r = oa.responses.create(model="gpt-test", input="hi")
out["responses"] = r.output_text

out["models"] = [m.id for m in oa.models.list()]

an = anthropic.Anthropic(base_url=base, api_key="sk-ant-test", max_retries=0)
r = an.messages.create(model="claude-test", max_tokens=64, messages=msgs)
out["messages"] = r.content[0].text

with an.messages.stream(model="claude-test", max_tokens=64, messages=msgs) as stream:
    out["messages_stream"] = "".join(stream.text_stream)

out["count_tokens"] = an.messages.count_tokens(model="claude-test", messages=msgs).input_tokens

try:
    an.messages.create(model="status-429", max_tokens=64, messages=msgs)
    out["rate_limited"] = None
except anthropic.RateLimitError as e:
    out["rate_limited"] = e.status_code

json.dump(out, sys.stdout)
