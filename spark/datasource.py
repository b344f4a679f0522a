"""`MqksDataSource`, format name "mqks": the entry point Spark calls on the driver.

It only parses options and builds the reader or writer; all I/O happens in `source.py`
(driver-side consumer) and `sink.py` (executor-side publishers).
"""

from __future__ import annotations

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, DataSourceStreamWriter, DataSourceWriter
from pyspark.sql.types import StructType

from mqks.spark.sink import MqksBatchWriter, MqksStreamWriter, SinkOptions
from mqks.spark.source import SOURCE_SCHEMA, MqksStreamReader, SourceOptions


class MqksDataSource(DataSource):
    """Read an MQKS queue as a stream (ack on commit); write rows as published events."""

    @classmethod
    def name(cls) -> str:
        return "mqks"

    def schema(self) -> str:
        return SOURCE_SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return MqksStreamReader(SourceOptions.parse(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        return MqksStreamWriter(SinkOptions.parse(self.options), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        return MqksBatchWriter(SinkOptions.parse(self.options), schema)
