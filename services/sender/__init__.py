"""Gateway senders (serial and parallel, over one loop): queue batches to a remote site."""
