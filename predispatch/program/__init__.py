"""The ExportedProgram predispatch returns: how it writes back, runs its regions and calls ops; its printed form."""
