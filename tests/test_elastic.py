"""Elastic training: islands die and rejoin; the survivors' run equals a participation mask.

In-process (3 emulated devices, one per island): the state moves of `jaxcomm.elastic`
(remesh onto the survivors' mesh, heal a joiner from a live peer) reproduce a single-mesh
reference whose participation mask drops the dead worker and readmits it, with its inner
optimiser state started over. Multi-process (3 processes on loopback through
`experiments/launch_local.py` with a failure schedule, each run bounded in time): DiLoCo
with a process SIGKILLed and restarted, and data parallelism with a process SIGKILLed,
against the same references.
"""

import json
import os
import re
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import elastic_run
from experiments import launch_local
from jaxcomm import data, elastic, local, models, train
from jaxcomm.elastic import _membership

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W = 3       # islands, one device each
B = 12      # global batch: 4 examples per island
H = 2       # DiLoCo sync period in the in-process test
LR = 0.1
INNER = optax.sgd(LR, momentum=0.9)  # per-worker state, so a joiner's fresh start shows
OUTER = optax.sgd(0.7, momentum=0.9, nesterov=True)


# ------------------------------------------------------------------ in-process
@pytest.fixture(scope="module")
def task():
  model = models.MLP(hidden=(16,), num_classes=10)
  params = model.init(jax.random.key(0), jnp.zeros((1, 64)))
  loss = lambda p, b: models.classifier_loss(model)(p, b)[0]
  ds = data.digits()
  return params, loss, [ds.batch(t, B) for t in range(16)]


def island_batch(batch, islands):
  """The batch of a mesh of `islands` (in mesh order): each island's share of `batch`, the
  global batch of all W islands (what each process feeds in a multi-process run)."""
  def take(x):
    share = len(x) // W
    return np.concatenate([x[i * share:(i + 1) * share] for i in islands])
  return jax.tree.map(take, batch)


def trainer_on(loss, tx, islands, has_aux=False):
  devices = [jax.devices()[i] for i in islands]
  return train.Trainer(loss, tx, train.make_mesh({"data": len(devices)}, devices=devices),
                       has_aux=has_aux)


def run(trainer, state, batches, islands, first, last):
  for t in range(first, last):
    state, _ = trainer.step(state, island_batch(batches[t], islands))
  return state


def rows(trainer, tree, pw_tree, islands):
  """{island: that worker's view} of a state tree on a mesh of `islands`."""
  return {i: trainer.worker_view(tree, pw_tree, k) for k, i in enumerate(islands)}


def test_survivors_and_a_healed_joiner_equal_a_participation_mask(task):
  """3 islands for 3 syncs, island 2 dead for 2 syncs, then healed from island 0."""
  params, loss, batches = task
  tx = local.diloco(INNER, OUTER, H)
  # Elastic: the state moves jaxcomm.elastic.fit makes between generations.
  t3 = trainer_on(loss, tx, [0, 1, 2])
  s = run(t3, t3.init(params), batches, [0, 1, 2], 0, 6)        # syncs 0, 1, 2
  t2 = trainer_on(loss, tx, [0, 1])                              # island 2 died
  s = run(t2, elastic.remesh(s, t2, t2.init(params)), batches, [0, 1], 6, 10)  # syncs 3, 4
  order = [0, 2, 1]  # a generation after a restart uses a fresh device order
  t3b = trainer_on(loss, tx, order)
  before = s
  s = elastic.remesh(s, t3b, t3b.init(jax.tree.map(jnp.zeros_like, params)))
  s = elastic.heal(t3b, s, [i == 2 for i in order], donor=0)
  healed = s
  s = run(t3b, s, batches, order, 10, 14)                        # syncs 5, 6

  # The heal: island 2 holds island 0's parameters and the replicated state bit for bit,
  # and a fresh inner momentum; islands 0 and 1 kept theirs.
  layout = t3b.layout
  after = rows(t3b, healed.params, layout.params, order)
  donor = rows(t2, before.params, t2.layout.params, [0, 1])
  for i, j in ((2, 0), (0, 0), (1, 1)):
    chex.assert_trees_all_equal(after[i], donor[j])
  chex.assert_trees_all_equal(healed.opt_state.outer_params, before.opt_state.outer_params)
  chex.assert_trees_all_equal(healed.opt_state.outer_state, before.opt_state.outer_state)
  assert int(healed.step) == int(before.step) == 10
  assert int(healed.opt_state.count) == 10
  trace = rows(t3b, healed.opt_state.inner_state, layout.opt_state.inner_state, order)
  assert all(not np.any(x) for x in jax.tree.leaves(trace[2]))
  assert all(np.any(x) for x in jax.tree.leaves(trace[1]))

  # Reference: one 3-worker mesh; the mask drops worker 2 at syncs 3 and 4; at step 10 its
  # inner optimiser state starts over (what a joiner gets).
  mask = np.ones((7, W), bool)
  mask[3:5, 2] = False
  rt = trainer_on(loss, local.diloco(INNER, OUTER, H, participation=mask), [0, 1, 2])
  r = run(rt, rt.init(params), batches, [0, 1, 2], 0, 10)
  fresh = rt.init(params)
  r = r._replace(opt_state=jax.tree.map(
      lambda pw, x, f: x.at[2].set(f[2]) if pw else x, rt.layout.opt_state, r.opt_state,
      fresh.opt_state))
  r = run(rt, r, batches, [0, 1, 2], 10, 14)
  got = rows(t3b, s.params, layout.params, order)
  want = rows(rt, r.params, rt.layout.params, [0, 1, 2])
  for i in range(W):
    chex.assert_trees_all_close(got[i], want[i], rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(s.opt_state.outer_params, r.opt_state.outer_params,
                              rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(s.opt_state.outer_state, r.opt_state.outer_state,
                              rtol=1e-5, atol=1e-6)


def test_heal_rejects_a_donor_that_is_a_joiner(task):
  params, loss, _ = task
  t = trainer_on(loss, local.diloco(INNER, OUTER, H), [0, 1, 2])
  s = t.init(params)
  with pytest.raises(ValueError, match="donor"):
    elastic.heal(t, s, [True, False, False], donor=0)
  with pytest.raises(ValueError, match="joiner flag per worker"):
    elastic.heal(t, s, [False, True], donor=0)


def test_single_process_fit_trains_in_rounds_like_the_trainer(task, tmp_path):
  """Without jax.distributed, elastic.fit is plain training in rounds of H steps."""
  params, loss, batches = task
  tx = local.diloco(INNER, OUTER, H)
  make = lambda mesh: train.Trainer(loss, tx, mesh)
  # One process: its share of the batch is the whole batch, split over the 8 devices.
  result = elastic.fit(make, params, lambda t: data.digits().batch(t, 16), 5, round_steps=H,
                       log_every=1, workdir=str(tmp_path))
  t = make(train.make_mesh({"data": 8}))
  s = t.init(params)
  for step in range(5):
    s, _ = t.step(s, data.digits().batch(step, 16))
  chex.assert_trees_all_equal(result.state.params, s.params)
  assert result.rounds == 3 and result.failed_rounds == 0  # steps 0-2, 2-4, 4-5
  rows_written = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows_written] == [1, 2, 3, 4, 5]


# ------------------------------------------------------------------ membership bookkeeping
def test_planner_never_reuses_a_device_order_that_failed_or_had_other_members():
  planner = _membership.Planner({0: [0], 1: [2048], 2: [4096]})
  first = ((0, 10), (1, 11), (2, 12))
  r0 = planner.plan(first)
  assert r0["order"] == [0, 2048, 4096] and r0["joiners"] == [] and r0["donor"] == 0
  planner.committed(first)
  planner.failed(tuple(r0["order"]))                 # island 2 died during a round
  survivors = ((0, 10), (1, 11))
  r1 = planner.plan(survivors)
  assert r1["order"] == [0, 2048] and r1["joiners"] == []
  planner.committed(survivors)
  back = ((0, 10), (1, 11), (2, 13))                 # island 2 restarted: a new incarnation
  r2 = planner.plan(back)
  assert r2["joiners"] == [2] and r2["donor"] == 0
  assert r2["order"] != r0["order"] and sorted(r2["order"]) == [0, 2048, 4096]
  planner.failed(tuple(r2["order"]))                 # that round failed too: a fresh order
  r3 = planner.plan(back)
  assert r3["joiners"] == [2] and r3["order"] not in (r0["order"], r2["order"])
  assert r3["index"] == 3
  for _ in range(4):                                 # 3! orders in all for single devices
    planner.failed(tuple(planner.plan(back)["order"]))
  with pytest.raises(RuntimeError, match="no unused device order"):
    planner.plan(back)


class FakeStore(dict):
  """The coordination service's key-value store: create-only keys, blocking reads."""

  def key_value_set(self, key, value):
    if key in self:
      raise jax.errors.JaxRuntimeError(f"ALREADY_EXISTS: {key}")
    self[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    del timeout_ms
    if key not in self:
      raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: {key}")
    return self[key]


def test_every_member_follows_one_commit_decision():
  members = (0, 1, 2)
  store = FakeStore({"a/vote/1": "1", "a/vote/2": "1"})
  assert _membership.decide(store, "a", 0, members, True, 10)        # all yes: commit
  store = FakeStore({"b/vote/0": "1", "b/vote/2": "0"})
  assert not _membership.decide(store, "b", 1, members, True, 10)    # it sees a no: abort
  store = FakeStore()
  assert not _membership.decide(store, "d", 2, members, False, 10)   # its collective failed
  assert not _membership.decide(store, "d", 0, members, True, 10)    # the others follow
  assert not _membership.decide(store, "d", 1, members, True, 10)
  # A vote missing in time (a slow or dead member): abort; when the late member votes yes
  # afterwards it follows the decision instead of committing alone.
  store = FakeStore({"c/vote/1": "1"})
  assert not _membership.decide(store, "c", 0, members, True, 10)
  assert not _membership.decide(store, "c", 2, members, True, 10)
  assert store["c/decision"] == "abort"


def test_candidate_orders_keep_islands_contiguous_and_count_n_factorial_times_d():
  orders = list(elastic.candidate_orders({0: [0, 1], 1: [8, 9], 2: [16, 17]}))
  assert len(orders) == len(set(orders)) == 6 * 2
  for order in orders:
    assert {frozenset(order[i:i + 2]) for i in (0, 2, 4)} == {
        frozenset((0, 1)), frozenset((8, 9)), frozenset((16, 17))}


# ------------------------------------------------------------------ launcher and hooks
@pytest.mark.parametrize("spec,match", [
    (["2"], "P@T"), (["x@3"], "P@T"), (["0@3"], "process must be in"),
    (["3@3"], "process must be in"), (["1@-1"], "step >= 0")])
def test_failure_schedules_are_checked(spec, match):
  with pytest.raises(ValueError, match=match):
    launch_local.schedule("kill", spec, 3)


def test_elastic_env_arms_only_the_scheduled_process(tmp_path):
  kills = launch_local.schedule("kill", ["2@40"], 3)
  base = {"XLA_FLAGS": "--foo"}
  env2 = launch_local.elastic_env(base, 2, str(tmp_path), kills, 7)
  assert env2["JAXCOMM_KILL_AT"] == "40" and env2["JAXCOMM_ELASTIC"] == "1"
  assert env2["XLA_FLAGS"] == "--foo --xla_cpu_collective_timeout_seconds=7"
  assert "JAXCOMM_KILL_AT" not in launch_local.elastic_env(base, 1, str(tmp_path), kills, 7)
  # A restarted process is not killed again.
  assert "JAXCOMM_KILL_AT" not in launch_local.elastic_env(env2, 2, str(tmp_path), kills, 7,
                                                           killable=False)


def test_experiment_hooks_read_the_launcher_environment(monkeypatch):
  assert elastic_run.round_steps("diloco", 20) == 20 and elastic_run.round_steps("dp", 20) == 1
  quorum = elastic_run.min_islands("2@10,3@40")
  assert [quorum(t) for t in (0, 10, 39, 40)] == [1, 2, 2, 3]
  assert elastic_run.min_islands(None)(100) == 1
  monkeypatch.setenv("XLA_FLAGS", "--a=1 --xla_cpu_collective_timeout_seconds=7")
  assert elastic_run.collective_timeout_s() == 7
  monkeypatch.delenv("JAXCOMM_KILL_AT", raising=False)
  fn = lambda t: {"t": t}
  assert elastic_run.with_kill_switch(fn) is fn  # not armed: the batch function itself
  assert launch_local.schedule("kill", ["2@40", "1@7"], 3) == [(2, 40), (1, 7)]


def test_checkpointer_processes_and_fit_arguments_are_checked(tmp_path, task):
  with pytest.raises(ValueError, match="processes"):
    train.Checkpointer(str(tmp_path), processes={0, 1})
  with pytest.raises(ValueError, match="processes"):
    train.Checkpointer(str(tmp_path), processes=["a"])
  params, loss, _ = task
  make = lambda mesh: train.Trainer(loss, optax.sgd(0.1), mesh)
  with pytest.raises(ValueError, match="round_steps"):
    elastic.fit(make, params, lambda t: {}, 4, round_steps=0)
  with pytest.raises(ValueError, match="checkpointer"):
    elastic.fit(make, params, lambda t: {}, 4, round_steps=1, checkpoint_every=2)
  with pytest.raises(ValueError, match="collective_timeout_s"):
    elastic.start_distributed(collective_timeout_s=0)


# ------------------------------------------------------------------ multi-process
# The experiment, as config paths (experiments/config.py) and values.
EXPERIMENT = {"model.name": "mlp", "data.name": "digits", "optimizer.name": "momentum",
              "optimizer.lr": 0.05, "data.batch_size": 24, "seed": 0}
SYNC = 5  # DiLoCo's H in the multi-process run


def program_args(algo, steps, checkpoint_every, log_every):
  """experiments/train.py's command line for `algo` on EXPERIMENT."""
  method = [f"--config.method.sync_every={SYNC}"] if algo == "diloco" else []
  return [f"--config={ROOT}/experiments/configs/default.py:{algo}",
          *[f"--config.{k}={v}" for k, v in EXPERIMENT.items()], f"--config.steps={steps}",
          f"--config.checkpoint_every={checkpoint_every}", f"--config.log_every={log_every}",
          *method]


def launch(tmp_path, schedule, program_args, *, env=None, timeout=240):
  """3 processes of experiments/train.py (one device each) with a failure schedule."""
  cmd = [sys.executable, "-m", "experiments.launch_local", "--processes=3", "--devices=3",
         "--heartbeat_timeout=3", "--collective_timeout=20", "--grace=10", *schedule, "--",
         f"--workdir={tmp_path}", *program_args]
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
                                   **(env or {})), check=False)
  lines = [l for l in result.stderr.splitlines() if l.startswith("launch_local: {")]
  assert lines, result.stderr[-6000:]
  return result.stderr, json.loads(lines[-1][len("launch_local: "):])


def reference(algo, steps, extra=None):
  """(trainer on `islands`, params, batch_fn) of the same experiment on one process."""
  from experiments import build, config  # pylint: disable=import-outside-toplevel
  settings = {"sync_every": SYNC} if algo == "diloco" else {}
  c = config.base_config(algo, **settings, **(extra or {}))
  c.steps = steps
  for path, value in EXPERIMENT.items():
    *parents, leaf = path.split(".")
    node = c
    for part in parents:
      node = node[part]
    node[leaf] = value
  _, loss, has_aux, params, batch_fn = build.model_task(c)
  tx = build.make_optimizer(c, build.Context(
      config=c, inner=build.inner_optimizer(c), axis_name="data", num_workers=W,
      mesh_shape={"data": W}, key=jax.random.key(c.seed)))
  return (lambda islands: trainer_on(loss, tx, islands, has_aux)), params, batch_fn


def restored(directory, trainer, params, step=None):
  """A checkpoint of the live islands (all rows) and the island of each row."""
  ckpt = train.Checkpointer(directory)
  if step is not None:  # an older one: move the newer ones aside
    for s in ckpt.steps:
      if s > step:
        os.rename(os.path.join(directory, str(s)), os.path.join(directory, f"{s}.later"))
    ckpt = train.Checkpointer(directory)
  state, info = ckpt.restore(trainer, trainer.init(params))
  return state, info["islands"]


def test_diloco_survives_a_killed_process_and_heals_it_when_it_restarts(tmp_path):
  """Island 2 is SIGKILLed after the 3rd sync and restarted; the others train on."""
  steps = 35
  log, report = launch(tmp_path, ["--kill=2@15", "--restart=2@20"],
                       program_args("diloco", steps, checkpoint_every=steps, log_every=5),
                       env={"JAXCOMM_MIN_ISLANDS": "3@25"})
  assert report["returncodes"] == [0, 0, 0], log[-6000:]
  assert report["incarnations"][2] == [-9, 0] and report["restarted"] == [[2, 20]]
  # Both survivors discarded the round island 2 died in and saw it leave; all saw it heal.
  for p in (0, 1):
    assert f"process {p}: round from step 15 discarded" in log, log[-6000:]
    assert f"process {p}: live set changed [0, 1, 2] -> [0, 1] at step 15 (lost [2])" in log
    assert re.search(f"process {p}: recovered in [0-9.]+ s", log)
  joined = re.search(r"process 2: joined at step (\d+) from process 0 .* replicated state "
                     r"(\w+), of the parameters (\w+)", log)
  assert joined, log[-6000:]
  at = int(joined.group(1))
  assert at % SYNC == 0 and 20 <= at <= 25
  healers = re.findall(rf"process (\d): healed \[2\] at step {at} from process 0 .* "
                       r"replicated state (\w+), of the parameters (\w+)", log)
  assert sorted(p for p, *_ in healers) == ["0", "1"]
  # The joiner's outer state is every survivor's, bit for bit; its parameters the donor's.
  assert {outer for _, outer, _ in healers} == {joined.group(2)}
  assert dict((p, d) for p, _, d in healers)["0"] == joined.group(3)

  # Reference: one process, 3 workers; the mask drops worker 2 from the sync at update 20
  # (index 3) until it is healed at step `at`; then its inner momentum starts over.
  dropped = ",".join(str(k) for k in range(3, at // SYNC))
  make, params, batch_fn = reference("diloco", steps, {"participation": f"drop:2@{dropped}"})
  rt = make([0, 1, 2])
  r = rt.init(params)
  for t in range(steps):
    if t == at:
      fresh = rt.init(params)
      r = r._replace(opt_state=jax.tree.map(
          lambda pw, x, f: x.at[2].set(f[2]) if pw else x, rt.layout.opt_state, r.opt_state,
          fresh.opt_state))
    r, _ = rt.step(r, batch_fn(t))
  got, islands = restored(str(tmp_path / "checkpoints"), rt, params)
  assert sorted(islands) == [0, 1, 2] and int(got.step) == steps
  mine = rows(rt, got.params, rt.layout.params, islands)
  want = rows(rt, r.params, rt.layout.params, [0, 1, 2])
  for i in range(W):
    chex.assert_trees_all_close(mine[i], want[i], rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(got.opt_state.outer_params, r.opt_state.outer_params,
                              rtol=1e-5, atol=1e-6)


def test_dp_discards_the_step_in_flight_and_its_later_checkpoint_resumes_exactly(tmp_path):
  """Island 2 is SIGKILLed before step 6: no survivor applies step 6 with it; DP goes on
  over islands 0 and 1, and a checkpoint written after the failure resumes bit for bit."""
  steps, kill = 12, 6
  log, report = launch(tmp_path, [f"--kill=2@{kill}"],
                       program_args("dp", steps, checkpoint_every=3, log_every=1))
  assert report["returncodes"] == [0, 0, -9], log[-6000:]
  for p in (0, 1):
    assert f"process {p}: round from step {kill} discarded" in log, log[-6000:]
  # Reference: 3 workers up to step 6, then workers 0 and 1 on their shares of the batch.
  make, params, batch_fn = reference("dp", steps)
  t3, t2 = make([0, 1, 2]), make([0, 1])
  r = run(t3, t3.init(params), [batch_fn(t) for t in range(steps)], [0, 1, 2], 0, kill)
  r = jax.tree.map(lambda x, like: jax.device_put(np.asarray(x), like.sharding), r,
                   t2.init(params))
  r = run(t2, r, [batch_fn(t) for t in range(steps)], [0, 1], kill, steps)
  final, islands = restored(str(tmp_path / "checkpoints"), t2, params)
  assert islands == [0, 1] and int(final.step) == steps
  chex.assert_trees_all_close(final.params, r.params, rtol=1e-5, atol=1e-6)
  # The checkpoint of step 9, written by the survivors, resumed here runs to the run's
  # final state bit for bit.
  resumed, _ = restored(str(tmp_path / "checkpoints"), t2, params, step=9)
  assert int(resumed.step) == 9
  resumed = run(t2, resumed, [batch_fn(t) for t in range(steps)], [0, 1], 9, steps)
  chex.assert_trees_all_equal(resumed.params, final.params)
  chex.assert_trees_all_equal(resumed.opt_state, final.opt_state)
