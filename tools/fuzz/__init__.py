"""Differential fuzzing of predispatch against eager.

``generator.programs()`` draws random small modules (grad/autocast regions,
views, in-place ops, parameter and buffer updates, outputs aliasing inputs);
``oracle.check(program)`` runs eager first and then the exported program;
``python -m tools.fuzz.run --examples N`` runs many and prints a report.
"""
