"""moonep.stats.LoadRecorder against hand-computed figures, and tools/expert_load.py on its jsonl."""
import json

import pytest
import torch

from moonep.planner import plan_moonep
from moonep.stats import LoadRecorder


def test_recorder_hand_computed(tmp_path):
    c = torch.tensor([[4, 0, 0, 0], [2, 1, 1, 0]])  # home loads [7, 1]; plan moves 3 rows of e0 to rank 1
    p = plan_moonep(c, 4, backend="torch")
    rec = LoadRecorder()
    rec.record(3, c, p, row_bytes=10, expert_weight_bytes=1000)
    rec.record(3, c, p, row_bytes=10, expert_weight_bytes=1000)
    rec.record(5, c, None, row_bytes=10)
    st = rec.layers[3]
    assert st.tokens_E.tolist() == [12, 2, 2, 0]
    assert st.before_R.tolist() == [14, 2] and st.after_R.tolist() == [8, 8]
    s = rec.summary()
    assert s["moe/L3/rank_imbalance_before"] == pytest.approx(7 / 4 - 1)
    assert s["moe/L3/rank_imbalance_after"] == 0.0 and s["moe/L5/rank_imbalance_after"] == pytest.approx(0.75)
    assert s["moe/L3/replicas"] == 1.0 and s["moe/replicas"] == 1.0
    # off-rank rows: plan: s0->r1 1, s1->r0 1 = 2 per call (x2 calls); no plan: s0 none, s1->e0,e1 = 3
    assert rec._layer_host(rec.layers[3])["token_bytes"] == 2 * 2 * 10
    assert rec._layer_host(rec.layers[5])["token_bytes"] == 3 * 10
    assert s["moe/replica_weight_mb"] == pytest.approx(2000 / 2**20)
    rec.write_jsonl(tmp_path / "expert_load.jsonl", step=10)
    rec.reset()
    assert rec.summary() == {}
    rec.record(3, c, p, row_bytes=10)
    rec.write_jsonl(tmp_path / "expert_load.jsonl", step=20)
    lines = [json.loads(x) for x in (tmp_path / "expert_load.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [10, 20] and lines[1]["layers"]["3"]["calls"] == 1
    with pytest.raises(ValueError, match="parallel.ep"):
        rec.record(0, torch.zeros(3, 4, dtype=torch.int64))


def test_expert_load_tool(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "expert_load", Path(__file__).resolve().parents[1] / "tools" / "expert_load.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    main = mod.main
    rec = LoadRecorder()
    g = torch.Generator().manual_seed(0)
    for step in (1, 2, 3):
        for layer in (1, 2):
            idx = torch.multinomial(torch.tensor([8.0] + [1.0] * 15).expand(4, 16).contiguous(), 32, True,
                                    generator=g)
            c = torch.zeros(4, 16, dtype=torch.int64).scatter_add_(1, idx, torch.ones_like(idx))
            rec.record(layer, c, plan_moonep(c, 32), row_bytes=8, expert_weight_bytes=64)
        rec.write_jsonl(tmp_path / "expert_load.jsonl", step)
        rec.reset()
    files = main([str(tmp_path)])
    assert len(files) == 3 and all(f.stat().st_size > 1000 for f in files)
    out = capsys.readouterr().out
    # the two imbalance figures carry distinct names: per EP rank (MoonEP) and per expert (QB)
    assert "rank_imbal_before" in out and "expert_maxvio" in out and "maxvio_before" not in out
    assert "step 3" in out
    # without EP (no plan, one rank) the report still renders
    rec = LoadRecorder()
    rec.record(1, torch.tensor([[5, 1, 1, 1]]), None)
    rec.write_jsonl(tmp_path / "noep" / "expert_load.jsonl", 1)
    assert len(main([str(tmp_path / "noep")])) == 3
    with pytest.raises(SystemExit):  # --help describes every argument
        main(["--help"])
    helptext = capsys.readouterr().out
    assert "expert_load_replicas.png" in helptext and "directory for the three PNGs" in helptext
    with pytest.raises(ValueError, match="expert_load.jsonl"):
        main([str(tmp_path / "nope")])
