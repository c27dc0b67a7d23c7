"""Sharded modules (DTensor, tensor parallel, FSDP2): each rank's program over its local shards."""
