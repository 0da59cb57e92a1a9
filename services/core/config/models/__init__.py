"""The site file's sections as frozen, strict pydantic models, one module per section.

``kafka`` (the cluster connection and client timing), ``queues`` (gateway
senders, async event queues and their listeners), ``region`` (regions and
the region service), ``receiver``, ``subscriptions``, and ``site``, the whole
file.  Each section module also holds the rules between its own fields, as
functions of plain data; ``sluice.core.config`` re-exports the models.
"""
