"""mqks.spark: the PySpark data source `mqks` (needs the `spark` extra: pyspark, pyarrow).

    from mqks.spark import MqksDataSource
    spark.dataSource.register(MqksDataSource)
    spark.readStream.format("mqks").option("queue", "q").option("events", "e1 user.*.created").load()
    df.writeStream.format("mqks")...   # or df.write.format("mqks"): columns event, data[, msg_id]

The Spark side never imports gevent: it speaks the line protocol over a plain blocking socket
(`line_client.py`) and shares only the pure `mqks.client.wire` and `mqks.client.errors`.
"""

from mqks.spark.datasource import MqksDataSource
from mqks.spark.line_client import MqksConnectionError, MqksError

__all__ = ["MqksConnectionError", "MqksDataSource", "MqksError"]
