"""Masks end to end: `--remove-mask` follows the spec's "Event mask works only for events with dots",
masks with `*` inside a token route over the wire, and many masks still route each event to its own.

The broker-level tests call `Broker.rebind` directly; the rest are wire transcripts.
"""

import pytest
from helpers import unique_bytes as unique

from mqks.server.core.state import Broker

pytestmark = [pytest.mark.timeout(60), pytest.mark.core]


@pytest.mark.parametrize(
    "bound, masks, kept",
    [
        ([b"e1", b"plain", b"*", b"e.x"], [b"e*", b"*"], [b"e1", b"plain", b"*", b"e.x"]),  # no dot: never removed
        ([b"e1", b"e1.a"], [b"e1"], [b"e1", b"e1.a"]),  # not even by its own name
        ([b"e5.id1.a1", b"e5.*.a1", b"e5.a1", b"e5.x.y.a1", b"e5"], [b"e5.*.a1"], [b"e5.a1", b"e5.x.y.a1", b"e5"]),
        ([b"a.b", b"a.c", b"a"], [b"a.b"], [b"a.c", b"a"]),  # a mask without `*` removes its own name
        ([b"e5.id1.a1", b"e5.xid.a1", b"e5.id*.a1"], [b"e5.id*.a1"], [b"e5.xid.a1"]),  # `*` inside a token
        ([b"a..b", b".x", b"x.", b"x"], [b"a.*.b", b"*.*"], [b"x"]),  # empty tokens, leading and trailing dots
    ],
)
def test_remove_mask_removes_only_events_with_dots_that_it_matches(bound, masks, kept):
    broker = Broker()
    queue = broker.queue(b"q")
    broker.rebind(queue, replace=bound)
    changed = broker.rebind(queue, remove_masks=masks)
    assert list(queue.events) == kept
    assert changed is (kept != bound)
    assert broker.routing.subscription_count() == len(kept)  # the routing let go of the removed ones too


def test_remove_mask_leaves_events_without_a_dot_bound(broker):
    conn, publisher = broker.wire(), broker.wire()
    queue, e1, plain = unique("q"), unique("e1"), unique("plain")
    conn.send(b"c1 consume --confirm %b %b %b %b.x" % (queue, e1, plain, e1))
    conn.expect(b"c1 ok ")
    conn.send(b"rb1 rebind --confirm %b --remove-mask e* *" % queue)
    conn.expect(b"rb1 ok ")  # nothing removed, so no --update came first
    conn.send(b"rb2 rebind --confirm %b --remove-mask %b --remove-mask *.x" % (queue, e1))
    conn.expect(b"c1 ok --update %b %b %b" % (queue, e1, plain))  # only the event with a dot went
    conn.expect(b"rb2 ok ")
    publisher.send(b"m1 publish %b one" % e1, b"m2 publish %b two" % plain, b"m3 publish %b.x three" % e1)
    publisher.barrier()
    assert conn.barrier() == [b"c1 ok m1 event=%b one" % e1, b"c1 ok m2 event=%b two" % plain]


def test_remove_mask_removes_matching_events_and_an_equal_mask(broker):
    conn, publisher = broker.wire(), broker.wire()
    queue, p = unique("q"), unique("p")
    conn.send(b"c1 consume --confirm %b %b.id1.a1 %b.*.a1 %b.a1 %b.x.y.a1" % (queue, p, p, p, p))
    conn.expect(b"c1 ok ")
    conn.send(b"rb rebind %b --remove-mask %b.*.a1" % (queue, p))
    conn.expect(b"c1 ok --update %b %b.a1 %b.x.y.a1" % (queue, p, p))
    publisher.send(b"m1 publish %b.id2.a1 gone" % p, b"m2 publish %b.a1 kept" % p)
    publisher.barrier()
    assert conn.barrier() == [b"c1 ok m2 event=%b.a1 kept" % p]


def test_masks_with_a_star_inside_a_token_route(broker_per_worker_count):
    conn, publisher = broker_per_worker_count.wire(), broker_per_worker_count.wire()
    queue, p = unique("q"), unique("p")
    conn.send(b"c1 consume --confirm %b %b.us*r.created %b.id*.a1 %b.*.b" % (queue, p, p, p))
    conn.expect(b"c1 ok ")
    events = [b"%b.user.created" % p, b"%b.usr.created" % p, b"%b.us.r.created" % p, b"%b.id7.a1" % p,
              b"%b.xid7.a1" % p, b"%b..b" % p, b"%b.id7.a2" % p]
    publisher.send(*(b"m%d publish %b d" % (i, event) for i, event in enumerate(events)))
    publisher.barrier()
    expected = [0, 1, 3, 5]  # `*` spans no dot (us.r), matches inside a token only where the mask says (xid7)
    assert conn.barrier() == [b"c1 ok m%d event=%b d" % (i, events[i]) for i in expected]


def test_a_star_without_a_dot_is_an_exact_name_on_the_wire(broker):
    conn, publisher = broker.wire(), broker.wire()
    queue, p = unique("q"), unique("p")
    conn.send(b"c1 consume --confirm %b %b*" % (queue, p))
    conn.expect(b"c1 ok ")
    publisher.send(b"m1 publish %b1 no" % p, b"m2 publish %b* yes" % p)
    publisher.barrier()
    assert conn.barrier() == [b"c1 ok m2 event=%b* yes" % p]


def test_each_of_many_masks_gets_only_its_own_events(broker_per_worker_count):
    conn, publisher = broker_per_worker_count.wire(), broker_per_worker_count.wire()
    queue, p = unique("q"), unique("p")
    masks = [b"%b.svc%d.*.created" % (p, k) for k in range(2000)]
    for start in range(0, len(masks), 500):
        conn.send(b"rb rebind --confirm %b --add %b" % (queue, b" ".join(masks[start:start + 500])))
        conn.expect(b"rb ok ")
    conn.send(b"c1 consume --confirm %b" % queue)
    conn.expect(b"c1 ok ")
    publisher.send(b"m1 publish %b.svc1999.u1.created a" % p, b"m2 publish %b.svc2000.u2.created b" % p,
                   b"m3 publish %b.svc7.u3.deleted c" % p, b"m4 publish %b.svc7.u4.created d" % p)
    publisher.barrier()
    assert conn.barrier() == [b"c1 ok m1 event=%b.svc1999.u1.created a" % p,
                              b"c1 ok m4 event=%b.svc7.u4.created d" % p]
