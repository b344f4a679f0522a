# The MQKS broker. Inside a container it must listen on every interface; publish the
# port only where you mean to (for example `-p 127.0.0.1:25000:25000`). Queues and
# messages live in the volume /var/lib/mqks (write-ahead log, fsync always): mount one
# (`-v mqks-data:/var/lib/mqks`) to keep them across containers.
# The hot path compiled by mypyc (setup.py) needs a C compiler at build time only: this stage builds the wheel,
# the image below installs it without one.
FROM python:3.11-slim AS wheel
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim

# the broker runs as this user, and only its data dir is writable to it
RUN useradd --system --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin mqks \
    && mkdir -p /var/lib/mqks \
    && chown mqks:mqks /var/lib/mqks

WORKDIR /opt/mqks

# Dependencies first, in a layer of their own: a code change does not reinstall them.
# install_requires is read from setup.py itself (setup() stubbed out), so it is listed once.
COPY setup.py README.md ./
COPY server/build.py server/build.py
RUN python -c "import runpy, sys, types; sys.modules['setuptools'] = types.SimpleNamespace(setup=lambda **kw: print(*kw['install_requires'], sep='\n')); runpy.run_path('setup.py')" > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# then the code (root-owned, read-only to the broker), without resolving dependencies again;
# `--build-arg EXTRAS=cluster` adds the replicated log's client (deploy/compose.cluster.yml)
ARG EXTRAS=""
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-deps /tmp/wheels/*.whl \
    && if [ -n "$EXTRAS" ]; then pip install --no-cache-dir "$(ls /tmp/wheels/*.whl)[$EXTRAS]"; fi \
    && rm -rf /tmp/wheels \
    && mqksd --version

# declared after the chown: a new named volume starts with the directory's owner
VOLUME /var/lib/mqks
USER mqks
EXPOSE 25000

# healthy once the broker answers `h ping` with `h ok `; the standard library only. A durable
# start replays the log first (about 3 s per million queued messages), hence the start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import socket, sys; s = socket.create_connection(('127.0.0.1', 25000), 3); s.settimeout(3); s.sendall(b'h ping\\n'); sys.exit(0 if s.makefile('rb').readline().startswith(b'h ok') else 1)"]

CMD ["mqksd", "--host", "0.0.0.0", "--port", "25000", "--data-dir", "/var/lib/mqks"]
