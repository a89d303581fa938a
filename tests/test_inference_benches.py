"""tools/bench_prefix_cache.py, tools/bench_decode.py, tools/bench_preempt.py and tools/bench_engine_batch.py run end
to end with tiny arguments."""
import contextlib
import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_decode  # noqa: E402
import bench_engine_batch  # noqa: E402
import bench_prefix_cache  # noqa: E402
import bench_preempt  # noqa: E402


def _run(fn, argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = fn(argv)
    return rc, out.getvalue()


def test_bench_prefix_cache_tiny():
    rc, out = _run(bench_prefix_cache.main, ["--sessions", "2", "--branches", "1", "--turns", "2", "--system", "16",
                                             "--user", "4", "--tool-min", "4", "--tool-max", "12", "--reply", "2",
                                             "--page-size", "4", "--interval", "8", "--coarse", "128"])
    rows = [l.split()[0] for l in out.splitlines()[2:6]]
    assert rows == ["no-reuse", "last", "coarse(128)", "ours(8)"], out
    assert "replies identical across policies: True" in out
    assert "ours / no-reuse prefill" in out and "ours / last prefill" in out
    assert rc in (0, 1)


def test_bench_decode_tiny():
    rc, out = _run(bench_decode.main, ["--contexts", "16", "48", "--new", "2", "--page-size", "16", "--chunk", "32"])
    assert rc == 0 and "(equal)" in out, out
    assert len([l for l in out.splitlines() if l.strip().startswith(("16", "48"))]) == 2


def test_bench_preempt_tiny():
    rc, out = _run(bench_preempt.main, ["--requests", "4", "--prompt", "8", "--new", "12", "--pool", "8",
                                        "--page-size", "4"])
    assert rc == 0 and "outputs identical across policies: True" in out, out
    assert "preempt / reserve: mean sequences at once" in out


def test_bench_engine_batch_tiny():
    rc, out = _run(bench_engine_batch.main, ["--batches", "1", "3", "--steps", "2", "--prompt", "5", "--group", "3",
                                             "--repeat", "1", "--long", "520", "--long-group", "2"])
    assert rc == 0 and "outputs (tokens, logprobs) of old and new: identical" in out, out
    assert "ms per sequence" in out and "group start (3 samples" in out
    assert "long group outputs, holds on vs off: same tokens" in out and "528 prefill tokens computed" in out


def test_bench_bad_arguments_exit_2():
    assert bench_decode.main(["--new", "0"]) == 2
    assert bench_prefix_cache.main(["--interval", "20", "--page-size", "16"]) == 2
    assert bench_preempt.main(["--pool", "0"]) == 2
    assert bench_engine_batch.main(["--batches", "0"]) == 2
    assert bench_engine_batch.main(["--long", "-1"]) == 2
    assert bench_engine_batch.main(["--baseline", "no-such-revision"]) == 2
