"""Sluice: Apache Geode's event distribution semantics on Kafka."""

__version__ = "0.1.0"
