"""Kev's service: the `kev` CLI (cli/) on top, the app wiring, engine actor, settings and logs here,
an actor runtime on anyio (runtime/), observability (observe/) and benchmarks (bench/) below it."""
