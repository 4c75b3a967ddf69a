"""The one call on FSDP2 (``hetero_comm.compress(model, optimizer, mesh=mesh)``) on 4 gloo ranks
as 2 machines x 2 ranks: the exchange with every value sent equals native HSDP bitwise; the
recipes train next to dense HSDP with the replicas of each shard equal and a residual the size
of the shard; a run resumed through torch.distributed.checkpoint continues exactly; what FSDP
users run with it (gradient accumulation, mixed precision, no resharding, activation
checkpointing) works; every bad call is refused before anything changes."""

import math

import pytest
import torch

import fsdp_workers
from hetero_comm.fsdp import padded_shard_numel
from lab.launch import run_ranks

WORLD = 4


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_exchange_sending_every_value_equals_native_hsdp_bitwise(dtype):
    assert run_ranks(WORLD, fsdp_workers.dense_equals_native, dtype) == [True] * WORLD


@pytest.mark.parametrize("kind,optimizer,lr", [("transformer", "adamw", 3e-3), ("mlp", "sgd", 0.05)])
def test_recipe_trains_with_replicas_equal_and_a_shard_sized_residual(kind, optimizer, lr):
    results = run_ranks(WORLD, fsdp_workers.recipe_against_dense, kind, optimizer, lr, 30)
    for result in results:
        assert result["replicas_equal"]
        stats = result["stats"]
        assert stats["steps"] == 30 and stats["dense_fallbacks"] == 0
        assert stats["compression_ratio"] > 4  # these shards are small: importance is a share
        # the residual (and the SGD recipe's velocity) covers this rank's shard only
        per_shard = 2 if optimizer == "sgd" else 1
        assert result["residual_numel"] >= per_shard * result["local_numel"]
        assert result["residual_numel"] < per_shard * result["full_numel"] * 0.6
        assert max(result["compressed"][-5:]) < result["compressed"][0] * 0.5  # it learns


def test_recipe_sums_its_int8_wire_in_two_phases_between_machines():
    """The int8 wire summed in two phases across the replicate dimension (as beyond 63
    machines): replicas stay bitwise equal, it trains, and it is not the allreduce's run."""
    two_phase = run_ranks(WORLD, fsdp_workers.recipe_against_dense, "transformer", "adamw", 3e-3, 20,
                          fsdp_workers.MESH_SHAPE, "cpu", "two_phase")
    allreduce = run_ranks(WORLD, fsdp_workers.recipe_against_dense, "transformer", "adamw", 3e-3, 20)
    for result in two_phase:
        assert result["replicas_equal"] and result["stats"]["dense_fallbacks"] == 0
        assert max(result["compressed"][-5:]) < result["compressed"][0] * 0.5
    assert two_phase[0]["compressed"] != allreduce[0]["compressed"]  # 127 steps a rank, not 63


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_resume_through_distributed_checkpoint_is_exact(optimizer, tmp_path):
    for result in run_ranks(WORLD, fsdp_workers.resume_through_dcp, optimizer, str(tmp_path / "ckpt")):
        assert result["step_after_load"] == 6 and result["final_step"] == 10
        assert result["equal"] and result["losses_equal"]
        # the check can fail: without the exchange's error feedback the run differs
        assert not result["equal_without_exchange"]


@pytest.mark.parametrize("case", ["accumulate", "bf16 params, fp32 reduce", "bf16 reduce",
                                  "no reshard after forward", "checkpointed blocks"])
def test_what_fsdp_users_run_with_it(case):
    result = run_ranks(WORLD, fsdp_workers.accumulation_and_precision, case)[0]
    assert result["steps"] == 12  # one step an optimizer step, however many micro-batches
    assert result["replicas_equal"] and result["dense_fallbacks"] == 0
    assert result["warnings"] == []
    if case == "accumulate":  # the exchange ran once a step, at the sync: FSDP reduced nothing before
        assert result["bytes_dense"] == 12 * 4 * result["residual_numel"]
    assert result["compressed"][-1] < result["compressed"][0]


@pytest.mark.parametrize("kind", ["unused", "branch", "unfreeze", "grouped"])
def test_parameters_without_gradients_and_layouts_that_change(kind):
    """A parameter without a gradient (reduced as zeros: one layout on every rank), ranks that
    use different parameters, a layer unfrozen after two steps (its state laid out anew), two
    blocks in one fully_shard call (one group): compressed throughout, replicas equal."""
    for result in run_ranks(WORLD, fsdp_workers.unused_parameter, kind):
        assert result["replicas_equal"]
        assert result["dense_fallbacks"] == 0
        assert not any("sent dense" in message for message in result["warnings"])


EXPECTED_ERRORS = {
    "not sharded": ("TypeError", "fully_shard"),
    "native HSDP": ("ValueError", "mesh=mesh['shard']) instead of fully_shard(module, mesh=mesh)"),
    "one-dimensional mesh": ("ValueError", "two dimensions ('replicate', 'shard')"),
    "mesh dims misnamed": ("ValueError", "named ('dp', 'fsdp')"),
    "not a mesh": ("TypeError", "DeviceMesh"),
    "sharded on another mesh": ("ValueError", "sharded on the ranks [0, 1, 2, 3]"),
    "no mesh": ("ValueError", "give compress the two-dimensional mesh"),
    "machines with mesh": ("ValueError", "pass no machines"),
    "auto ratio": ("ValueError", "ratio='auto' is not offered with FSDP2"),
    "ratio too large": ("ValueError", "ratio"),
    "unsupported optimizer": ("TypeError", "no recipe for RMSprop"),
    "foreign parameters": ("ValueError", "not the sharded model's"),
    "second call": ("ValueError", "called on this model already"),
}


@pytest.mark.misuse
def test_bad_calls_are_refused_before_anything_changes():
    results = run_ranks(WORLD, fsdp_workers.bad_calls)
    assert set(results[0]) == set(EXPECTED_ERRORS)
    for name, (kind, fragment) in EXPECTED_ERRORS.items():
        for result in results:
            raised, message, untouched = result[name]
            assert raised == kind, (name, raised, message)
            assert fragment in message, (name, message)
            assert untouched, name


@pytest.mark.misuse
def test_ranks_that_disagree_all_raise_naming_each_ranks_setting():
    for message in run_ranks(WORLD, fsdp_workers.ranks_disagree):
        assert "differ" in message and "'ratio': 16" in message and "'ratio': 32" in message


@pytest.mark.parametrize("shape,shards,placement_dim,expected", [
    ((10, 3), 4, 0, 3 * 3),  # 10 rows padded to 12, 3 a shard
    ((8, 3), 4, 0, 2 * 3),
    ((3,), 4, 0, 1),  # fewer rows than shards: one padded row each
    ((4, 8), 2, 1, 4 * 4),  # another dimension: even, no padding
])
def test_padded_shard_numel_is_what_fsdp_reduce_scatters(shape, shards, placement_dim, expected):
    from torch.distributed.tensor import Shard

    class Fake:
        def size(self):
            return torch.Size(shape)
        placements = (Shard(placement_dim),)

    assert padded_shard_numel(Fake(), shards) == expected
    assert expected * shards >= math.prod(shape)


@pytest.mark.misuse
def test_states_built_by_hand_that_differ_raise_on_every_rank_at_register():
    for message in run_ranks(WORLD, fsdp_workers.direct_states_disagree):
        assert "FSDPSparseState settings differ" in message
        assert "rank 3: 'density': 0.2" in message and "rank 0: 'density': 0.1" in message


@pytest.mark.parametrize("shape", [(2, 1), (3, 1)])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_other_mesh_shapes(shape, optimizer):
    """Machines of one rank each (FSDP shards nothing inside a machine) and three machines:
    replicas equal, steps counted, the model learns."""
    for result in run_ranks(shape[0] * shape[1], fsdp_workers.recipe_on_mesh, list(shape), optimizer):
        assert result["replicas_equal"] and result["steps"] == 8 and result["dense_fallbacks"] == 0
        assert result["losses"][-1] < result["losses"][0]


def test_one_machine_warns_and_trains_as_plain_fsdp():
    for result in run_ranks(2, fsdp_workers.one_machine):
        assert result["equal"] and result["optimizer_untouched"]
        assert any("the mesh has one machine" in message for message in result["warnings"])


@pytest.mark.parametrize("optimizer,schedule", [("adam", False), ("sgd_nesterov", False),
                                                ("sgd_plain", False), ("adamw", True)])
def test_other_optimizers_and_a_schedule(optimizer, schedule):
    """Adam, SGD with Nesterov's momentum and without momentum, and AdamW under a one-cycle
    schedule: each gets its recipe, the replicas agree and the model learns."""
    for result in run_ranks(WORLD, fsdp_workers.recipe_on_mesh, [2, 2], optimizer, 8, schedule):
        assert result["replicas_equal"] and result["steps"] == 8 and result["dense_fallbacks"] == 0
        assert result["losses"][-1] < result["losses"][0]
