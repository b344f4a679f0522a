# The MQKS broker. Inside a container it must listen on every interface; publish the
# port only where you mean to (for example `-p 127.0.0.1:25000:25000`). Queues and
# messages live in the volume /var/lib/mqks (write-ahead log, fsync always): mount one
# (`-v mqks-data:/var/lib/mqks`) to keep them across containers.
FROM python:3.11-slim
WORKDIR /opt/mqks
COPY . .
RUN pip install --no-cache-dir .
VOLUME /var/lib/mqks
EXPOSE 25000
CMD ["mqksd", "--host", "0.0.0.0", "--port", "25000", "--data-dir", "/var/lib/mqks"]
