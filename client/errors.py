"""The exceptions of both MQKS clients: the gevent `Client` and the Spark data source.

Step in the flow: the end of a request that went wrong: the broker answered `error`, no answer
came in time, or the connection was lost. Invariant: no imports at all (no gevent, no I/O), so
Spark's Python workers can catch these without loading the gevent client.
"""

from __future__ import annotations


class MqksError(Exception):
    """The broker answered `error`, or the client got no answer; `error_id` is None for the latter."""

    def __init__(self, reason: str, error_id: str | None = None, rid: str | None = None) -> None:
        super().__init__(f"error {error_id}: {reason}" if error_id else reason)
        self.reason = reason
        self.error_id = error_id
        self.rid = rid


# a consume refused while its queue's owner fails over is sent again after TRANSIENT_RETRY_SECONDS, doubling up to
# TRANSIENT_RETRY_MAX_SECONDS, for FAILOVER_SECONDS (longer than a cluster's lease plus its catch-up)
TRANSIENT_RETRY_SECONDS = 0.5
TRANSIENT_RETRY_MAX_SECONDS = 2.0
FAILOVER_SECONDS = 60.0


def is_transient(error: MqksError) -> bool:
    """True for a refusal that will pass by itself: the owner of the queue is restarting or failing over."""
    reason = error.reason
    return reason.endswith("try again") or "is restarting" in reason or "(failing over)" in reason


def not_done_try_again(error: MqksError) -> bool:
    """True for a refusal that did nothing and will pass by itself (`...: try again`, the broker's words for a
    line it could not run while an owner fails over): a confirmed publish so refused is sent again. A refusal
    after some queues took the message ends otherwise, and is never sent again (it would make copies)."""
    return type(error) is MqksError and error.reason.endswith("try again")


class MqksTimeoutError(MqksError, TimeoutError):
    """No answer in time: the request may or may not have been done."""


class MqksConnectionError(MqksError, ConnectionError):
    """Not connected, or the connection died before the answer came; the broker requeues un-acked messages."""


class MqksProtocolError(MqksConnectionError):
    """The peer answered something that is not MQKS (an HTTP server on the port, say)."""
