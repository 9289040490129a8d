"""Secrets a plugin never sees: the manifest binds a secret to a host, the operator supplies its value.

A plugin declares what it needs and where it may go (``plugin.toml``)::

    [permissions]
    network = ["api.github.com:443"]

    [secrets.GITHUB_TOKEN]
    host = "api.github.com"

The operator supplies the value outside the plugin folder (the daemon's config)::

    [secrets]
    GITHUB_TOKEN = { env = "GH_TOKEN" }                 # the daemon's environment
    # GITHUB_TOKEN = { file = "/run/secrets/gh" }        # a file (a mounted Kubernetes Secret)
    # GITHUB_TOKEN = { credential = "gh" }               # systemd: $CREDENTIALS_DIRECTORY/gh
    # GITHUB_TOKEN = { env = "GH_TOKEN", hosts = ["api.github.com"] }   # and only ever to these hosts

How it is enforced:

* The worker's environment holds ``GITHUB_TOKEN=<placeholder>``: ``toolcell-secret-`` and 32 hex
  digits, an HMAC of the plugin and secret names under a key drawn at random when the daemon starts.
  The value itself is read by the daemon only and never sent to a worker.
* The egress proxy (``runtime.egress``) terminates TLS for a ``CONNECT`` to a bound host with a
  certificate from the daemon's own CA (``runtime.egress_tls``; only workers of plugins with secrets
  trust it), checks the real host's certificate on the way out, and replaces the placeholder by the
  value in each request's headers and target; in each response, the value by the placeholder (so a
  host that echoes it does not hand it to the plugin). Request bodies are not rewritten.
* A placeholder sent anywhere else -- another host, or the bound host over plain HTTP -- is sent as
  it is: only a verified TLS connection to the bound host ever carries the value.
* A secret bound to a host outside the plugin's network grant is refused when the manifest is read;
  one the operator supplies no value for (or forbids for that host) is refused when the plugin loads.
  Values are never logged; the ``egress`` log line names the secrets put into a request.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import msgspec

from runtime.egress_rules import Entry, ip_literal, normalize_host
from runtime.egress_tls import CA_VARS, EgressCA, EgressTLSError
from runtime.logs import log
from sandbox.isolation.egress import NO_PROXY_VARS, PROXY_VARS

#: What the worker sees in place of a value.
PLACEHOLDER_PREFIX = "toolcell-secret-"
#: An operator's secret file larger than this is refused (a token is well under 1 KiB).
MAX_VALUE_BYTES = 16 * 1024
CREDENTIALS_DIRECTORY = "CREDENTIALS_DIRECTORY"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_CREDENTIAL = re.compile(r"^[A-Za-z0-9_.@:-]{1,255}$")
#: Visible ASCII and spaces: a value with a line break or a control character would split a header.
_VALUE = re.compile(rb"^[\x20-\x7e]+$")


class SecretError(Exception):
    """A secret that cannot be used; ``reason`` says what to fix (it never holds a value)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SecretSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[secrets.NAME]`` in a manifest: the host the secret is sent to (a name or an IP address)."""

    host: str


class SecretSource(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[secrets] NAME = {...}`` in the daemon's config: where the value comes from (exactly one)."""

    #: A variable of the daemon's own environment.
    env: str | None = None
    #: An absolute path (a mounted Kubernetes Secret, a Docker secret, ...).
    file: str | None = None
    #: A systemd credential: ``$CREDENTIALS_DIRECTORY/NAME`` (``LoadCredential=``/``SetCredential=``).
    credential: str | None = None
    #: When given: the only hosts a plugin may bind this secret to.
    hosts: list[str] | None = None
    #: When given: the only plugins (by name) that may use this secret at all; any other plugin that
    #: declares it is refused at load, whatever host it names and whoever approves it.
    plugins: list[str] | None = None


def check_sources(sources: Mapping[str, SecretSource]) -> list[str]:
    """What is wrong with the config's ``[secrets]`` table, one sentence each."""
    problems = []
    for name, src in sources.items():
        where = f"secrets.{name}"
        if not _NAME.match(name):
            problems.append(f"{where}: not a variable name")
        given = [k for k in ("env", "file", "credential") if getattr(src, k) is not None]
        if len(given) != 1:
            problems.append(f"{where}: give exactly one of env, file or credential (got {', '.join(given) or 'none'})")
        if src.env is not None and not _NAME.match(src.env):
            problems.append(f"{where}.env: {src.env!r} is not a variable name")
        if src.file is not None and not src.file.startswith("/"):
            problems.append(f"{where}.file: {src.file!r} must be an absolute path")
        if src.credential is not None and (not _CREDENTIAL.match(src.credential) or src.credential in (".", "..")):
            problems.append(f"{where}.credential: {src.credential!r} is not a credential name")
        for host in src.hosts or []:
            try:
                normalize_host(host)
            except ValueError as exc:
                problems.append(f"{where}.hosts: {exc}")
    return problems


def check_bindings(specs: Mapping[str, SecretSpec], grant: Iterable[Entry], env_names: Iterable[str],
                   reserved: Iterable[str] = ()) -> list[str]:
    """What is wrong with a manifest's ``[secrets]`` (``grant``: its parsed network entries)."""
    problems = []
    entries = list(grant)
    taken, reserved_ = set(env_names), {*reserved, *CA_VARS, *PROXY_VARS, *NO_PROXY_VARS, "TOOLCELL_WORKER"}
    for name, spec in specs.items():
        where = f"secrets.{name}"
        if not _NAME.match(name):
            problems.append(f"{where}: not a variable name")
            continue
        if name in taken:
            problems.append(f"{where}: {name} is also in [env]; a variable is either a secret or not")
        if name in reserved_ or name.startswith(("PYTHON", "LD_")):
            problems.append(f"{where}: {name} is set by toolcell itself")
        try:
            host = binding_host(spec.host)
        except ValueError as exc:
            problems.append(f"{where}.host: {exc}")
            continue
        if not any(_reaches(e, host) for e in entries):
            granted = ", ".join(str(e) for e in entries) or "nothing"
            problems.append(f"{where}: host {host} is outside the plugin's network grant (permissions.network "
                            f"allows {granted}): a secret may only be bound to a host the plugin can reach")
    return problems


def binding_host(text: str) -> str:
    """A binding's host, normalised; raises ``ValueError`` (no port, no wildcard: one exact host)."""
    if "*" in text:
        raise ValueError(f"{text!r}: bind a secret to one exact host, not a wildcard")
    if ":" in text and ip_literal(text) is None:
        raise ValueError(f"{text!r}: a host name, without a port (it is sent on every granted port)")
    return normalize_host(text)


def _reaches(entry: Entry, host: str) -> bool:
    if entry.kind == "wildcard":
        return host.endswith(entry.host[1:]) and ip_literal(host) is None
    return entry.host == host


def read_value(name: str, src: SecretSource, environ: Mapping[str, str] | None = None) -> bytes:
    """The operator's value of secret ``name``; raises ``SecretError`` saying what is missing."""
    environ = os.environ if environ is None else environ
    if src.env is not None:
        raw = environ.get(src.env)
        if raw is None:
            raise SecretError(f"secret {name}: the daemon's environment has no {src.env} (the config's "
                              f"[secrets] {name} = {{ env = \"{src.env}\" }})")
        data = raw.encode("utf-8", "surrogateescape")
    else:
        path = value_path(src, environ)
        if path is None:
            raise SecretError(f"secret {name}: credential {src.credential!r} asked for, but ${CREDENTIALS_DIRECTORY} "
                              "is not set (run the daemon under systemd with LoadCredential=)")
        what = f"file {src.file}" if src.file is not None else \
            f"credential {src.credential} ({os.path.dirname(path)})"
        data = _read_file(name, path, what)
        data = data[:-2] if data.endswith(b"\r\n") else data[:-1] if data.endswith(b"\n") else data
    if not data:
        raise SecretError(f"secret {name}: the value from the {_source_words(src)} is empty")
    if not _VALUE.match(data):
        raise SecretError(f"secret {name}: the value from the {_source_words(src)} holds a line break, a control or "
                          "a non-ASCII character (it is sent in an HTTP header)")
    return data


def value_path(src: SecretSource, environ: Mapping[str, str]) -> str | None:
    """The file a value is kept in: ``file``, or ``credential`` under ``$CREDENTIALS_DIRECTORY`` (None
    when that is not set, or for a value from the environment)."""
    if src.file is not None:
        return src.file
    base = environ.get(CREDENTIALS_DIRECTORY)
    return os.path.join(base, str(src.credential)) if base and src.credential is not None else None


def _source_words(src: SecretSource) -> str:
    return (f"environment variable {src.env}" if src.env is not None else
            f"file {src.file}" if src.file is not None else f"credential {src.credential}")


def _read_file(name: str, path: str, what: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise SecretError(f"secret {name}: the {what} cannot be read: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SecretError(f"secret {name}: the {what} is not a regular file")
        data = os.read(fd, MAX_VALUE_BYTES + 1)
    except OSError as exc:
        raise SecretError(f"secret {name}: the {what} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_VALUE_BYTES:
        raise SecretError(f"secret {name}: the {what} is larger than {MAX_VALUE_BYTES} bytes")
    return data


@dataclass(frozen=True)
class Binding:
    """One secret of one plugin: the host it goes to, what the worker sees, and (daemon-side) the value."""

    name: str
    host: str
    placeholder: bytes
    value: bytes = field(repr=False)


@dataclass(frozen=True)
class PluginSecrets:
    """A plugin's bindings, as the proxy applies them and the worker's environment shows them."""

    bindings: tuple[Binding, ...]
    #: The daemon's egress CA (its leaves for the bound hosts, the upstream context, the workers' bundle).
    ca: EgressCA | None = None
    #: The binding with the operator's current value (``SecretStore.current``): a value kept in a file
    #: is read again when the file changed, so a rotated secret is used from the next connection.
    current: Callable[[Binding], Binding] | None = field(default=None, repr=False, compare=False)

    def for_host(self, host: str) -> tuple[Binding, ...]:
        """The bindings whose host is ``host`` (as a CONNECT names it), with their current values."""
        try:
            name = normalize_host(host)
        except ValueError:
            return ()
        found = tuple(b for b in self.bindings if b.host == name)
        return tuple(self.current(b) for b in found) if self.current is not None else found

    def worker_env(self) -> dict[str, str]:
        """What the worker's environment gets: each secret's placeholder, and the CA bundle it trusts."""
        env = {b.name: b.placeholder.decode("ascii") for b in self.bindings}
        if self.ca is not None:
            env.update(self.ca.worker_env())
        return env

    def read_paths(self) -> list[str]:
        """Files the worker must be able to read (the CA bundle)."""
        return [self.ca.bundle_path] if self.ca is not None else []


def substitute(data: bytes, bindings: Iterable[Binding]) -> tuple[bytes, list[str]]:
    """``data`` with every placeholder of ``bindings`` replaced by its value; the names put in."""
    used = []
    for b in bindings:
        if b.placeholder in data:
            data = data.replace(b.placeholder, b.value)
            used.append(b.name)
    return data, used


class Masker:
    """``mask`` over a stream of chunks: a value split across two chunks is still caught (the tail that
    could begin one is held back, unmasked, until the next chunk or ``flush``)."""

    def __init__(self, bindings: Iterable[Binding]) -> None:
        values = sorted({b.value for b in bindings}, key=len, reverse=True)
        self.placeholders = {b.value: b.placeholder for b in bindings}
        self.pattern = re.compile(b"|".join(re.escape(v) for v in values)) if values else None
        self.keep = max((len(v) for v in values), default=1) - 1
        self.held = b""

    def feed(self, data: bytes) -> bytes:
        raw = self.held + data
        if self.pattern is None:
            self.held = b""
            return raw
        out, pos = [], 0
        for m in self.pattern.finditer(raw):
            out += [raw[pos:m.start()], self.placeholders[m.group()]]
            pos = m.end()
        tail = raw[pos:]
        cut = max(0, len(tail) - self.keep)
        out.append(tail[:cut])
        self.held = tail[cut:]
        return b"".join(out)

    def flush(self) -> bytes:
        out, self.held = self.held, b""
        return out


def mask(data: bytes, bindings: Iterable[Binding]) -> bytes:
    """``data`` with every value of ``bindings`` replaced by its placeholder (what a host sends back)."""
    masker = Masker(bindings)
    return masker.feed(data) + masker.flush()


class SecretStore:
    """The daemon's secrets: the operator's sources, and the per-daemon key placeholders are made with."""

    def __init__(self, sources: Mapping[str, SecretSource], state_dir: str, upstream_ca_file: str | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.sources = dict(sources)
        self.state_dir = state_dir
        self.upstream_ca_file = upstream_ca_file
        self.environ = environ
        self._key = secrets.token_bytes(32)
        self._ca: EgressCA | None = None
        #: Values kept in files, by secret name: the file's stat signature when read, and the value.
        self._read: dict[str, tuple[tuple[int, int, int, int], bytes]] = {}
        #: The last problem reading each secret again (said once, not at every connection).
        self._reread_problem: dict[str, str] = {}

    def ca(self) -> EgressCA:
        """The egress CA, made or read on first use; raises ``SecretError``."""
        if self._ca is None:
            try:
                self._ca = EgressCA(self.state_dir, self.upstream_ca_file)
            except EgressTLSError as exc:
                raise SecretError(f"secrets: {exc}") from None
        return self._ca

    def current(self, binding: Binding) -> Binding:
        """``binding`` with the operator's value as it is now: a file that changed since it was read
        (a mounted Kubernetes Secret updated in place, a rotated credential) is read again, with the
        checks of the first read; if that fails, the last good value stays and the problem is logged."""
        src = self.sources.get(binding.name)
        # A value from the daemon's environment does not change: only a file's is looked at again.
        path = value_path(src, os.environ if self.environ is None else self.environ) if src is not None else None
        if src is None or path is None:
            return binding
        try:
            st = os.stat(path)
            signature = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            signature = (0, 0, -1, 0)
        known = self._read.get(binding.name)
        if known is not None and known[0] == signature:
            return binding if known[1] == binding.value else replace(binding, value=known[1])
        try:
            value = read_value(binding.name, src, self.environ)
        except SecretError as exc:
            if self._reread_problem.get(binding.name) != exc.reason:
                self._reread_problem[binding.name] = exc.reason
                log("secret_reread_failed", level="error", secret=binding.name, error=exc.reason,
                    note="the value read before is used until the file is readable again")
            return binding if known is None else replace(binding, value=known[1])
        self._reread_problem.pop(binding.name, None)
        if known is not None and known[1] != value:
            log("secret_value_changed", secret=binding.name, note="used from the next connection")
        self._read[binding.name] = (signature, value)
        return replace(binding, value=value)

    def placeholder(self, plugin: str, name: str) -> bytes:
        digest = hmac.new(self._key, f"{plugin}\0{name}".encode(), hashlib.sha256).hexdigest()[:32]
        return (PLACEHOLDER_PREFIX + digest).encode("ascii")

    def for_plugin(self, plugin: str, specs: Mapping[str, SecretSpec]) -> PluginSecrets:
        """``plugin``'s bindings with their values; raises ``SecretError`` listing every problem."""
        problems, bindings = [], []
        for name, spec in sorted(specs.items()):
            src = self.sources.get(name)
            if src is None:
                problems.append(f"secret {name}: the operator supplies no value (add it to the daemon's config: "
                                f"[secrets] {name} = {{ env = \"...\" }}, {{ file = \"...\" }} or {{ credential = \"...\" }})")
                continue
            if src.plugins is not None and plugin not in src.plugins:
                problems.append(f"secret {name}: the operator allows it only to plugin(s) {', '.join(src.plugins)}, "
                                f"not {plugin}")
                continue
            host = binding_host(spec.host)  # checked with the manifest
            if src.hosts is not None and host not in {normalize_host(h) for h in src.hosts}:
                problems.append(f"secret {name}: the operator allows it only to {', '.join(src.hosts)}, not {host}")
                continue
            try:
                value = read_value(name, src, self.environ)
            except SecretError as exc:
                problems.append(exc.reason)
                continue
            bindings.append(Binding(name, host, self.placeholder(plugin, name), value))
        if problems:
            raise SecretError("; ".join(problems))
        return PluginSecrets(tuple(bindings), self.ca(), self.current)
