"""`python -m benchmarks.answer_surface` stays runnable on a tiny model: both tables, their ratios, and the
n-samples check (each sample equal to its question asked alone) passing. Speed is never asserted."""

from benchmarks import answer_surface
from benchmarks.command import run_alone

pytest_plugins = ["serve_fixtures"]


def test_answer_surface_prints_the_logprobs_cost_and_the_samples_against_questions(tiny_model_dir, capsys):
    assert run_alone(answer_surface.register, ["--model", str(tiny_model_dir), "--batch", "4", "--steps", "2",
                                               "--prompt-tokens", "40", "--rounds", "1", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    for row in ("| nobody asks |", "| one asks (top 5) |", "| all ask (top 20) |", "| n=4, one question |",
                "| 4 questions |", "every sample equal to its question alone", "n=4 / 4 questions: wall time"):
        assert row in out
    computed = {line.split("|")[1].strip(): int(line.split("|")[2]) for line in out.splitlines()
                if line.startswith(("| n=4", "| 4 questions"))}
    assert computed["n=4, one question"] < computed["4 questions"]  # the samples share the prompt's blocks
