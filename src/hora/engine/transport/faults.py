"""What goes wrong on a control connection, whichever plane carries it: a peer is gone (:class:`PeerLost`) or a
frame failed its checks (:class:`BadFrame`). The rounds catch both and turn them into the user's errors."""

from __future__ import annotations

from hora.errors import CollectiveError


class PeerLost(CollectiveError):
    """A rank is gone: its control connection closed or broke (its process ended or its link went down), or
    a peer's loss notice said so."""

    def __init__(self, peer: int, why: str) -> None:
        super().__init__(f"rank {peer}'s control connection {why}")
        self.peer = peer


class BadFrame(CollectiveError):
    """A peer's control frame failed a check (its tag, its number, its size): the connection was tampered
    with, or the peer is broken. The round fails on this rank, naming the peer."""

    def __init__(self, rank: int, peer: int, where: str, why: str) -> None:
        super().__init__(f"rank {rank}: the control connection from rank {peer} ({where}) {why}; the job cannot "
                         "trust its negotiation any more")
        self.peer = peer
