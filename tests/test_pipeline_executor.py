"""The pipeline + data-parallel executor (hetero_comm.pipeline.executor): errors in one process,
then real gloo ranks (2 machines x 2 stages, and 1 machine x 2 stages) whose stage gradients
must equal single-process training of the whole model on the global batch."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from lab.launch import run_ranks
from hetero_comm.pipeline import PipelineGroups, PipelinePlan, StagePlan, build_pipeline
from pipeline_workers import (build_with_this_ranks_arguments, make_pipeline_model, make_plan,
                              train_pipeline)

TOLERANCE = 1e-12  # float64; the pipeline sums micro-batches in another order than one batch

# 2 machines x 2 stages: each schedule plain and with one stage recomputing behind a comm hook.
DATA_PARALLEL_CONFIGS = {
    "gpipe": dict(schedule="gpipe", micro_batches=2, other_init=True),
    "gpipe-recompute-hook": dict(schedule="gpipe", micro_batches=4, recompute_stage=0, hook=True),
    "1f1b": dict(schedule="1f1b", micro_batches=2),
    "1f1b-recompute-hook": dict(schedule="1f1b", micro_batches=4, recompute_stage=1, hook=True),
}
SINGLE_MACHINE_CONFIGS = {
    "gpipe": dict(schedule="gpipe", micro_batches=4, recompute_stage=1),
    "1f1b": dict(schedule="1f1b", micro_batches=2),
}


@pytest.fixture(scope="module")
def data_parallel_results():
    """Each config's result on ranks 0..3 (rank = machine * 2 + stage), from one launch."""
    per_rank = run_ranks(4, train_pipeline, 2, list(DATA_PARALLEL_CONFIGS.values()), timeout=120)
    return {name: [ranks[i] for ranks in per_rank] for i, name in enumerate(DATA_PARALLEL_CONFIGS)}


@pytest.fixture(scope="module")
def single_machine_results():
    per_rank = run_ranks(2, train_pipeline, 2, list(SINGLE_MACHINE_CONFIGS.values()), timeout=120)
    return {name: [ranks[i] for ranks in per_rank] for i, name in enumerate(SINGLE_MACHINE_CONFIGS)}


@pytest.fixture
def world_of_one():
    """A gloo world of this process alone (for what needs a process group but no peer)."""
    if dist.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def check_against_single_process(results, config):
    for rank, result in enumerate(results):
        assert max(result["grad_errors"]) < TOLERANCE, f"rank {rank}: {result['grad_errors']}"
        assert result["param_error"] < TOLERANCE, f"rank {rank} after SGD"
        forward_per_micro_batch = 2 if config.get("recompute_stage") == rank % 2 else 1
        assert result["forward_calls"] == forward_per_micro_batch * config["micro_batches"]
    last_stages = [result for rank, result in enumerate(results) if rank % 2 == 1]
    for result in last_stages:
        assert result["num_losses"] == config["micro_batches"]
        assert max(result["loss_errors"]) < TOLERANCE


# ------------------------------------------------------------------ 2 machines x 2 stages
@pytest.mark.multirank
@pytest.mark.parametrize("name", list(DATA_PARALLEL_CONFIGS))
def test_two_machines_match_single_process_training(data_parallel_results, name):
    """Every rank's stage gradient equals that of the whole model on the global batch (mean
    loss), at two steps, so micro-batch scaling, DDP averaging and recomputation are right."""
    results, config = data_parallel_results[name], DATA_PARALLEL_CONFIGS[name]
    assert all(result["is_ddp"] for result in results)
    check_against_single_process(results, config)


@pytest.mark.parametrize("name", list(DATA_PARALLEL_CONFIGS))
def test_replicas_of_a_stage_stay_identical_after_sgd(data_parallel_results, name):
    """Machine 1's copy of each stage equals machine 0's, also when it started from other
    weights ("gpipe": DDP broadcasts machine 0's at construction)."""
    results = data_parallel_results[name]
    for stage in range(2):
        machine_0, machine_1 = results[stage]["params"], results[2 + stage]["params"]
        assert (machine_0 == machine_1).all(), f"stage {stage}"


@pytest.mark.parametrize("name", ["gpipe-recompute-hook", "1f1b-recompute-hook"])
def test_comm_hook_runs_once_per_step(data_parallel_results, name):
    """The hook registered on runner.module reduces once per step (two steps), not once more
    for the shape-inference forward of the first step, and the gradients still match."""
    for rank, result in enumerate(data_parallel_results[name]):
        assert result["hook_steps"] == 2, f"rank {rank}"


# ------------------------------------------------------------------ 1 machine x 2 stages
@pytest.mark.multirank
@pytest.mark.parametrize("name", list(SINGLE_MACHINE_CONFIGS))
def test_one_machine_matches_single_process_training(single_machine_results, name):
    results = single_machine_results[name]
    assert not any(result["is_ddp"] for result in results)
    check_against_single_process(results, SINGLE_MACHINE_CONFIGS[name])


# ------------------------------------------------------------------ one process
def test_layer_count_must_match_the_plan():
    plan = PipelinePlan((StagePlan("cpu", 0, 2), StagePlan("cpu", 2, 4)), micro_batches=2)
    with pytest.raises(ValueError, match="the plan covers 4 layers but the model has 5"):
        build_pipeline(make_pipeline_model(), plan, nn.functional.mse_loss)


def test_groups_need_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        PipelineGroups(num_stages=2, machines=2)


def test_world_size_must_be_machines_times_stages(world_of_one):
    with pytest.raises(ValueError, match="2 stages on 2 machines needs a world of 4 ranks; "
                                         "this world has 1"):
        PipelineGroups(num_stages=2, machines=2)
    with pytest.raises(ValueError, match="a plan of 2 stages needs a world of a multiple of 2"):
        build_pipeline(make_pipeline_model(), make_plan("gpipe", 2), nn.functional.mse_loss)
    groups = PipelineGroups(num_stages=1, machines=1)
    with pytest.raises(ValueError, match="groups are for 1 stages; the plan has 2"):
        build_pipeline(make_pipeline_model(), make_plan("gpipe", 2), nn.functional.mse_loss,
                       groups=groups)


def test_step_checks_its_inputs_and_a_single_stage_trains_like_the_model(world_of_one):
    plan = PipelinePlan((StagePlan("cpu", 0, 5, recompute=True),), micro_batches=2)
    runner = build_pipeline(make_pipeline_model(), plan, nn.functional.mse_loss)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="step\\(\\) on stage 0 needs inputs"):
        runner.step(None, y)
    with pytest.raises(ValueError, match="step\\(\\) on the last stage \\(0\\) needs target"):
        runner.step(x, None)
    with pytest.raises(ValueError, match="batch of 7, not divisible into 2 equal micro-batches"):
        runner.step(x[:7], y[:7])
    losses = runner.step(x, y)
    reference = make_pipeline_model()
    loss = nn.functional.mse_loss(reference(x), y)
    loss.backward()
    torch.testing.assert_close(torch.stack(losses).mean(), loss.detach(), rtol=0, atol=TOLERANCE)
    for ours, theirs in zip(runner.stage_module.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=TOLERANCE)
    with pytest.raises(ValueError, match="shape \\(2, 6\\); the pipeline was sized for \\(4, 6\\)"):
        runner.step(x[:4], y[:4])


# ------------------------------------------------------------- ranks that disagree
@pytest.mark.misuse
@pytest.mark.parametrize("variants,named", [
    ([{}, {}, {"micro_batches": 4}, {}], "'micro_batches': 4"),
    ([{}, {"schedule": "1f1b"}, {}, {}], "'schedule': '1f1b'"),
    ([{}, {}, {}, {"wider": True}], "(9, 8)"),
    ([{"machines": 2}, {"machines": 2}, {"machines": 2}, {"machines": 4}], "'machines': 4"),
])
def test_ranks_passing_different_pipelines_all_raise_before_anything_blocks(variants, named):
    """Without the comparison, these block in new_group or in the stages' first receive until
    the process group's timeout; with it every rank raises within seconds, naming each rank's
    value, and the model is left as it was."""
    for error_type, message, unchanged in run_ranks(4, build_with_this_ranks_arguments, variants,
                                                    timeout=60):
        assert error_type == "ValueError" and "differ" in message and named in message, message
        assert unchanged
