"""Which queues get a copy of an event: an exact-name index plus a token trie of masks, with a cache.

A publish reads `cache` first (Broker holds this very dict: it is cleared, never replaced). On
a miss the route is the exact event's queues plus those of every matching mask; masks sit in a
trie of their dot-separated tokens, walked once per event (exact child, `*` child, and the rare
tokens with a `*` inside, checked only where they hang), so the cost follows the event's length,
not the number of masks. A route lists each queue once: exact-name queues in bind order, then
each matching mask's, masks in first-bind order. A bind or unbind of an exact name pops its
cached route; of a mask, clears the cache.
"""

from __future__ import annotations

import re
from itertools import islice
from typing import Any

MAX_CACHED_EVENTS = 65536  # events with ids in their names would otherwise grow it forever
SWEPT_EVENTS = MAX_CACHED_EVENTS // 4  # a full cache drops its oldest quarter: hot events stay cached


def cache_put(cache: dict, event: bytes, value: Any) -> None:
    """Remember `value` for `event`, sweeping the oldest entries out of a full cache (no clear-all cliff)."""
    if len(cache) >= MAX_CACHED_EVENTS:
        for old in list(islice(cache, SWEPT_EVENTS)):
            del cache[old]
    cache[event] = value
STAR = b"*"


def is_mask(event: bytes) -> bool:
    """A subscription is a mask only if it has a `*` and a dot (the spec's masks need dots)."""
    return b"*" in event and b"." in event


def compile_mask(mask: bytes) -> re.Pattern[bytes]:
    """`user.*.created` -> a pattern where `*` is any run of characters other than a dot."""
    return re.compile(re.escape(mask).replace(rb"\*", rb"[^.]*"))


class Node:
    """One token position in the mask trie; the mask whose last token leads here keeps its queues here.

    Tokens of a mask are filed three ways: a whole literal token in `children`, the token `*`
    as `star`, and a token with a `*` inside (`id*`, `us*r`) in `partials` with its pattern,
    so a mask's whole-token prefix is still walked by dict lookups. Empty slots stay None:
    most nodes have one kind of child, and the memory per bound mask is mostly these nodes.
    """

    __slots__ = ("children", "star", "partials", "queues", "seq")

    def __init__(self) -> None:
        self.children: dict[bytes, Node] | None = None
        self.star: Node | None = None
        self.partials: dict[bytes, tuple[re.Pattern[bytes], Node]] | None = None
        self.queues: tuple | None = None  # while a mask ends here: its queues in bind order (route() returns it as is)
        self.seq = 0  # when that mask was first bound: a route lists masks in this order

    def is_empty(self) -> bool:
        return self.queues is None and self.children is None and self.star is None and self.partials is None


def _seq(node: Node) -> int:
    return node.seq


class Routing:
    """Bindings of one worker: event or mask -> queues, in bind order."""

    __slots__ = ("queues_by_event", "root", "mask_count", "mask_seq", "cache", "cache_enabled")

    def __init__(self, cache_enabled: bool = True) -> None:
        self.queues_by_event: dict[bytes, dict[Any, None]] = {}
        self.root = Node()
        self.mask_count = 0
        self.mask_seq = 0
        self.cache: dict[bytes, tuple] = {}
        self.cache_enabled = cache_enabled

    def bind(self, queue: Any, event: bytes) -> None:
        if is_mask(event):
            node = self.root
            for token in event.split(b"."):
                node = _child(node, token)
            if node.queues is None:
                node.queues = ()
                self.mask_count += 1
                self.mask_seq += 1
                node.seq = self.mask_seq
            if queue not in node.queues:
                node.queues += (queue,)  # a tuple: 48 bytes for one queue where a dict takes 224
            self.cache.clear()
        else:
            self.queues_by_event.setdefault(event, {})[queue] = None
            self.cache.pop(event, None)

    def unbind(self, queue: Any, event: bytes) -> None:
        if is_mask(event):
            path: list[tuple[Node, bytes]] = []
            node = self.root
            for token in event.split(b"."):
                path.append((node, token))
                child = _existing_child(node, token)
                if child is None:
                    return
                node = child
            if node.queues is None or queue not in node.queues:
                return
            node.queues = tuple(q for q in node.queues if q != queue)
            if not node.queues:
                node.queues = None
                self.mask_count -= 1
                while path and node.is_empty():  # prune the branch no other mask needs
                    parent, token = path.pop()
                    _remove_child(parent, token)
                    node = parent
            self.cache.clear()
        else:
            queues = self.queues_by_event.get(event)
            if queues is None:
                return
            queues.pop(queue, None)
            if not queues:
                del self.queues_by_event[event]
            self.cache.pop(event, None)

    def route(self, event: bytes) -> tuple:
        """Every queue bound to `event` by name or by mask, each once."""
        queues = self.cache.get(event)
        if queues is not None:
            return queues
        exact = self.queues_by_event.get(event)
        leaves = self.match(event) if self.mask_count and b"." in event else None
        if not leaves:
            queues = tuple(exact) if exact else ()
        elif exact is None and len(leaves) == 1:
            queues = leaves[0].queues or ()
        else:
            if len(leaves) > 1:
                leaves.sort(key=_seq)
            found = dict(exact) if exact else {}
            for leaf in leaves:
                for queue in leaf.queues or ():
                    found[queue] = None
            queues = tuple(found)
        if self.cache_enabled:
            cache_put(self.cache, event, queues)
        return queues

    def match(self, event: bytes) -> list[Node]:
        """The trie nodes of every bound mask that matches `event`, in no particular order.

        One pass over the event's tokens with the set of nodes reached so far; a node is
        reached through one edge only, so no node comes twice.
        """
        nodes = [self.root]
        for token in event.split(b"."):
            reached = []
            for node in nodes:
                children = node.children
                if children is not None:
                    child = children.get(token)
                    if child is not None:
                        reached.append(child)
                if node.star is not None:
                    reached.append(node.star)
                if node.partials is not None:
                    for pattern, child in node.partials.values():
                        if pattern.fullmatch(token):
                            reached.append(child)
            if not reached:
                return reached
            nodes = reached
        return [node for node in nodes if node.queues is not None]

    def subscription_count(self) -> int:
        return len(self.queues_by_event) + self.mask_count


def _child(node: Node, token: bytes) -> Node:
    """The child of `node` for a mask token, created if missing."""
    if token == STAR:
        if node.star is None:
            node.star = Node()
        return node.star
    if STAR in token:
        if node.partials is None:
            node.partials = {}
        entry = node.partials.get(token)
        if entry is None:
            entry = node.partials[token] = (compile_mask(token), Node())
        return entry[1]
    if node.children is None:
        node.children = {}
    child = node.children.get(token)
    if child is None:
        child = node.children[token] = Node()
    return child


def _existing_child(node: Node, token: bytes) -> Node | None:
    if token == STAR:
        return node.star
    if STAR in token:
        entry = node.partials.get(token) if node.partials is not None else None
        return entry[1] if entry is not None else None
    return node.children.get(token) if node.children is not None else None


def _remove_child(node: Node, token: bytes) -> None:
    if token == STAR:
        node.star = None
    elif STAR in token:
        assert node.partials is not None  # the path to the child went through it
        del node.partials[token]
        if not node.partials:
            node.partials = None
    else:
        assert node.children is not None
        del node.children[token]
        if not node.children:
            node.children = None
