"""`kev bench load`: an open-loop load benchmark. One seeded arrival trace, replayed against each system
one after another in this process; per system goodput, TTFT and end-to-end percentiles, and answers
token-identical to a solo greedy run. A table per rate, a JSON result and a latency-vs-rate plot.

command.py            the flags (`register`, what `kev --help` imports) and the error boundary
run.py                one invocation: per rate, the trace against each system, then table, JSON and plot
trace.py, texts.py    the arrival trace and the text its long prompts are cut from
kev_engine.py         Kev's async Engine in process          kev_kafka.py   Kev behind the embedded broker
transformers_static.py  transformers generate, static batches  openai_compatible.py  any server over HTTP
solo_reference.py     each question answered alone: what "identical" compares with
report.py, plot.py    what is measured per system, the table and the plot
"""

from kev_async.bench.load.command import register

__all__ = ["register"]
