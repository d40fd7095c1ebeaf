"""bench.py subcommands end to end on tiny models, and the keys of their JSON."""

import json

import pytest

import bench
import conftest

pytestmark = pytest.mark.usefixtures("shakespeare")  # the parity runs train on it

LEVEL_KEYS = {"level", "params", "linear_B_per_param", "model_B_per_param", "activation_B_per_token",
              "gemm_weight_B_per_param"}


def test_memory_tiny(tmp_path):
    out = tmp_path / "memory.json"
    bench.main(["memory", "--models", "tiny", "--tokens", "32", "--json", str(out)])
    data = json.loads(out.read_text())
    assert {"device", "date", "torch"} <= set(data["env"])
    rows = {r["level"]: r for r in data["memory"]}
    assert set(rows) == {"bf16", "O1", "O2", "O2-fp8v", "O2-fp8acc", "O2-fp8v-fp8acc"}
    assert all(LEVEL_KEYS <= set(r) for r in rows.values())
    # the precision table, measured: 16 -> 7 bytes per block-Linear parameter between backward and
    # step (6 at the step), 1 B less with FP8 v, 1 B less with FP8 gradient accumulation
    assert 16.0 <= rows["bf16"]["linear_B_per_param"] < 16.01
    for level, between, at_step in (("O2", 7, 6), ("O2-fp8v", 6, 5), ("O2-fp8acc", 6, 6), ("O2-fp8v-fp8acc", 5, 5)):
        assert between <= rows[level]["linear_B_per_param"] < between + 0.01, level
        assert at_step <= rows[level]["linear_B_per_param_at_step"] < at_step + 0.01, level
    assert rows["O1"]["activation_B_per_token"] < rows["bf16"]["activation_B_per_token"]


@pytest.mark.slow
@pytest.mark.dist
def test_comm_two_ranks(tmp_path):
    out = tmp_path / "comm.json"
    bench.main(["comm", "--worlds", "2", "--json", str(out)])
    rows = {r["level"]: r for r in json.loads(out.read_text())["comm"]}
    assert set(rows) == {"bf16", "O1", "O2", "O3"}
    # The FP8 layers: about 0.25x an fp32 all-reduce (1 byte a value, + 4-byte scales); every
    # other parameter: fp32 gradients at every level (2 (W-1)/W x 4 bytes = 4 at W=2).
    for level in ("O1", "O2", "O3"):
        assert rows[level]["fp8_layers_vs_fp32"] <= 0.26, rows[level]
        assert rows[level]["rest_B_per_param"] == rows["bf16"]["rest_B_per_param"] == 4.0, rows[level]
        assert rows[level]["model_vs_fp32"] > rows[level]["fp8_layers_vs_fp32"]
    # model parallelism: FP8 payloads + 4-byte scales against BF16 layers of the same cut (width 128)
    mp = {(r["parallel"], r["pass"]): r for r in json.loads(out.read_text())["comm_model_parallel"]}
    assert set(mp) == {(p, s) for p in ("tensor", "tensor+sequence", "pipeline") for s in ("fwd", "fwd+bwd")}
    for r in mp.values():
        assert 0.5 <= r["fp8_vs_bf16"] <= 0.52, r
    assert mp["tensor", "fwd"]["bf16_B_per_token"] == 512  # 2 all-reduces of 128 bf16 values, 2 ranks
    assert mp["pipeline", "fwd"]["bf16_B_per_token"] == 256  # 128 bf16 values per token
    assert "reduce_scatter_fp8" in mp["tensor+sequence", "fwd"]["fp8_ops"]
    assert "pp_send_e5m2" in mp["pipeline", "fwd+bwd"]["fp8_ops"]


TINY = conftest.TINY + ["log_interval=100"]


@pytest.mark.slow
def test_parity_throughput_and_report(tmp_path):
    bench.main(["parity", "--variants", "bf16", "O1", "O2", "--iters", "6", "--eval_interval", "3",
                "--cpu", "--out", str(tmp_path), "--json", str(tmp_path / "parity_cpu.json"), "--set", *TINY])
    parity = json.loads((tmp_path / "parity_cpu.json").read_text())
    rows = {r["variant"]: r for r in parity["parity"]}
    assert set(rows) == {"bf16", "O1", "O2"} and rows["bf16"]["gap_vs_bf16"] == 0
    assert all(abs(r["gap_vs_bf16"]) < 0.05 for r in rows.values())  # 6 steps: barely trained
    assert (tmp_path / "parity.csv").read_text().startswith("variant,kind,iter,loss")
    assert (tmp_path / "parity.png").stat().st_size > 10000
    bench.main(["throughput", "--models", "cpu-small", "--steps", "1",
                "--json", str(tmp_path / "throughput_cpu.json")])
    tp = json.loads((tmp_path / "throughput_cpu.json").read_text())["throughput"]
    assert {r["level"] for r in tp} == {"bf16", "O1", "O2"} and all(r["tokens_per_s"] > 0 for r in tp)
    assert all(r["device_kind"].startswith("CPU") for r in tp)  # labelled as CPU figures
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- results:start -->\nold\n<!-- results:end -->\n")
    bench.main(["report", "--results", str(tmp_path), "--readme", str(readme)])
    text = readme.read_text()
    assert "Loss parity" in text and "Throughput" in text and "old" not in text
    assert "No GPU figures" in text
