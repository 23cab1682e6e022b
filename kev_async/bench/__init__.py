"""The benchmarks a user of the service runs, behind `kev bench` (load, kafka, gateway, batch, peer, structured,
spec, isolation, fairness), one module or package each, plus what several share (arguments.py, model.py, machine.py),
which the research comparisons in benchmarks/ use too; imported by the CLI, never by serving code. Their
pictures need matplotlib, Kev's `bench` extra (kev_async/drawing.py)."""
