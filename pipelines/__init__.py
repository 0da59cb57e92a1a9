"""The Sluice data pipeline on Spark (DESIGN §2): jobs over a site's topics, on PySpark.

* ``lake``: Structured Streaming from the region changelogs and the
  dead-letter topics into Parquet, partitioned by region and date, exactly
  once through a checkpoint;
* ``reconcile``: two sites' region state (from their changelogs) compared
  key by key, with the winner by Geode's conflict rule; exit status 1 on
  divergence;
* ``queue_health``: per queue and partition, events enqueued and removed per
  minute and the time events waited, as a table and a PNG chart.

Each runs as ``sluice pipeline JOB …`` or ``spark-submit pipelines/JOB.py …``;
``session`` builds the Spark session and its Kafka options, ``records``
decodes Sluice's Avro records in Spark.  User documentation:
``pipelines/README.md``.  Importing this package does not import PySpark.
"""
