"""``state.prepare_optimizer``: a dense optimizer, prepared, steps exactly as the recipe
(docs/recipes.md) written by hand, keeps the user's learning rate between steps (for schedulers and checkpoints),
and is refused, untouched, when it does not suit the hook."""

import copy

import pytest
import torch

from hetero_comm.hooks import AllreduceState, DCTQuantState, SegmentSparseState
from hetero_comm.hooks.segment_sparse import momentum_correction_lr_scale

SIGN = dict(density=0.1, basis="dct", output="sign")
MOMENTUM_CORRECTION = dict(density=0.1, momentum=0.9)
MC_SCALE = momentum_correction_lr_scale(0.1, 0.9)  # 2.42
MC_NESTEROV_SCALE = momentum_correction_lr_scale(0.1, 0.9, nesterov=True)  # 2.12


def make_groups(seed=0):
    """Two parameter groups (the second at a tenth of the rate), as users have."""
    generator = torch.Generator().manual_seed(seed)
    first = [torch.nn.Parameter(torch.randn(5, 3, generator=generator))]
    second = [torch.nn.Parameter(torch.randn(7, generator=generator))]
    return [{"params": first}, {"params": second, "lr_factor": 0.1}]


def make(kind, lr, **settings):
    groups = make_groups()
    for group in groups:
        group["lr"] = lr * group.pop("lr_factor", 1.0)
    return getattr(torch.optim, kind)(groups, lr=lr, **settings)


SCHEDULERS = {
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1 / (1 + step % 4)),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
}


def train(optimizer, scheduler=None, steps=6, seed=1, sign=False, first=0):
    """Steps ``first`` to ``first + steps`` with reproducible gradients (each step's drawn from
    its own seed; signs for the sign hook); the rates between steps."""
    rates = []
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(seed * 1000 + step)
        for group in optimizer.param_groups:
            for p in group["params"]:
                grad = torch.randn(p.shape, generator=generator)
                p.grad = grad.sign() if sign else grad
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        rates.append([group["lr"] for group in optimizer.param_groups])
    return rates


def parameters(optimizer):
    return [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]


# (state settings, dense optimizer, the recipe written by hand as docs/recipes.md gives it:
# the rate scaled, the weight decay scaled back to dense's)
RECIPES = {
    "adamw sign": (SIGN, ("AdamW", 2e-3, dict(weight_decay=0.01)),
                   ("AdamW", 3e-3, dict(weight_decay=0.01 / 1.5, betas=(0.0, 0.0)))),
    "adam sign": (SIGN, ("Adam", 1e-3, {}), ("Adam", 1.5e-3, dict(betas=(0.0, 0.0)))),
    "adam sign, decoupled decay": (SIGN, ("Adam", 1e-3, dict(weight_decay=0.01, decoupled_weight_decay=True)),
                                   ("AdamW", 1.5e-3, dict(weight_decay=0.01 / 1.5, betas=(0.0, 0.0)))),
    "sgd momentum correction": (MOMENTUM_CORRECTION, ("SGD", 0.05, dict(momentum=0.9, weight_decay=1e-4)),
                                ("SGD", 0.05 * MC_SCALE,
                                 dict(momentum=0.0, weight_decay=1e-4 / (0.1 * MC_SCALE)))),
    "sgd, its momentum already 0": (MOMENTUM_CORRECTION, ("SGD", 0.05, {}), ("SGD", 0.05 * MC_SCALE, {})),
    "sgd nesterov momentum correction": (
        dict(MOMENTUM_CORRECTION, nesterov=True), ("SGD", 0.05, dict(momentum=0.9, nesterov=True, weight_decay=1e-4)),
        ("SGD", 0.05 * MC_NESTEROV_SCALE, dict(momentum=0.0, weight_decay=1e-4 / (0.1 * MC_NESTEROV_SCALE)))),
}


@pytest.mark.parametrize("scheduler", [None, *SCHEDULERS])
@pytest.mark.parametrize("scheduler_first", [True, False])
@pytest.mark.parametrize("recipe", RECIPES)
def test_prepared_optimizer_steps_as_the_recipe_by_hand_and_keeps_the_users_rate(recipe, scheduler, scheduler_first):
    settings, (kind, lr, options), (hand_kind, hand_lr, hand_options) = RECIPES[recipe]
    sign = settings.get("output") == "sign"
    by_hand = make(hand_kind, hand_lr, **hand_options)
    dense = make(kind, lr, **options)
    unprepared = make(kind, lr, **options)
    make_scheduler = SCHEDULERS.get(scheduler, lambda o: None)
    hand_rates = train(by_hand, make_scheduler(by_hand), sign=sign)
    schedule = make_scheduler(dense) if scheduler_first else None
    assert SegmentSparseState(**settings).prepare_optimizer(dense) is dense
    schedule = schedule if scheduler_first else make_scheduler(dense)
    rates = train(dense, schedule, sign=sign)
    user_rates = train(unprepared, make_scheduler(unprepared), sign=sign)
    for mine, hands in zip(parameters(dense), parameters(by_hand)):
        torch.testing.assert_close(mine, hands, rtol=1e-6, atol=1e-9)
    assert rates == user_rates  # the scheduler and anyone reading saw the user's rate
    scale = hand_lr / lr
    for mine, hands in zip(rates, hand_rates):
        assert mine == pytest.approx([r / scale for r in hands], rel=1e-12)
    assert not any(torch.equal(a, b) for a, b in zip(parameters(dense), parameters(unprepared)))


@pytest.mark.parametrize("kind,settings", [("SGD", dict(momentum=0.9)), ("AdamW", {})])
@pytest.mark.parametrize("state", [lambda: AllreduceState(), lambda: DCTQuantState(),
                                   lambda: SegmentSparseState(density=0.1)],
                         ids=["allreduce", "dct_quant", "sparse sum"])
def test_hooks_that_hand_a_sum_leave_any_optimizer_as_it_is_unless_given_a_scale(state, kind, settings):
    prepared, plain = make(kind, 0.01, **settings), make(kind, 0.01, **settings)
    hyperparameters = copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                                     for g in prepared.param_groups])
    state().prepare_optimizer(prepared)
    assert [{k: v for k, v in g.items() if k != "params"} for g in prepared.param_groups] == hyperparameters
    train(prepared), train(plain)
    assert all(torch.equal(a, b) for a, b in zip(parameters(prepared), parameters(plain)))
    scaled, doubled = make(kind, 0.01, **settings), make(kind, 0.02, **settings)
    state().prepare_optimizer(scaled, lr_scale=2.0)
    train(scaled), train(doubled)
    for a, b in zip(parameters(scaled), parameters(doubled)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_preparing_again_replaces_the_earlier_call():
    state = SegmentSparseState(**MOMENTUM_CORRECTION)
    twice = make("SGD", 0.05, momentum=0.9)
    state.prepare_optimizer(twice)
    state.prepare_optimizer(twice)
    state.prepare_optimizer(twice, lr_scale=3.0)
    state.prepare_optimizer(twice)  # back to the default
    by_hand = make("SGD", 0.05 * MC_SCALE)
    train(twice), train(by_hand)
    for a, b in zip(parameters(twice), parameters(by_hand)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_a_checkpoint_holds_the_users_rate_and_resumes_exactly():
    state = SegmentSparseState(**SIGN)

    def fresh():
        optimizer = make("AdamW", 2e-3, weight_decay=0.01)
        return optimizer, SCHEDULERS["cosine"](optimizer)

    whole, whole_schedule = fresh()
    state.prepare_optimizer(whole)
    whole_rates = train(whole, whole_schedule, steps=8, sign=True)

    first, first_schedule = fresh()
    state.prepare_optimizer(first)
    train(first, first_schedule, steps=3, sign=True)
    saved = copy.deepcopy((first.state_dict(), first_schedule.state_dict(), parameters(first)))
    assert [g["lr"] for g in saved[0]["param_groups"]] == whole_rates[2]  # the user's rate
    assert saved[0]["param_groups"][0]["betas"] == (0.0, 0.0)

    for prepare_before_loading in (True, False):
        resumed, resumed_schedule = fresh()
        with torch.no_grad():
            for p, value in zip([p for g in resumed.param_groups for p in g["params"]], saved[2]):
                p.copy_(value)
        if prepare_before_loading:
            state.prepare_optimizer(resumed)
        resumed.load_state_dict(saved[0])
        resumed_schedule.load_state_dict(saved[1])
        if not prepare_before_loading:
            state.prepare_optimizer(resumed)
        rates = train(resumed, resumed_schedule, steps=5, sign=True, first=3)
        assert rates == whole_rates[3:]
        assert all(torch.equal(a, b) for a, b in zip(parameters(resumed), parameters(whole)))


def test_loading_a_dense_checkpoint_keeps_what_the_hook_needs():
    dense = make("AdamW", 1e-3)
    train(dense, steps=2)
    prepared = make("AdamW", 1e-3)
    SegmentSparseState(**SIGN).prepare_optimizer(prepared)
    prepared.load_state_dict(dense.state_dict())  # betas (0.9, 0.999) in the file
    assert all(group["betas"] == (0.0, 0.0) for group in prepared.param_groups)


def test_the_fit_forgets_the_groups_a_loaded_checkpoint_replaced():
    """load_state_dict replaces every group dict: the fit keeps what it knew of the live
    groups only (it held on to every replaced one before), and still checks them."""
    optimizer = make("AdamW", 1e-3)
    SegmentSparseState(**SIGN).prepare_optimizer(optimizer)
    fit = optimizer._hetero_comm_fit
    saved = optimizer.state_dict()
    for _ in range(3):
        optimizer.load_state_dict(saved)
    assert sorted(fit._before_fit) == sorted(id(group) for group in optimizer.param_groups)
    optimizer.param_groups[0]["betas"] = (0.9, 0.999)  # as a cycling scheduler would
    with pytest.raises(ValueError, match="betas"):
        train(optimizer, steps=1)


def test_a_scheduler_cycling_momentum_cannot_give_the_optimizer_its_momentum_back():
    optimizer = make("SGD", 0.05, momentum=0.9)
    cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10,
                                                base_momentum=0.9, max_momentum=0.9)
    SegmentSparseState(**MOMENTUM_CORRECTION).prepare_optimizer(optimizer)
    used = []  # what each step itself ran with
    optimizer.register_step_post_hook(lambda o, *_: used.append([g["momentum"] for g in o.param_groups]))
    train(optimizer, cycle, steps=4)
    assert [g["momentum"] for g in optimizer.param_groups] != [0.0, 0.0]  # the cycle set them
    assert used == [[0.0, 0.0]] * 4


@pytest.mark.parametrize("kind, settings, hook, changed", [
    ("AdamW", dict(betas=(0.9, 0.999)), SIGN, "betas"),
    ("SGD", dict(momentum=0.9), MOMENTUM_CORRECTION, "momentum"),
])
@pytest.mark.parametrize("scheduler_first", [True, False])
def test_a_scheduler_cycling_momentum_is_refused_at_the_step_after_it_changed_it(
        kind, settings, hook, changed, scheduler_first):
    """OneCycleLR's default cycle_momentum=True rewrites what the recipe fixed (AdamW's betas,
    SGD's momentum): preparing the optimizer or the next step raises, naming the scheduler
    setting; without the cycle the run trains on."""
    def prepare_and_train(cycle_momentum):
        optimizer = make(kind, 0.05, **settings)
        make_cycle = lambda: torch.optim.lr_scheduler.OneCycleLR(  # noqa: E731
            optimizer, max_lr=0.1, total_steps=10, cycle_momentum=cycle_momentum)
        cycle = make_cycle() if scheduler_first else None
        SegmentSparseState(**hook).prepare_optimizer(optimizer)
        train(optimizer, cycle or make_cycle(), steps=3, sign=kind == "AdamW")
        return optimizer

    with pytest.raises(ValueError, match=f"{changed}.*cycle_momentum=False"):
        prepare_and_train(cycle_momentum=True)
    optimizer = prepare_and_train(cycle_momentum=False)
    assert all(group[changed] in ((0.0, 0.0), 0.0) for group in optimizer.param_groups)


@pytest.mark.parametrize("scheduler", [None, "exponential"])
def test_a_step_that_raises_does_not_leave_the_rate_scaled(scheduler):
    make_scheduler = {None: lambda o: None,
                      "exponential": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.9)}[scheduler]
    optimizer = make("SGD", 0.05, momentum=0.9, weight_decay=1e-4)
    schedule = make_scheduler(optimizer)
    SegmentSparseState(**MOMENTUM_CORRECTION).prepare_optimizer(optimizer)
    by_hand = make("SGD", 0.05 * MC_SCALE, weight_decay=1e-4 / (0.1 * MC_SCALE))
    hand_schedule = make_scheduler(by_hand)
    train(optimizer, schedule, steps=1), train(by_hand, hand_schedule, steps=1)

    def failing_closure():
        raise RuntimeError("loss could not be computed")

    with pytest.raises(RuntimeError, match="loss could not"):
        optimizer.step(failing_closure)
    assert [g["lr"] for g in optimizer.param_groups] == user_rates_after_one_step(schedule)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [1e-4, 1e-4]
    if schedule is not None:  # a chainable scheduler reads the rate the failed step left
        schedule.step(), hand_schedule.step()
    train(optimizer, schedule, steps=2, first=1), train(by_hand, hand_schedule, steps=2, first=1)
    for mine, hands in zip(optimizer.param_groups, by_hand.param_groups):
        assert mine["lr"] == pytest.approx(hands["lr"] / MC_SCALE, rel=1e-12)
    for a, b in zip(parameters(optimizer), parameters(by_hand)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def user_rates_after_one_step(schedule):
    """The two groups' rates (0.05 and a tenth of it) after one step of ``schedule``."""
    decay = 1.0 if schedule is None else 0.9
    return [0.05 * decay, 0.05 * 0.1 * decay]


def test_a_group_added_later_is_checked_and_fitted():
    optimizer = make("SGD", 0.05, momentum=0.9)
    SegmentSparseState(**MOMENTUM_CORRECTION).prepare_optimizer(optimizer)
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], "momentum": 0.9})
    train(optimizer, steps=1)
    assert [g["momentum"] for g in optimizer.param_groups] == [0.0, 0.0, 0.0]
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], "momentum": 0.5})
    with pytest.raises(ValueError, match="group 3 has momentum 0.5"):
        train(optimizer, steps=1)


def test_copies_lose_the_fit_and_preparing_them_again_restores_it():
    state = SegmentSparseState(**SIGN)
    optimizer = make("AdamW", 1e-3)
    state.prepare_optimizer(optimizer)
    copied = copy.deepcopy(optimizer)
    assert "step" not in vars(copied) and not hasattr(copied, "_hetero_comm_fit")
    state.prepare_optimizer(copied)
    by_hand = make("AdamW", 1.5e-3, betas=(0.0, 0.0), weight_decay=0.01 / 1.5)  # AdamW's default 0.01
    train(copied, sign=True), train(by_hand, sign=True)
    for a, b in zip(parameters(copied), parameters(by_hand)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("interval", [1, 2, 5, 12, 40])
@pytest.mark.parametrize("momentum", [0.5, 0.9, 0.99])
def test_momentum_correction_scale_gives_back_what_clearing_loses(interval, momentum, nesterov):
    """Simulate the hook on one coordinate whose segment goes out every ``interval`` steps: a
    unit gradient arriving at each step of the interval in turn; what the sends carry, times
    the factor, is what momentum SGD (plain or Nesterov's, which moves a gradient as far in
    all) would move it (``1 / (1 - momentum)``) on average."""
    carried = []
    for arrival in range(interval):
        velocity = held = sent = 0.0
        for step in range(arrival, arrival + interval * 400):
            gradient = 1.0 if step == arrival else 0.0
            velocity = momentum * velocity + gradient
            held += gradient + momentum * velocity if nesterov else velocity
            if step % interval == interval - 1:  # the segment goes out: sent, then cleared
                sent, held, velocity = sent + held, 0.0, 0.0
        carried.append(sent)
    scale = momentum_correction_lr_scale(1.0 / interval, momentum, nesterov)
    assert scale * sum(carried) / interval == pytest.approx(1 / (1 - momentum), rel=1e-9)
    assert momentum_correction_lr_scale(1.0 / interval, 0.0, nesterov) == 1.0


@pytest.mark.parametrize("settings,optimizer,error,match", [
    (SIGN, lambda: make("SGD", 0.05, momentum=0.9), TypeError, "Adam or AdamW.*got SGD"),
    (SIGN, lambda: make("RMSprop", 1e-3), TypeError, "got RMSprop"),
    (MOMENTUM_CORRECTION, lambda: make("AdamW", 1e-3), TypeError, "replaces SGD's momentum; got AdamW"),
    (MOMENTUM_CORRECTION, lambda: make("SGD", 0.05, momentum=0.5), ValueError,
     "group 0 has momentum 0.5, but the hook applies momentum 0.9"),
    (MOMENTUM_CORRECTION, lambda: make("SGD", 0.05, momentum=0.9, nesterov=True), ValueError,
     "group 0 uses Nesterov momentum, but the hook applies plain momentum: give "
     "SegmentSparseState nesterov=True"),
    (dict(MOMENTUM_CORRECTION, nesterov=True), lambda: make("SGD", 0.05, momentum=0.9), ValueError,
     "group 0 uses plain momentum, but the hook applies Nesterov momentum: give "
     "SegmentSparseState nesterov=False"),
    (SIGN, lambda: torch.nn.Linear(2, 2), TypeError, "must be a torch.optim.Optimizer"),
    (SIGN, lambda: make("Adam", 1e-3, weight_decay=0.01), ValueError, "Adam's weight_decay 0.01"),
    (MOMENTUM_CORRECTION, lambda: make("SGD", 0.05, momentum=0.9, dampening=0.1), ValueError,
     "dampening 0.1"),
])
def test_an_optimizer_that_does_not_suit_is_refused_untouched(settings, optimizer, error, match):
    optimizer = optimizer()
    before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"}
                            for g in getattr(optimizer, "param_groups", [])])
    with pytest.raises(error, match=match):
        SegmentSparseState(**settings).prepare_optimizer(optimizer)
    if before:
        assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == before
        assert "step" not in vars(optimizer) and not hasattr(optimizer, "_hetero_comm_fit")


@pytest.mark.parametrize("lr_scale", [0.0, -1.0, float("nan"), float("inf"), "2"])
def test_a_bad_lr_scale_is_refused(lr_scale):
    optimizer = make("AdamW", 1e-3)
    with pytest.raises((ValueError, TypeError), match="lr_scale"):
        SegmentSparseState(**SIGN).prepare_optimizer(optimizer, lr_scale=lr_scale)
    assert all(group["betas"] == (0.9, 0.999) for group in optimizer.param_groups)


@pytest.mark.parametrize("recipe", ["adamw sign", "sgd momentum correction"])
def test_weight_decay_keeps_dense_trainings_rate(recipe):
    """Where the hook sends nothing (a zero gradient) only the decay moves a parameter: the
    prepared optimizer shrinks it by dense's steady factor every step (AdamW: ``1 - lr * wd``;
    momentum SGD: ``1 - lr * wd / (1 - momentum)``, which dense reaches once its momentum has
    built up), not by the recipe's scaled rate; between steps the group holds the user's
    decay."""
    settings, (kind, lr, options), _ = RECIPES[recipe]
    prepared, dense = make(kind, lr, **options), make(kind, lr, **options)
    SegmentSparseState(**settings).prepare_optimizer(prepared)
    decay = options["weight_decay"] / (1 - options.get("momentum", 0.0))
    for optimizer in (prepared, dense):
        for _ in range(300):
            before = parameters(optimizer)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            optimizer.step()
        for group, old, new in zip(optimizer.param_groups, before, parameters(optimizer)):
            steady = 1 - group["lr"] * decay
            tolerance = 1e-6 if optimizer is prepared else 1e-5  # dense: its momentum's tail
            torch.testing.assert_close(new / old, torch.full_like(old, steady), rtol=tolerance, atol=0)
            assert group["weight_decay"] == options["weight_decay"]
