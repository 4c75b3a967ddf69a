"""run_ranks: gloo ranks in new processes, their results, their failures and their environment."""

import os

import pytest

from lab.launch import run_ranks
from launch_workers import (environment_value, exit_on_rank_one, imported_package, parent_and_test,
                            raise_on_rank_one, summed_rank)

VARIABLE = "HETERO_COMM_TEST_LAUNCH_VALUE"


@pytest.mark.multirank
def test_results_come_back_in_rank_order_from_one_gloo_group():
    assert run_ranks(3, summed_rank) == [(0, 3.0), (1, 3.0), (2, 3.0)]


@pytest.mark.multirank
def test_ranks_see_the_environment_as_it_is_when_they_start(monkeypatch):
    # Ranks fork from a server that keeps the environment it started with; a change since must
    # still reach them (scripts hand settings to their ranks that way).
    monkeypatch.delenv(VARIABLE, raising=False)
    assert run_ranks(2, environment_value, VARIABLE) == [None, None]
    monkeypatch.setenv(VARIABLE, "first")
    assert run_ranks(2, environment_value, VARIABLE) == ["first", "first"]
    monkeypatch.setenv(VARIABLE, "second")
    assert run_ranks(2, environment_value, VARIABLE) == ["second", "second"]
    monkeypatch.delenv(VARIABLE)
    assert run_ranks(2, environment_value, VARIABLE) == [None, None]


@pytest.mark.multirank
def test_a_rank_that_raises_fails_the_run_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"rank 1 failed:(.|\n)*ValueError: rank one refuses"):
        run_ranks(2, raise_on_rank_one)


@pytest.mark.multirank
def test_a_rank_that_dies_fails_the_run_with_its_exit_code():
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3"):
        run_ranks(2, exit_on_rank_one, timeout=120)


@pytest.mark.multirank
@pytest.mark.parametrize("test", ["first", "second"])
def test_ranks_fork_from_the_server_in_every_test(test, monkeypatch):
    """pytest rewrites PYTEST_CURRENT_TEST before each test, and libraries set variables as they
    are imported (torch's inductor, lightning): neither may send the ranks back to spawning
    (each spawned rank imports torch again: seconds per rank). Forked, a rank's parent is the
    server, not this process; it still sees this test's environment."""
    monkeypatch.setenv(VARIABLE, test)
    ranks = run_ranks(2, parent_and_test, VARIABLE)
    assert all(parent != os.getpid() for parent, _, _ in ranks)
    assert all(name == os.environ["PYTEST_CURRENT_TEST"] and value == test for _, name, value in ranks)


@pytest.mark.multirank
def test_ranks_import_the_package_this_process_imported():
    """The server's sys.path starts with its working directory: from a source checkout, a rank
    must still get the installed package (with its compiled kernels), not the source tree."""
    import hetero_comm
    from hetero_comm._backend import extension_loaded
    assert run_ranks(2, imported_package) == [(hetero_comm.__file__, extension_loaded())] * 2
