"""Source of the test plugins that ask their client (written into ``tmp_path`` by ``make_plugin``)."""

from __future__ import annotations

#: Tools that ask, one of each kind; every tool says what it heard in its text result.
ASKER = r'''
import os
import time

import msgspec

from sandbox import current, tool
from sandbox.asking import (CapabilityMissing, ClientRefused, Elicit, InputCancelled, InputTimeout, ListRoots,
                            Sample)


class Confirm(msgspec.Struct):
    ok: bool
    note: str = ""


NAME_FORM = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def _mark(marker):
    if marker:
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")


@tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@tool
def confirm(key: str = "") -> str:
    """Ask for a confirmation with a Struct form; say what came back."""
    try:
        answer = current().elicit("Proceed?", Confirm, key=key)
    except CapabilityMissing as exc:
        return f"missing:{exc.capability}"
    except InputTimeout:
        return "timeout"
    except InputCancelled:
        return "cancelled"
    except ClientRefused as exc:
        return f"refused:{exc}"
    if answer.accepted:
        return f"accept:{type(answer.content).__name__}:{answer.content.ok}:{answer.content.note}"
    return f"{answer.action}:{answer.content!r}"


@tool
def form(marker: str = "") -> str:
    """Ask for a name with a JSON schema form."""
    _mark(marker)
    answer = current().elicit("What is your name?", NAME_FORM, key="name")
    return f"{answer.action}:{answer.content!r}"


@tool
def sample(prompt: str) -> str:
    """Ask the client's model."""
    answer = current().sample(prompt, max_tokens=50, system_prompt="be brief")
    return f"{answer.role}:{answer.model}:{answer.text}"


@tool
def roots() -> str:
    """List the client's roots."""
    return ";".join(f"{r.uri}|{r.name}" for r in current().roots())


@tool
def two_rounds(marker: str = "") -> str:
    """A form, then the model, in two rounds; records each start (one pid a line) in ``marker``."""
    _mark(marker)
    ctx = current()
    name = ctx.elicit("What is your name?", NAME_FORM, key="name")
    who = (name.content or {}).get("name", "nobody") if name.accepted else "nobody"
    greeting = ctx.sample(f"Greet {who}", max_tokens=20, key="greeting")
    return f"pid={os.getpid()} who={who} greeting={greeting.text}"


@tool
def one_round(marker: str = "") -> str:
    """A form, the model and the roots in one round."""
    _mark(marker)
    name, greeting, roots = current().ask(Elicit("Name?", NAME_FORM, key="name"), Sample("Hello", key="greeting"),
                                          ListRoots(key="roots"))
    who = (name.content or {}).get("name", "nobody") if name.accepted else name.action
    return f"pid={os.getpid()} who={who} greeting={greeting.text} roots={len(roots)}"


@tool
def sample_or_say(prompt: str) -> str:
    """Sample, or say which capability the client lacks."""
    try:
        return "sampled:" + current().sample(prompt, max_tokens=10).text
    except CapabilityMissing as exc:
        return f"missing:{exc.capability}:{exc}"


@tool
def must_sample() -> str:
    """Sample without catching anything."""
    return current().sample("hello", max_tokens=10, key="hello").text


@tool
def elicit_then_sample(marker: str = "") -> str:
    """A form (elicitation) and then, whatever happened, the model (sampling)."""
    _mark(marker)
    ctx = current()
    try:
        name = ctx.elicit("Name?", NAME_FORM, key="name")
        who = f"form:{name.action}"
    except CapabilityMissing:
        who = "form:missing"
    greeting = ctx.sample("Hello", max_tokens=10, key="greeting")
    return f"{who} greeting={greeting.text}"


@tool
def patient(before_s: float = 0.0, after_s: float = 0.0, key: str = "wait") -> str:
    """Say the pid (as progress), sleep, ask, sleep: the call's deadline must not run while it waits."""
    current().progress(1, None, f"pid={os.getpid()}")
    time.sleep(before_s)
    try:
        answer = current().elicit("Still there?", NAME_FORM, key=key)
    except InputTimeout as exc:
        return f"timeout:{exc}"
    except InputCancelled as exc:
        return f"cancelled:{exc}"
    time.sleep(after_s)
    return f"{answer.action}:{answer.content!r}"


@tool
def ask_again(same_key: bool = False) -> str:
    """Ask; when that times out, ask something else (under the same key, or a key of its own)."""
    ctx = current()
    try:
        first = ctx.elicit("First?", NAME_FORM, key="again")
        return f"first:{first.action}"
    except InputTimeout:
        pass
    try:
        second = ctx.elicit("Second?", NAME_FORM, key="again" if same_key else "")
    except ClientRefused as exc:
        return f"second:refused:{exc}"
    except ValueError as exc:  # a key names one question for the call's whole life
        return f"second:not asked:{exc}"
    return f"second:{second.action}:{second.content!r}"


@tool
def ask_n(n: int) -> str:
    """Ask ``n`` rounds of one question each (for limits.max_asks)."""
    ctx = current()
    seen = []
    for i in range(n):
        seen.append(ctx.elicit(f"Question {i}?", NAME_FORM, key=f"q{i}").action)
    return ",".join(seen)


@tool
def url() -> str:
    """URL-mode elicitation."""
    try:
        answer = current().elicit_url("https://example.com/login", "Log in, please", key="login")
    except CapabilityMissing as exc:
        return f"missing:{exc}"
    return f"url:{answer.action}"


@tool
def pid() -> str:
    """The worker's process id."""
    return str(os.getpid())
'''

#: A plugin that writes hand-made ``Ask`` frames straight onto its IPC channel (see
#: tests/sandbox/hostile_plugin_source.py for the technique), and tools that ask too much.
HOSTILE_ASK = r'''
import os
import stat
import struct
import time

import msgspec

from sandbox import current, tool
from sandbox.asking import ListRoots

NAME_FORM = {"type": "object", "properties": {"name": {"type": "string"}}}


def _ipc_fd():
    for fd in [3] + [int(n) for n in os.listdir("/proc/self/fd") if int(n) > 3]:
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                return fd
        except OSError:
            pass
    raise RuntimeError("no IPC socket found")


def _ask_frame(call_id, requests):
    body = msgspec.msgpack.encode(["ask", call_id, requests])
    return struct.pack(">I", len(body)) + body


def _deep(depth):
    value = "bottom"
    for _ in range(depth):
        value = {"d": value}
    return value


@tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@tool
def raw_ask(kind: str) -> str:
    """Write a hand-made Ask frame (or two) for the running call, then wait to be stopped."""
    call_id = current().call_id
    form = ["k", "elicitation/create", {"mode": "form", "message": "hand-made", "requestedSchema": NAME_FORM}]
    frames = {
        "unknown_method": [_ask_frame(call_id, [["k", "tools/call", {"name": "x"}]])],
        "duplicate_key": [_ask_frame(call_id, [form, form])],
        "hundred": [_ask_frame(call_id, [[f"k{i}", "roots/list", {}] for i in range(100)])],
        "deep_params": [_ask_frame(call_id, [["k", "sampling/createMessage", {"messages": _deep(300)}]])],
        "bad_key": [_ask_frame(call_id, [["bad\x00key", "roots/list", {}]])],
        "empty": [_ask_frame(call_id, [])],
        "params_not_a_map": [_ask_frame(call_id, [["k", "roots/list", [1, 2]]])],
        "not_running": [_ask_frame(call_id + 1000, [form])],
        "second_while_pending": [_ask_frame(call_id, [form]), _ask_frame(call_id, [["k2", "roots/list", {}]])],
    }[kind]
    fd = _ipc_fd()
    for frame in frames:
        view = memoryview(frame)
        while view:
            view = view[os.write(fd, view):]
    time.sleep(0.3)  # (the daemon reads the frames in order: it sees the Ask before this result anyway)
    return "sent"


@tool
def ask_rounds(n: int) -> str:
    """Ask ``n`` rounds of one question each."""
    for i in range(n):
        current().roots(key=f"r{i}")
    return f"asked {n}"


@tool
def ask_at_once(n: int) -> str:
    """Ask ``n`` questions in one round."""
    current().ask(*[ListRoots(key=f"r{i}") for i in range(n)])
    return f"asked {n} at once"


@tool
def wait_for_name() -> str:
    """An honest tool that asks and waits (a bystander)."""
    answer = current().elicit("Your name?", NAME_FORM, key="name")
    return f"{answer.action}:{answer.content!r}"
'''
