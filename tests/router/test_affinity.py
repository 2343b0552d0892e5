from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember.router.affinity import SessionAffinity, ring_point
from ember.router.endpoint import NoEndpointError

URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]
SESSIONS = [f"ses_{i:06d}" for i in range(1000)]


def test_the_same_session_always_gets_the_same_endpoint() -> None:
    ring = SessionAffinity(URLS)
    first = {s: ring.lookup(s) for s in SESSIONS}
    assert all(ring.lookup(s) == first[s] for s in SESSIONS)
    # Another router process, endpoints added in another order, agrees.
    other = SessionAffinity(reversed(URLS))
    assert {s: other.lookup(s) for s in SESSIONS} == first


def test_ring_points_are_pinned_across_processes() -> None:
    # blake2b-64, not hash(): every router process and restart puts a session at the same point.
    assert ring_point("ses_1") == 6317158696462146419


def test_removing_an_endpoint_moves_only_its_sessions() -> None:
    ring = SessionAffinity(URLS)
    before = {s: ring.lookup(s) for s in SESSIONS}
    gone = URLS[1]
    ring.remove(gone)
    after = {s: ring.lookup(s) for s in SESSIONS}
    moved = {s for s in SESSIONS if before[s] != after[s]}
    owned = {s for s in SESSIONS if before[s] == gone}
    assert moved == owned and owned
    assert gone not in after.values()
    # and they are spread over the survivors, not dumped on one
    assert len({after[s] for s in owned}) == len(URLS) - 1


def test_adding_an_endpoint_takes_sessions_only_for_itself() -> None:
    ring = SessionAffinity(URLS)
    before = {s: ring.lookup(s) for s in SESSIONS}
    ring.add("http://10.0.0.9:8000")
    after = {s: ring.lookup(s) for s in SESSIONS}
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert moved and all(after[s] == "http://10.0.0.9:8000" for s in moved)
    ring.remove("http://10.0.0.9:8000")
    assert {s: ring.lookup(s) for s in SESSIONS} == before


def test_add_and_remove_are_idempotent() -> None:
    ring = SessionAffinity(URLS)
    before = [ring.lookup(s) for s in SESSIONS]
    ring.add(URLS[0])
    ring.remove("http://not-there")
    assert len(ring) == len(URLS) and [ring.lookup(s) for s in SESSIONS] == before


def test_ten_thousand_sessions_spread_evenly_over_four_endpoints() -> None:
    ring = SessionAffinity(URLS)
    counts = Counter(ring.lookup(f"ses_{i}") for i in range(10_000))
    assert set(counts) == set(URLS)
    assert all(0.75 * 2500 <= c <= 1.25 * 2500 for c in counts.values()), counts


def test_preference_list_starts_at_the_owner_and_lists_each_url_once() -> None:
    ring = SessionAffinity(URLS)
    for s in SESSIONS[:100]:
        pref = ring.preference_list(s)
        assert pref[0] == ring.lookup(s)
        assert sorted(pref) == sorted(URLS)


def test_an_idle_cluster_never_rejects_the_owner() -> None:
    ring = SessionAffinity(URLS)
    idle = dict.fromkeys(URLS, 0.0)
    assert all(ring.choose(s, idle) == ring.lookup(s) for s in SESSIONS)


def test_an_overloaded_owner_is_skipped_for_the_next_endpoint_on_the_ring() -> None:
    ring = SessionAffinity(URLS)
    for s in SESSIONS[:200]:
        owner = ring.lookup(s)
        loads = dict.fromkeys(URLS, 100.0)
        loads[owner] = 1000.0  # mean 325, bound 406.25 at epsilon 0.25
        # The next endpoint on the ring is the one that would own s if the owner were gone.
        without = SessionAffinity(u for u in URLS if u != owner)
        assert ring.choose(s, loads, epsilon=0.25) == without.lookup(s)


def test_a_loaded_owner_within_the_bound_keeps_its_session() -> None:
    ring = SessionAffinity(URLS)
    s = SESSIONS[0]
    owner = ring.lookup(s)
    loads = dict.fromkeys(URLS, 100.0)
    loads[owner] = 130.0  # mean 107.5, bound 134.4
    assert ring.choose(s, loads, epsilon=0.25) == owner
    assert ring.choose(s, loads, epsilon=0.1) != owner  # bound 118.25


def test_unhealthy_endpoints_are_skipped() -> None:
    ring = SessionAffinity(URLS)
    for s in SESSIONS[:200]:
        owner = ring.lookup(s)
        healthy = {u: 0.0 for u in URLS if u != owner}
        assert ring.choose(s, healthy) == ring.preference_list(s)[1]


@given(
    loads=st.lists(st.floats(0.0, 1e6), min_size=4, max_size=4),
    healthy=st.lists(st.booleans(), min_size=4, max_size=4).filter(any),
    epsilon=st.floats(0.0, 2.0),
    session=st.text(max_size=20),
)
def test_choose_takes_the_first_candidate_within_the_bound(
    loads: list[float], healthy: list[bool], epsilon: float, session: str
) -> None:
    ring = SessionAffinity(URLS)
    cand = {u: x for u, x, h in zip(URLS, loads, healthy, strict=True) if h}
    got = ring.choose(session, cand, epsilon=epsilon)
    bound = (1 + epsilon) * sum(cand.values()) / len(cand)
    within = [u for u in ring.preference_list(session) if u in cand and cand[u] <= bound]
    assert got == (within[0] if within else min(cand, key=cand.__getitem__))


def test_bounded_loads_cap_the_busiest_endpoint() -> None:
    # Sessions all hashing to one region would pile up without the bound; with it, no endpoint
    # ends above (1 + epsilon) * mean + one session.
    ring = SessionAffinity(URLS)
    eps = 0.25
    loads = dict.fromkeys(URLS, 0.0)
    hot = [s for s in (f"ses_{i}" for i in range(20_000)) if ring.lookup(s) == URLS[0]][:2000]
    for s in hot:
        loads[ring.choose(s, loads, epsilon=eps)] += 1.0
    mean = sum(loads.values()) / len(loads)
    assert max(loads.values()) <= (1 + eps) * mean + 1
    assert loads[URLS[0]] == max(loads.values())  # the owner still takes the most


def test_empty_ring_and_no_candidates_raise() -> None:
    ring = SessionAffinity()
    with pytest.raises(NoEndpointError):
        ring.lookup("ses_1")
    with pytest.raises(NoEndpointError):
        ring.choose("ses_1", {"http://a": 0.0})
    ring.add("http://a")
    with pytest.raises(NoEndpointError):
        ring.choose("ses_1", {"http://elsewhere": 0.0})
    with pytest.raises(ValueError):
        ring.choose("ses_1", {"http://a": 0.0}, epsilon=-0.1)
