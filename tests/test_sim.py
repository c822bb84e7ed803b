"""Simulated wall clock: a DP step on the WAN by hand, overlap, schedules, time to target."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcomm import comm, sim, sync, train

N = 2000          # parameters of the test model (one f32 leaf: one all-reduce)
W = 8


@pytest.fixture(scope="module")
def dp_step(mesh8):
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
  trainer = train.Trainer(loss, optax.chain(sync.mean("data"), optax.sgd(0.1)), mesh8)
  state = trainer.init({"w": jnp.zeros(N)})
  batch = {"x": jnp.ones((16, N)) / N, "y": jnp.ones(16)}
  report = comm.inspect(trainer.step_fn(state, batch), state, batch)
  _, m = trainer.step(state, batch)
  return report, int(m["wire_bytes"])


def test_dp_step_on_the_wan_preset_matches_a_hand_calculation(dp_step):
  report, counted = dp_step
  # By hand: one all-reduce of N f32 over 8 workers; WAN: 1 Gbit/s = 1.25e8 B/s, 30 ms.
  alpha, bw, n = 0.03, 1e9 / 8, 4 * N
  assert counted == 2 * 7 / 8 * n == report.wire_bytes()
  ring = 14 * alpha + 2 * 7 / 8 * n / bw          # 2(p-1) latencies + the wire bytes
  tree = 3 * (alpha + n / bw)                     # recursive doubling: log2(8) full exchanges
  halving = 6 * alpha + 2 * 7 / 8 * n / bw        # Rabenseifner
  assert (ring, tree, halving) == pytest.approx((0.420112, 0.090192, 0.180112))
  compute = sim.seconds_from_flops(1e12, peak_flops=20e12)  # a stated 50 ms of compute
  assert compute == pytest.approx(0.05)
  steps = 10
  for algorithm, comm_s in (("ring", ring), ("auto", tree)):
    costed = comm.cost(report, "wan", algorithm)
    per_step = sim.comm_seconds_per_step([counted] * steps, costed)
    np.testing.assert_allclose(per_step, comm_s, rtol=1e-12)
    assert comm.wire_bytes_time(counted, "wan", group_size=W, algorithm=algorithm) == \
        pytest.approx(comm_s)
    timeline = sim.simulate(compute, per_step)
    np.testing.assert_allclose(timeline.done, (compute + comm_s) * np.arange(1, steps + 1))
    assert timeline.total == pytest.approx(steps * (compute + comm_s))
    assert timeline.exposed_comm == pytest.approx(steps * comm_s)


def test_overlap_hides_communication_as_far_as_compute_allows():
  c, steps = 0.1, 20
  hidden = sim.simulate(c, [0.06] * steps, overlap_steps=1)
  assert hidden.total == pytest.approx(steps * c + 0.06)   # only the last one shows
  bound = sim.simulate(c, [0.25] * steps, overlap_steps=1)
  assert bound.total == pytest.approx(c + steps * 0.25)    # the network is the bottleneck
  sync_ = sim.simulate(c, [0.06] * steps)
  assert sync_.total == pytest.approx(steps * (c + 0.06))
  # Streaming-style: a 0.35 s sync every 5 steps hides behind tau = 4 steps of compute.
  comm_s = [0.35 if t % 5 == 4 else 0.0 for t in range(steps)]
  assert sim.simulate(c, comm_s, overlap_steps=4).total == pytest.approx(steps * c + 0.35)
  assert sim.simulate(c, comm_s).total == pytest.approx(steps * c + 4 * 0.35)
  # tau = 2 hides 0.2 s of each sync; 0.15 s stays exposed for all but the last.
  assert sim.simulate(c, comm_s, overlap_steps=2).total == pytest.approx(
      steps * c + 3 * 0.15 + 0.35)


def test_per_step_compute_and_a_sync_every_h_steps():
  compute = np.array([0.1, 0.2, 0.1, 0.2])
  comm_s = np.array([0.0, 0.5, 0.0, 0.5])
  t = sim.simulate(compute, comm_s)
  np.testing.assert_allclose(t.compute_end, [0.1, 0.3, 0.9, 1.1])
  np.testing.assert_allclose(t.done, [0.1, 0.8, 0.9, 1.6])


def test_conditional_collectives_are_charged_on_the_steps_that_send():
  def col(wire, cond):
    return comm.Collective(op="all-reduce", dtype="f32", shape=(1,), axes=("data",),
                           group_size=W, operand_bytes=wire * W / (2 * (W - 1)),
                           wire_bytes=wire, in_conditional=cond, trips=1, name="x")

  report = comm.CollectiveReport((col(700.0, False), col(7000.0, True)))
  costed = comm.cost(report, comm.Link(1e6, 1e-3), "ring")
  every, branch = costed.seconds(conditional=False), costed.seconds(conditional=True)
  per_step = sim.comm_seconds_per_step([700, 7700, 700, 7700 + 0.0], costed)
  np.testing.assert_allclose(per_step, [every, every + branch, every, every + branch])
  assert every == pytest.approx(14e-3 + 700 / 1e6) and branch == pytest.approx(14e-3 + 7e-3)


def test_time_to_target_and_never_reached():
  losses = [5.0, 4.0, 2.9, 3.5, 3.0, 2.5]
  times = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
  assert sim.time_to_target(losses, times, 3.0) == 3.0
  # Smoothed over 2 records one lucky batch does not count: (3.0 + 2.5) / 2 at t = 6.
  assert sim.time_to_target(losses, times, 3.0, window=2) == 6.0
  assert sim.time_to_target(losses, times, 1.0) is None
  assert sim.time_to_target([], [], 1.0) is None


def test_measured_and_modelled_compute():
  x = jnp.ones((64, 64))
  assert sim.measure_seconds(lambda a: a @ a, x, repeats=3) > 0
  assert 0 < sim.measure_seconds(lambda a: a @ a, x, repeats=3, statistic="min")
  assert sim.step_flops(lambda a: a @ a, x) == 2 * 64 ** 3


@pytest.mark.parametrize("make, word", [
    (lambda: sim.simulate(-0.1, [0.0]), "compute_seconds"),
    (lambda: sim.simulate(0.1, [float("nan")]), "comm_seconds"),
    (lambda: sim.simulate([0.1, 0.1], [0.0]), "compute_seconds"),
    (lambda: sim.simulate(0.1, [0.0], overlap_steps=-1), "overlap_steps"),
    (lambda: sim.time_to_target([1.0], [1.0], float("nan")), "target"),
    (lambda: sim.time_to_target([1.0, 2.0], [1.0], 1.0), "times"),
    (lambda: sim.time_to_target([1.0], [1.0], 1.0, window=0), "window"),
    (lambda: sim.seconds_from_flops(1e9, 0.0), "peak_flops"),
    (lambda: sim.seconds_from_flops(1e9, 1e12, utilization=1.5), "utilization"),
    (lambda: sim.comm_seconds_per_step([-1.0], comm.CommCost(())), "step_bytes"),
    (lambda: sim.comm_seconds_per_step([1.0], 0.5), "comm_cost"),
    (lambda: sim.measure_seconds(lambda: 0, repeats=0), "repeats"),
    (lambda: sim.measure_seconds(lambda: 0, statistic="mean"), "statistic"),
])
def test_bad_input_names_the_argument(make, word):
  with pytest.raises(ValueError, match=word):
    make()


# ---------------------------------------------------------------- overlapped backward pass
def test_backward_overlap_by_hand():
  """Forward 1 s, backward 2 s, buckets of 1, 1, 2 bytes (ready at 1.5, 2, 3 s) taking 1,
  0.25 and 1 s on the link: bucket 0 runs 1.5-2.5, bucket 1 waits for the link (2.5-2.75),
  bucket 2 starts when it is ready (3-4); 1 s is exposed after the backward pass, and the
  0.5 s update follows: 4.5 s."""
  o = sim.backward_overlap(1.0, 2.0, [1, 1, 2], [1.0, 0.25, 1.0], optimizer=0.5)
  assert o.ready.tolist() == [1.5, 2.0, 3.0]
  assert o.start.tolist() == [1.5, 2.5, 3.0]
  assert o.finish.tolist() == [2.5, 2.75, 4.0]
  assert (o.exposed_comm, o.step_seconds) == (1.0, 4.5)
  # A link slower than the backward pass: every bucket queues behind the first.
  o = sim.backward_overlap(1.0, 2.0, [1, 1, 2], [3.0, 3.0, 3.0])
  assert o.finish.tolist() == [4.5, 7.5, 10.5] and o.exposed_comm == 7.5


def test_backward_overlap_bounds():
  # Infinite bandwidth (and no latency): the step is its compute.
  o = sim.backward_overlap(0.3, 0.6, [4.0, 2.0, 2.0], [0.0, 0.0, 0.0], optimizer=0.1)
  assert (o.exposed_comm, o.step_seconds) == (0.0, 0.3 + 0.6 + 0.1)
  # One bucket: nothing overlaps, compute plus communication.
  o = sim.backward_overlap(0.3, 0.6, [8.0], [0.25], optimizer=0.1)
  assert o.exposed_comm == 0.25 and o.step_seconds == pytest.approx(1.25)
  for bad, words in ((dict(forward=-1.0), "forward"), (dict(bucket_bytes=[]), "bucket_bytes"),
                     (dict(bucket_seconds=[1.0]), "one finite time")):
    args = dict(forward=1.0, backward=1.0, bucket_bytes=[1, 1], bucket_seconds=[0.1, 0.1])
    with pytest.raises(ValueError, match=words):
      sim.backward_overlap(**{**args, **bad})
