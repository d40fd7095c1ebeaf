"""bench.py subcommands end to end on tiny models, and the keys of their JSON."""

import json

import bench

LEVEL_KEYS = {"level", "params", "linear_B_per_param", "model_B_per_param", "activation_B_per_token",
              "gemm_weight_B_per_param"}


def test_memory_tiny(tmp_path):
    out = tmp_path / "memory.json"
    bench.main(["memory", "--models", "tiny", "--tokens", "32", "--json", str(out)])
    data = json.loads(out.read_text())
    assert {"device", "date", "torch"} <= set(data["env"])
    rows = {r["level"]: r for r in data["memory"]}
    assert set(rows) == {"bf16", "O1", "O2", "O2-fp8v"}
    assert all(LEVEL_KEYS <= set(r) for r in rows.values())
    # the precision table, measured: 16 -> 6 (-> 5 with FP8 v) bytes per block-Linear parameter
    assert 16.0 <= rows["bf16"]["linear_B_per_param"] < 16.01
    assert 6.0 <= rows["O2"]["linear_B_per_param"] < 6.01
    assert 5.0 <= rows["O2-fp8v"]["linear_B_per_param"] < 5.01
    assert rows["O1"]["activation_B_per_token"] < rows["bf16"]["activation_B_per_token"]


def test_comm_two_ranks(tmp_path):
    out = tmp_path / "comm.json"
    bench.main(["comm", "--worlds", "2", "--json", str(out)])
    rows = {r["level"]: r for r in json.loads(out.read_text())["comm"]}
    assert set(rows) == {"bf16", "O1", "O2", "O3"}
    # gradient synchronization at or below 0.5x a BF16 all-reduce (0.25x fp32), scales included
    for level in ("O1", "O2", "O3"):
        assert rows[level]["vs_bf16_allreduce"] <= 0.505, rows[level]
