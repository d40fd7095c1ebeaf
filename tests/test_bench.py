"""bench.py subcommands end to end on tiny models, and the keys of their JSON."""

import json
import subprocess

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
    assert set(rows) == {"bf16", "O1", "O2", "O2-fp8v", "O2-fp8acc", "O2-fp8v-fp8acc", "O1-mxfp8", "O1-fp8attn"}
    assert all(LEVEL_KEYS <= set(r) for r in rows.values())
    # the precision table, measured: 16 -> 7 bytes per block-Linear parameter between backward and
    # step (6 at the step), 1 B less with FP8 v, 1 B less with FP8 gradient accumulation; plus the
    # scales of the FP8 gradient, m and v, one fp32 per 128 values: 1/32 B each
    s = 1 / 32
    assert 16.0 <= rows["bf16"]["linear_B_per_param"] < 16.01
    for level, between, at_step in (("O2", 7 + 2 * s, 6 + 3 * s), ("O2-fp8v", 6 + 2 * s, 5 + 3 * s),
                                    ("O2-fp8acc", 6 + 3 * s, 6 + 3 * s), ("O2-fp8v-fp8acc", 5 + 3 * s, 5 + 3 * s)):
        assert between <= rows[level]["linear_B_per_param"] < between + 0.01, level
        assert at_step <= rows[level]["linear_B_per_param_at_step"] < at_step + 0.01, level
    assert rows["O1"]["activation_B_per_token"] < rows["bf16"]["activation_B_per_token"]
    # MX: the FP8 W and W^T held for the step carry one E8M0 byte per 32 values each (fp32 scales
    # per 32 values would be 4 B each: 2 + 8/32)
    assert 2 + 2 / 32 <= rows["O1-mxfp8"]["gemm_weight_B_per_param"] < 2 + 2 / 32 + 0.001
    # FP8 attention keeps FP8 Q, K, V and an fp32 lse per head (3 * 64 + 2 * 4 B per token and
    # layer here) where the CPU's attention keeps fp32 Q, K, V and O (4 * 64 * 4 B)
    saved = rows["O1"]["activation_B_per_token"] - rows["O1-fp8attn"]["activation_B_per_token"]
    assert saved >= 2 * (4 * 64 * 4 - (3 * 64 + 2 * 4)), saved


def test_levels_and_variants_are_tables(monkeypatch):
    """A level or variant is its table's overrides, whatever its name says: nothing is parsed from
    the name (a new variant is one line in the table)."""
    monkeypatch.setitem(bench.LEVELS, "sqrt-v-in-e4m3", dict(precision="O2", o2_v_format="fp8"))
    _, opt, settings = bench.build(bench.MODELS["tiny"], "sqrt-v-in-e4m3")
    assert settings["precision"] == "O2" and settings["o2_v_format"] == "fp8" and settings["o2_grad_accum"] == "fp16"
    monkeypatch.setitem(bench.VARIANTS, "fine", ({"precision": "O1", "fp8_granularity": "block"}, 1))
    monkeypatch.setitem(bench.VARIANTS, "blockless", ({"precision": "O1"}, 1))
    assert bench.target("fine") == bench.BLOCK_TARGET and bench.target("blockless") == bench.TARGET


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
    # engine=torch, FSDP2: O1 gathers the block Linears' weights in FP8, a quarter of their fp32
    # bytes (the scale is agreed by an all-reduce, not sent); gradients are reduce-scattered in fp32
    ft = {r["level"]: r for r in json.loads(out.read_text())["comm_torch"]}
    assert ft["bf16"]["of_which_fp8"] == 0 and ft["O1"]["of_which_fp8"] > 0
    fp32_of_fp8_layers = ft["bf16"]["all_gather_B_per_param"] - (ft["O1"]["all_gather_B_per_param"] - ft["O1"]["of_which_fp8"])
    assert 0.25 <= ft["O1"]["of_which_fp8"] / fp32_of_fp8_layers <= 0.26, ft
    assert ft["O1"]["reduce_scatter_B_per_param"] == ft["bf16"]["reduce_scatter_B_per_param"] == 2.0
    assert ft["O1"]["model_vs_bf16"] < 0.6
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


MACHINE_A = {"device": "CPU (test)", "torch": "2", "date": "2026-01-01T00:00:00", "cpu_capability": "AVX2",
             "cpu_bf16_instructions": "none"}
MACHINE_B = {**MACHINE_A, "date": "2026-02-01T00:00:00", "cpu_capability": "AVX512",
             "cpu_bf16_instructions": "AVX512-BF16"}


def fake_run(variant, seed, final, iters=1000, cpu=100.0, env=MACHINE_A):
    """A run record as bench.run_all writes it, ending at val loss `final`."""
    return {"variant": variant, "seed": seed, "iters": iters, "processes": bench.VARIANTS[variant][1],
            "command": f"python train.py config/shakespeare_char.py seed={seed}", "commit": "abc1234",
            "env": env, "cpu_seconds": cpu, "wall_seconds": 1.0,
            "losses": [[i, 4.0 - i / iters * (4.0 - final)] for i in range(iters)],
            "evals": [[0, 4.0, 4.0], [iters // 2, 3.0, 3.0], [iters, final, final]]}


# bf16's final val losses at seeds 0, 1, 2, and each variant's per-seed relative gaps to them
BF16 = [2.0, 2.1, 1.9]
GAPS = {"O1": [0.001, 0.002, 0.003],        # mean 0.2%, SE 0.0577%: 95% interval within 1%: met
        "O2": [0.020, 0.021, 0.022],        # 2.1% +- 0.06%: above 1%: missed
        "O1-block": [0.001, 0.002, 0.003],  # the 0.25% target lies in -0.05%..+0.45%: unresolvable
        "O1-row": [0.0, 0.001]}             # 2 of 3 seeds: incomplete


def fake_runs():
    runs = {("bf16", s, 1000): fake_run("bf16", s, v, cpu=200.0) for s, v in enumerate(BF16)}
    for name, gaps in GAPS.items():
        runs.update({(name, s, 1000): fake_run(name, s, BF16[s] * (1 + g)) for s, g in enumerate(gaps)})
    # seed 2 of bf16 and O1 ran on a second machine, ten times faster
    runs["bf16", 2, 1000] = fake_run("bf16", 2, BF16[2], cpu=20.0, env=MACHINE_B)
    runs["O1", 2, 1000] = fake_run("O1", 2, BF16[2] * (1 + GAPS["O1"][2]), cpu=10.0, env=MACHINE_B)
    runs["bf16", 0, 3000] = fake_run("bf16", 0, 1.5, iters=3000)
    runs["O1", 0, 3000] = fake_run("O1", 0, 1.503, iters=3000)
    return runs


def test_parity_summary_known_answers():
    d = bench.summarize(fake_runs(), ["bf16", "O1", "O2", "O1-block", "O1-row", "O1-pp2"], [0, 1, 2], 1000,
                        ["bf16", "O1", "O2"], 3000)
    rows = {r["variant"]: r for r in d["parity"]}
    assert d["noise_floor"] == pytest.approx(0.1 / 2.0)  # std of 2.0, 2.1, 1.9 over their mean
    # CPU time per machine, never averaged across machines
    a, b = (m["machine"] for m in d["machines"])
    assert "AVX2" in a and "AVX512-BF16" in b and [m["runs"] for m in d["machines"]] == [14, 2]
    assert rows["bf16"]["verdict"] == "baseline" and rows["bf16"]["cpu_seconds"] == {a: 200.0, b: 20.0}
    o1 = rows["O1"]
    assert o1["gap"] == pytest.approx(0.002) and o1["gap_se"] == pytest.approx(0.001 / 3 ** 0.5)
    assert o1["gap_ci95"] == pytest.approx([0.002 - 4.303 * 0.001 / 3 ** 0.5, 0.002 + 4.303 * 0.001 / 3 ** 0.5])
    # unpaired: the same mean gap, with the seed-to-seed spread in its standard error
    assert o1["gap_unpaired"] == pytest.approx(0.002, abs=1e-4) and o1["gap_unpaired_se"] > 10 * o1["gap_se"]
    assert o1["cpu_seconds"] == {a: 100.0, b: 10.0} and o1["cpu_seconds_vs_bf16"] == {a: 0.5, b: 0.5}
    assert o1["final_val_std"] > 0.09
    assert "A: 100 (0.50x bf16) · B: 10 (0.50x bf16)" in "\n".join(bench.report_parity({**d, "config": "c"}))
    assert [rows[v]["verdict"] for v in ("O1", "O2", "O1-block", "O1-row", "O1-pp2")] == \
        ["met", "missed", "unresolvable", "incomplete", "incomplete"]
    assert rows["O1-block"]["target"] == 0.0025 and rows["O2"]["target"] == 0.01
    assert rows["O1-row"]["note"].startswith("2 of 3") and rows["O1-pp2"]["note"].startswith("0 of 3")
    long = {r["variant"]: r for r in d["long"]}
    assert set(long) == {"bf16", "O1"} and long["O1"]["gap"] == pytest.approx(0.002)
    # a verdict needs MIN_SEEDS pairs, and an interval that is not entirely on one side of the target
    assert bench.verdict([0.0, 0.0, 0.0], 0.01)[0] == "met"
    assert bench.verdict([0.01, 0.01, 0.01], 0.01)[0] == "unresolvable"
    assert bench.verdict([0.02] * 2, 0.01)[0] == "incomplete"


def test_parity_pairs_each_run_with_the_bf16_run_of_its_machine(tmp_path, monkeypatch):
    """bf16 at one seed lands apart on two machines (different CPU kernels), so a run is paired
    with a bf16 run of its own machine where there is one: a twin, run with --twins and kept
    beside the first run of that seed. Pairs made across machines are counted and reported."""
    runs = {("bf16", s, 1000): fake_run("bf16", s, v) for s, v in enumerate(BF16)}
    runs["bf16", 2, 1000] = fake_run("bf16", 2, BF16[2], env=MACHINE_B)  # seed 2 ran on B first ...
    twin = fake_run("bf16", 2, 1.95)  # ... and again on A
    runs.update({("O2", s, 1000): fake_run("O2", s, b * 1.01) for s, b in enumerate(BF16[:2] + [1.95])})
    runs["O1", 2, 1000] = fake_run("O1", 2, BF16[2] * 1.002, env=MACHINE_B)
    for s in (0, 1):
        runs["O1", s, 1000] = fake_run("O1", s, BF16[s] * 1.002, env={**MACHINE_A, "cpu_capability": "AVX512"})
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    for (v, s, n), r in runs.items():
        (runs_dir / f"{v}-seed{s}-{n}.json").write_text(json.dumps(r))
    (runs_dir / "bf16-seed2-1000-avx2.json").write_text(json.dumps(twin))
    assert bench.load_runs(str(runs_dir)) == runs
    twins = bench.load_runs(str(runs_dir), twins=True)
    assert list(twins) == [("bf16", 2, 1000, bench._machine(twin))]
    d = bench.summarize(runs, ["bf16", "O1", "O2"], [0, 1, 2], 1000, twins=twins)
    rows = {r["variant"]: r for r in d["parity"]}
    assert rows["O2"]["gap"] == pytest.approx(0.01) and rows["O2"]["pairs_across_machines"] == 0
    assert rows["O1"]["gap"] == pytest.approx(0.002) and rows["O1"]["pairs_across_machines"] == 2
    assert d["noise_floor"] == pytest.approx(0.1 / 2.0)  # (the first run of each seed)
    assert d["bf16_on_two_machines"] == [{"seed": 2, "final_val_loss": {bench._machine(runs["bf16", 2, 1000]): 1.9,
                                                                         bench._machine(twin): 1.95}}]
    text = "\n".join(bench.report_parity({**d, "config": "c"}))
    letters = bench._letters(d)
    b, a = letters[bench._machine(runs["bf16", 2, 1000])], letters[bench._machine(twin)]
    assert f"(seed 2: {b} 1.9000, {a} 1.9500)" in text and "pairs across machines: O1 (2 of 3)." in text
    # run_all --twins runs again on this machine (A) what ran on another (B), beside it
    started = []

    def fake(name, seed, iters, config, threads, set_=()):
        started.append((name, seed))
        out = tmp_path / f"h{len(started)}.json"
        out.write_text(json.dumps({"losses": [], "evals": [[iters, 1.0, 1.0]]}))
        return (subprocess.Popen(["true"]), str(out), {"variant": name, "seed": seed, "iters": iters,
                                                         "command": name, "env": MACHINE_A}, str(tmp_path / "x"))

    monkeypatch.setattr(bench, "start_run", fake)
    monkeypatch.setattr(bench, "environment", lambda: MACHINE_A)
    monkeypatch.setattr(bench.shutil, "rmtree", lambda path: None)
    todo = [("bf16", s, 1000) for s in (0, 1, 2)]
    bench.run_all(todo, "config", str(runs_dir), jobs=1, threads=1)
    assert started == []
    (runs_dir / "bf16-seed2-1000-avx2.json").unlink()
    bench.run_all(todo, "config", str(runs_dir), jobs=1, threads=1, twins=True)
    assert started == [("bf16", 2)] and (runs_dir / "bf16-seed2-1000-avx2.json").exists()
    assert json.loads((runs_dir / "bf16-seed2-1000.json").read_text())["env"] == MACHINE_B  # kept


def test_parity_outputs_and_report(tmp_path):
    """parity --no_run summarizes finished runs: JSON, CSV, PNG without an absolute path; report turns
    them into the README's section with one sentence per target."""
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    for (v, s, n), r in fake_runs().items():
        (runs_dir / f"{v}-seed{s}-{n}.json").write_text(json.dumps(r))
    out = tmp_path / "results"
    bench.main(["parity", "--no_run", "--runs", str(runs_dir), "--out", str(out),
                "--variants", "bf16", "O1", "O2", "O1-block", "O1-row", "--seeds", "0", "1", "2"])
    text = (out / "parity_cpu.json").read_text()
    d = json.loads(text)
    assert d["config"] == "config/shakespeare_char.py" and str(tmp_path) not in text and bench.REPO not in text
    assert [r["verdict"] for r in d["parity"]] == ["baseline", "met", "missed", "unresolvable", "incomplete"]
    csv = (out / "parity.csv").read_text().splitlines()
    assert csv[0] == "variant,seed,iters,kind,iter,loss" and "O1,0,3000,val,3000,1.5030" in csv
    assert len(csv) == 1 + 14 * (1000 + 3) + 2 * (3000 + 3)  # every step of every run, and its evals
    assert (out / "parity.png").stat().st_size > 10000
    readme, more = tmp_path / "README.md", tmp_path / "docs" / "results.md"
    readme.write_text("# x\n<!-- results:start -->\nold\n<!-- results:end -->\n")
    more.parent.mkdir()
    more.write_text("# y\n<!-- results-more:start -->\nold\n<!-- results-more:end -->\n")
    bench.main(["report", "--results", str(out), "--readme", str(readme)])
    text, more_text = readme.read_text(), more.read_text()
    assert "old" not in more_text and "No GPU figures" in more_text and "Noise floor" not in more_text
    assert bench.write_sections(str(more), {"results-more": ["[j](results/j.json)"]}, str(tmp_path)) == ["results-more"]
    assert "[j](../results/j.json)" in more.read_text()  # links made relative to docs/
    assert "old" not in text and "No GPU figures" in text and "**Noise floor:** bf16's final val loss moves by 5.00%" in text
    assert "- **O1** (target 1.00%): met, +0.20% +- 0.06%" in text
    assert "- **O2** (target 1.00%): missed" in text and "- **O1-block** (target 0.25%): unresolvable" in text
    assert "- **O1-row** (target 1.00%): incomplete, 2 of 3 seeds" in text
    assert "| O1 | 3000 | 0 | 1.5030 | +0.20% |" in text  # the long runs


@pytest.mark.slow  # trains the parity variants: ~8 s
def test_parity_runs_and_resume(tmp_path, monkeypatch):
    """Real runs as child processes, two at a time: one JSON each with its CPU time and a command
    without absolute paths; a second invocation starts none of them again."""
    args = ["parity", "--variants", "bf16", "O1", "--seeds", "0", "--iters", "2", "--long_iters", "0",
            "--jobs", "2", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--set", *TINY]
    bench.main(args)
    for v in ("bf16", "O1"):
        r = json.loads((tmp_path / "runs" / f"{v}-seed0-2.json").read_text())
        assert r["cpu_seconds"] > 0 and [e[0] for e in r["evals"]] == [0, 2] and len(r["losses"]) == 2
        assert r["command"].startswith("python train.py config/shakespeare_char.py ")
        assert not any(a.startswith("/") or "=/" in a for a in r["command"].split())  # no out_dir, no absolute path

    def refuse(*a, **k):
        raise AssertionError("a finished run was started again")
    monkeypatch.setattr(bench, "start_run", refuse)
    bench.main(args)
    assert json.loads((tmp_path / "out" / "parity_cpu.json").read_text())["parity"][1]["n"] == 1


def test_parity_failed_run_stops_the_others(tmp_path, monkeypatch):
    """One run failing ends the invocation with its name, and the runs beside it (each its own
    process group, every rank) are stopped, not left to compete for the CPU."""
    import subprocess

    started = []

    def fake(name, seed, iters, config, threads, set_=()):
        p = subprocess.Popen(["sleep", "60"] if name == "bf16" else ["false"], start_new_session=True)
        started.append(p)
        return p, str(tmp_path / "none.json"), {"variant": name, "seed": seed, "iters": iters, "command": name}, str(tmp_path)

    monkeypatch.setattr(bench, "start_run", fake)
    with pytest.raises(RuntimeError, match="O1 seed 0 failed"):
        bench.run_all([("bf16", 0, 2), ("O1", 0, 2)], "config", str(tmp_path / "runs"), jobs=2, threads=1)
    assert started[0].poll() is not None  # the sleeping run was stopped


@pytest.mark.slow
@pytest.mark.dist
def test_parity_two_process_variant(tmp_path):
    """A torchrun variant (pipeline_parallel=2) at two seeds, beside bf16: curves for both seeds."""
    bench.main(["parity", "--variants", "bf16", "O1-pp2", "--seeds", "0", "1", "--iters", "4", "--long_iters", "0",
                "--jobs", "2", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--set", *TINY])
    d = json.loads((tmp_path / "out" / "parity_cpu.json").read_text())
    pp = d["parity"][1]
    assert pp["variant"] == "O1-pp2" and pp["n"] == 2 and pp["verdict"] == "incomplete" and pp["processes"] == 2
    assert abs(pp["gap"]) < 0.05 and pp["command"].startswith("torchrun --nproc_per_node=2 train.py")


def test_throughput_tiny(tmp_path):
    bench.main(["throughput", "--models", "tiny", "--steps", "1", "--rounds", "1",
                "--json", str(tmp_path / "throughput_cpu.json")])
    d = json.loads((tmp_path / "throughput_cpu.json").read_text())
    rows = {r["level"]: r for r in d["throughput"]}
    assert set(rows) == {"fp32", "bf16", "O1", "O2", "O1-mxfp8"} and all(r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["bf16"]["vs_bf16"] == 1 and rows["fp32"]["vs_fp32"] == 1
    assert rows["O1"]["vs_fp32"] == pytest.approx(rows["O1"]["vs_bf16"] * rows["bf16"]["vs_fp32"])
    assert all(r["device_kind"].startswith("CPU") for r in rows.values()) and d["env"]["cpu_capability"]


def test_throughput_report_states_the_step_target():
    """A throughput section (docs/results.md) says met or missed against STEP_TARGET, and how much of O1's
    step is the fp32 floor (known answers: bf16 100 tok/s, fp32 80, O1 50 or 90)."""
    def report(o1):
        rows = [{"model": "m", "level": lv, "compile": False, "tokens_per_s": t, "vs_bf16": t / 100, "vs_fp32": t / 80,
                 "device_kind": "CPU (FP8 emulated: not a speed figure)", "rounds": 3}
                for lv, t in (("fp32", 80), ("bf16", 100), ("O1", o1))]
        return "\n".join(bench.report_throughput({"env": {"device": "CPU", "date": "d", "torch": "t"}, "throughput": rows}))
    missed, met = report(50), report(90)
    assert "missed on this CPU, O1's step takes 2.00x bf16's" in missed
    assert "fp32's step takes 1.25x bf16's here, and the casts and decodes add 1.60x" in missed
    assert "needs them to add at most 1.20x" in missed
    assert "met on this CPU, O1's step takes 1.11x bf16's" in met


def test_gpu_report_takes_the_median_round_and_the_ratio_to_bf16(tmp_path):
    """report_gpu renders results/gpu/: a level's figure is the median of its rounds, its ratio is to
    bf16 of the same model and compile setting, and a level with no bf16 beside it gets no ratio
    (known answers)."""
    rows = [{"model": "m", "level": lv, "compile": c, "round": r, "tokens_per_s": t}
            for lv, c, r, t in (("bf16", False, 0, 100), ("bf16", False, 1, 120), ("O1", False, 0, 90),
                                ("O1", False, 1, 150), ("O1", False, 2, 60), ("O1", True, 0, 200))]
    d = {"device": "GPU", "torch": "t", "triton": "tr", "date": "d", "commit": "c", "command": "cmd",
         "throughput_note": "note", "throughput": rows}
    (tmp_path / "throughput_x.json").write_text(json.dumps(d))
    text = "\n".join(bench.report_gpu(str(tmp_path)))
    assert "| m | False | bf16 | 2 | 110 | 1.000x |" in text
    assert "| m | False | O1 | 3 | 90 | 0.818x |" in text
    assert "| m | True | O1 | 1 | 200 |  |" in text
    assert bench.report_gpu(str(tmp_path / "none"))[1].startswith("No GPU figures")


def test_gpu_report_renders_the_kernels_ratios(tmp_path):
    """A kernels_*.json (python kernels.py --json) renders TFLOPS as integers and the per-shape
    ratios (triton over cuBLAS) to two decimals, so a 0.08 is not printed as 0 (known answers)."""
    row = {"shape": "square 1024", "M": 1024, "N": 1024, "K": 1024, "triton": 17.8, "_scaled_mm": 152.8,
           "triton / _scaled_mm": 0.116, "triton mx / bf16 matmul": None}
    d = {"device": "GPU", "torch": "t", "triton": "tr", "date": "2026-01-01", "seconds": 151.2, "gemm": [row]}
    (tmp_path / "kernels_x.json").write_text(json.dumps(d))
    text = "\n".join(bench.report_gpu(str(tmp_path)))
    assert "| square 1024 | 18 | 153 | 0.12 | n/a |" in text
    assert "took 151 s, compiling included" in text


def test_design_reports_the_card(capsys):
    """bench.py design measures what the design card budgets (not enforced by the tests)."""
    bench.main(["design"])
    out = capsys.readouterr().out
    for measure in ("lines of nanofp8/fp8.py", "lines of the core", "functions of one O1 Linear step",
                    "functions of one O2 optimizer step", "names train.py takes from run.py"):
        assert measure in out, out
