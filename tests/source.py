"""Reading the project's own source as syntax trees, for the tests that check its structure."""

from __future__ import annotations

import ast


def parse(source: str) -> ast.Module:
    """``ast.parse``, tried once more on CPython 3.11's spurious ``SystemError`` ("AST constructor
    recursion depth mismatch", python/cpython#106905, fixed in later releases: an error inside one
    AST construction leaves its depth count off; seen once in a whole-suite run)."""
    try:
        return ast.parse(source)
    except SystemError:
        return ast.parse(source)
