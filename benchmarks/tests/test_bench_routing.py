"""`python -m benchmarks.routing --semantic` stays runnable: both hashes on the fixed pairs, on a tiny model's
embedding layer (a measurement; what semantic_hash guarantees is tests/test_routing_embedding.py)."""

from benchmarks import routing
from benchmarks.command import run_alone

pytest_plugins = ["serve_fixtures"]


def test_routing_semantic_prints_both_hashes_on_the_pairs(tiny_model_dir, capsys):
    assert run_alone(routing.register, ["--semantic", "--model", str(tiny_model_dir), "--rounds", "1",
                                        "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "16 paraphrase and 16 unrelated pairs" in out and "CPU: " in out
    for strategy in ("semantic_hash", "prefix_hash"):
        for pairs in ("all", "English", "Chinese"):
            assert any(line.split()[:2] == [strategy, pairs] for line in out.splitlines()), (strategy, pairs)
    assert "'How do I get a refund?' -> " in out and "hyperplane seeds 0..1" in out
