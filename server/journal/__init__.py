"""The write-ahead log: its record kinds, frames committed to disk, confirms, replay.

    records.py, journal.py, recovery.py   the records, the journal over a `Log`, the replay's table
    log.py, segments.py                   the first Log: segment files on the local disk
    jetstream_log.py                      the second Log (the cluster extra), on NATS JetStream, over:
    stream.py                             where it lives on NATS and the JetStream API calls
    stream_writer.py, stream_recovery.py  the writer and its slow path (tail reads, stalls, rivals)
    stream_reader.py                      replay to the tail, follow it

Nothing here imports the layers above (cluster/ plugs its lease into the writer through hooks); the NATS
transport is below, in nats_io/.
"""
