"""`MqksDataSource`, format name "mqks": the entry point Spark calls on the driver.

It parses options, binds the source's queues at `load()` (so nothing published after `start()` is lost while
the query plans its first batch), and builds the reader or writer; the rest of the I/O happens in `source.py`
(a driver that plans and acks, executors that fetch under leases) and `sink.py`
(executor-side publishers). Options are checked when Spark builds the data source, so a
bad or unknown option fails `load()` or `start()`, not the first batch.
"""

from __future__ import annotations

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, DataSourceStreamWriter, DataSourceWriter
from pyspark.sql.types import StructType

from mqks.spark.sink import MqksBatchWriter, MqksStreamWriter, SinkOptions
from mqks.spark.source import SOURCE_SCHEMA, MqksStreamReader, SourceOptions, bind_at_load, check_schema


class MqksDataSource(DataSource):
    """Read MQKS queues as a stream (executors fetch under leases, acked on commit); write rows as events."""

    @classmethod
    def name(cls) -> str:
        return "mqks"

    def schema(self) -> str:
        """Called once by `load()`: options checked (a bad one fails load()), and the queues bound."""
        bind_at_load(SourceOptions.parse(self.options))
        return SOURCE_SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        check_schema(schema)
        return MqksStreamReader(SourceOptions.parse(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return MqksStreamWriter(SinkOptions.parse(self.options), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return MqksBatchWriter(SinkOptions.parse(self.options), schema)
