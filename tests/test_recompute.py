"""Recomputation in the backward (hetero_comm._recompute): values and buffers as without it,
any number of backward passes, and the recompute context entered once per recomputation."""

import copy

import pytest
import torch
import torch.nn as nn

from hetero_comm._recompute import PRODUCT_OPS, recompute_in_backward
from hetero_comm.pipeline.executor import _RecomputedSequential


def conv_block():
    torch.manual_seed(0)
    # The second BatchNorm averages over all batches so far (momentum None): it reads its count.
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Dropout(0.3),
                         nn.Sequential(nn.Conv2d(6, 4, 1), nn.BatchNorm2d(4, momentum=None)))


def run(model, forward, steps=3, backward_passes=1):
    """Losses, gradients and buffers after each of ``steps`` SGD steps."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(2)  # dropout's masks
    results = []
    for _ in range(steps):
        inputs = torch.randn(4, 3, 9, 9, generator=generator, requires_grad=True)
        optimizer.zero_grad(set_to_none=True)
        loss = forward(model, inputs).square().mean()
        for index in range(backward_passes):
            loss.backward(retain_graph=index + 1 < backward_passes)
        results.append((loss.detach(), inputs.grad.clone(), [p.grad.clone() for p in model.parameters()],
                        [b.clone() for b in model.buffers()]))
        optimizer.step()
    return results


def assert_equal_runs(got, expected):
    for (loss, input_grad, grads, buffers), (want_loss, want_input, want_grads, want_buffers) in zip(got, expected):
        assert torch.equal(loss, want_loss) and torch.equal(input_grad, want_input)
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))
        assert len(buffers) == len(want_buffers) == 6  # two BatchNorms: mean, variance, count
        assert all(torch.equal(b, w) for b, w in zip(buffers, want_buffers))


@pytest.mark.parametrize("keep_outputs_of", [None, PRODUCT_OPS], ids=["whole", "partial"])
@pytest.mark.parametrize("backward_passes", [1, 2])
def test_recomputing_changes_no_value_and_updates_running_statistics_once(backward_passes, keep_outputs_of):
    """Plain torch.utils.checkpoint would move BatchNorm's running mean twice per batch (and
    count the batch twice); a second backward over the same graph recomputes again."""
    model = conv_block()
    expected = run(copy.deepcopy(model), lambda m, x: m(x), backward_passes=backward_passes)
    recomputed = lambda m, x: recompute_in_backward(m, m, x, keep_outputs_of=keep_outputs_of)  # noqa: E731
    if keep_outputs_of is not None and backward_passes > 1:  # a limit of torch's selective checkpointing
        with pytest.raises(RuntimeError, match="backward an extra time"):
            run(model, recomputed, backward_passes=backward_passes)
        return
    got = run(model, recomputed, backward_passes=backward_passes)
    assert_equal_runs(got, expected)
    assert got[-1][3][2].item() == 3  # the first BatchNorm counted three batches


def test_the_pipelines_recomputing_stage_updates_buffers_once():
    plain = conv_block()
    recomputed = _RecomputedSequential(*copy.deepcopy(plain))
    assert_equal_runs(run(recomputed, lambda m, x: m(x)), run(plain, lambda m, x: m(x)))


class _CountingContext:
    def __init__(self) -> None:
        self.entered = self.exited = 0

    def __enter__(self) -> None:
        self.entered += 1

    def __exit__(self, *exc) -> bool:
        self.exited += 1
        return False


@pytest.mark.parametrize("keep_outputs_of", [None, PRODUCT_OPS], ids=["whole", "partial"])
def test_the_recompute_context_wraps_each_recomputation_and_nothing_else(keep_outputs_of):
    model, counter = conv_block(), _CountingContext()
    output = recompute_in_backward(model, model, torch.randn(2, 3, 9, 9), keep_outputs_of=keep_outputs_of,
                                   recompute_context=counter)
    assert (counter.entered, counter.exited) == (0, 0)  # the forward runs outside it
    output.sum().backward(retain_graph=keep_outputs_of is None)
    assert (counter.entered, counter.exited) == (1, 1)  # ended by early stopping, still exited
    if keep_outputs_of is None:  # selective checkpointing allows one backward only
        output.sum().backward()
        assert (counter.entered, counter.exited) == (2, 2)


def test_a_module_without_buffers_recomputes_as_checkpoint_does():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 3))
    inputs = torch.randn(4, 5, requires_grad=True)
    model(inputs).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()] + [inputs.grad.clone()]
    model.zero_grad(set_to_none=True)
    inputs.grad = None
    recompute_in_backward(model, model, inputs).sum().backward()
    got = [p.grad for p in model.parameters()] + [inputs.grad]
    assert all(torch.equal(g, w) for g, w in zip(got, expected))


@pytest.mark.parametrize("choice", ["recompute", "partial"])
def test_a_compiled_model_with_a_recomputed_block_trains_as_the_plain_one(choice):
    """Compiled, checkpoint takes no Python contexts: recomputation falls back to plain (or
    selective) checkpointing inside the graph, whose recomputation updates no buffer."""
    from hetero_comm.memory import MemoryPlan, apply_memory_plan
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()), nn.Linear(16, 4))
    plain = copy.deepcopy(model)
    inputs = torch.randn(5, 8)
    plain(inputs).square().sum().backward()
    with apply_memory_plan(model, MemoryPlan(("0", "1"), (choice, "keep"), 0, 0, 0, 0)):
        torch.compile(model, backend="aot_eager")(inputs).square().sum().backward()
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad)
    for got, want in zip(model.buffers(), plain.buffers()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
