"""Benchmarks behind `kev bench`, one module or package per benchmark (engine, lora, scaling, kafka, load,
gateway, routing, precision, step) plus what several share: arguments.py, model.py, machine.py; imported by
the CLI, never by serving code."""
