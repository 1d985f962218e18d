"""Every turn through the proxy is rolled back (a scripted hook): each SDK
call, streaming or not, must read the proxy's notice as an ordinary answer.
Prints the text each call got, as one JSON object."""

import json
import os

from anthropic import Anthropic
from openai import OpenAI

base = os.environ["CRAB_BASE"]
oa = OpenAI(base_url=base + "/v1", api_key="sk-test-openai", max_retries=0, timeout=60)
an = Anthropic(base_url=base, api_key="sk-ant-test", max_retries=0, timeout=60)
say = [{"role": "user", "content": "hi"}]
out = {}
out["chat"] = oa.chat.completions.create(model="m", messages=say).choices[0].message.content
stream = oa.chat.completions.create(model="m", messages=say, stream=True)
out["chat_stream"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
out["messages"] = an.messages.create(model="m", max_tokens=16, messages=say).content[0].text
with an.messages.stream(model="m", max_tokens=16, messages=say) as s:
    out["messages_stream"] = "".join(s.text_stream)
out["responses"] = oa.responses.create(model="m", input="hi").output_text
with oa.responses.stream(model="m", input="hi") as s:
    deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
    final = s.get_final_response().output_text
out["responses_stream"] = deltas if deltas == final else f"{deltas!r} != {final!r}"
with oa.chat.completions.stream(model="m", messages=say) as s:
    out["chat_stream_helper"] = s.get_final_completion().choices[0].message.content
print(json.dumps(out))
