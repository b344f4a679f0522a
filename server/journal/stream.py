"""One replicated log's place on NATS (the cluster extra): its stream, its subject in it, the fence it appends with,
and the JetStream API calls the writer, the reader and the takeover make about it, each in the bridge's asyncio
thread (nats_io/nats_bridge.py). The headers every frame carries are named here; jetstream_log.py says what they
mean. Nothing here keeps frames: stream_writer.py writes them, stream_reader.py reads and follows them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from ..nats_io.nats_bridge import Bridge, BridgeError, Hub, NatsBridge, SharedNats, parse_puback

log = logging.getLogger("mqks.log")

EPOCH = "Mqks-Epoch"
FRAME = "Mqks-Frame"
MORE = "Mqks-More"
OWNER = "Mqks-Owner"
HANDOFF = "Mqks-Handoff"  # on an owner's last frame: the node it hands its group to (mqks cluster move)
SNAPSHOT = "Mqks-Snapshot"  # on a snapshot's first frame: a reader that missed the frames before it may start there
LAST = "Mqks-Last"  # on an idle owner's heartbeat: the log's last sequence, as the owner just read it
MSG_ID = "Nats-Msg-Id"
EXPECTED = "Nats-Expected-Last-Sequence"
EXPECTED_OF_SUBJECT = "Nats-Expected-Last-Subject-Sequence"  # a group's fence in a stream it shares
WRONG_LAST_SEQUENCE = 10071  # a fence: something else was appended (the text says the last sequence)
# "wrong last sequence" with no number: a shared stream's leader refusing a right expectation for the moment
# (bench/subject_fencing.py: 4 in 117,830 frames); the same frame, sent again, is stored once
WRONG_LAST_SEQUENCE_FOR_NOW = 10164
NOT_FOUND = 10037
# "duplicate message id is in process": the takeover sent again while NATS still handles the first (a minority's
# leader, during a partition): asked again, it is answered as the first one is (the partition test)
DUPLICATE_IN_PROCESS = 10158
RESEND_SECONDS = 0.005
FRAME_BYTES = 1 << 20  # commits waiting to be sent are merged into frames up to this (or max_payload)
ACK_SECONDS = 2.0  # a frame with no answer after this: read the tail (an election answers 503 at once)
RETRY_SECONDS = 0.5  # NATS has no answer: read the tail again after this
STARTING_NATS_SECONDS = 30.0  # open: JetStream calls that time out this long (a NATS just started) end the start
OWNER_PING_SECONDS = 1.5
TAKEOVER_SECONDS = 10.0  # a takeover no stream leader answers for this long stands by again (NATS elects in 2-14 s)
SUBJECTS_OVERLAP = 10065
REPLICAS_FALLBACK_ERRORS = (10074, 10005)  # insufficient resources, R>1 on a single server


class LogOwned(Exception):
    """Another broker owns the stream and answers: name it, and say how to take over."""


class LogStream:
    """Where one log lives on NATS (a stream of its own, or a group's subject in a stream groups share), its
    connections (the bridge for the JetStream API, the hub's own for frames), and the API calls about it."""

    def __init__(self, servers: list[str], stream: str, owner: str, replicas: int = 3,
                 timeout_seconds: float = 15.0, connect_timeout: float = 5.0, node: str | None = None,
                 nats_options: dict[str, Any] | None = None, shared: SharedNats | None = None,
                 group: str | None = None, stream_subjects: list[str] | None = None) -> None:
        self.stream = stream
        # a cluster's slot group in a stream it shares with others (`group`: its name, `stream_subjects`: every
        # group's subject): it reads and writes its subject alone, fenced by the subject's last sequence
        self.name = group or stream
        self.in_shared_stream = group is not None
        self.label = f"group {group}" if group is not None else f"stream {stream}"
        self.subject = f"mqks.log.{self.name}"
        self.stream_subjects = stream_subjects or [self.subject]
        self.fence = EXPECTED_OF_SUBJECT if self.in_shared_stream else EXPECTED
        self.owner_subject = f"mqks.owner.{self.name}"
        self.beat_subject = f"mqks.beat.{self.name}"
        self.owner = owner
        self.node = node  # the cluster node this broker is, as its owner ping answers
        self.replicas = replicas
        self.timeout_seconds = timeout_seconds
        self.max_payload = FRAME_BYTES
        # a cluster node's process shares one connection between its groups (`shared`); else the log has its own
        self.bridge: Bridge = (NatsBridge(servers, connect_timeout, nats_options) if shared is None
                               else shared.scope())
        # ... and its groups read their shared stream's figures together
        self.shared_figures = shared.figures if shared is not None and self.in_shared_stream else None
        self._hub: Hub | None = None  # the hub's NATS connection (the bridge's hub_nats), once the log needs it
        # figures
        self.stream_bytes = 0
        self.stream_messages = 0
        self.leader = ""

    def hub(self) -> Hub:
        """The hub's NATS connection this log publishes and subscribes on (the process's, for a cluster's group)."""
        if self._hub is None:
            self._hub = self.bridge.hub_nats()
        return self._hub

    @property
    def hub_if_made(self) -> Hub | None:
        return self._hub

    async def ensure(self, nc: Any) -> None:
        """Make the stream unless it exists, and check it can hold this log (its subject, no limit that discards)."""
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout
        from nats.js.api import DiscardPolicy, StorageType, StreamConfig
        from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

        js = nc.jetstream(timeout=5)
        self.max_payload = min(FRAME_BYTES, nc.max_payload) if nc.max_payload else FRAME_BYTES
        # a NATS cluster started moments ago (Compose, CI) answers JetStream calls only once its meta leader is
        # elected: until then a call times out or finds no responder (CI: "cannot start: nats: timeout")
        deadline = time.monotonic() + STARTING_NATS_SECONDS
        while True:
            try:
                info = await js.stream_info(self.stream)
                break
            except NotFoundError:
                info = None
                break
            except (NatsTimeout, NoRespondersError, ServiceUnavailableError) as e:
                await self._ask_again_later(e, deadline)
        if info is None:
            replicas = self.replicas
            while True:
                config = StreamConfig(name=self.stream, subjects=self.stream_subjects, num_replicas=replicas,
                                      storage=StorageType.FILE, discard=DiscardPolicy.NEW, allow_rollup_hdrs=True,
                                      allow_direct=False, duplicate_window=120.0)
                try:
                    info = await js.add_stream(config)
                    break
                except (NatsTimeout, NoRespondersError, ServiceUnavailableError) as e:
                    await self._ask_again_later(e, deadline)
                    try:  # a create that timed out may have been made meanwhile
                        info = await js.stream_info(self.stream)
                        break
                    except (NotFoundError, NatsTimeout, NoRespondersError, ServiceUnavailableError):
                        continue
                except APIError as e:
                    if replicas > 1 and e.err_code in REPLICAS_FALLBACK_ERRORS:
                        log.warning("%s: NATS cannot place %d replicas (%s): trying %d", self.label,
                                    replicas, e.description, replicas - 1)
                        replicas -= 1
                        continue
                    hint = (": the cluster's groups are in streams of another layout on this NATS (every node must "
                            "run the same --groups and --streams)") if e.err_code == SUBJECTS_OVERLAP else ""
                    raise BridgeError(f"cannot create stream {self.stream}: {e.description}{hint}") from None
            log.info("stream %s created on NATS: %d replicas, file storage", self.stream, replicas)
        config = info.config
        if self.subject not in (config.subjects or []):
            raise BridgeError(f"stream {self.stream} does not hold subject {self.subject} (its subjects: "
                              f"{', '.join(config.subjects or [])}): it was made for another layout")
        limited = [name for name, value in (("max_msgs", config.max_msgs), ("max_bytes", config.max_bytes),
                                            ("max_age", config.max_age)) if value not in (None, -1, 0)]
        if limited and config.discard != DiscardPolicy.NEW:
            raise BridgeError(f"stream {self.stream} has limits ({', '.join(limited)}) that would discard old "
                              "frames: a log must lose nothing; remove them or use discard: new")
        # the stream takes no write until it has a leader (a fresh R3 stream, or during an election)
        deadline = time.monotonic() + 30
        while not (info.cluster is None or info.cluster.leader) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            info = await js.stream_info(self.stream)
        self._note_info(info)
        if self.in_shared_stream:
            await self.note_figures(nc)

    async def _ask_again_later(self, error: Exception, deadline: float) -> None:
        """A JetStream call timed out or found no responder, as while NATS elects its meta leader: raise `error`
        past `deadline`, else say so and wait before the caller asks again."""
        if time.monotonic() > deadline:
            raise error
        log.warning("%s: JetStream does not answer yet (%s); asking again", self.label, type(error).__name__)
        await asyncio.sleep(RETRY_SECONDS)

    def _note_info(self, info: Any) -> None:
        self.stream_bytes = info.state.bytes
        self.stream_messages = info.state.messages
        self.leader = (info.cluster.leader or "") if info.cluster is not None else ""

    async def last_seq(self, nc: Any) -> int:
        """The log's last sequence: the stream's; in a shared stream, its subject's (0: none yet)."""
        js = nc.jetstream(timeout=5)
        if not self.in_shared_stream:
            info = await js.stream_info(self.stream)
            self._note_info(info)
            return int(info.state.last_seq)
        from nats.js.errors import NotFoundError

        try:
            return int((await js.get_last_msg(self.stream, self.subject)).seq or 0)  # from the stream's leader
        except NotFoundError:
            return 0

    async def note_figures(self, nc: Any) -> int:
        """The stream's figures for `stats()` (in a shared stream, the messages are its subject's); its last
        sequence."""
        if self.shared_figures is not None:
            info = await self.shared_figures.info(nc, self.stream)
        else:
            info = await nc.jetstream(timeout=5).stream_info(
                self.stream, subjects_filter=self.subject if self.in_shared_stream else None)
        self._note_info(info)
        if self.in_shared_stream:
            self.stream_messages = int((info.state.subjects or {}).get(self.subject, 0))
        return int(info.state.last_seq)

    async def tail_after(self, nc: Any, base: int, epoch: int) -> tuple[int, list[tuple[int, dict[str, str]]]]:
        """The log's last sequence, and the headers of its messages after sequence `base` up to it, each read from
        the stream's leader (a replica may be behind), up to the first of an epoch over `epoch`; in a shared stream,
        its subject's alone."""
        js = nc.jetstream(timeout=3)
        last = await self.last_seq(nc)
        found: list[tuple[int, dict[str, str]]] = []
        seq = base
        while seq < last:
            try:
                if self.in_shared_stream:
                    msg = await js.get_msg(self.stream, seq + 1, subject=self.subject, next=True)
                    seq = int(msg.seq)
                    if seq > last:
                        break
                else:
                    seq += 1
                    msg = await js.get_msg(self.stream, seq)
            except Exception as e:
                if "no message found" in str(e).lower() or getattr(e, "err_code", 0) == NOT_FOUND:
                    if self.in_shared_stream:
                        break
                    continue
                raise
            headers = dict(msg.headers or {})
            found.append((seq, headers))
            if int(headers.get(EPOCH, 0)) > epoch:
                break
        return last, found

    async def purge_below(self, nc: Any, below: int) -> None:
        await nc.jetstream(timeout=self.timeout_seconds).purge_stream(
            self.stream, seq=below, subject=self.subject if self.in_shared_stream else None)

    async def ask_owner(self, nc: Any, silent_is_owner: bool = False) -> str | None:
        """The running owner's description, or None when no broker answers for the stream (with `silent_is_owner`,
        only when none listens: one that listens and does not answer may be paused, not gone)."""
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout

        try:
            answer = await nc.request(self.owner_subject, b"", timeout=OWNER_PING_SECONDS)
        except NoRespondersError:
            return None
        except NatsTimeout:
            return "an owner that does not answer" if silent_is_owner else None
        try:
            about = json.loads(answer.data)
            return f"{about['owner']} (epoch {about['epoch']})"
        except (ValueError, KeyError):
            return answer.data.decode(errors="replace")

    async def append_takeover(self, nc: Any, record: bytes, last_seq: int, epoch: int, writer_id: str) -> Any:
        """The takeover's PubAck; None when no stream leader answered within TAKEOVER_SECONDS. The same Msg-Id makes a
        later try safe: stored meanwhile, it is answered with the first one's sequence."""
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout

        headers = {EPOCH: str(epoch), FRAME: "0", OWNER: self.owner,
                   MSG_ID: f"{self.name}.{epoch}.{writer_id}.0", self.fence: str(last_seq)}
        deadline = time.monotonic() + TAKEOVER_SECONDS
        while True:
            try:
                msg = await nc.request(self.subject, record, timeout=ACK_SECONDS, headers=headers)
                if msg.data:
                    answer = parse_puback(0, msg.data)
                    if answer.error_code not in (WRONG_LAST_SEQUENCE_FOR_NOW, DUPLICATE_IN_PROCESS):
                        return answer
                    await asyncio.sleep(RESEND_SECONDS)
                    continue
            except (NoRespondersError, NatsTimeout):
                pass
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(RETRY_SECONDS)  # an election: the same Msg-Id makes the retry safe
