"""Checkers that judge what a run did from its records, after the fact: no Kafka, no I/O."""
