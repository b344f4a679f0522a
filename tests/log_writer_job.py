"""A `Log` writer in its own process, for test_log's disk-full and out-of-descriptors tests.

The disk-full test starts it with a low RLIMIT_FSIZE and SIGXFSZ ignored, so a write past the
limit fails with EFBIG as a full disk fails with ENOSPC. It reads one command a line on stdin and
answers one line on stdout; every wait has a deadline and answers "timeout ..." when it passes.

    commit K     append K records (`{n:08d} ` and 100 x's, n counting from 0) and commit: "commit N"
    failed N     wait until commit N is reported failed: "failed N disk_full=True"
    durable N    wait until commit N is durable: "durable N disk_full=False"
    unlimit      raise the soft file size limit to the hard one: "unlimited"
    exhaust      open /dev/null until the process has no descriptor left, as clients would: "exhausted"
    spend-spare  close the log's spare descriptor, as the loop's accept could take it first: "spent"
    release      close what exhaust opened: "released"
    blocked      why the log waits: "blocked None" or "blocked {reason}"
    close        close the log and exit: "closed"
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import sys
import threading
import time

from mqks.server.journal.log import Log

WAIT_SECONDS = 10.0


def record(n: int) -> bytes:
    return b"%08d " % n + b"x" * 100


def main() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead of killing us
    wake = threading.Event()
    log = Log(sys.argv[1], fsync="always", wake=wake.set)
    failed: set[int] = set()
    durable = 0
    records = 0
    hogs: list[int] = []

    def wait(kind: str, number: int) -> bool:
        """Poll until commit `number` is durable or failed (`kind`), with a deadline."""
        nonlocal durable
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            wake.clear()
            durable, newly = log.poll()
            failed.update(newly)
            if (number in failed) if kind == "failed" else (durable >= number):
                return True
            if time.monotonic() > deadline:
                return False
            wake.wait(0.1)

    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "commit":
            for _ in range(int(arg)):
                log.append(record(records))
                records += 1
            reply = f"commit {log.commit()}"
        elif command == "failed":
            number = int(arg)
            ok = wait("failed", number)
            reply = f"failed {number} disk_full={log.disk_full}" if ok else f"timeout failed={sorted(failed)}"
        elif command == "durable":
            number = int(arg)
            ok = wait("durable", number)
            reply = f"durable {number} disk_full={log.disk_full}" if ok else f"timeout durable={durable}"
        elif command == "unlimit":
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
            reply = "unlimited"
        elif command == "exhaust":
            try:
                while True:
                    hogs.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as e:
                reply = "exhausted" if e.errno == errno.EMFILE else f"exhaust failed: {e}"
        elif command == "spend-spare":
            os.close(log._files._spare_fd)
            log._files._spare_fd = -1
            reply = "spent"
        elif command == "release":
            while hogs:
                os.close(hogs.pop())
            reply = "released"
        elif command == "blocked":
            reply = f"blocked {log.blocked}"
        elif command == "close":
            log.close()
            print("closed", flush=True)
            return
        else:
            reply = f"unknown command {line!r}"
        print(reply, flush=True)


if __name__ == "__main__":
    main()
