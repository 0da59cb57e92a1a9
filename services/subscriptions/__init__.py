"""The subscription service: client interest, per-client queues in Kafka, durable and HA delivery."""

from .service import SubscriptionService

__all__ = ["SubscriptionService"]
