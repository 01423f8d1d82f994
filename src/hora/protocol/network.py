"""Addresses and interfaces, in one place for the launcher, the workers and ``hora check``.

Which address of the launcher the hosts reach (the rendezvous store's), which interface a host uses towards
the store, which address a worker advertises to its peers, each interface's IPv4 address, and listening on
that one address rather than on every interface (:func:`listen_on`).

Standard library only (the agent imports this without hora's core). Linux interface addresses come from
``ioctl``; elsewhere the functions return what they can and callers fall back to the defaults.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import logging
import socket
import struct
from collections.abc import Iterable

from hora.errors import ConfigError

log = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915


def interface_addresses() -> dict[str, str]:
    """IPv4 address of each interface that has one: ``{'lo': '127.0.0.1', 'eth0': '10.0.0.5'}``."""
    found: dict[str, str] = {}
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return found
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def route_source(target: str, family: int = socket.AF_UNSPEC) -> str | None:
    """The local address the kernel would use to reach ``target`` (nothing is sent), or None.

    ``family``: ``socket.AF_INET`` for an IPv4 address only; by default whatever ``target`` resolves to.
    """
    try:
        infos = socket.getaddrinfo(target.strip("[]"), 9, family, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.connect(sockaddr)
                return str(sock.getsockname()[0])
        except OSError:
            continue
    return None


def advertised_address(peer: str) -> str:
    """This host's IPv4 address on the route to ``peer``: the one ``peer`` (and hosts beside it) reach us at.

    Workers advertise it to each other (the negotiators' mesh, the death watch) with the store host as peer.
    Without a route, the address this host's name resolves to.
    """
    return route_source(peer, socket.AF_INET) or socket.gethostbyname(socket.gethostname())


def listen_on(address: str, port: int = 0, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on ``address`` (a name or an IP address of this host) only, so a listener the job
    uses is not offered on every interface of the host (docs/security.md). Where ``address`` is not an address
    of this host (a Kubernetes service's, a NAT's), every interface, as before, with one INFO line.

    Raises:
        OSError: the port is taken (or the address cannot be bound for another reason).
    """
    try:
        infos = socket.getaddrinfo(address.strip("[]"), port, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first: the address hora's launcher hands out
    for family, _, _, _, sockaddr in infos[:1]:
        try:
            return _listening(family, sockaddr, backlog)
        except OSError as e:
            if e.errno != errno.EADDRNOTAVAIL:
                raise
    log.info("%s is not an address of this host: listening on every interface (port %d)", address, port)
    return _listening(socket.AF_INET, ("", port), backlog)


def _listening(family: int, sockaddr: tuple[object, ...], backlog: int) -> socket.socket:
    """A listening socket (``socket.create_server`` without its rewording of bind()'s error)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def interface_of(address: str) -> str | None:
    """The name of the interface holding ``address``, or None."""
    for name, addr in interface_addresses().items():
        if addr == address:
            return name
    return None


def interface_towards(target: str) -> str | None:
    """The interface this host uses to reach ``target`` (e.g. the rendezvous store)."""
    source = route_source(target)
    return interface_of(source) if source else None


def get_driver_ip(nics: Iterable[str] | None = None) -> str:
    """Horovod's ``horovod.runner.util.network.get_driver_ip``: this machine's address on the first of ``nics``
    that has one, else the address its host name resolves to."""
    addrs = interface_addresses()
    for name in nics or ():
        if name in addrs:
            return addrs[name]
    return socket.gethostbyname(socket.gethostname())


def store_address(remote_hosts: list[str], interfaces: tuple[str, ...]) -> str:
    """Pick the address of this machine that the workers connect to for the rendezvous store.

    With ``--network-interface`` it is that interface's address. With only local hosts it is loopback.
    Otherwise it is the source address the kernel routes towards every remote host (they must agree).

    Raises:
        ConfigError: the interface is unknown, or no single address reaches every host.
    """
    if interfaces:
        addrs = interface_addresses()
        for name in interfaces:
            if name in addrs:
                return addrs[name]
        known = ", ".join(sorted(addrs)) or "none found"
        raise ConfigError(f"--network-interface {','.join(interfaces)}: no IPv4 address on this machine "
                          f"for that interface (interfaces: {known}); pick one of them")
    if not remote_hosts:
        return "127.0.0.1"
    sources = {host: route_source(host) for host in remote_hosts}
    unroutable = [h for h, s in sources.items() if s is None]
    if unroutable:
        raise ConfigError(f"host {unroutable[0]}: cannot resolve it or find a route to it from this machine; "
                          "check the name, or pass --network-interface")
    distinct = sorted({s for s in sources.values() if s is not None})
    usable = [a for a in distinct if not ipaddress.ip_address(a).is_loopback] or distinct
    if len(usable) > 1:
        log.warning("hosts are reached from different local addresses %s; using %s for the store "
                    "(pass --network-interface to choose)", usable, usable[0])
    return usable[0]
