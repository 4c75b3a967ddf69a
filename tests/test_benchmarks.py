"""The benchmark scripts run end to end on the CPU (tiny sizes): their tables and JSON keep
their shape, and the CUDA mode's aim rules pick the rows they say. No speed is asserted."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *args: str) -> str:
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *args],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_kernel_benchmark_prints_and_saves_every_row(tmp_path):
    saved = tmp_path / "kernels.json"
    out = run_script("bench_kernels", "--sizes", "64K", "--quick", "--only", "quantize",
                     "--json", str(saved))
    assert "quantize(x, scale" in out and "dequantize(q, scale" in out and "aims" in out
    report = json.loads(saved.read_text())
    assert {row["kernel"] for row in report["rows"]} == {"quantize", "dequantize"}
    assert all(row["compiled_ms"] > 0 and row["reference_ms"] > 0 for row in report["rows"])
    assert report["copy_bandwidth"]["how"] == "dst.copy_(src)"
    assert {aim["aim"].split()[0] for aim in report["aims"]} == {"quantize", "dequantize"}


@pytest.mark.slow
def test_kernel_benchmark_times_the_dct_in_the_hooks_grouped_layout(tmp_path):
    saved = tmp_path / "dct.json"
    out = run_script("bench_kernels", "--sizes", "64K", "--quick", "--only", "dct", "--json", str(saved))
    assert "the sparse hook's grouped layout" in out
    (row,) = json.loads(saved.read_text())["dct_grouped"]
    assert row["numel"] == 64_000
    assert all(row[key] > 0 for key in ("encode_then_interleave_ms", "encode_grouped_ms",
                                        "deinterleave_then_decode_ms", "decode_grouped_ms"))


def test_cuda_aims_judge_rows_of_16_mb_and_the_named_dct_configurations():
    bench = load_benchmark("bench_kernels")
    bench.copy_bandwidth_gbps = 100.0
    row = lambda kernel, config, numel, nbytes: bench.Row(kernel, config, numel, nbytes, 1.0, 0.5)  # noqa: E731
    small = row("quantize", "n=1M", 1 << 20, 5 << 20)
    large = row("quantize", "n=25M", 25 << 20, 125 << 20)
    aim = next(a for a in bench.CUDA_AIMS if a.kernel == "quantize")
    assert not aim.judges(small, largest_size=25 << 20) and aim.judges(large, largest_size=25 << 20)
    encode = next(a for a in bench.CUDA_AIMS if a.kernel == "dct_encode")
    recipe = row("dct_encode", "n=25M B=64 keep=64", 25 << 20, 200 << 20)
    other = row("dct_encode", "n=25M B=1024 keep=128", 25 << 20, 200 << 20)
    assert encode.judges(recipe, 0) and not encode.judges(other, 0)


def test_cuda_aims_in_gpu_time_judge_only_rows_that_have_it():
    # Rows measured without a CUDA graph (gpu_ms None) leave the GPU-time aims unjudged.
    import torch
    bench = load_benchmark("bench_kernels")
    bench.copy_bandwidth_gbps, bench.device = 100.0, torch.device("cuda")
    timed = bench.Row("quantize", "n=25M", 25 << 20, 125 << 20, 1.0, 2.0, gpu_ms=1.5)
    untimed = bench.Row("dequantize", "n=25M", 25 << 20, 125 << 20, 1.0, 2.0)
    assert timed.gpu_pct_of_copy == 100.0 * (125 << 20) / 1.5e-3 / 1e9 / 100.0
    judged = {(r["aim"].split()[0], r["metric"]) for r in bench.evaluate_aims([timed, untimed], 25 << 20)}
    assert ("quantize", "gpu_pct_of_copy") in judged and ("dequantize", "pct_of_copy") in judged
    assert ("dequantize", "gpu_pct_of_copy") not in judged


@pytest.mark.slow
def test_density_sensitivity_rows_schedule_and_the_pinned_automatic_density_changes_nothing(tmp_path):
    bench = load_benchmark("bench_density_sensitivity")
    dipped = [i for i in range(200) if bench.scheduled_density("dips0.5", i, 0.2) != 0.2]
    assert dipped == [40, 41, 42, 43, 140, 141, 142, 143]
    assert bench.scheduled_density("dips0.5", 41, 0.2) == 0.1 and bench.scheduled_density("pinned", 41, 0.2) == 0.2
    saved = tmp_path / "sensitivity.json"
    out = run_script("bench_density_sensitivity", "--quick", "--rows", "fixed16,pinned", "--json", str(saved))
    assert "fixed16" in out and "pinned" in out
    rows = json.loads(saved.read_text())
    # the automatic density's measurements and agreements alone move no number
    assert rows["pinned"]["final_loss"] == rows["fixed16"]["final_loss"]
    assert rows["pinned"]["bytes_sent"] == rows["fixed16"]["bytes_sent"]
    assert rows["pinned"]["ranks_identical"] and rows["fixed16"]["ranks_identical"]


@pytest.mark.slow
def test_codec_calls_benchmark_times_every_call():
    out = run_script("bench_codec_calls", "--calls", "20")
    for call in ("sparse_encode_", "sparse_pack_", "sparse_unpack_", "dist.all_reduce"):
        assert call in out
    assert "kernels compiled" in out


def test_convergence_benchmark_prints_the_table_of_a_results_file(tmp_path):
    """--table reprints a results file (kept after each cell) with each row against dense of
    its workload and ranks, seed by seed; compression on the link where the file has it."""
    def record(row, title, loss, accuracy, compression, seed=0, **link):
        return dict(workload="gpt_large_adamw", ranks=8, row=row, title=title, seed=seed,
                    diverged=False, loss=loss, accuracy=accuracy, bytes_per_step=1000 / compression,
                    compression=compression, wall_seconds=60.0, ranks_identical=True,
                    curve=dict(step=[10], bytes=[100], test_loss=[loss]), **link)
    saved = tmp_path / "bench_convergence.json"
    saved.write_text(json.dumps([record("dense", "dense allreduce", 2.0, 0.5, 1.0, link_compression=1.0),
                                 record("recipe_adamw", "AdamW recipe", 2.05, 0.48, 31.0,
                                        link_compression=17.5)]))
    out = run_script("bench_convergence", "--table", str(saved))
    assert "| gpt_large_adamw | 8 | dense allreduce | 1 | 2.000 | +0.0 | 50.0% | +0.0 |" in out
    assert ("| gpt_large_adamw | 8 | AdamW recipe | 1 | 2.050 | +2.5 | 48.0% | -2.0 | 32 | 31.0x | 17.5x |"
            in out)
    # Seeds run apart are merged: the cell's mean over both seeds, its gap paired seed by seed;
    # a file from before the link was counted leaves the cell's link column empty.
    more = tmp_path / "seed_1.json"
    more.write_text(json.dumps([record("dense", "dense allreduce", 1.0, 0.7, 1.0, seed=1),
                                record("recipe_adamw", "AdamW recipe", 1.01, 0.69, 31.0, seed=1)]))
    out = run_script("bench_convergence", "--table", f"{saved},{more}")
    assert "| gpt_large_adamw | 8 | dense allreduce | 2 | 1.500 |" in out
    assert "| gpt_large_adamw | 8 | AdamW recipe | 2 | 1.530 | +1.7 (+1.0..+2.5) | 58.5% | -1.5 (-2.0..-1.0) | 32 | 31.0x | - |" in out


def test_hook_cost_benchmark_reports_every_configuration(tmp_path):
    saved, profile = tmp_path / "cost.json", tmp_path / "profile.txt"
    out = run_script("bench_hook_cost", "--device", "cpu", "--width", "64", "--layers", "2",
                     "--batch", "8", "--steps", "2", "--warmup", "2", "--json", str(saved),
                     "--profile", str(profile))
    assert "world size 1, gloo" in out and "2 gloo ranks on one device" in out
    report = json.loads(saved.read_text())
    for run in report["runs"].values():
        assert set(run["summary"]) == {"allreduce", "no communication", "no communication, AdamW",
                                       "AdamW recipe", "SGD recipe", "SGD recipe, no watch"}
        assert run["summary"]["no communication"]["added_ms"] == 0
        # the AdamW recipe is measured against the step with AdamW and no communication
        times = run["times_ms"]
        assert run["summary"]["AdamW recipe"]["added_ms"] == pytest.approx(
            times["AdamW recipe"] - times["no communication, AdamW"])
        assert all(v > 0 for v in run["times_ms"].values())
    assert "AdamW recipe" in profile.read_text() and "SGD recipe" in profile.read_text()


@pytest.mark.slow
def test_generality_benchmark_averages_seeds_and_keeps_cases_it_has(tmp_path):
    saved = tmp_path / "generality.json"
    args = ("--quick", "--models", "resnet", "--optimizers", "adamw", "--lrs", "1e-3",
            "--seeds", "2", "--json", str(saved))
    out = run_script("bench_generality", *args)
    [case] = json.loads(saved.read_text())
    assert case["seeds"] == 2 and [run["seed"] for run in case["per_seed"]] == [0, 1]
    losses = [run["recipe_run"]["loss"] for run in case["per_seed"]]
    assert case["recipe_run"]["loss"] == sum(losses) / 2 and losses[0] != losses[1]
    row = next(line for line in out.splitlines() if line.startswith("| resnet"))
    assert row.split(" | ")[5] == "2" and "points" in row  # the seeds, and the gaps over them
    again = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_generality.py"), *args],
                           capture_output=True, text=True, timeout=300, cwd=REPO)
    assert "kept: resnet, adamw, lr 0.001, 2 ranks" in again.stderr  # not run twice
    out = run_script("bench_generality", *args, "--ratio", "8")  # a case of its own
    own, asked = json.loads(saved.read_text())
    assert (own["ratio"], asked["ratio"]) == (None, 8.0)
    # ten steps, the first dense, the rest in the density warm-up: 3.3x against 4.0x
    assert asked["recipe_run"]["compression"] < 0.9 * own["recipe_run"]["compression"]
    assert sum("(ratio=8)" in line for line in out.splitlines() if line.startswith("| resnet")) == 1


def two_level_record(final_loss: float, losses) -> dict:
    """What bench_two_level's worker keeps of a run: evaluations at 1, 2, 3 s."""
    return dict(epochs=dict(test_loss=[final_loss], seconds=[3.0]), final_accuracy=0.9,
                evaluations=dict(seconds=[1.0, 2.0, 3.0], test_loss=list(losses)),
                history=dict(seconds=[0.01] * 10), steps=10, hook_stats=None, ranks_identical=True)


def test_two_level_benchmark_averages_seeds_each_against_dense_of_its_seed():
    sys.path.insert(0, str(REPO / "benchmarks"))  # bench_two_level imports netbench from there
    bench = load_benchmark("bench_two_level")
    records = {
        "dense": two_level_record(1.0, [2.0, 1.5, 1.0]),
        "dense seed 1": two_level_record(2.0, [3.0, 2.5, 2.0]),
        "flat": two_level_record(1.0, [1.5, 1.3, 1.0]),  # within 2% of 1.0 at 3 s
        "flat seed 1": two_level_record(2.0, [2.0, 2.0, 2.0]),  # within 2% of 2.0 at 1 s
        "two_level_auto": two_level_record(1.1, [1.2, 1.1, 1.1]),  # never within 2% of 1.0
        "two_level_auto seed 1": two_level_record(2.0, [2.0, 2.0, 2.0]),
    }

    def row(text: str, hook: str) -> list:
        return next(line for line in text.splitlines()
                    if line.startswith("| mlp_sgd") and hook in line).split(" | ")

    both = bench.table({("mlp_sgd", "1gbit"): records}, ["dense", "flat"], seeds=2)
    assert row(both, "flat recipe")[6] == "2.00"  # every row reached dense's loss in both seeds
    # the times are compared over the seeds every row reached: seed 1 only
    text = bench.table({("mlp_sgd", "1gbit"): records}, ["dense", "flat", "two_level_auto"], seeds=2)
    flat = row(text, "flat recipe")
    assert flat[3] == "1.500" and flat[6] == "1.00 (2 of 2 reached)" and flat[7] == "1.00x"
    auto = row(text, "ratio='auto'")
    assert auto[3] == "1.550" and auto[6] == "1.00 (1 of 2 reached)" and auto[7] == "1.00x"
    never = dict(records, **{"two_level_auto seed 1": two_level_record(2.1, [2.1, 2.1, 2.1])})
    text_never = bench.table({("mlp_sgd", "1gbit"): never}, ["dense", "flat", "two_level_auto"], seeds=2)
    # a row that never reached it leaves the others compared over every seed they reached
    assert row(text_never, "ratio='auto'")[6] == "0 of 2 seeds reached"
    assert row(text_never, "flat recipe")[6] == "2.00"
    one_missed = bench.table({("mlp_sgd", "1gbit"): never}, ["dense", "flat", "two_level_auto"], seeds=1)
    assert row(one_missed, "flat recipe")[6] == "3.00" and row(one_missed, "ratio='auto'")[6] == "not reached"
    one_seed = bench.table({("mlp_sgd", "1gbit"): records}, ["dense", "flat"], seeds=1)
    assert row(one_seed, "flat recipe")[6] == "3.00"
    # --dense-from: the targets from another link's run; this run's own records are kept
    earlier = {"mlp_sgd 100mbit": {key: records[key] for key in ("dense", "dense seed 1")},
               "gpt_adamw 100mbit": {"dense": two_level_record(9.0, [9.0])}}
    without_dense = {key: r for key, r in records.items() if not key.startswith("dense")}
    merged = bench.with_dense_targets({("mlp_sgd", "1gbit"): without_dense}, earlier)
    assert bench.table(merged, ["flat", "two_level_auto"], seeds=2) == "\n".join(
        line for line in text.splitlines() if "flat dense" not in line)


def test_two_level_benchmark_counts_the_seeds_every_row_has_after_a_merge():
    sys.path.insert(0, str(REPO / "benchmarks"))
    bench = load_benchmark("bench_two_level")
    record = two_level_record(1.0, [1.0, 1.0, 1.0])
    earlier = {"auto seed 3": record, "fixed seed 3": record, "auto seed 4": record}
    run = {"auto": record, "fixed": record, "auto seed 1": record, "fixed seed 1": record,
           "auto seed 2": record, "fixed seed 2": record}
    merged = {("gpt", "100mbit"): {**earlier, **run}}
    assert bench.seeds_present(merged, ["auto", "fixed"]) == 4  # seed 4 lacks a fixed row
    assert bench.seeds_present(merged, ["auto"]) == 5
    assert bench.seeds_present({("gpt", "1gbit"): earlier}, ["auto"]) == 1  # none from 0: one


def test_memory_trace_finds_the_compute_streams_gaps_and_the_copies_in_them():
    load_benchmark("bench_memory")  # the trace script takes its workloads from there
    trace = load_benchmark("trace_memory_plan")

    def event(ts, dur, stream, cat="kernel", name="gemm"):
        return dict(ph="X", cat=cat, ts=ts, dur=dur, name=name, args=dict(stream=stream))

    events = [event(1000, 1000, 7), event(2000, 500, 7), event(5000, 1000, 7), event(7000, 100, 7),
              event(2600, 3000, 20, "gpu_memcpy", "Memcpy DtoH"),
              dict(ph="X", cat="cpu_op", ts=0, dur=99999, name="aten::mm", args={})]
    summary = trace.summarize_trace(events)
    assert summary["compute_stream"] == 7
    assert summary["streams"] == {7: pytest.approx(2.6), 20: pytest.approx(3.0)}
    assert summary["copies"] == [(1.6, 3.0, "Memcpy DtoH")]
    # 2.5 ms waiting while the copy ran, then 1 ms with nothing in flight (the host behind)
    assert [(round(length, 6), round(at, 6), names) for length, at, names in summary["gaps"]] == [
        (2.5, 1.5, ["Memcpy DtoH"]), (1.0, 5.0, [])]
    assert summary["gap_total_ms"] == pytest.approx(3.5) and summary["span_ms"] == pytest.approx(6.1)
    assert trace.summarize_trace(events[-1:]) == {"streams": {}, "copies": [], "gaps": []}


@pytest.mark.slow
def test_fsdp_benchmark_runs_every_row_and_reprints_its_table(tmp_path):
    saved = tmp_path / "fsdp.json"
    out = run_script("bench_fsdp", "--quick", "--workloads", "cnn_sgd", "--lrs", "0.05",
                     "--json", str(saved))
    rows = [line for line in out.splitlines() if line.startswith("| cnn_sgd")]
    assert len(rows) == 3 and "hetero_comm.compress(mesh=)" in rows[2]
    records = json.loads(saved.read_text())["cnn_sgd 0.05 loopback"]
    assert set(records) == {"dense", "bf16", "recipe"}
    assert records["recipe"]["compression"] > 4 and records["dense"]["compression"] == 1
    again = run_script("bench_fsdp", "--json", str(saved), "--table")
    assert [line for line in again.splitlines() if line.startswith("| cnn_sgd")] == rows


@pytest.mark.slow
def test_generality_benchmark_trains_the_baselines_that_apply_beside_the_recipe(tmp_path):
    """--baselines: PowerSGD beside either optimizer, DeMo (a sign step) beside AdamW only,
    each judged against dense of its seed in the last column; a case with baselines is a case
    of its own."""
    saved = tmp_path / "generality.json"
    common = ("--quick", "--models", "resnet", "--lrs", "1e-3", "--json", str(saved))
    run_script("bench_generality", *common, "--optimizers", "adamw")
    out = run_script("bench_generality", *common, "--optimizers", "adamw,sgd",
                     "--baselines", "powersgd_1,demo_k2")
    plain, adamw, sgd = json.loads(saved.read_text())
    assert "baselines" not in plain
    assert set(adamw["baselines"]) == {"powersgd_1", "demo_k2"} and set(sgd["baselines"]) == {"powersgd_1"}
    for run in (*adamw["baselines"].values(), *sgd["baselines"].values()):
        assert not run["diverged"] and run["compression"] > 1
    assert adamw["baselines"]["demo_k2"]["loss"] != adamw["recipe_run"]["loss"]
    # at 2 ranks DeMo's all-gather sends what a rank hands in, as a ring allreduce does
    demo = adamw["baselines"]["demo_k2"]
    assert demo["link_compression"] == pytest.approx(demo["compression"])
    rows = [line for line in out.splitlines() if line.startswith("| resnet")]
    assert len(rows) == 3
    adamw_row = next(row for row in rows if "| adamw |" in row and "DeMo" in row)
    assert "PowerSGD 1: " in adamw_row and "DeMo 2/64: " in adamw_row and "x on the link)" in adamw_row
    sgd_row = next(row for row in rows if "| sgd |" in row)
    assert "PowerSGD 1: " in sgd_row and "DeMo" not in sgd_row


def quality_record(cell, seed, hook, loss=1.0, accuracy=0.9, compression=30.0):
    return dict(cell=cell, seed=seed, hook=hook, diverged=False, loss=loss, accuracy=accuracy,
                compression=compression)


@pytest.mark.parametrize("recipe_accuracies,dense_accuracies,verdict", [
    ((0.902, 0.9, 0.898), (0.9, 0.9, 0.9), "ok"),  # within a point, spread under the 0.5 floor...
    ((0.88, 0.88, 0.88), (0.9, 0.9, 0.9), "not yet (quality)"),  # ...2 points below
    ((0.92, 0.90, 0.88), (0.9, 0.9, 0.9), "not yet (spread)"),  # 4 points of spread, dense 0
    ((0.93, 0.90, 0.89), (0.92, 0.90, 0.88), "ok"),  # twice dense's spread of 4 points
])
def test_quality_matrix_judges_the_mean_gap_and_the_seed_spread(recipe_accuracies,
                                                              dense_accuracies, verdict):
    quality = load_benchmark("bench_quality")
    name, cell = "mlp_sgd_constant", quality.CELLS["mlp_sgd_constant"]
    records = {}
    for seed, (d, r) in enumerate(zip(dense_accuracies, recipe_accuracies)):
        records[quality.run_key(name, cell, seed, "dense")] = quality_record(cell, seed, "dense", accuracy=d)
        records[quality.run_key(name, cell, seed, "recipe")] = quality_record(cell, seed, "recipe", accuracy=r)
    assert quality.summarize(name, cell, records)["verdict"] == verdict


def test_quality_matrix_judges_text_by_the_loss_and_compression():
    quality = load_benchmark("bench_quality")
    name, cell = "gpt_adamw_linear", quality.CELLS["gpt_adamw_linear"]
    records = {quality.run_key(name, cell, 0, "dense"): quality_record(cell, 0, "dense", loss=2.0),
               quality.run_key(name, cell, 0, "recipe"): quality_record(cell, 0, "recipe", loss=2.03,
                                                                         compression=12.0)}
    summary = quality.summarize(name, cell, records)
    assert summary["verdict"] == "not yet (compression)" and summary["gap"] == pytest.approx(1.5)


def test_quality_matrix_meets_every_factor_with_each_optimizer_family():
    quality = load_benchmark("bench_quality")
    cells = quality.CELLS.values()
    for family in ("adam", "sgd"):
        mine = [c for c in cells if quality.FAMILY[c["optimizer"]] == family]
        for factor, values in (("schedule", ("cosine", "linear", "constant", "warmup_constant", "wsd")),
                               ("model", ("mlp", "cnn_bn", "resnet", "gru", "gpt")),
                               ("ranks", (2, 4, 8))):
            assert set(values) <= {c[factor] for c in mine}, (family, factor)
        assert {100, 400, 2000} <= {c["steps"] for c in mine} | {c["steps"] // 100 * 100 for c in mine}
    assert set(quality.OPTIMIZERS) == {c["optimizer"] for c in cells}
    held = quality.HELD_OUT.values()
    assert all((c["model"], c["schedule"], c["lr"]) not in {(m["model"], m["schedule"], m["lr"])
                                                           for m in cells} for c in held)


def test_quality_matrix_runs_a_cell_and_keeps_its_runs(tmp_path):
    saved = tmp_path / "quality.json"
    args = ("--cells", "cnn_bn_sgd_constant", "--seeds", "0", "--steps", "4", "--json", str(saved))
    out = run_script("bench_quality", *args)
    records = json.loads(saved.read_text())
    assert sorted(records) == ["cnn_bn_sgd_constant|4|0|dense", "cnn_bn_sgd_constant|4|0|recipe"]
    assert all(r["steps"] == 4 for r in records.values())
    row = next(line for line in out.splitlines() if line.startswith("| cnn_bn_sgd_constant"))
    assert "| 4 | 1 |" in row and "x |" in row
    again = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_quality.py"), *args],
                           capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 0 and "seed 0" not in again.stderr  # nothing run twice


@pytest.mark.parametrize("name,expected", [
    ("mlp_adamw_constant_3e-3", dict(output="sign", density=0.25)),
    ("cnn_bn_nesterov_wsd", dict(momentum=0.9, nesterov=True, density=0.25)),
    ("mlp_sgd_plain_linear", dict(density=0.25)),
])
def test_quality_matrix_variant_is_the_cells_recipe_with_the_changes(name, expected):
    """``--variant`` runs the recipe the one call would choose for the cell, changed only where
    asked (that it trains as the one call does was checked run for run: the same losses)."""
    quality = load_benchmark("bench_quality")
    settings = quality.variant_settings(quality.CELLS[name], {"density": 0.25})
    assert {key: settings.get(key) for key in expected} == expected
    assert settings["density_warmup_steps"] == 25 and settings["segment_size"] == 512
    if "momentum" not in expected:
        assert "momentum" not in settings
    unchanged = quality.variant_settings(quality.CELLS[name], {})
    assert unchanged["density"] in (0.08, 0.10)
