"""A streaming query for test_spark's failure tests, run in its own process so a test can SIGKILL it.

It reads an mqks queue and records each micro-batch's `msg_id retry` lines into `--out`, one file
per batch and process, fsynced. With `--block-batch K`, the first non-empty batch with id >= K is
recorded, then the job writes `{out}/blocked` and sleeps: that batch was read but never committed
(the test kills the driver). With `--stall-executor-batch K`, one task of the first non-empty batch
with id >= K stops inside its executor after reading its rows and writes that executor's JVM pid to
`{out}/stalled` (the test kills that executor; Spark retries the task elsewhere).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def executor_jvm_pid() -> int:
    """The pid of the java process above this Python worker (its executor)."""
    pid = os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
            if f.read().strip() == "java":
                return pid
        pid = int(fields[1])
    raise RuntimeError("no java process above this worker")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--events", default="")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--max-records-per-batch", type=int, default=100)
    parser.add_argument("--block-batch", type=int, default=None)
    parser.add_argument("--stall-executor-batch", type=int, default=None)
    args = parser.parse_args()

    from mqks.spark.session import local_session

    spark = local_session("mqks-failure-job", master=args.master)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stalled = out / "stalled"

    def stall_once(rows):
        rows = list(rows)
        if rows:
            try:
                fd = os.open(stalled, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return rows  # the retried task, or another partition: go on
            os.write(fd, b"%d %d\n" % (executor_jvm_pid(), len(rows)))
            os.close(fd)
            time.sleep(3600)  # the test SIGKILLs this executor here
        return rows

    def record(batch_df, batch_id: int) -> None:
        stall = args.stall_executor_batch
        if stall is not None and batch_id >= stall and not stalled.exists():
            rows = batch_df.select("msg_id", "retry").rdd.mapPartitions(stall_once).collect()
        else:
            rows = batch_df.select("msg_id", "retry").collect()
        path = out / f"batch-{batch_id}-{os.getpid()}.txt"
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(f"{row.msg_id} {row.retry}\n" for row in rows))
            f.flush()
            os.fsync(f.fileno())
        if args.block_batch is not None and batch_id >= args.block_batch and rows:
            (out / "blocked").write_text(f"{batch_id} {len(rows)}\n")
            time.sleep(3600)  # the test SIGKILLs this process group here

    stream = (
        spark.readStream.format("mqks")
        .option("port", str(args.port))
        .option("queue", args.queue)
        .option("events", args.events)
        .option("maxRecordsPerBatch", str(args.max_records_per_batch))
        .option("idleAckSeconds", "1")
        .load()
    )
    query = stream.writeStream.foreachBatch(record).option("checkpointLocation", args.checkpoint).start()
    (out / f"started-{os.getpid()}").write_text(query.id)
    query.awaitTermination()


if __name__ == "__main__":
    main()
