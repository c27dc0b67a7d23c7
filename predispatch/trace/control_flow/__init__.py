"""torch's control-flow operators (cond, while_loop, map) kept in the program, their branches traced by the pipeline."""
