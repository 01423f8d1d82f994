"""The hosts of an elastic job: its settings, host discovery, and the blacklist with cooldown and backoff.

An elastic job's hosts come from ``--host-discovery-script`` (run about once a second; each line of its output
is ``host`` or ``host:slots``) or from a fixed ``-H``/``--hostfile``. A host whose worker failed is
blacklisted: for good, or, with ``--blacklist-cooldown-range MIN MAX``, for a cooldown that doubles with each
failure of that host (from MIN seconds, at most MAX, with up to 25 % random jitter so hosts that failed
together do not come back together).

Example:
    >>> parse_discovery_output("a:2\\n# comment\\nb\\n", default_slots=4, script="d.sh")
    (HostSpec(name='a', slots=2), HostSpec(name='b', slots=4))
    >>> hm = HostManager(cooldown=None)
    >>> hm.update(parse_hosts("a:2,b:2"))
    (['a', 'b'], [])
    >>> hm.blacklist("b", now=0.0)  # no cooldown range: for good
    inf
    >>> [h.name for h in hm.available(now=1.0)]
    ['a']
"""

from __future__ import annotations

import logging
import random
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hora.errors import ConfigError
from hora.launcher import procs
from hora.launcher.hosts import HostSpec, parse_entry, parse_hosts  # noqa: F401 - parse_hosts for the doctest

log = logging.getLogger(__name__)

DISCOVERY_INTERVAL = 1.0  # seconds between two runs of the discovery script
REMOVAL_ANSWERS = 2  # a host is removed once this many discovery answers in a row leave it out
DISCOVERY_TIMEOUT = 30.0  # a discovery run that takes longer is killed (and counts as a failed run)


def parse_discovery_output(text: str, default_slots: int | None, script: str) -> tuple[HostSpec, ...]:
    """The hosts a discovery script printed: ``host`` or ``host:slots`` lines (blank lines, ``#`` comments
    skipped). A host without slots gets ``default_slots`` (``--slots-per-host``), else 1.

    Raises:
        ConfigError: a line that is not a host, or a host printed twice.
    """
    hosts: list[HostSpec] = []
    seen: set[str] = set()
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"--host-discovery-script {script}: output line {lineno}"
        spec = parse_entry(line, where)
        if ":" not in line.rsplit("]", 1)[-1] and default_slots is not None:
            spec = HostSpec(spec.name, default_slots)
        if spec.name in seen:
            raise ConfigError(f"{where}: host {spec.name!r} printed twice; print each host once")
        seen.add(spec.name)
        hosts.append(spec)
    return tuple(hosts)


class DiscoveryError(Exception):
    """One run of the discovery script failed (the job keeps its last hosts and tries again)."""


class HostSource(Protocol):
    """Where an elastic job's hosts come from: a discovery script (:class:`Discovery`), or a cluster framework's
    own view of its nodes (``hora.ray``'s). The driver calls :meth:`run` about once a second."""

    def run(self) -> tuple[HostSpec, ...]:
        """The hosts available now and their slots; :class:`DiscoveryError` when they cannot be read this time."""
        ...

    def stop(self) -> None:
        """The job is ending: stop a run in progress."""
        ...


class HostDiscovery:
    """Horovod's discovery API (``horovod.runner.elastic.discovery.HostDiscovery``): a subclass says which hosts
    are available now, as ``{host: slots}``; an elastic Ray job takes its hosts from one
    (``settings.discovery`` with ``override_discovery=False``), through :class:`DiscoveredHosts`."""

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """``{host: slots}`` of the hosts available now."""
        raise NotImplementedError


class FixedHosts(HostDiscovery):
    """The same hosts every time (Horovod's ``FixedHosts``); :meth:`set` changes them."""

    def __init__(self, host_slots: Mapping[str, int]) -> None:
        self._host_slots = dict(host_slots)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return dict(self._host_slots)

    def set(self, host_slots: Mapping[str, int]) -> None:
        self._host_slots = dict(host_slots)


class HostDiscoveryScript(HostDiscovery):
    """The hosts a discovery script prints (Horovod's ``HostDiscoveryScript``; ``hora run
    --host-discovery-script`` runs one the same way, :class:`Discovery`)."""

    def __init__(self, discovery_script: str, slots: int | None) -> None:
        self._discovery = Discovery(discovery_script, slots)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return {h.name: h.slots for h in self._discovery.run()}


@dataclass
class DiscoveredHosts:
    """A :class:`HostSource` from a :class:`HostDiscovery` (hosts with no slot are left out)."""

    discovery: HostDiscovery

    def run(self) -> tuple[HostSpec, ...]:
        found = self.discovery.find_available_hosts_and_slots()
        return tuple(HostSpec(str(host), int(slots)) for host, slots in found.items() if int(slots) > 0)

    def stop(self) -> None:
        return None


def run_discovery(script: str, default_slots: int | None, cwd: str | None = None,
                  timeout: float = DISCOVERY_TIMEOUT) -> tuple[HostSpec, ...]:
    """Run the discovery script once (see :class:`Discovery`) and parse what it printed.

    Raises:
        DiscoveryError: it failed, timed out or printed something that is not a host list.
    """
    return Discovery(script, default_slots, cwd, timeout).run()


@dataclass
class Discovery:
    """The discovery script of a job, run through the shell (as horovodrun does) in a process group of its own:
    one that outlives its timeout is killed as a group (the shell and whatever it started: a ``curl``, an
    ``aws`` call), and so is one still running when the job ends (:meth:`stop`)."""

    script: str
    default_slots: int | None
    cwd: str | None = None
    timeout: float = DISCOVERY_TIMEOUT
    _running: subprocess.Popen[str] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> tuple[HostSpec, ...]:
        """Run the script once and parse what it printed.

        Raises:
            DiscoveryError: it failed, timed out or printed something that is not a host list.
        """
        try:
            proc = subprocess.Popen(self.script, shell=True, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        except OSError as exc:
            raise DiscoveryError(f"--host-discovery-script {self.script}: cannot run it ({exc.strerror or exc})") \
                from None
        with self._lock:
            self._running = proc
        try:
            out, err = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            raise DiscoveryError(f"--host-discovery-script {self.script}: did not finish within {self.timeout:g}s "
                                 "(it was killed, with every process it started)") from None
        finally:
            with self._lock:
                self._running = None
        if proc.returncode != 0:
            last = (err.strip().splitlines() or ["(nothing on stderr)"])[-1]
            raise DiscoveryError(f"--host-discovery-script {self.script}: exit code {proc.returncode}: {last}")
        try:
            return parse_discovery_output(out, self.default_slots, self.script)
        except ConfigError as exc:
            raise DiscoveryError(str(exc)) from None

    def stop(self) -> None:
        """Kill a run in progress, with every process it started (the job is ending); :meth:`run` reaps it."""
        with self._lock:
            if self._running is not None and self._running.returncode is None:
                procs.signal_groups([self._running.pid], signal.SIGKILL)

    @staticmethod
    def _kill(proc: subprocess.Popen[str]) -> None:
        # the shell leads the group and is not reaped yet, so its group id cannot belong to anyone else
        procs.signal_groups([proc.pid], signal.SIGKILL)
        try:
            proc.communicate(timeout=5.0)
        except (subprocess.TimeoutExpired, ValueError):  # a process of another session holds its pipes
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            proc.wait()


@dataclass
class Absences:
    """Hosts the discovery script stopped listing, until their removal is confirmed: left out of
    :data:`REMOVAL_ANSWERS` answers in a row (a cloud API's one short answer stops no worker).

    Example:
        >>> seen = Absences()
        >>> seen.look({"a"}, ["a", "b"]), seen.look({"a", "b"}, ["a", "b"]), seen.look({"a"}, ["a", "b"])
        ([], [], [])
        >>> seen.look({"a"}, ["a", "b"])
        ['b']
    """

    missing: dict[str, int] = field(default_factory=dict)  # host -> answers in a row without it

    def look(self, listed: set[str], known: Sequence[str]) -> list[str]:
        """Take one answer (the hosts it lists) about the ``known`` hosts; return those whose removal it confirms."""
        for host in [h for h in self.missing if h in listed or h not in known]:
            del self.missing[host]
        confirmed = []
        for host in known:
            if host not in listed:
                self.missing[host] = self.missing.get(host, 0) + 1
                if self.missing[host] >= REMOVAL_ANSWERS:
                    confirmed.append(host)
        return confirmed


@dataclass
class _Blacklisted:
    failures: int  # how many times the host was blacklisted
    until: float  # monotonic time its cooldown ends (inf: for good)
    why: str = ""


@dataclass
class HostManager:
    """The job's current hosts (as last discovered) and its blacklist.

    Args:
        cooldown: ``(MIN, MAX)`` seconds of ``--blacklist-cooldown-range``; None blacklists for good.
        rng: the jitter's source (tests pass a seeded one).
    """

    cooldown: tuple[float, float] | None
    rng: Callable[[], float] = field(default=random.random)
    hosts: dict[str, int] = field(default_factory=dict)  # name -> slots, in discovery order
    blacklisted: dict[str, _Blacklisted] = field(default_factory=dict)

    def update(self, found: Sequence[HostSpec]) -> tuple[list[str], list[str]]:
        """Take a new discovery result; return the hosts (names) added and removed since the last one."""
        new = {h.name: h.slots for h in found}
        added = [name for name in new if name not in self.hosts]
        removed = [name for name in self.hosts if name not in new]
        self.hosts = new
        return added, removed

    def blacklist(self, host: str, now: float, why: str = "") -> float:
        """Blacklist ``host`` (a worker on it failed); return the seconds it stays out (inf: for good)."""
        entry = self.blacklisted.get(host)
        failures = (entry.failures if entry else 0) + 1
        if self.cooldown is None:
            delay = float("inf")
        else:
            low, high = self.cooldown
            delay = min(high, low * 2 ** (failures - 1) * (1.0 + 0.25 * self.rng()))
        self.blacklisted[host] = _Blacklisted(failures, now + delay, why)
        return delay

    def is_blacklisted(self, host: str, now: float) -> bool:
        entry = self.blacklisted.get(host)
        return entry is not None and now < entry.until

    def available(self, now: float) -> list[HostSpec]:
        """The current hosts that are not blacklisted (a host whose cooldown ended is back), in order."""
        return [HostSpec(name, slots) for name, slots in self.hosts.items() if not self.is_blacklisted(name, now)]

    def cooling(self, now: float) -> list[str]:
        """Current hosts blacklisted for a cooldown that will end."""
        return [name for name in self.hosts
                if self.is_blacklisted(name, now) and self.blacklisted[name].until != float("inf")]

    def all_blacklisted_for_good(self, now: float) -> bool:
        """Every current host is blacklisted with no cooldown: nothing can ever run again."""
        return bool(self.hosts) and all(
            self.is_blacklisted(n, now) and self.blacklisted[n].until == float("inf") for n in self.hosts)
