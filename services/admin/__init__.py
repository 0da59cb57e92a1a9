"""Operator commands: status and control of queues."""
