#!/usr/bin/env python3
"""The agent of `crab-bench eval --agent-inside`, run inside its sandbox.

An agent whose shell and memory live in the sandbox (the sandbox's own
process, under crab-init): it asks the LLM what to run through the
sandbox's proxy ($OPENAI_BASE_URL), runs each command with `bash -lc` in
the task's directory, tells the LLM their exit statuses and asks again,
until the LLM says it is done; then it marks the end and waits.

Each request names the agent and its turn, built the same way every time:
an agent restored mid-request asks the same turn again byte for byte, so
the proxy can answer it from the sandbox's transcript. Its header
`x-crab-eval-sent-us` says when it was sent (wall clock): a request its
driver sees after killing the sandbox was sent by the agent it killed if
it was sent before. A failed request is asked again, as an SDK retries (a
proxy that is restoring refuses it).

Environment: CRAB_AGENT_KEY (its name to the LLM), CRAB_AGENT_CWD (where
commands run), CRAB_AGENT_LIMIT (seconds a command may take),
OPENAI_BASE_URL (the shim sets it to the proxy).
"""

import json
import os
import subprocess
import time
import urllib.request

KEY = os.environ["CRAB_AGENT_KEY"]
CWD = os.environ["CRAB_AGENT_CWD"]
LIMIT = os.environ.get("CRAB_AGENT_LIMIT", "60")
URL = os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
DONE = "/tmp/crab-agent.done"

# The proxy is on the sandbox's loopback: no proxy of the environment's.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def ask(turn, statuses):
    """Turn `turn`'s request, after commands that exited with `statuses`;
    answers what the LLM said (a JSON object)."""
    said = json.dumps({"agent": KEY, "turn": turn, "statuses": statuses}, sort_keys=True)
    body = json.dumps(
        {"model": "crab-eval", "messages": [{"role": "user", "content": said}]},
        sort_keys=True,
    ).encode()
    while True:
        headers = {
            "content-type": "application/json",
            "x-crab-eval-sent-us": str(time.time_ns() // 1000),
        }
        request = urllib.request.Request(URL, data=body, headers=headers)
        try:
            with OPENER.open(request, timeout=900) as response:
                answer = json.load(response)
            return json.loads(answer["choices"][0]["message"]["content"])
        except Exception:  # noqa: BLE001 - any failure is asked again
            time.sleep(0.2)


def run(command):
    """Runs `command` as the host-side agent does; answers its status."""
    return subprocess.run(
        ["timeout", "-s", "KILL", LIMIT, "bash", "-lc", command],
        cwd=CWD,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    ).returncode


def main():
    turn, statuses = 1, []
    while True:
        said = ask(turn, statuses)
        if said.get("done"):
            break
        statuses = [run(c) for c in said["commands"]]
        # The turn that ends step s is s + 2 (turn 1 asks for step 0).
        turn = said["step"] + 2
    open(DONE, "w").close()
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
