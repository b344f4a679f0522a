"""Exact and mask routing, with the per-event cache on and off: both must route alike.

Every lookup goes through `route()`, which asks twice: with the cache on, the second answer
is the cached one; with it off, both are computed and nothing may be kept. Routing each
event once would run the same computing path in both modes and never tell them apart.
The mask trie is also checked against a brute-force matcher on random bindings and events.
"""

import random

import pytest

from mqks.server.core.routing import MAX_CACHED_EVENTS, Routing, is_mask

pytestmark = [pytest.mark.timeout(10), pytest.mark.core,
              pytest.mark.parametrize("cache", [True, False], ids=["cache", "nocache"])]


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
        (b"a.*.b", b"a..b", True),  # `*` matches an empty run too
        (b"*.a", b".a", True),
        (b"a.*", b"a.", True),
        (b".*", b".", True),
        (b"*.*", b"a", False),
        (b"user.*", b"user.*", True),  # an event may hold a `*`: the mask's `*` matches it
        (b"us*r.created", b"user.created", True),  # `*` inside a token (the spec's wording allows it)
        (b"us*r.created", b"usr.created", True),
        (b"us*r.created", b"us.r.created", False),
        (b"us*r.created", b"user.created.x", False),
        (b"e5.id*.a1", b"e5.id1.a1", True),
        (b"e5.id*.a1", b"e5.id.a1", True),
        (b"e5.id*.a1", b"e5.xid1.a1", False),
        (b"e5.id*.a1", b"e5.id1.a2", False),
        (b"*x*.*", b"axb.c", True),
        (b"*x*.*", b"ab.c", False),
        (b"**.b", b"a.b", True),
        (b"a.b*c*d", b"a.bcd", True),
        (b"a.b*c*d", b"a.bxcxd", True),
        (b"a.b*c*d", b"a.bxdxc", False),
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


def test_route_lists_exact_queues_then_masks_in_the_order_they_were_first_bound(routing):
    routing.bind("m2", b"a.*.c")
    routing.bind("m1", b"*.b.c")
    routing.bind("x", b"a.b.c")
    routing.bind("m3", b"a.b.*")
    routing.bind("m1", b"a.*.c")  # already listed through *.b.c: one copy, in that place
    assert route(routing, b"a.b.c") == ("x", "m2", "m1", "m3")
    routing.unbind("m2", b"a.*.c")
    routing.unbind("m1", b"a.*.c")
    routing.bind("m2", b"a.*.c")  # bound anew: now the newest mask
    assert route(routing, b"a.b.c") == ("x", "m1", "m3", "m2")


def test_unbinding_every_mask_leaves_an_empty_trie(routing):
    masks = [b"a.*.c", b"a.*", b"a.b*.c", b"*.*.c", b"a.**", b".*", b"*.", b"a..*"]
    for queue in ("q1", "q2"):
        for mask in masks:
            routing.bind(queue, mask)
    routing.unbind("q1", b"a.nothing.*")  # never bound: no effect
    routing.unbind("q3", b"a.*.c")  # a queue the mask never had: no effect
    assert routing.subscription_count() == len(masks)
    for queue in ("q2", "q1"):
        for mask in masks:
            routing.unbind(queue, mask)
    assert routing.subscription_count() == 0
    assert routing.root.is_empty()
    assert route(routing, b"a.b.c") == ()


def test_many_masks_route_one_event_to_the_one_that_matches(routing):
    for k in range(10_000):
        routing.bind(f"q{k}", b"svc%d.*.created" % k)
        routing.bind(f"p{k}", b"*.svc%d.id*" % k)
    assert route(routing, b"svc42.u1f.created") == ("q42",)
    assert route(routing, b"u1f.svc42.id7") == ("p42",)
    assert route(routing, b"svc42.u1f.deleted") == ()


def matches(mask: bytes, event: bytes) -> bool:
    """The reference: `*` eats any run of characters but dots, one character at a time; dotless events never match."""
    if b"." not in event:
        return False

    def match_from(i: int, j: int) -> bool:
        if i == len(mask):
            return j == len(event)
        if mask[i] == ord("*"):
            k = j
            while True:
                if match_from(i + 1, k):
                    return True
                if k == len(event) or event[k] == ord("."):
                    return False
                k += 1
        return j < len(event) and mask[i] == event[j] and match_from(i + 1, j + 1)

    return match_from(0, 0)


class Reference:
    """Bindings kept the plain way, routed by testing every mask: what the trie must agree with."""

    def __init__(self) -> None:
        self.queues_by_subscription: dict[bytes, list[str]] = {}  # first bound first

    def bind(self, queue: str, event: bytes) -> None:
        queues = self.queues_by_subscription.setdefault(event, [])
        if queue not in queues:
            queues.append(queue)

    def unbind(self, queue: str, event: bytes) -> None:
        queues = self.queues_by_subscription.get(event, [])
        if queue in queues:
            queues.remove(queue)
            if not queues:
                del self.queues_by_subscription[event]

    def route(self, event: bytes) -> tuple:
        exact = () if is_mask(event) else self.queues_by_subscription.get(event, ())
        found = dict.fromkeys(exact)  # exact names first
        for subscription, queues in self.queues_by_subscription.items():
            if is_mask(subscription) and matches(subscription, event):
                found.update(dict.fromkeys(queues))
        return tuple(found)


MASK_TOKENS = [b"", b"a", b"b", b"ab", b"*", b"*", b"a*", b"*b", b"a*b", b"*a*", b"**"]
EVENT_TOKENS = [b"", b"a", b"b", b"ab", b"ba", b"aab", b"abb", b"*"]


def random_name(rng, tokens: list[bytes]) -> bytes:
    """1 to 4 tokens joined by dots: empty tokens give `a..b`, leading and trailing dots."""
    return b".".join(rng.choice(tokens) for _ in range(rng.randint(1, 4)))


@pytest.mark.parametrize("seed", range(8))
def test_trie_routes_like_a_brute_force_matcher(routing, seed):
    rng = random.Random(seed)
    reference = Reference()
    queues = [f"q{i}" for i in range(5)]
    bound: list[tuple[str, bytes]] = []
    for _step in range(300):
        if bound and rng.random() < 0.35:
            queue, event = bound.pop(rng.randrange(len(bound)))
            routing.unbind(queue, event)
            reference.unbind(queue, event)
        else:
            event = random_name(rng, MASK_TOKENS if rng.random() < 0.8 else EVENT_TOKENS)
            queue = rng.choice(queues)
            routing.bind(queue, event)
            reference.bind(queue, event)
            bound.append((queue, event))
        for _ in range(5):
            event = random_name(rng, EVENT_TOKENS)
            assert route(routing, event) == reference.route(event), (event, reference.queues_by_subscription)
        assert routing.subscription_count() == len(reference.queues_by_subscription)
    for queue, event in bound:
        routing.unbind(queue, event)
    assert routing.subscription_count() == 0 and routing.root.is_empty()
