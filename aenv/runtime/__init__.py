"""Isolation drivers behind one interface (see base.py). Importing this package loads no driver."""
