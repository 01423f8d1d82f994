"""The round's schedule, simulated: from whichever rank starts a round (idle ranks join when a frame reaches
them), every rank ends holding every payload, each frame holds what its receiver expects, and each rank talks
to about log2 n peers."""

from __future__ import annotations

import pytest

from hora.engine.transport.round_schedule import Schedule, doubling, full, schedule


def _simulate(plans: list[Schedule], starter: int) -> list[set[int]]:
    """Run one round: ``starter`` begins; an idle rank begins once any frame reaches it. Each step's frames go
    out, then the rank waits for that step's frames. Returns the payloads each rank holds at the end."""
    n = len(plans)
    held = [{r} for r in range(n)]
    at = [0] * n  # each rank's next step
    sent_step: set[tuple[int, int]] = set()
    queued: dict[tuple[int, int], list[tuple[int, ...]]] = {}  # (to, from) -> frames in order
    awake = [r == starter for r in range(n)]
    moved = True
    while moved:
        moved = False
        for r, plan in enumerate(plans):
            if not awake[r]:
                if not any(queued.get((r, p)) for p in range(n)):
                    continue
                awake[r] = moved = True
            while at[r] < len(plan.steps):
                step = plan.steps[at[r]]
                if (r, at[r]) not in sent_step:
                    for t in step.sends:
                        assert set(t.origins) <= held[r], f"rank {r} sends payloads it does not hold: {t}"
                        queued.setdefault((t.peer, r), []).append(t.origins)
                    sent_step.add((r, at[r]))
                    moved = True
                if not all(queued.get((r, t.peer)) for t in step.receives):
                    break
                for t in step.receives:
                    assert queued[(r, t.peer)].pop(0) == t.origins
                    held[r] |= set(t.origins)
                at[r] += 1
                moved = True
    assert not any(queued.values()), "a frame was sent that nobody reads"
    return held


@pytest.mark.parametrize("size", [*range(1, 34), 64, 100, 128])
def test_doubling_gathers_everything_from_any_starter_over_log_n_peers(size: int) -> None:
    plans = [doubling(r, size) for r in range(size)]
    for rank, plan in enumerate(plans):  # what one side sends is what the other expects, in order
        for peer, frames in plan.sending().items():
            assert [t.origins for t in plans[peer].receiving()[rank]] == [t.origins for t in frames]
    for starter in range(size) if size <= 33 else (0, size - 1):
        assert _simulate(plans, starter) == [set(range(size))] * size, f"started by rank {starter}"
    log2 = max(size.bit_length() - 1, 0)
    assert max((len(p.peers) for p in plans), default=0) <= log2 + 1
    assert max((sum(len(s.sends) + len(s.receives) for s in p.steps) for p in plans), default=0) <= 2 * log2 + 3


@pytest.mark.parametrize("size", [1, 2, 5, 8])
def test_the_full_exchange_is_one_step_with_every_other_rank(size: int) -> None:
    plans = [full(r, size) for r in range(size)]
    assert _simulate(plans, 0) == [set(range(size))] * size
    assert all(p.peers == tuple(r for r in range(size) if r != p.rank) for p in plans)


def test_the_shape_is_chosen_by_the_rank_count() -> None:
    assert schedule(3, 8, full_upto=8).shape == "full"
    assert schedule(3, 9, full_upto=8).shape == "doubling"
