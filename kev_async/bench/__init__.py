"""Benchmarks behind `kev bench`, one module per benchmark (engine, lora, scaling, kafka) plus the mixed
questions they share (also the demo's) and plots; imported by the CLI, never by serving code."""
