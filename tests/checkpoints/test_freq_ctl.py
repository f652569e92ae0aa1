"""Each test names one defect of AReaL's original trigger control that this one must not have."""

from areal_eval.checkpoints.freq_ctl import EpochStepTimeFreqCtl, FrequencyControl


class FakeClock:
    """A monotonic clock we can move by hand (time itself is not under test)."""

    def __init__(self, start=1000.0):
        self.now = start

    def __call__(self):
        return self.now


def run_epochs(ctl, steps_per_epoch, epochs):
    fired = []
    global_step = 0
    for _ in range(epochs):
        for step in range(steps_per_epoch):
            global_step += 1
            if ctl.check(epochs=int(step == steps_per_epoch - 1), steps=1):
                fired.append(global_step)
    return fired


def test_freq_secs_works_without_torch_distributed():
    # Original: `interval_seconds` was only bound inside `if dist.is_initialized()`.
    import torch.distributed as dist

    assert not dist.is_initialized()
    clock = FakeClock()
    ctl = EpochStepTimeFreqCtl(freq_sec=10, clock=clock)
    assert ctl.check(epochs=0, steps=1) is False
    clock.now += 10.5
    assert ctl.check(epochs=0, steps=1) is True
    assert ctl.check(epochs=0, steps=1) is False


def test_eval_before_train_fires_before_the_first_update():
    # Original: `initial_value=True` made the first check() (after step 1) fire.
    ctl = EpochStepTimeFreqCtl(freq_step=5, initial_epoch_value=True)
    assert ctl.before_train() is True
    assert ctl.before_train() is False
    # ...and the first update is not an extra evaluation.
    assert [ctl.check(0, 1) for _ in range(5)] == [False, False, False, False, True]


def test_eval_before_train_off_means_no_initial_firing():
    ctl = EpochStepTimeFreqCtl(freq_step=5, initial_epoch_value=False)
    assert ctl.before_train() is False
    assert ctl.check(0, 1) is False


def test_epoch_and_step_triggers_do_not_fire_back_to_back():
    # Original: epoch and step controllers never reset each other, so with 11 steps per epoch
    # and freq_step=10 they fired at steps 10 and 11.
    ctl = EpochStepTimeFreqCtl(freq_epoch=1, freq_step=10, fold_within_steps=5)
    fired = run_epochs(ctl, steps_per_epoch=11, epochs=6)
    gaps = [b - a for a, b in zip(fired, fired[1:], strict=False)]
    assert fired and min(gaps) > 1, fired
    # Still evaluates regularly: no interval longer than one epoch.
    assert max(gaps) <= 11


def test_aligned_epoch_and_step_fire_once():
    ctl = EpochStepTimeFreqCtl(freq_epoch=1, freq_step=10)
    assert run_epochs(ctl, steps_per_epoch=10, epochs=3) == [10, 20, 30]


def test_every_step_is_not_folded():
    ctl = EpochStepTimeFreqCtl(freq_step=1)
    assert run_epochs(ctl, steps_per_epoch=4, epochs=1) == [1, 2, 3, 4]


def test_time_is_measured_on_a_monotonic_clock(monkeypatch):
    # Original: datetime.now(); a wall-clock jump back made intervals negative, forward fired early.
    import time

    clock = FakeClock()
    ctl = EpochStepTimeFreqCtl(freq_sec=60, clock=clock)
    monkeypatch.setattr(time, "time", lambda: 10**10)  # the wall clock jumps a century ahead
    assert ctl.check(0, 1) is False
    assert EpochStepTimeFreqCtl.__dataclass_fields__["clock"].default is time.monotonic


def test_resume_does_not_count_downtime():
    # Original: state_dict stored wall-clock timestamps; after a 1 h outage every time trigger fired.
    clock = FakeClock()
    ctl = EpochStepTimeFreqCtl(freq_sec=100, freq_step=50, clock=clock)
    for _ in range(7):
        ctl.check(0, 1)
    clock.now += 40
    state = ctl.state_dict()

    resumed_clock = FakeClock(start=5.0)  # a new process: its monotonic clock starts elsewhere
    resumed_clock.now += 3600  # ...and the job was down for an hour
    resumed = EpochStepTimeFreqCtl(freq_sec=100, freq_step=50, clock=resumed_clock)
    resumed.load_state_dict(state)
    assert resumed.check(0, 1) is False  # 40 s elapsed, not 3640
    resumed_clock.now += 61
    assert resumed.check(0, 1) is True  # 101 s of training time


def test_state_dict_round_trip_keeps_step_counts():
    ctl = EpochStepTimeFreqCtl(freq_step=4)
    ctl.check(0, 1), ctl.check(0, 1), ctl.check(0, 1)
    other = EpochStepTimeFreqCtl(freq_step=4)
    other.load_state_dict(ctl.state_dict())
    assert other.check(0, 1) is True


def test_without_folding_the_epoch_and_step_controls_fire_on_their_own_as_areals():
    ctl = EpochStepTimeFreqCtl(freq_epoch=1, freq_step=10)
    assert run_epochs(ctl, steps_per_epoch=11, epochs=1) == [10, 11]


def test_one_control_needs_its_steps_and_its_seconds():
    clock = FakeClock()
    ctl = FrequencyControl(frequency_seconds=10, frequency_steps=2, clock=clock)
    assert ctl.check() is False  # one step
    clock.now += 11
    assert ctl.check() is True  # two steps and 11 s
    assert ctl.check() is False
