"""tools/layout.py: the printed groups are grid.py's; invalid layouts exit 2 with one line naming the field."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from parallel.grid import Layout

ROOT = Path(__file__).resolve().parents[1]


def run_tool(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "layout.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_json_matches_grid():
    p = run_tool("world_size=64", "parallel.tp=4", "parallel.pp=2", "parallel.ep=8", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    lay = Layout(world_size=64, tp=4, dp=8, pp=2, ep=8)  # dp derived: 64 / (4*1*2)
    assert out["layout"] == {"world_size": 64, "tp": 4, "cp": 1, "dp": 8, "pp": 2, "ep": 8, "etp": 1,
                             "edp": 4, "order": "tp-cp-ep-dp-pp", "model": "k3_full"}
    assert out["dense"] == lay.dense_groups()
    assert out["expert"] == lay.expert_groups()
    assert out["coords"] == [lay.coords(r) for r in range(64)]
    assert out["dense"]["tp"][0] == [0, 1, 2, 3] and out["dense"]["pp"][0] == [0, 32]


def test_text_lists_every_axis_and_the_rank_table():
    p = run_tool("world_size=16", "parallel.tp=2", "parallel.pp=4", "parallel.ep=2",
                 "parallel.order=tp-cp-ep-dp-pp", "model=k3_mini", "--ranks")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("rank"))
    row = {ln.split()[0]: ln for ln in lines[:header] if ln.startswith("  ")}
    assert set(row) == {"tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-dp-cp", "etp", "ep", "edp", "ep-etp"}
    assert row["tp"].endswith("[0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]")
    assert row["dp"].endswith("[0,2] [1,3] [4,6] [5,7] [8,10] [9,11] [12,14] [13,15]")
    assert row["pp"].endswith("[0,4,8,12] [1,5,9,13] [2,6,10,14] [3,7,11,15]")
    table = lines[header + 1:]
    assert len(table) == 16
    assert table[13].split() == ["13", "1", "0", "0", "3", "0", "1", "0"]  # rank tp cp dp pp etp ep edp


@pytest.mark.parametrize("args, needle", [
    (["world_size=64", "parallel.tp=3"], "parallel.tp*cp*pp"),
    (["world_size=8", "parallel.ep=3"], "parallel.etp*ep*pp"),
    (["world_size=3", "parallel.ep=3", "model=k3_mini"], "parallel.ep=3 does not divide model.moe.num_experts=128"),
    (["world_size=16", "parallel.tp=16", "model=k3_mini"], "parallel.tp=16 does not divide model.kda.num_heads=8"),
    (["world_size=16", "parallel.pp=16", "model=k3_mini"], "parallel.pp=16 exceeds model.num_layers=13"),
    (["world_size=8", "parallel.order=tp-dp-pp"], "parallel.order"),
    (["world_size=8", "parallel.dp=2"], "parallel.dp=0"),
    (["world_size=8", "parallel.tp=two"], "parallel.tp='two'"),
    (["world_size=8", "parallel.bogus=1"], "parallel.bogus"),
    (["world_size=8", "model=nope"], "unknown model 'nope'"),
])
def test_invalid_layout_exits_2_with_one_line(args, needle):
    p = run_tool(*args)
    assert p.returncode == 2
    assert p.stdout == ""
    assert needle in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
