"""What every stage shares, predispatch's IR: the trace's records, node-meta keys, our ops, regions, the program's record."""
