"""The stages after capture, one pass a module: history, writes, regions."""
