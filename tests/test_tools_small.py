"""Every benchmark and report tool a user is told to run, run small as the user would (a subprocess
from an empty directory, OMP_NUM_THREADS=1): exit status 0 and the numbers each one exists to
print, checked where they have a known value (measured bytes == computed bytes, parameter counts,
the baseline's own ratio 1.00). tools/gpu_check.py is tested in tests/test_gpu_check.py; the
planner tools (plan, layout, param_count, simulate_scale, pipeline_trace) in their own files.
Timings themselves are never asserted on."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _tool(tmp_path, name, *args, code=None, env=None):
    argv = [sys.executable, *(("-c", code) if code else (str(ROOT / "tools" / f"{name}.py"),)), *args]
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {})))
    assert r.returncode == 0, (name, r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.stdout


def _floats(line):
    return [float(x) for x in re.findall(r"-?\d+\.\d+(?:e[-+]\d+)?", line)]


def test_smoke(tmp_path):
    from megak3.config import load_model_config
    from megak3.model.param_count import count_parameters

    out = _tool(tmp_path, "smoke")
    m = re.search(r"k3_tiny: ([\d,]+) params, loss (\S+), grad norm (\S+)", out)
    assert m, out
    cfg = load_model_config("k3_tiny")
    routers_bias = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) * cfg.moe.num_experts  # buffers
    assert int(m[1].replace(",", "")) == count_parameters(cfg)["total"] - routers_bias
    assert 0 < float(m[2]) < 20 and 0 < float(m[3]) < 1e4


def test_bench_checkpoint(tmp_path):
    out = _tool(tmp_path, "bench_checkpoint", "--state-mib", "4", "--step-ms", "10", "--steps", "4",
                "--save-every", "2", "--dir", str(tmp_path / "ck"))
    assert re.search(r"none: run .* = 1\.00 x no checkpoint", out), out
    assert re.search(r"sync: run .*cost per save", out) and re.search(r"async: run .*x sync", out), out


def test_bench_kda(tmp_path):
    out = _tool(tmp_path, "bench_kda", "--T", "128", "--backward-T", "128", "--repeats", "1", "--threads", "1",
                "--no-memory")
    rows = [l for l in out.splitlines() if re.match(r"\s*(fwd|fwd\+bwd)\s+128\s+64 \|", l)]
    assert len(rows) == 2 and all("x" in r for r in rows), out


def test_bench_kda_cp_measured_bytes_equal_computed(tmp_path):
    out = _tool(tmp_path, "bench_kda_cp", "--measure-T", "128", "--repeats", "1", "--no-timing")
    row = next(l for l in out.splitlines() if re.match(r"\s+128\s", l))
    v = _floats(row)  # scan meas, calc, halo meas, calc, a2a meas, calc, a2a/scan, |o diff|/|o|
    assert v[0] == v[1] and v[2] == v[3] and v[4] == v[5], row
    assert v[0] == 768.0 and v[2] == 18.0, row  # tests/test_plan_cp.py's hand count at cp=4
    assert v[-1] < 1e-5, row  # the all-to-all form computes the scan's output


def test_bench_moonep(tmp_path):
    out = _tool(tmp_path, "bench_moonep", "--reps", "1", "--ranks", "8", "--zipf", "1.0")
    assert "latent/full = 0.500" in out, out  # latent_size = hidden_size / 2 at K3


def test_bench_offload_without_deepspeed(tmp_path):
    code = ("import runpy, sys; sys.modules['deepspeed'] = None; sys.argv = ['bench_offload.py'] + sys.argv[1:]; "
            f"runpy.run_path({str(ROOT / 'tools' / 'bench_offload.py')!r}, run_name='__main__')")
    out = _tool(tmp_path, "bench_offload", "--model", "k3_tiny", "--vocab-size", "512", "--steps", "1", code=code)
    assert re.search(r"torch AdamW foreach \(baseline\)\s+\S+\s+\S+\s+1\.00x", out), out
    for variant in ("torch AdamW fused", "torch AdamW for-loop", "offload torch twin, in place",
                    "offload torch twin, host copies"):
        assert re.search(re.escape(variant) + r"\s+[\d.]+\s+[\d.]+\s+[\d.]+x", out), (variant, out)
    assert "DeepSpeed not installed: its rows are left out" in out


def test_qb_deviation(tmp_path):
    out = _tool(tmp_path, "qb_deviation", "--steps", "2", "--batch", "2", "--seq-len", "64", "--threads", "1")
    assert re.search(r"summary \(2 steps", out) and "h4096" in out and "h1024" in out, out


def test_bench_qat(tmp_path):
    out = _tool(tmp_path, "bench_qat", "--steps", "2", "--seq-len", "32", "--batch", "2", "--eval-batches", "1",
                "--last", "1")
    for fragment in ("train loss (mean of last 1)", "val loss (1 batches)", "step time  qat / fp32 ="):
        assert fragment in out, (fragment, out)


def test_bench_layouts_memory_matches_expected(tmp_path):
    out = _tool(tmp_path, "bench_layouts", "--layouts", "1x1,2x1", "--steps", "1", "--seqlen", "32", "--batch", "2")
    rows = [l for l in out.splitlines() if re.match(r"\s+tp\dxdp\d\s", l)]
    assert [r.split()[0] for r in rows] == ["tp1xdp1", "tp2xdp1"], out
    for r in rows:
        params, expected = _floats(r.split("|")[1])
        assert params == expected, r  # params per rank measured == the sharding's count
    assert rows[0].rstrip().endswith("1.00x"), rows[0]


def test_bench_pipeline(tmp_path):
    out = _tool(tmp_path, "bench_pipeline", "--pp", "2", "--micro-batches", "2", "--layers", "2", "--seqlen", "16",
                "--schedules", "1f1b")
    assert re.search(r"^1f1b\s+[\d.]+", out, re.M), out
    m = re.search(r"rank 0 -> 1:\s+([\d.]+) KiB = \(1 partial \+ (\d+) blocks\) x ([\d.]+) KiB", out)
    assert m and float(m[1]) == (1 + int(m[2])) * float(m[3]), out


def test_parity_report(tmp_path):
    out = _tool(tmp_path, "parity_report", "--steps", "1", "--layouts", "2s1")
    rows = [l for l in out.splitlines() if "grads rel" in l]
    assert len(rows) == 1, out
    for r in rows:
        rel = float(re.search(r"grads rel (\S+)", r)[1])
        loss = float(re.search(r"loss step 0 diff (\S+)", r)[1])
        assert rel < 1e-5 and loss < 1e-5, r


def test_vision_ablation(tmp_path):
    out = _tool(tmp_path, "vision_ablation", "--steps", "1", "--batch", "1", "--seq-len", "64", "--serial",
                "--val-rows", "4", env={"HOME": str(tmp_path)})  # the demo corpus cache goes under tmp_path
    arms = {m[1]: (float(m[2]), float(m[3])) for m in
            re.finditer(r"(real|noise)\s+images: train loss (\S+) -> (\S+);", out)}
    assert set(arms) == {"real", "noise"}, out
    assert all(first == last for first, last in arms.values()), arms  # one step: its loss is the mean
    assert re.search(r"margin \(noise - real\): caption loss [-+][\d.]+ nats/token", out), out


def test_bench_overlap(tmp_path):
    out = _tool(tmp_path, "bench_overlap", "--ranks", "2", "--experts", "1", "--reps", "1", "--only", "1",
                "--seqlen", "32")
    assert re.search(r"\[1\] gloo x2, 1 k3_mini experts per peer", out), out
    assert re.search(r"\[2\] MoonEP layer fwd\+bwd .*outputs identical: True", out), out  # overlap changes no number


def test_bench_long_context(tmp_path):
    out = _tool(tmp_path, "bench_long_context", "--T", "256", "--cp", "2", "--recompute", "none")
    assert re.search(r"^\s+256\s+none\s+[\d.]+ MiB\s+1\.00", out, re.M), out


def test_bench_serve(tmp_path):
    """tools/bench_serve.py starts the server on a tiny checkpoint, 4 clients x 2 requests (half of them
    streamed): no errors, every output equal to the same request alone, also through a second server with
    ``serve --replicas 2``; --url off this machine is refused."""
    from test_generate_cli import make_tiny_run

    run, _, _ = make_tiny_run(tmp_path / "run")
    out = _tool(tmp_path, "bench_serve", "--checkpoint", str(run), "--clients", "4", "--requests", "2",
                "--prefix-words", "4", "--suffix-words", "2", "--min-tokens", "2", "--max-tokens", "4",
                "--timeout", "120", "--replicas", "2", "--checkpoint-interval", "16")
    m = re.search(r"concurrent: 8 requests in .* errors (\d+)", out)
    assert m and m.group(1) == "0", out
    assert "outputs equal to the same request alone: 8/8" in out, out
    assert re.search(r"TTFT p50 \d+\.\d+ s p99 \d+\.\d+ s \(4 streamed\)", out), out
    assert re.search(r"peak server RSS: \d+\.\d MiB; peak cache pages in use: \d+ / \d+", out), out
    assert re.search(r"concurrent, 2 replicas: 8 requests in .* errors 0", out), out
    assert "outputs equal to the same request alone (2 replicas): 8/8" in out, out
    assert re.search(r"2 replicas / 1 engine: \d+\.\d\dx requests/s", out), out
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_serve.py"), "--url", "http://10.0.0.1:80"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "127.0.0.1" in r.stderr, r.stderr


def test_bench_rollout(tmp_path):
    out = _tool(tmp_path, "bench_rollout", "--small", "--max-stale", "1")
    m = re.search(r"^trace: log-normal.*p99/p50 = ([\d.]+)", out, re.M)
    assert m and float(m[1]) >= 20, out  # the long tail the comparison is about
    rows = {m[1]: m[0] for m in re.finditer(r"^\s*(synchronous|partial \(lambda=0\.9\)|partial, group trigger\*): "
                                            r"\d+ groups x 2 in flight; 16 samples of groups 0-7 .*", out, re.M)}
    assert len(rows) == 3, out  # every mode trained the same 8 groups of 2
    assert re.search(r"\(4\.0 samples/update\).*staleness 0\.00 versions/token, "
                     r"a sample spans <= 1 versions", rows["synchronous"]), out  # whole updates, never stale
    span = re.search(r"a sample spans <= (\d+) versions", rows["partial, group trigger*"])
    assert span and int(span[1]) <= 2, out  # the prototype's bound: no trained token more than 1 version stale
    for mode in (r"partial \(lambda=0\.9\)", r"partial, group trigger\*"):
        ratios = r" / synchronous: trained samples per second x[\d.]+, learner idle fraction x[\d.]+, mean decode"
        assert re.search(mode + ratios, out), (mode, out)
