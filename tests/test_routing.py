"""Exact and mask routing, with the per-event cache on and off: both must route alike."""

import pytest

from mqks.server.routing import MAX_CACHED_EVENTS, Routing, is_mask

pytestmark = [pytest.mark.timeout(10), pytest.mark.parametrize("cache", [True, False], ids=["cache", "nocache"])]


def test_exact_binding_routes_only_that_event(cache):
    routing = Routing(cache_enabled=cache)
    routing.bind("q1", b"user.created")
    assert routing.route(b"user.created") == ("q1",)
    assert routing.route(b"user.deleted") == ()


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
def test_mask_semantics(cache, mask, event, matches):
    routing = Routing(cache_enabled=cache)
    routing.bind("q", mask)
    assert routing.route(event) == (("q",) if matches else ())


def test_star_without_dot_is_an_exact_name(cache):
    assert not is_mask(b"*")
    routing = Routing(cache_enabled=cache)
    routing.bind("q", b"*")
    assert routing.route(b"anything") == ()
    assert routing.route(b"*") == ("q",)


def test_queue_bound_by_name_and_mask_gets_one_copy(cache):
    routing = Routing(cache_enabled=cache)
    routing.bind("q1", b"user.1.created")
    routing.bind("q1", b"user.*.created")
    routing.bind("q2", b"user.*.created")
    assert sorted(routing.route(b"user.1.created")) == ["q1", "q2"]


def test_unbind_takes_effect_after_a_cached_route(cache):
    routing = Routing(cache_enabled=cache)
    routing.bind("q1", b"e1")
    routing.bind("q2", b"e.*")
    assert routing.route(b"e1") == ("q1",)
    assert routing.route(b"e.x") == ("q2",)
    routing.unbind("q1", b"e1")
    routing.unbind("q2", b"e.*")
    assert routing.route(b"e1") == ()
    assert routing.route(b"e.x") == ()
    assert routing.subscription_count() == 0


def test_new_binding_takes_effect_after_a_cached_miss(cache):
    routing = Routing(cache_enabled=cache)
    assert routing.route(b"a.b") == ()
    routing.bind("q1", b"a.*")
    assert routing.route(b"a.b") == ("q1",)
    routing.bind("q2", b"a.b")
    assert sorted(routing.route(b"a.b")) == ["q1", "q2"]


def test_cache_stays_bounded(cache):
    routing = Routing(cache_enabled=cache)
    routing.bind("q", b"user.*.seen")
    for i in range(MAX_CACHED_EVENTS + 10):
        routing.route(b"user.%d.seen" % i)
    assert len(routing.cache) <= MAX_CACHED_EVENTS
    assert routing.route(b"user.x.seen") == ("q",)
