"""The gateway receiver: applies batches from remote sites and acknowledges them."""
