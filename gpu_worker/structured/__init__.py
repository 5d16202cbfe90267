"""Structured output in the worker: grammar masks per row, compiled ahead of admission (``grammar``)."""
