"""Convergence on real data (scikit-learn's digits, 2 gloo ranks) and the demo command."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from demo import main
from lab.throttle import cpu_quota_unavailable
from lab.training import TrainConfig, run_training


@pytest.fixture(scope="module")
def dense_accuracy():
    record = run_training(TrainConfig(hook="dense"))
    assert record["ranks_identical"]
    assert record["final_accuracy"] > 0.9  # the baseline itself learns
    return record["final_accuracy"]


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("overrides,min_compression,allowed_drop", [
    (dict(hook="sparse", hook_settings=dict(density=0.01)), 40.0, 0.01),
    (dict(hook="dct", hook_settings=dict(keep_ratio=0.125, bits=8)), 8.0, 0.01),
])
def test_compressed_hooks_reach_dense_accuracy(dense_accuracy, overrides, min_compression,
                                               allowed_drop):
    record = run_training(TrainConfig(**overrides))
    assert record["ranks_identical"]
    assert record["hook_stats"]["compression_ratio"] >= min_compression
    assert record["final_accuracy"] >= dense_accuracy - allowed_drop


@pytest.mark.slow
@pytest.mark.multirank
def test_demo_writes_table_json_and_plot(tmp_path, capsys):
    assert main(["--workloads", "mlp_sgd", "--hooks", "dense,sparse", "--epochs", "1",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "segment_sparse_hook" in out and "compression" in out
    numbers = json.loads((tmp_path / "demo.json").read_text())
    assert set(numbers) == {"dense", "sparse"}
    assert numbers["sparse"]["bytes_per_step"] < numbers["dense"]["bytes_per_step"]
    assert (tmp_path / "demo.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.multirank
def test_demo_default_hooks_on_two_workloads(tmp_path, capsys):
    """The demo's default hooks (dense, the one call's recipe, PowerSGD) on two workloads, one
    epoch each: a row per workload and hook, the recipe compressing."""
    assert main(["--workloads", "mlp_sgd,mlp_adamw", "--epochs", "1", "--out",
                 str(tmp_path)]) == 0
    out = capsys.readouterr().out
    numbers = json.loads((tmp_path / "demo.json").read_text())
    assert set(numbers) == {f"{w}/{h}" for w in ("mlp_sgd", "mlp_adamw")
                            for h in ("dense", "recipe", "powersgd")}
    for workload in ("mlp_sgd", "mlp_adamw"):
        # one epoch (22 steps) lies in the recipes' 25-step density warm-up: beyond the int8
        # wire's 4x, short of the nominal ratio (the demo's own 8 epochs reach it)
        assert numbers[f"{workload}/recipe"]["hook_stats"]["compression_ratio"] > 6
        assert numbers[f"{workload}/recipe"]["ranks_identical"]
        assert f"| {workload}" in out
    assert "hetero_comm.compress" in out and "torch powerSGD_hook" in out


@pytest.mark.slow
@pytest.mark.parametrize("flags,message", [
    (["--hooks", "dense,zip"], "unknown hook"),
    (["--workers", "0"], "workers must be an integer >= 1; got 0"),
    (["--density", "1.5"], "density must be a number in (0.0, 1.0]; got 1.5"),
    (["--segment-size", "0"], "segment_size must be an integer in [1, 1048576]; got 0"),
    (["--epochs", "two"], "expected an integer"),
    (["--bits", "12"], "invalid choice"),
    (["--ratio", "2"], "ratio must be a number in [4.0, 256.0]; got 2.0"),
    (["--powersgd-rank", "x"], "expected an integer"),
    (["--powersgd-rank", "0"], "matrix_approximation_rank must be an integer >= 1; got 0"),
    (["--hooks", "dense", "--density", "0"], "density must be a number in (0.0, 1.0]; got 0.0"),
    (["--lr", "-1"], "lr must be a number in (0.0, inf]; got -1.0"),
    (["--batching", "dynamic", "--hooks", "dense,fp16"], "'fp16' averages them equally: drop it"),
    (["--batching", "sometimes"], "invalid choice"),
    (["--slow-worker-cores", "0"], "slow_worker_cores must be a number in (0.0"),
    (["--workloads", "rnn_sgd"], "unknown workload(s) ['rnn_sgd']"),
])
def test_demo_rejects_bad_flags(flags, message):
    demo_script = Path(__file__).resolve().parents[1] / "benchmarks" / "demo.py"
    result = subprocess.run([sys.executable, str(demo_script), *flags],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert message in result.stderr or pytest.fail(result.stderr)


@pytest.mark.slow
@pytest.mark.multirank
def test_text_workload_trains_with_adamw_and_a_cosine_schedule():
    """The transformer on text (the convergence benchmark's workload, narrower), 40 steps: the
    byte-level validation loss falls well below uniform guessing (ln 256 = 5.55 nats; measured
    about 3.6)."""
    record = run_training(TrainConfig(model="gpt", hidden=32, optimizer="adamw", lr=3e-3,
                                      weight_decay=0.01, lr_warmup_steps=5, lr_schedule="cosine",
                                      clip_norm=1.0, epochs=1, max_steps=40, global_batch=32))
    assert record["ranks_identical"] and record["steps"] == 40
    assert record["epochs"]["test_loss"][-1] < 4.5


@pytest.mark.slow
@pytest.mark.multirank
def test_dct_sign_recipe_keeps_a_transformer_with_adamw_near_dense():
    """Issue 17's aim in small: the transformer on text, AdamW with warm-up, cosine schedule and
    clipping, 200 steps at 2 ranks. The plain sparse hook at ~25x ends far above dense (measured
    +11% over seeds 0-2); the DCT-sign recipe at ~23x ends within noise of dense (measured -1.6%
    to +0%). The int8 wire at twice the density and the same bytes runs as a user would: AdamW
    at dense's rate and betas, handed to ``state.prepare_optimizer`` (about 10% below dense
    here, at seed 0). The bounds leave room for other seeds and machines, not for the plain hook."""
    text = dict(model="gpt", hidden=32, optimizer="adamw", lr=3e-3, weight_decay=0.01,
                lr_warmup_steps=10, lr_schedule="cosine", clip_norm=1.0, epochs=4, max_steps=200,
                global_batch=32)
    recipe = dict(density=0.055, segment_size=128, wire_dtype="bfloat16", basis="dct", output="sign")
    loss, compression = {}, {}
    int8 = dict(recipe, density=0.11, wire_dtype="int8")
    for name, hook, settings_ in (("dense", "dense", {}), ("recipe", "sparse", recipe),
                                  ("int8", "sparse", int8), ("plain", "sparse", dict(density=0.03))):
        record = run_training(TrainConfig(hook=hook, hook_settings=settings_,
                                          prepare_optimizer=name == "int8", **text))
        assert record["ranks_identical"] and record["steps"] == 200
        loss[name] = record["epochs"]["test_loss"][-1]
        compression[name] = record["dense_bytes_per_step"] / record["bytes_per_step"]
    assert all(compression[name] > 20 for name in ("recipe", "int8", "plain"))  # every collective counted
    assert loss["recipe"] < 1.03 * loss["dense"] and loss["int8"] < 1.03 * loss["dense"]
    assert loss["plain"] > 1.06 * loss["dense"]  # the gap the recipe closes


@pytest.mark.parametrize("overrides,message", [
    (dict(optimizer="rmsprop"), "optimizer must be one of 'sgd', 'adamw', 'adam'"),
    (dict(lr_schedule="exponential"), "lr_schedule must be one of"),
    (dict(clip_norm=0.0), "clip_norm must be a number in (0.0"),
    (dict(hook="sparse", hook_settings=dict(density=2.0)), "density must be a number in (0.0, 1.0]"),
    (dict(hook="sparse", optimizer="adamw", hook_settings=dict(momentum=0.9)), "apply momentum twice"),
    (dict(hook="sparse", nesterov=True, hook_settings=dict(momentum=0.9)), "give it nesterov=True"),
    (dict(hook="sparse", hook_settings=dict(output="sign")), "output='sign' is a recipe for AdamW"),
    (dict(hook="powersgd", prepare_optimizer=True), "prepare_optimizer needs a hetero_comm hook"),
    (dict(hook="fp16", prepare_optimizer=True), "prepare_optimizer needs a hetero_comm hook"),
    (dict(hook="powersgd", dropout=0.5, dropout_kind="unit", skip_dropped=True),
     "skip_dropped needs a hetero_comm hook"),
])
def test_train_config_rejects_bad_settings(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainConfig(**overrides).validate()


@pytest.mark.multirank
def test_evaluations_every_few_steps_and_progress(tmp_path):
    progress = tmp_path / "progress"
    record = run_training(TrainConfig(hook="two_level", hook_settings=dict(machines=1, density=0.1),
                                      epochs=2, max_steps=7, evaluate_every=3,
                                      progress_file=str(progress)), timeout=300)
    evaluations = record["evaluations"]
    assert evaluations["step"] == [3, 6]
    assert 0 < evaluations["seconds"][0] < evaluations["seconds"][1] <= sum(record["epochs"]["seconds"])
    assert all(np.isfinite(evaluations["test_loss"]))
    assert progress.read_text() == "7 7"
    with pytest.raises(ValueError, match=re.escape("hook 'two_level' has no setting(s) ['machine']")):
        TrainConfig(hook="two_level", hook_settings=dict(machine=1)).validate()
    TrainConfig(hook="two_level", hook_settings=dict(machines=2, segment_size=64)).validate()


SGD_RECIPE = dict(hook="sparse", prepare_optimizer=True, momentum=0.9,
                  hook_settings=dict(density=0.08, momentum=0.9, wire_dtype="int8", segment_size=512,
                                     min_segments_per_bucket=150))


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("options,epochs", [(dict(hook="dense"), 3), (dict(hook="sparse"), 3), (SGD_RECIPE, 6)],
                         ids=["dense", "sparse", "sgd_recipe"])
def test_dynamic_batches_train_the_same_model_as_equal_batches(options, epochs):
    """Whatever split the measured speeds give, the weighted gradient is the global batch's:
    with dense allreduce dynamic batching ends where equal batching does (up to float
    rounding of the sums); the sparse hook (1%), and the SGD recipe (its int8 wire,
    the CNN's bucket cut into 150 segments or more, the optimizer prepared), whose segment
    choice can flip on such rounding, reach the same accuracy. The recipe runs 6 epochs: after
    3 the CNN is at about 77%, where runs that differ only in rounding spread by more than the
    bound (67.8% against 76.7% in one CI run); after 6 it is at 95-96% for splits from 50/46 to
    95/1 (measured with a CPU quota on one rank)."""
    hook = options["hook"]
    common = dict(options, epochs=epochs, model="cnn", hidden=64, global_batch=96)
    equal = run_training(TrainConfig(batching="equal", **common))
    dynamic = run_training(TrainConfig(batching="dynamic", **common))
    assert dynamic["ranks_identical"]
    sizes = dynamic["epochs"]["batch_sizes"]
    assert sizes[0] == [48, 48] and all(sum(s) == 96 and min(s) >= 1 for s in sizes)
    assert len(dynamic["speed_history"]) == epochs  # one plan an epoch, the last for the record
    if hook == "dense":
        np.testing.assert_allclose(dynamic["final_parameters"], equal["final_parameters"],
                                   rtol=1e-4, atol=1e-5)
    else:
        assert dynamic["final_accuracy"] >= equal["final_accuracy"] - 0.03


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.skipif(cpu_quota_unavailable() is not None,
                    reason=f"CPU quota unavailable: {cpu_quota_unavailable()}")
def test_demo_with_a_slow_worker_gives_it_a_smaller_batch(tmp_path, capsys):
    """The last worker gets 0.2 cores against a whole core for the other: measured, it is
    several times slower, so the plan gives it well under half of the global batch."""
    assert main(["--hooks", "dense", "--workloads", "cnn_sgd", "--epochs", "2", "--batching",
                 "both", "--slow-worker-cores", "0.2", "--no-plot", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "epoch time (s)" in out and "batch per worker" in out
    numbers = json.loads((tmp_path / "demo.json").read_text())
    assert set(numbers) == {"dense/equal", "dense/dynamic"}
    assert numbers["dense/equal"]["epochs"]["batch_sizes"] == [[32, 32], [32, 32]]
    fast, slow = numbers["dense/dynamic"]["epochs"]["batch_sizes"][1]
    assert fast + slow == 64 and slow < 0.4 * 64
