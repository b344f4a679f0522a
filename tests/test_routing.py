"""Exact and mask routing, with the per-event cache on and off: both must route alike.

Every lookup goes through `route()`, which asks twice: with the cache on, the second answer
is the cached one; with it off, both are computed and nothing may be kept. Routing each
event once would run the same computing path in both modes and never tell them apart.
"""

import pytest

from mqks.server.routing import MAX_CACHED_EVENTS, Routing, is_mask

pytestmark = [pytest.mark.timeout(10), pytest.mark.parametrize("cache", [True, False], ids=["cache", "nocache"])]


@pytest.fixture
def routing(cache: bool) -> Routing:
    routing = Routing(cache_enabled=cache)
    assert routing.cache_enabled is cache  # route() below takes the mode from here
    return routing


def route(routing: Routing, event: bytes) -> tuple:
    """The queues for `event`, computed and then read again (from the cache when it is on)."""
    computed = routing.route(event)
    if routing.cache_enabled:
        assert routing.cache.get(event) == computed, "the route was not cached"
    else:
        assert routing.cache == {}, "the cache is off, yet routes were kept"
    again = routing.route(event)
    assert again == computed
    return again


def test_exact_binding_routes_only_that_event(routing):
    routing.bind("q1", b"user.created")
    assert route(routing, b"user.created") == ("q1",)
    assert route(routing, b"user.deleted") == ()


@pytest.mark.parametrize(
    "mask, event, matches",
    [
        (b"*.updated", b"user.updated", True),
        (b"*.updated", b"comment.updated", True),
        (b"*.updated", b"user.123.updated", False),
        (b"document.*", b"document.created", True),
        (b"document.*", b"document", False),
        (b"user.*.connected", b"user.57e82b3931d9d614f0247ac7.connected", True),
        (b"user.*.connected", b"user.1.disconnected", False),
        (b"*.*.deleted", b"post.123.deleted", True),
        (b"*.*.deleted", b"category.subcategory.deleted", True),
        (b"*.*.deleted", b"deleted", False),
        (b"e5.*.a1", b"e5.id1.a1", True),
        (b"a+b.*", b"a+b.c", True),  # regex characters in a mask are literal
        (b"a+b.*", b"aab.c", False),
    ],
)
def test_mask_semantics(routing, mask, event, matches):
    routing.bind("q", mask)
    assert route(routing, event) == (("q",) if matches else ())


def test_star_without_dot_is_an_exact_name(routing):
    assert not is_mask(b"*")
    routing.bind("q", b"*")
    assert route(routing, b"anything") == ()
    assert route(routing, b"*") == ("q",)


def test_queue_bound_by_name_and_mask_gets_one_copy(routing):
    routing.bind("q1", b"user.1.created")
    routing.bind("q1", b"user.*.created")
    routing.bind("q2", b"user.*.created")
    assert sorted(route(routing, b"user.1.created")) == ["q1", "q2"]


def test_unbind_takes_effect_after_a_cached_route(routing):
    routing.bind("q1", b"e1")
    routing.bind("q2", b"e.*")
    assert route(routing, b"e1") == ("q1",)
    assert route(routing, b"e.x") == ("q2",)
    routing.unbind("q1", b"e1")
    routing.unbind("q2", b"e.*")
    assert route(routing, b"e1") == ()
    assert route(routing, b"e.x") == ()
    assert routing.subscription_count() == 0


def test_new_binding_takes_effect_after_a_cached_miss(routing):
    assert route(routing, b"a.b") == ()
    routing.bind("q1", b"a.*")
    assert route(routing, b"a.b") == ("q1",)
    routing.bind("q2", b"a.b")
    assert sorted(route(routing, b"a.b")) == ["q1", "q2"]


def test_cache_stays_bounded(routing):
    routing.bind("q", b"user.*.seen")
    for i in range(MAX_CACHED_EVENTS + 10):
        routing.route(b"user.%d.seen" % i)  # once each: this fills the cache
    assert len(routing.cache) <= MAX_CACHED_EVENTS
    assert route(routing, b"user.x.seen") == ("q",)
