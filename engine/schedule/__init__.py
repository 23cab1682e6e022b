"""Scheduling: every step's admissions, preemptions and evictions, and each question's life. Pure Python."""
