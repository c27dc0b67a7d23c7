"""Shrink a failing program to a minimal one that fails the same way.

    >>> small = minimize(program, lambda p: check(p).reason == failure.reason)

Greedy, over the program's structure rather than hypothesis's choice
sequence: drop a statement, unwrap a ``with`` block into its body, drop a
returned value, drop an input; keep any change after which the predicate
still holds (a candidate that no longer builds or that eager refuses simply
does not hold), until no change does.
"""
from __future__ import annotations

import copy
from typing import Callable, Iterator

from .generator import Program, Stmt


def _lists(stmts: list[Stmt]) -> Iterator[list[Stmt]]:
    yield stmts
    for s in stmts:
        if s.body is not None:
            yield from _lists(s.body)


def _candidates(program: Program) -> Iterator[Program]:
    # statement lists in a fresh copy are found by position in the walk
    n_lists = sum(1 for _ in _lists(program.stmts))
    for li in range(n_lists):
        size = len(list(_lists(program.stmts))[li])
        for i in reversed(range(size)):
            for unwrap in (False, True):
                p = copy.deepcopy(program)
                stmts = list(_lists(p.stmts))[li]
                if unwrap:
                    if stmts[i].body is None:
                        continue
                    stmts[i:i + 1] = stmts[i].body
                else:
                    del stmts[i]
                yield p
    for i in range(len(program.returns)):
        if len(program.returns) > 1:
            p = copy.deepcopy(program)
            del p.returns[i]
            yield p
    for i in range(len(program.inputs)):
        if len(program.inputs) > 1:
            p = copy.deepcopy(program)
            del p.inputs[i]
            yield p


def minimize(program: Program, still_fails: Callable[[Program], bool], *, budget: int = 400) -> Program:
    """The smallest program reached from ``program`` on which ``still_fails``
    holds, trying at most ``budget`` candidates."""
    tried = 0
    improved = True
    while improved and tried < budget:
        improved = False
        for candidate in _candidates(program):
            tried += 1
            if still_fails(candidate):
                program, improved = candidate, True
                break
            if tried >= budget:
                break
    return program
