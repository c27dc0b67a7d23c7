"""The stages after capture, one pass a module: history, dead code, writes, regions, functional check, signature."""
