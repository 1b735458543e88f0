"""Benchmarks: Spec-Bench prompts, fair timing of methods in one process, reports."""
