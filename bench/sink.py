"""A trivial MQKS-speaking sink: measures the load generator's own ceiling.

It reads and discards everything a publisher sends. A connection that sends
`{cid} consume --confirm ...` gets `{cid} ok ` and then, once any publisher has sent its
first bytes, `--deliver` canned deliveries written as fast as the kernel takes them.
Acks are read and discarded. `ping` is answered, so readiness checks work.
"""

from __future__ import annotations

import argparse
import socket
import threading

PAYLOAD = b"T%019d" % 0 + b"." * 75 + b"|EOM|"
BLOCK_DELIVERIES = 10_000  # ~1.4 MB per sendall: the GIL is held rarely


def serve(port: int, deliver: int) -> None:
    first_publish = threading.Event()
    listener = socket.create_server(("127.0.0.1", port), backlog=128)

    def stream(conn: socket.socket, cid: bytes) -> None:
        block = b"".join(b"%s ok m%d event=bench.ev %s\n" % (cid, i, PAYLOAD) for i in range(BLOCK_DELIVERIES))
        first_publish.wait()
        full, rest = divmod(deliver, BLOCK_DELIVERIES)
        try:
            for _ in range(full):
                conn.sendall(block)
            if rest:
                conn.sendall(block[: block.index(b"\n") + 1] * rest)
        except OSError:
            pass

    def handle(conn: socket.socket) -> None:
        buf = b""
        role = None
        try:
            while True:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    return
                if role is not None:
                    continue
                buf += chunk
                lines = buf.split(b"\n")
                buf = lines.pop()
                for line in lines:
                    parts = line.split(b" ", 3)
                    if len(parts) >= 2 and parts[1] == b"ping":
                        conn.sendall(parts[0] + b" ok " + (parts[2] if len(parts) > 2 else b"") + b"\n")
                    elif len(parts) >= 2 and parts[1] == b"consume":
                        role = "consumer"
                        conn.sendall(parts[0] + b" ok \n")
                        threading.Thread(target=stream, args=(conn, parts[0]), daemon=True).start()
                        break
                    elif len(parts) >= 2 and parts[1] == b"publish":
                        role = "publisher"
                        first_publish.set()
                        break
                if len(buf) > 1 << 20:
                    buf = b""
        except OSError:
            pass
        finally:
            conn.close()

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--deliver", type=int, default=100_000, help="canned deliveries per consumer")
    args = parser.parse_args()
    serve(args.port, args.deliver)


if __name__ == "__main__":
    main()
