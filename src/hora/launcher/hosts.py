"""Hosts and slots: ``-H``/``--hostfile`` parsing and Horovod's rank assignment, as pure functions.

Example:
    >>> hosts = parse_hosts("a:2,b:2")
    >>> [(s.rank, s.hostname, s.local_rank, s.cross_rank) for s in assign_slots(hosts, 3)]
    [(0, 'a', 0, 0), (1, 'a', 1, 0), (2, 'b', 0, 1)]
"""

from __future__ import annotations

import re
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

from hora.errors import ConfigError
from hora.protocol.topology import derive_topology

# A host name, an IPv4 address, or a bracketed IPv6 address.
_HOST_RE = re.compile(r"^(\[[0-9A-Fa-f:.%a-zA-Z0-9]+\]|[A-Za-z0-9_.\-]+)$")
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]", "localhost.localdomain"})


@dataclass(frozen=True, slots=True)
class HostSpec:
    """One host and how many workers (slots) it takes."""

    name: str
    slots: int
    slots_given: bool = field(default=True, compare=False)  # False: written without ":slots" (so 1 slot)

    @property
    def is_local(self) -> bool:
        """True for names that mean this machine (started without ssh): localhost, loopback addresses and
        this machine's own host name."""
        return self.name in LOCAL_NAMES or self.name.startswith("127.") or self.name == socket.gethostname()


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """Where one rank runs and its place in the job (Horovod's rank/local/cross numbering)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    host_index: int


def parse_entry(entry: str, where: str) -> HostSpec:
    """One ``host`` or ``host:slots`` entry (an IPv6 address in brackets); ``where`` names it in errors."""
    entry = entry.strip()
    if not entry:
        raise ConfigError(f"{where}: empty host entry; write host:slots entries separated by commas, "
                          "e.g. -H node1:4,node2:4")
    slots_text: str | None = None
    if entry.startswith("["):
        name, close, rest = entry.partition("]")
        name += close
        if rest.startswith(":"):
            slots_text = rest[1:]
        elif rest:
            raise ConfigError(f"{where}: cannot read {entry!r}; write [address]:slots")
    elif entry.count(":") > 1:
        raise ConfigError(f"{where}: IPv6 address {entry!r} needs brackets, e.g. [{entry}]:2")
    elif ":" in entry:
        name, _, slots_text = entry.partition(":")
    else:
        name = entry
    if slots_text == "":
        raise ConfigError(f"{where}: missing slot count after ':' in {entry!r}; write host:slots, e.g. {name}:2")
    if not _HOST_RE.match(name):
        raise ConfigError(f"{where}: {name!r} is not a valid host name or address")
    if slots_text is None:
        return HostSpec(name, 1, slots_given=False)
    return HostSpec(name, _parse_slots(slots_text, name, entry, where))


def _parse_slots(text: str, host: str, entry: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise ConfigError(f"{where}: slot count {text!r} in {entry!r} is not an integer") from None
    if slots < 1:
        raise ConfigError(f"{where}: host {host!r} has {slots} slots; each host needs at least 1 slot")
    return slots


def _check_unique(hosts: list[HostSpec], where: str) -> tuple[HostSpec, ...]:
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise ConfigError(f"{where}: host {host.name!r} is listed twice; list each host once "
                              "with its total slot count")
        seen.add(host.name)
    if not hosts:
        raise ConfigError(f"{where}: no hosts given")
    return tuple(hosts)


def parse_hosts(text: str) -> tuple[HostSpec, ...]:
    """Parse ``-H``: ``host[:slots],host[:slots],...`` (slots default to 1)."""
    where = f"-H {text!r}"
    return _check_unique([parse_entry(e, where) for e in text.split(",")], where)


def parse_hostfile_text(text: str, path: str) -> tuple[HostSpec, ...]:
    """Parse a hostfile's text: ``host slots=N`` or ``host:N`` or ``host`` lines; ``#`` comments."""
    hosts: list[HostSpec] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"hostfile {path} line {lineno}"
        fields = line.split()
        if len(fields) == 1:
            hosts.append(parse_entry(fields[0], where))
            continue
        m = re.fullmatch(r"slots\s*=\s*(\S+)", " ".join(fields[1:]))
        if not m:
            raise ConfigError(f"{where}: cannot read {line!r}; write 'host slots=N' or 'host:N'")
        spec = parse_entry(fields[0], where)
        hosts.append(HostSpec(spec.name, _parse_slots(m.group(1), spec.name, line, where)))
    return _check_unique(hosts, f"hostfile {path}")


def parse_hostfile(path: str) -> tuple[HostSpec, ...]:
    """Read and parse a hostfile; a missing or unreadable file is a :class:`ConfigError`."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"--hostfile {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"--hostfile {path}: is a directory, not a hostfile") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ConfigError(f"--hostfile {path}: cannot read it ({reason})") from None
    return parse_hostfile_text(text, path)


def hosts_from(hosts: str | None, hostfile: str | None, np: int | None = None,
               flags: tuple[str, str] = ("-H", "--hostfile")) -> tuple[HostSpec, ...]:
    """The job's hosts: ``-H``'s list, else the hostfile's, else this machine (``localhost`` with ``np`` slots).

    ``flags``: how the caller names the two options in the error when both are given.

    Raises:
        ConfigError: both are given, or either cannot be read.
    """
    if hosts is not None and hostfile is not None:
        raise ConfigError(f"{flags[0]} and {flags[1]} both given; use only one of them")
    if hosts is not None:
        return parse_hosts(hosts)
    if hostfile is not None:
        return parse_hostfile(hostfile)
    return (HostSpec("localhost", np or 1),)


_TRAILING_DIGITS = re.compile(r"(.*?\D)(\d+)")


def missing_colon(host: HostSpec) -> str | None:
    """``name:N`` when ``host`` reads like a ``host:slots`` entry whose colon was left out (``localhost2``): written
    without a slot count, and this machine's name followed by digits; else None.

    Example:
        >>> missing_colon(parse_hosts("localhost2")[0]), missing_colon(parse_hosts("node2")[0])
        ('localhost:2', None)
    """
    found = _TRAILING_DIGITS.fullmatch(host.name)
    if host.slots_given or found is None:
        return None
    name = found.group(1)
    return f"{name}:{found.group(2)}" if name in LOCAL_NAMES or name == socket.gethostname() else None


def check_missing_colons(hosts: tuple[HostSpec, ...], flag: str) -> None:
    """Refuse, before anything is started (no ssh), a host that reads like ``host:slots`` without its colon and
    that no resolver knows (``-H localhost2``).

    Raises:
        ConfigError: naming the host, the entry it probably meant and the ``host:slots`` form.
    """
    for host in hosts:
        meant = missing_colon(host)
        if meant is not None and not _resolves(host.name):
            raise ConfigError(f"{flag}: host {host.name!r} does not resolve; did you mean {meant}? Give slots as "
                              f"host:slots, with a colon (-H {meant})")


def _resolves(name: str, timeout_s: float = 3.0) -> bool:
    """Whether ``name`` resolves within ``timeout_s`` (a resolver that does not answer counts as no)."""
    answer: list[bool] = []

    def look_up() -> None:
        try:
            socket.getaddrinfo(name, None)
            answer.append(True)
        except (OSError, UnicodeError):
            answer.append(False)

    thread = threading.Thread(target=look_up, name="hora-resolve", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(answer and answer[0])


def _unsized(hosts: tuple[HostSpec, ...] | list[HostSpec]) -> str:
    """Why the hosts offer fewer slots than expected, when some were written without a slot count."""
    unsized = [h for h in hosts if not h.slots_given]
    if not unsized:
        return ""
    names = ", ".join(h.name for h in unsized[:3]) + (", ..." if len(unsized) > 3 else "")
    guesses = [g for g in map(missing_colon, unsized) if g]
    guess = f"; did you mean {guesses[0]}?" if guesses else ""
    return f" ({names} {'is' if len(unsized) == 1 else 'are'} written without :slots, so 1 slot each{guess})"


def assign_slots(hosts: tuple[HostSpec, ...] | list[HostSpec], np: int) -> list[SlotInfo]:
    """Give ranks ``0..np-1`` to the hosts' slots in order, Horovod's way.

    Ranks fill each host before the next; ``local_rank`` is the index on the host; ``cross_rank`` is the
    index of the host among the hosts that have a rank with that ``local_rank``. ``np`` caps the workers.
    """
    total = sum(h.slots for h in hosts)
    if np < 1:
        raise ConfigError(f"-np {np}: the number of processes must be at least 1")
    if np > total:
        raise ConfigError(f"-np {np} is more than the {total} slot{'s' if total > 1 else ''} the hosts offer"
                          f"{_unsized(hosts)}; lower -np or add slots (-H host:slots)")
    placed: list[tuple[int, int]] = []  # (host_index, local_rank)
    for index, host in enumerate(hosts):
        for local in range(host.slots):
            if len(placed) < np:
                placed.append((index, local))
    keys = [str(host_index) for host_index, _ in placed]  # hosts by position: two may share a name
    names = [hosts[host_index].name for host_index, _ in placed]
    slots = []
    for rank, (host_index, _) in enumerate(placed):
        t = derive_topology(keys, names, rank)  # the same numbering init() derives in the workers
        slots.append(SlotInfo(rank=rank, size=np, local_rank=t.local_rank, local_size=t.local_size,
                              cross_rank=t.cross_rank, cross_size=t.cross_size, hostname=names[rank],
                              host_index=host_index))
    return slots
