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
import queue
import re
import shlex
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import config
from experiments import specs
from experiments import elastic_run
from experiments import launch_local
from jaxcomm import data, elastic, local, models, train
from jaxcomm.elastic import _membership
from jaxcomm.elastic import _watchdog

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


def program_on(loss, tx, islands, params, has_aux=False):
  # Without donation: the test keeps states across later steps to compare them.
  devices = [jax.devices()[i] for i in islands]
  return train.make_program(loss, tx, train.make_mesh({"data": len(devices)}, devices=devices),
                            params, has_aux=has_aux, donate=False)


def run(program, state, batches, islands, first, last):
  for t in range(first, last):
    state, _, _ = program.dispatch(state, island_batch(batches[t], islands))
  return state


def rows(program, tree, pw_tree, islands):
  """{island: that worker's view} of a state tree on a mesh of `islands`."""
  return {i: program.worker_view(tree, pw_tree, k) for k, i in enumerate(islands)}


def test_survivors_and_a_healed_joiner_equal_a_participation_mask(task):
  """3 islands for 3 syncs, island 2 dead for 2 syncs, then healed from island 0."""
  params, loss, batches = task
  tx = local.diloco(INNER, OUTER, H)
  # Elastic: the state moves jaxcomm.elastic.fit makes between generations.
  t3 = program_on(loss, tx, [0, 1, 2], params)
  s = run(t3, t3.init(params), batches, [0, 1, 2], 0, 6)        # syncs 0, 1, 2
  t2 = program_on(loss, tx, [0, 1], params)                      # island 2 died
  s = run(t2, elastic.remesh(s, t2, t2.init(params)), batches, [0, 1], 6, 10)  # syncs 3, 4
  order = [0, 2, 1]  # a generation after a restart uses a fresh device order
  t3b = program_on(loss, tx, order, params)
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
  rt = program_on(loss, local.diloco(INNER, OUTER, H, participation=mask), [0, 1, 2], params)
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
  t = program_on(loss, local.diloco(INNER, OUTER, H), [0, 1, 2], params)
  s = t.init(params)
  with pytest.raises(ValueError, match="donor"):
    elastic.heal(t, s, [True, False, False], donor=0)
  with pytest.raises(ValueError, match="joiner flag per worker"):
    elastic.heal(t, s, [False, True], donor=0)


def test_single_process_fit_trains_in_rounds_like_the_program(task, tmp_path):
  """Without jax.distributed, elastic.fit is plain training in rounds of H steps."""
  params, loss, batches = task
  tx = local.diloco(INNER, OUTER, H)
  make = lambda mesh: train.make_program(loss, tx, mesh, params)
  # One process: its share of the batch is the whole batch, split over the 8 devices.
  result = elastic.fit(make, params, lambda t: data.digits().batch(t, 16), 5, round_steps=H,
                       log_every=1, workdir=str(tmp_path))
  t = make(train.make_mesh({"data": 8}))
  s = t.init(params)
  for step in range(5):
    s, _, _ = t.dispatch(s, data.digits().batch(step, 16))
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
  """The coordination service's key-value store: create-only keys."""

  def key_value_set(self, key, value):
    if key in self:
      raise jax.errors.JaxRuntimeError(f"ALREADY_EXISTS: {key}")
    self[key] = value

  def key_value_try_get(self, key):
    if key not in self:
      raise jax.errors.JaxRuntimeError(f"NOT_FOUND: {key}")
    return self[key]


def test_every_member_follows_one_commit_decision_and_a_missing_vote_is_evicted():
  members = (0, 1, 2)
  commit = lambda store, base, me, ok: _membership.decide(store, base, me, members, ok, 10)
  store = FakeStore({"a/vote/1": "1", "a/vote/2": "1"})
  assert commit(store, "a", 0, True) == {"commit": True, "evicted": []}   # all yes: commit
  store = FakeStore({"b/vote/0": "1", "b/vote/2": "0"})
  assert commit(store, "b", 1, True) == {"commit": False, "evicted": []}  # a no: abort
  store = FakeStore({"d/vote/2": "1"})
  assert not commit(store, "d", 0, False)["commit"]  # its collective failed: abort
  assert not commit(store, "d", 1, True)["commit"]   # the others follow, though all voted
  # A vote missing at the deadline (a hung or dead member): abort and evict it; when the
  # late member votes yes afterwards it follows the decision (and learns it was evicted).
  store = FakeStore({"c/vote/1": "1"})
  assert commit(store, "c", 0, True) == {"commit": False, "evicted": [2]}
  assert commit(store, "c", 2, True) == {"commit": False, "evicted": [2]}


def test_the_watchdog_ends_a_process_declared_dead_or_evicted_with_status_75(capsys):
  """A stall longer than the heartbeat timeout (SIGSTOP: the service declared the process
  dead) or the others' eviction key with this incarnation ends it with EVICTED and a line
  naming the generation; a key of an older incarnation, or a short stall, does not."""
  now, ended = [0.0], queue.Queue()
  store = FakeStore({"k": "6"})  # an older incarnation was evicted
  store.shutdown = lambda: ended.put("left")
  dog = _watchdog.Watchdog(store, "k", 3, lambda: (4, 35), clock=lambda: now[0],
                           end=ended.put)
  dog.incarnation = 7
  now[0] += 2.0  # a stall shorter than the heartbeat timeout
  with pytest.raises(queue.Empty):
    ended.get(timeout=0.5)
  now[0] += 3.5
  assert ended.get(timeout=5) == elastic.EVICTED == 75
  assert ("process 0: evicted at generation 4 (round from step 35): it did not run for 3.5 "
          "s, longer than the heartbeat timeout (3 s)") in capsys.readouterr().err
  dog.close()
  store = FakeStore({"k": "7"})
  store.shutdown = lambda: ended.put("left")
  dog = _watchdog.Watchdog(store, "k", None, lambda: (5, 40), end=ended.put)
  dog.incarnation = 7
  assert [ended.get(timeout=5), ended.get(timeout=5)] == ["left", elastic.EVICTED]
  assert ("process 0: evicted at generation 5 (round from step 40): the others evicted it"
          in capsys.readouterr().err)
  dog.close()


def test_quorum_rules_let_at_most_one_side_of_a_partition_train_on():
  q = elastic.Quorum(min_workers=2)
  last = (0, 1, 2, 3)
  assert q.violations((0, 1, 2), last, 0) == []           # the larger side goes on
  assert len(q.violations((3,), last, 0)) == 2            # the smaller one may not
  assert q.violations((0, 1), last, 0) and q.violations((2, 3), last, 0)  # 2|2: neither
  assert elastic.Quorum(min_workers=2, majority=False).violations((2, 3), last, 0) == []
  assert q.violations((0, 1, 5), (0, 1, 2), 0) == []      # joiners count for min_workers
  assert elastic.Quorum(min_workers=lambda t: 3 if t >= 10 else 1).violations(
      (0, 1), (), 10)                                     # schedules, and no last quorum
  with pytest.raises(ValueError, match="min_workers"):
    elastic.Quorum(min_workers=0).check()
  with pytest.raises(ValueError, match="min_workers"):
    specs.min_workers("3@x")
  assert [specs.min_workers("1,3@25,2@30")(t) for t in (0, 25, 30)] == [1, 3, 2]


def test_the_leader_is_the_lowest_live_process_holding_the_state():
  planner = _membership.Planner({0: [0], 1: [2048], 2: [4096]})
  first = ((0, 10), (1, 11), (2, 12))
  assert planner.leader(first) == 0                  # generation 0: the lowest process
  planner.committed(first)
  back = ((0, 13), (1, 11), (2, 12))                 # process 0 restarted: a joiner
  assert planner.leader(back) == 1
  record = planner.plan(back)
  assert record["leader"] == record["donor"] == 1 and record["joiners"] == [0]
  # Any process can continue the leader's bookkeeping from a record.
  mirror = _membership.Planner({0: [0], 1: [2048], 2: [4096]})
  mirror.load(json.loads(json.dumps(record["state"])))
  assert (mirror.index, mirror.members, mirror.used, mirror.spent) == (
      planner.index, planner.members, planner.used, planner.spent)


def test_candidate_orders_keep_islands_contiguous_and_count_n_factorial_times_d():
  orders = list(elastic.candidate_orders({0: [0, 1], 1: [8, 9], 2: [16, 17]}))
  assert len(orders) == len(set(orders)) == 6 * 2
  for order in orders:
    assert {frozenset(order[i:i + 2]) for i in (0, 2, 4)} == {
        frozenset((0, 1)), frozenset((8, 9)), frozenset((16, 17))}


# ------------------------------------------------------------------ launcher and hooks
@pytest.mark.parametrize("spec,match", [
    (["2"], "P@T"), (["x@3"], "P@T"), (["-1@3"], "process must be in"),
    (["3@3"], "process must be in"), (["1@-1"], "step >= 0")])
def test_failure_schedules_are_checked(spec, match):
  with pytest.raises(ValueError, match=match):
    launch_local.schedule("kill", spec, 3)


def _readme_elastic_command() -> list:
  """The README's elastic example: the launcher's command line with a --restart."""
  text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
  (block,) = [b for b in blocks if "launch_local" in b and "--restart=" in b]
  return shlex.split(block.replace("\\\n", " "))


def test_the_readme_elastic_example_cannot_end_before_the_restarted_process_rejoins():
  """Whatever the machine's speed: after the restart's step and before the last, a round
  needs every process (config.elastic.min_workers), so the survivors wait for the restarted
  one (at most quorum_timeout_s, which leaves it minutes to start) and it joins there.
  (tests/test_elastic.py's DiLoCo run checks that a joiner is waited for and healed.)"""
  argv = _readme_elastic_command()
  flag = lambda name: [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
  processes = int(flag("processes")[0])
  restarts = launch_local.schedule("restart", flag("restart"), processes)
  steps = int(flag("config.steps")[0])
  need = specs.min_workers((flag("config.elastic.min_workers") or ["1"])[0])
  assert restarts
  for _, after in restarts:
    assert any(need(t) == processes for t in range(after + 1, steps)), argv
  timeout = float((flag("config.elastic.quorum_timeout_s") or [60])[0])
  assert timeout >= 120, timeout


def test_faults_and_elastic_mode_reach_the_program_as_flags(tmp_path):
  faults = {"kill": launch_local.schedule("kill", ["0@40"], 3),
            "stop": launch_local.schedule("stop", ["1@9"], 3)}
  assert launch_local.fault_flags(0, faults) == ["--fault=kill@40"]
  assert launch_local.fault_flags(1, faults) == ["--fault=stop@9"]
  assert launch_local.fault_flags(0, faults, first=False) == []  # a restart is not killed
  assert launch_local.fault_flags(2, faults, partition="0+1|2@5") == [
      "--fault=partition=0+1|2@5"]
  flags = launch_local.elastic_flags(2, str(tmp_path), 3, 7)
  assert "--config.elastic.enabled=True" in flags
  assert "--config.elastic.collective_timeout_s=7" in flags
  assert elastic_run.parse_faults(["stop@9", "partition=0+1|2+3@5"]) == {
      "stop": (9, None), "partition": (5, [[0, 1], [2, 3]])}
  for bad in ("kill", "kill@x", "nap@3", "partition@3"):
    with pytest.raises(ValueError, match="--fault"):
      elastic_run.parse_faults([bad])
  fn = lambda t: {"t": t}
  assert elastic_run.with_faults(fn, {}) is fn  # not armed: the batch function itself
  assert elastic_run.round_steps(config.base_config("diloco", sync_every=20).method) == 20
  assert elastic_run.round_steps(config.base_config("dp").method) == 1
  with pytest.raises(ValueError, match="config.elastic.quorum_timeout_s"):
    c = config.base_config("dp")
    c.elastic.quorum_timeout_s = -1.0
    config.check(c)


def test_checkpoint_and_fit_arguments_are_checked(tmp_path, task):
  with pytest.raises(ValueError, match="processes"):
    train.Checkpointer(str(tmp_path), processes={0, 1})
  with pytest.raises(ValueError, match="processes"):
    train.Checkpointer(str(tmp_path), processes=["a"])
  params, loss, _ = task
  make = lambda mesh: train.make_program(loss, optax.sgd(0.1), mesh, params)
  with pytest.raises(ValueError, match="round_steps"):
    elastic.fit(make, params, lambda t: {}, 4, round_steps=0)
  with pytest.raises(ValueError, match="checkpoint_dir"):
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


def launch(tmp_path, schedule, program_args, *, processes=W, timeout=300,
           collective_timeout=20):
  """`processes` processes of experiments/train.py (one device each) with a failure schedule;
  launch_local starts the coordination service in a process of its own and stops it."""
  cmd = [sys.executable, "-m", "experiments.launch_local", f"--processes={processes}",
         f"--devices={processes}", "--heartbeat_timeout=3",
         f"--collective_timeout={collective_timeout}", "--grace=10", *schedule, "--",
         f"--workdir={tmp_path}", *program_args]
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          cwd=ROOT, start_new_session=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))
  try:
    _, stderr = proc.communicate(timeout=timeout)
  finally:  # whatever happened: nothing of the run is left running
    if proc.poll() is None:
      os.killpg(proc.pid, 9)
      proc.wait()
  lines = [l for l in stderr.splitlines() if l.startswith("launch_local: {")]
  assert lines, stderr[-6000:]
  return stderr, json.loads(lines[-1][len("launch_local: "):])


def reference(algo, steps, extra=None, workers=W):
  """(program on `islands`, params, batch_fn) of the same experiment on one process."""
  from experiments import build
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
      config=c, inner=build.inner_optimizer(c), axis_name="data", num_workers=workers,
      mesh_shape={"data": workers}, key=jax.random.key(c.seed)))
  return (lambda islands: program_on(loss, tx, islands, params, has_aux)), params, batch_fn


def restored(directory, program, params, step=None):
  """A checkpoint of the live islands (all rows) and the island of each row."""
  ckpt = train.Checkpointer(directory)
  if step is not None:  # an older one: move the newer ones aside
    for s in ckpt.steps:
      if s > step:
        os.rename(os.path.join(directory, str(s)), os.path.join(directory, f"{s}.later"))
    ckpt = train.Checkpointer(directory)
  state, info = ckpt.restore(program, program.init(params))
  return state, info["islands"]


def reset_inner(program, state, params, worker):
  """`state` with `worker`'s per-worker optimiser state started over (what a joiner gets)."""
  fresh = program.init(params)
  return state._replace(opt_state=jax.tree.map(
      lambda pw, x, f: x.at[worker].set(f[worker]) if pw else x, program.layout.opt_state,
      state.opt_state, fresh.opt_state))


def test_diloco_loses_process_0_and_a_stopped_process_and_equals_the_masked_reference(
    tmp_path):
  """One run, two faults. Process 0 (rank 0: it used to host the coordination service and
  lead) is SIGKILLed before step 15 and restarted; processes 1 and 2 train on, wait for it at
  step 25 (min_workers 3 from there), wait the join window once with it, hold it out of the
  round from 25 (shrink_only: joiners only at checkpoint steps, every 10) and heal it at
  step 30. Process 1 is SIGSTOPped before step 35: declared dead (heartbeat, 3 s) and
  evicted (its vote missing at the deadline); 0 and 2 train on. SIGCONT once step 45 is
  committed: its watchdog sees it did not run for longer than the heartbeat timeout and
  exits with status 75 before JAX's client would abort it, without touching the live round.
  (0 and 2 sit in the sync's all-reduce with the stopped process until the collective
  timeout, 10 s here: the run's longest wait, and 5 times what a compile of a new mesh
  took on a loaded 2-core machine, which it must exceed.)"""
  steps = 50
  log, report = launch(tmp_path, ["--kill=0@15", "--restart=0@20", "--stop=1@35",
                                  "--cont=1@45"],
                       program_args("diloco", steps, checkpoint_every=10, log_every=5)
                       + ["--config.elastic.min_workers=1,3@25,2@35",
                          "--config.elastic.quorum_timeout_s=150",
                          "--config.elastic.deadline_s=5",
                          "--config.elastic.shrink_only=True",
                          "--config.elastic.join_window_s=1"], timeout=480,
                       collective_timeout=10)
  assert report["returncodes"][0] == report["returncodes"][2] == 0, log[-6000:]
  assert report["incarnations"][0] == [-9, 0] and report["restarted"] == [[0, 20]]
  assert report["continued"] == [[1, 45]]
  # The late process 1 exits by its watchdog, with the eviction status and where it was.
  assert report["incarnations"][1] == [elastic.EVICTED], (report, log[-6000:])
  assert re.search(r"process 1: evicted at generation \d+ \(round from step 35\): it did "
                   r"not run for [0-9.]+ s, longer than the heartbeat timeout \(3 s\)",
                   log), log[-6000:]
  assert "distributed service detected fatal errors" not in log
  # The join window: when process 0 came back, every process waited one empty round of
  # 1 s before the next generation formed; shrink_only then held 0 out until step 30.
  for p in (1, 2):
    assert f"process {p}: waiting at step 25: join window (1.0 s)" in log, log[-6000:]
  assert "process 0: waiting at step 25: join window (1.0 s)" in log, log[-6000:]
  assert "process 0: waiting at step 25: held" in log, log[-6000:]
  # Both survivors of each fault discarded the round in flight and saw the live set change.
  for p in (1, 2):
    assert f"process {p}: round from step 15 discarded" in log, log[-6000:]
    assert f"process {p}: live set changed [0, 1, 2] -> [1, 2] at step 15 (lost [0])" in log
  for p in (0, 2):
    assert re.search(rf"process {p}: round from step 35 discarded after [0-9.]+ s "
                     r"\(.*\); evicted \[1\] \(no vote within 5.0 s\)", log), log[-6000:]
    assert f"process {p}: live set changed [0, 1, 2] -> [0, 2] at step 35 (lost [1])" in log
  joined = re.search(r"process 0: joined at step (\d+) from process 1 .* replicated state "
                     r"(\w+), of the parameters (\w+)", log)
  assert joined, log[-6000:]
  at = int(joined.group(1))
  assert at == 30
  healers = re.findall(rf"process (\d): healed \[0\] at step {at} from process 1 .* "
                       r"replicated state (\w+), of the parameters (\w+)", log)
  assert sorted(p for p, *_ in healers) == ["1", "2"]
  # The joiner's outer state is every survivor's, bit for bit; its parameters the donor's.
  assert {outer for _, outer, _ in healers} == {joined.group(2)}
  assert dict((p, d) for p, _, d in healers)["1"] == joined.group(3)

  # Reference: one process, 3 workers; the mask drops worker 0 from the syncs of the rounds
  # from 15, 20 and 25 (indices 3, 4, 5) and worker 1 from the round from 35 on (indices
  # 7, 8, 9); worker 0's inner state starts over at step 30 (its heal).
  mask = "drop:0@3,4,5;1@7,8,9"
  make, params, batch_fn = reference("diloco", steps, {"participation": mask})
  rt = make([0, 1, 2])
  r = rt.init(params)
  for t in range(steps):
    if t == at:
      r = reset_inner(rt, r, params, 0)
    r, _, _ = rt.dispatch(r, batch_fn(t))
  make2, _, _ = reference("diloco", steps, workers=2)  # the survivors' mesh: 2 workers
  t2 = make2([0, 2])
  got, islands = restored(str(tmp_path / "checkpoints"), t2, params)
  assert sorted(islands) == [0, 2] and int(got.step) == steps
  mine = rows(t2, got.params, t2.layout.params, islands)
  want = rows(rt, r.params, rt.layout.params, [0, 1, 2])
  for i in (0, 2):
    chex.assert_trees_all_close(mine[i], want[i], rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(got.opt_state.outer_params, r.opt_state.outer_params,
                              rtol=1e-5, atol=1e-6)


def test_a_process_hung_between_its_vote_and_the_barrier_is_evicted_and_may_rejoin():
  """JAX's membership barrier has no timeout and waits for every process the service holds
  live. 3 processes take membership rounds only (tests/membership_runner.py); process 2
  hangs after the decision of the round from step 4, before the barrier, heartbeats going
  on. The others evict it 2 s (the deadline) after they arrived, its watchdog ends it
  (status 75), the round stays committed everywhere, and 0 and 1 go on, until step 8 needs
  all 3 (min_workers): process 2, started again, rejoins there as a new member."""
  n, port = 3, launch_local.free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  coordinator = subprocess.Popen(
      [sys.executable, "-m", "jaxcomm.elastic.coordinator", f"--address=127.0.0.1:{port}",
       f"--num_processes={n}", "--heartbeat_timeout=3"], cwd=ROOT, env=env,
      stderr=subprocess.DEVNULL, start_new_session=True)
  start = lambda i, hang_at: subprocess.Popen(
      [sys.executable, os.path.join(ROOT, "tests", "membership_runner.py"),
       f"127.0.0.1:{port}", str(i), str(n), str(hang_at)], cwd=ROOT, env=env,
      stderr=subprocess.PIPE, text=True, start_new_session=True)
  procs = [start(i, 4) for i in range(n)]
  try:
    first = procs[2].communicate(timeout=120)[1]
    procs.append(start(2, -1))  # its restart
    logs = [p.communicate(timeout=120)[1] for p in (procs[0], procs[1], procs[3])]
  finally:  # nothing left running (SIGKILL: JAX turns SIGTERM into a preemption notice)
    for p in [*procs, coordinator]:
      if p.poll() is None:
        os.killpg(p.pid, 9)
        p.wait()
  assert [p.returncode for p in procs] == [0, 0, elastic.EVICTED, 0], logs
  assert ("process 2: evicted at generation 0 (round from step 4): the others evicted it"
          in first), first[-3000:]
  assert "committed 5" not in first  # it hung before it could commit
  for p in (0, 1):
    assert (f"process {p}: process 2 voted but did not reach the membership barrier within "
            f"2.0 s; evicting it") in logs[p], logs[p][-3000:]
    done = dict(re.findall(rf"runner: process {p}: committed (\d+) live (\[.*\])", logs[p]))
    assert list(done) == [str(t) for t in range(1, 11)], logs[p][-3000:]
    assert (done["5"], done["6"], done["9"]) == ("[0, 1, 2]", "[0, 1]", "[0, 1, 2]")
  rejoined = re.findall(r"runner: process 2: committed (\d+) live (\[.*\])", logs[2])
  assert rejoined == [("9", "[0, 1, 2]"), ("10", "[0, 1, 2]")], logs[2][-3000:]


def test_dp_loses_process_0_and_discards_the_step_in_flight_everywhere(tmp_path):
  """Process 0 is SIGKILLed before step 6: no survivor applies step 6 with it; DP goes on
  over processes 1 and 2 (1 leads: it writes the checkpoints), and a checkpoint written
  after the failure resumes bit for bit."""
  steps, kill = 12, 6
  log, report = launch(tmp_path, [f"--kill=0@{kill}"],
                       program_args("dp", steps, checkpoint_every=3, log_every=1))
  assert report["returncodes"] == [-9, 0, 0], log[-6000:]
  for p in (1, 2):
    assert f"process {p}: round from step {kill} discarded" in log, log[-6000:]
  # Reference: 3 workers up to step 6, then workers 1 and 2 on their shares of the batch.
  make, params, batch_fn = reference("dp", steps)
  t3, t2 = make([0, 1, 2]), make([1, 2])
  r = run(t3, t3.init(params), [batch_fn(t) for t in range(steps)], [0, 1, 2], 0, kill)
  r = jax.tree.map(lambda x, like: jax.device_put(np.asarray(x), like.sharding), r,
                   t2.init(params))
  r = run(t2, r, [batch_fn(t) for t in range(steps)], [1, 2], kill, steps)
  final, islands = restored(str(tmp_path / "checkpoints"), t2, params)
  assert islands == [1, 2] and int(final.step) == steps
  chex.assert_trees_all_close(final.params, r.params, rtol=1e-5, atol=1e-6)
  # The metrics were written by the leader of each generation: every step once.
  rows_written = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [row["step"] for row in rows_written] == list(range(1, steps + 1))
  assert rows_written[-1]["live"] == [1, 2]
  # The checkpoint of step 9, written by the survivors, resumed here runs to the run's
  # final state bit for bit.
  resumed, _ = restored(str(tmp_path / "checkpoints"), t2, params, step=9)
  assert int(resumed.step) == 9
  resumed = run(t2, resumed, [batch_fn(t) for t in range(steps)], [1, 2], 9, steps)
  chex.assert_trees_all_equal(resumed.params, final.params)
  chex.assert_trees_all_equal(resumed.opt_state, final.opt_state)


def test_a_partition_never_trains_two_models_and_stops_cleanly_below_quorum(tmp_path):
  """4 processes split 2|2 from step 6 (a fault hook in the membership layer: each side sees
  only its own). Neither side holds a majority of the last quorum nor min_workers = 3: both
  stop with a clear message and exit status 69 after the quorum timeout, and the
  checkpoint of step 6 is intact and equals 6 steps of 4-worker DP."""
  steps, n = 12, 4
  log, report = launch(tmp_path, ["--partition=0+1|2+3@6"],
                       program_args("dp", steps, checkpoint_every=3, log_every=1)
                       + ["--config.elastic.min_workers=3",
                          "--config.elastic.quorum_timeout_s=3"], processes=n)
  assert report["returncodes"] == [elastic_run.NO_QUORUM] * n, log[-6000:]
  for p in range(n):
    side = [0, 1] if p < 2 else [2, 3]
    assert (f"process {p}: no valid quorum for 3.0 s at step 6: 2 live processes, fewer "
            f"than min_workers = 3; live {side} is not a strict majority of the last quorum "
            f"[0, 1, 2, 3]") in log, log[-6000:]
  rows_written = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [row["step"] for row in rows_written] == list(range(1, 7))  # nobody trained on
  make, params, batch_fn = reference("dp", steps, workers=n)
  t4 = make(list(range(n)))
  r = t4.init(params)
  for t in range(6):
    r, _, _ = t4.dispatch(r, batch_fn(t))
  got, islands = restored(str(tmp_path / "checkpoints"), t4, params)
  assert islands == [0, 1, 2, 3] and int(got.step) == 6
  chex.assert_trees_all_close(got.params, r.params, rtol=1e-5, atol=1e-6)
