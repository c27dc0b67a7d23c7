"""The records, node-meta keys and ops every stage shares: predispatch's IR."""
