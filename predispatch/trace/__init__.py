"""The capture stage: the module traced into a flat functional pre-dispatch graph, with what the trace saw."""
