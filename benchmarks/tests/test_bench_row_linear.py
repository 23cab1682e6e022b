"""`python -m benchmarks.row_linear` stays runnable: a row per dtype and row count, three kernels side by side
(speed not asserted)."""

from benchmarks import row_linear


def test_row_linear_prints_every_dtype_and_row_count(capsys):
    row_linear.main(["--repeats", "1", "--shapes", "o", "--threads", "2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[1], int(r[2])) for r in rows] == [(dtype, "o", n) for dtype in ("float32", "bfloat16")
                                                      for n in row_linear.ROWS]
    assert all(float(ms) > 0 for r in rows for ms in r[3:])
