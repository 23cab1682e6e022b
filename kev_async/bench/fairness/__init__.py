"""`kev bench fairness`: tenants sharing one engine, policy fair against FCFS, side by side in one run.

command.py      the flags (`register`, what `kev --help` imports) and the error boundary
scenarios.py    who asks what and when: a small tenant beside a flood; two backlogged tenants by weight
in_process.py   a scenario through Kev's async Engine in this process, each question under its tenant's
                principal
through_kafka.py  the same Scenario through `kev serve` in this process on an embedded broker, each question
                signed under its tenant; the same Outcomes, the scheduler's service scraped from kev_tenant_*
run.py          one invocation: each scenario under each policy on each path, the tables side by side, the
                JSON result
"""

from kev_async.bench.fairness.command import register

__all__ = ["register"]
