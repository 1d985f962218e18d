# The processes of the terminal mix of `crab-bench eval` (terminal.toml):
# long-lived servers whose state lives in memory, the kind an agent starts
# and keeps talking to across turns. Every server answers one request per
# connection on the sandbox's loopback; `STATE` reads its memory without
# changing it (what the evaluation compares after a recovery).
#   tools.py kv PORT          key-value store: set K V | get K | STATE
#   tools.py repl PORT        a Python namespace kept across requests: CODE | STATE
#   tools.py db PORT FILE     a daemon writing SQLite: add TEXT | STATE
#   tools.py shell PORT       one bash kept across requests (cd, export): CMD | STATE
#   tools.py ask PORT TEXT    a client: sends TEXT, prints the answer
#   tools.py up PORT          waits (5 s at most) until PORT answers
import contextlib
import io
import os
import socket
import sqlite3
import subprocess
import sys
import time


def serve(port, handle):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(16)
    while True:
        c, _ = s.accept()
        with c:
            data = b""
            while not data.endswith(b"\0"):
                chunk = c.recv(65536)
                if not chunk:
                    break
                data += chunk
            req = data.rstrip(b"\0").decode()
            c.sendall(handle(req).encode())


def kv():
    store = {}

    def handle(req):
        words = req.split(None, 2)
        if req == "STATE":
            return " ".join(f"{k}={v}" for k, v in sorted(store.items()))
        if words[:1] == ["set"] and len(words) == 3:
            store[words[1]] = words[2]
            return "ok"
        if words[:1] == ["get"] and len(words) == 2:
            return store.get(words[1], "-")
        return "ping" if req == "ping" else "?"

    return handle


def repl():
    ns = {}

    def handle(req):
        if req == "STATE":
            names = sorted(k for k in ns if not k.startswith("_"))
            return " ".join(f"{k}={ns[k]!r}" for k in names if not callable(ns[k]))
        if req == "ping":
            return "ping"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                exec(req, ns)
            except Exception as e:
                print(f"error: {e!r}")
        return out.getvalue()

    return handle


def db(path):
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("create table if not exists notes (id integer primary key, text text)")
    served = [0]

    def handle(req):
        if req == "STATE":
            rows = con.execute("select count(*) from notes").fetchone()[0]
            return f"rows={rows} served={served[0]}"
        if req == "ping":
            return "ping"
        if req.startswith("add "):
            served[0] += 1
            con.execute("insert into notes (text) values (?)", (req[4:],))
            return str(served[0])
        return "?"

    return handle


def shell():
    sh = subprocess.Popen(
        ["bash", "--norc", "--noprofile"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def run(cmd):
        sh.stdin.write(cmd + "\necho __crab_end__\n")
        sh.stdin.flush()
        lines = []
        for line in sh.stdout:
            if line == "__crab_end__\n":
                break
            lines.append(line)
        return "".join(lines)

    def handle(req):
        if req == "STATE":
            return run("pwd; env | grep '^APP_' | sort")
        return "ping" if req == "ping" else run(req)

    return handle


def ask(port, text):
    c = socket.create_connection(("127.0.0.1", port), timeout=30)
    c.sendall(text.encode() + b"\0")
    c.shutdown(socket.SHUT_WR)
    data = b""
    while chunk := c.recv(65536):
        data += chunk
    return data.decode()


def main():
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "ask":
        sys.stdout.write(ask(port, sys.argv[3]))
        return
    if mode == "up":
        for _ in range(100):
            with contextlib.suppress(OSError):
                if ask(port, "ping") == "ping":
                    return
            time.sleep(0.05)
        sys.exit(f"nothing answers on {port}")
    handlers = {"kv": kv, "repl": repl, "shell": shell}
    handle = db(sys.argv[3]) if mode == "db" else handlers[mode]()
    serve(port, handle)


main()
