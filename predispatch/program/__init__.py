"""The ExportedProgram predispatch returns: its metadata, write-backs, and its printed form."""
