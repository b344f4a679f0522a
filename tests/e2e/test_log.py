"""The write-ahead log on real files when the system refuses: a full disk, no file descriptor left. Each runs the
log in a process of its own (log_writer_job.py) with the limit set on it; the in-process tests of the same log are
tests/unit/journal/test_disk_log.py."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import WAIT_SECONDS

from mqks.server.journal.log import Log

pytestmark = pytest.mark.timeout(60)

JOB = Path(__file__).resolve().parents[1] / "log_writer_job.py"  # beside conftest.py


def replay_all(data_dir: Path, repair: bool = False) -> tuple[list[bytes], dict]:
    """Replay the log in `data_dir` to the end on a fresh Log; its records and stats."""
    log = Log(str(data_dir))
    try:
        return list(log.replay(repair=repair)), log.stats()
    finally:
        log.close()


def segments(data_dir: Path) -> list[Path]:
    return sorted(data_dir.glob("*.log"))


FILE_SIZE_LIMIT_BYTES = 4096


class WriterJob:
    """log_writer_job.py in its own process: one command a line, one answer a line."""

    def __init__(self, data_dir: Path, **options) -> None:
        self.proc = subprocess.Popen([sys.executable, str(JOB), str(data_dir)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **options)

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().strip()  # the job answers within its own deadlines
        assert reply, f"the job died after {command!r}: {self.proc.stderr.read()}"
        return reply

    def close(self) -> None:
        assert self.ask("close") == "closed"
        assert self.proc.wait(WAIT_SECONDS) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def limit_file_size() -> None:
    """In the child, before exec: writes past the limit fail with EFBIG (an ignored signal stays ignored)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT_BYTES, hard))


def test_disk_full_reports_the_failed_commit_and_writes_it_once_space_returns(tmp_path):
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if hard != resource.RLIM_INFINITY and hard < 1 << 20:
        pytest.skip(f"the hard file size limit ({hard}) leaves no room to raise the soft one")
    data_dir = tmp_path / "log"
    job = WriterJob(data_dir, preexec_fn=limit_file_size)
    ask = job.ask

    try:
        assert ask("commit 10") == "commit 1"  # about 1.1 KB: fits under the limit
        assert ask("durable 1") == "durable 1 disk_full=False"
        [segment] = segments(data_dir)
        written = segment.stat().st_size
        assert ask("commit 40") == "commit 2"  # about 4.4 KB: past the limit
        assert ask("failed 2") == "failed 2 disk_full=True"
        assert segment.stat().st_size == written  # the part that fit was cut off again
        assert ask("commit 1") == "commit 3"  # tried on arrival, behind frame 2: fails too
        assert ask("failed 3") == "failed 3 disk_full=True"
        assert ask("unlimit") == "unlimited"
        assert ask("durable 3") == "durable 3 disk_full=False"  # the timed retry wrote both
        job.close()
    finally:
        job.kill()
    records, stats = replay_all(data_dir)
    assert records == [b"%08d " % n + b"x" * 100 for n in range(51)]
    assert stats["truncated_bytes"] == 0
    assert os.path.getsize(segment) > FILE_SIZE_LIMIT_BYTES


def test_out_of_descriptors_the_spare_creates_the_segment(tmp_path):
    # issue 31.2: EMFILE creating a segment was fatal (exit 70), and clients can take every descriptor
    job = WriterJob(tmp_path / "log")
    try:
        assert job.ask("exhaust") == "exhausted"
        assert job.ask("commit 1") == "commit 1"  # the first segment: the spare descriptor pays for it
        assert job.ask("durable 1") == "durable 1 disk_full=False"
        assert job.ask("release") == "released"
        job.close()
    finally:
        job.kill()
    assert replay_all(tmp_path / "log")[0] == [b"%08d " % 0 + b"x" * 100]


def test_out_of_descriptors_without_a_spare_fails_the_commit_and_writes_it_once_one_returns(tmp_path):
    job = WriterJob(tmp_path / "log")
    try:
        assert job.ask("spend-spare") == "spent"  # as if the loop's accept had taken it first
        assert job.ask("exhaust") == "exhausted"
        assert job.ask("commit 1") == "commit 1"
        assert job.ask("failed 1") == "failed 1 disk_full=False"  # answered as failed, kept in memory
        assert job.ask("blocked") == "blocked out of file descriptors"
        assert job.ask("commit 1") == "commit 2"  # behind it, in order
        assert job.ask("release") == "released"
        assert job.ask("durable 2") == "durable 2 disk_full=False"  # the timed retry wrote both
        assert job.ask("blocked") == "blocked None"
        job.close()
    finally:
        job.kill()
    assert replay_all(tmp_path / "log")[0] == [b"%08d " % n + b"x" * 100 for n in range(2)]
