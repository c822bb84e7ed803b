"""The experiment layer: every config builds and trains, every default has one home (the
library factory's signature), and every bad setting fails before anything compiles with a
ValueError that names it."""

import ast
import glob
import inspect
import json
import os
import re
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from experiments.compare import settings as compare_settings
from experiments import _config_file
from experiments import build
from experiments import config
from experiments import specs
from jaxcomm import sync, train
from tests import contract

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "experiments", "configs", "*.py")))
CONFIGS = [p for p in CONFIGS if not p.endswith("__init__.py")]
W = 8

# Each method module and the library factory its settings mirror: the `plugin` column of the
# one table of transforms (tests/contract.py), written independently of the modules, so that a
# module that stops reading its factory's defaults fails.
FACTORIES = {method.plugin: contract.factory(name) for name, method in contract.METHODS.items()
             if method.plugin}


# Factory arguments the run supplies (experiments.build.Context), not settings.
CONTEXT = {"axis_name", "key", "num_workers", "param_specs", "regather", "views"}
# Factory arguments that are objects a method module builds, not settings: Muon's tree of
# dimension numbers, MuLoCo's outer optimiser (settings outer_lr, outer_momentum).
BUILT = {"muon_weight_dimension_numbers", "outer"}


def load_config(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
  """The config of a file as `--config=path[:arg]` loads it (a shipped one as a module)."""
  return _config_file.load(f"{path}:{arg}" if arg else path)


def tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`c` at a size that trains in a second: 2 steps of a one-layer LM or a small MLP."""
  c = c.copy_and_resolve_references()
  c.steps = 2
  c.data.update(batch_size=16, seq_len=16)
  c.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32, hidden=(16,))
  if "sync_every" in c.method:  # a sync inside the two steps
    c.method.sync_every = c.method.get("fragments", 1)
  if "overlap" in c.method:
    c.method.overlap = min(c.method.overlap, 1)
  if "compare" in c:  # the reference's first held-out evaluation within the two steps
    c.compare.eval_every = min(c.compare.eval_every, c.steps)
  return c


def test_every_method_ships_a_config_and_a_factory_entry():
  names = {os.path.basename(p)[:-3] for p in CONFIGS}
  assert set(build.available_methods()) == set(FACTORIES)
  assert set(FACTORIES) <= names | {"zero"}  # zero's config is zero.py
  assert "default" in names and "compare" in names


# default.py is dp.py's config (its argument picks any method) and compare.py dp's with the
# comparison's settings: dp.py trains for them.
TRAINED = [p for p in CONFIGS if os.path.basename(p) not in ("default.py", "compare.py")]


@pytest.mark.parametrize("path", TRAINED, ids=lambda p: os.path.basename(p)[:-3])
@pytest.mark.slow
def test_every_config_builds_and_trains_two_steps(path):
  """The config at tiny size trains two steps; a config whose mesh has no model axis trains
  the smallest model, the digits MLP, so that the suite compiles no LM for it (the model each
  config names is built in test_configs_build_their_own_model; the LM trains in
  tests/test_train.py and tests/test_checkpoint.py)."""
  c = tiny(load_config(path))
  if not set(build.mesh_shape(c.mesh, W)) & {"tensor", "sequence", "pipeline", "fsdp"}:
    c.model.name, c.data.name = "mlp", "digits"
  run = build.build(c)
  trainer = run.trainer()
  state, history = train.fit(trainer, trainer.init(run.params), run.batches, c.steps,
                             log_every=1, progress=False)
  assert int(state.step) == 2 and len(history) == 2
  assert all(np.isfinite(h["loss"]) for h in history)
  # What a workdir records (config.json) builds the same run again: resumable from it.
  again = ml_collections.ConfigDict(json.loads(c.to_json()))
  assert config.differences(json.loads(again.to_json()), json.loads(c.to_json())) == {}
  assert jax.tree.structure(build.build(again, abstract=True).params) == \
      jax.tree.structure(run.params)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(p)[:-3])
def test_configs_build_their_own_model(path):
  """Every config, with its own model and data, builds (abstract: nothing compiles)."""
  c = load_config(path)
  run = build.build(c, abstract=True)
  assert jax.tree.leaves(run.params) and run.batches(0)


@pytest.mark.parametrize("method", sorted(FACTORIES))
def test_method_defaults_are_the_factorys(method):
  """Every setting a factory also defaults has the factory's default, read here from the
  factory's signature."""
  settings = build.method_defaults(method)
  params = inspect.signature(FACTORIES[method]).parameters
  defaulted = [k for k, p in params.items() if p.default is not inspect.Parameter.empty]
  # Every default is a setting, except what the run's context supplies.
  assert set(defaulted) - set(settings.keys()) <= CONTEXT | BUILT, method
  for name in set(defaulted) & set(settings.keys()):
    default = params[name].default
    if isinstance(default, (bool, int, float, str, tuple)) or default is None:
      assert settings[name] == default, (method, name, settings[name], default)
    else:  # an object default (a codec) is left to the factory: the setting is unset
      assert settings[name] is None, (method, name)


# Settings a config file sets away from the factory's default: the experiment's choice, why.
CHOSEN = {
    ("compressed", "memory"): "top-k needs error feedback to converge (Stich et al. 2018)",
    ("streaming_diloco", "fragments"): "the paper's streaming: several fragments",
    ("streaming_diloco", "overlap"): "the paper's streaming: merged after tau steps",
    ("stale", "compensation"): "the DC-ASGD config shows the compensation",
    ("choco", "consensus_step"): "gamma 0.5 is stable on a ring with bf16 gossip",
    ("zero", "memory"): "int8 gradients with error feedback",
    ("muloco", "bits"): "the paper's headline: 2-bit outer gradients with error feedback",
    ("muloco", "memory"): "the paper's headline: 2-bit outer gradients with error feedback",
    ("factored_gossip_diloco", "blocking_every"):
        "the paper's point: non-blocking gossip each round, a blocking one every other",
    ("gasloc", "momentum"): "the paper's accelerated variant (g = 0.5) is its headline",
}


def test_config_files_change_a_factory_default_only_by_choice():
  """A config file sets the settings a factory requires (H, rank, ...); one that the factory
  defaults keeps the default unless it is a recorded experiment choice (`CHOSEN`)."""
  for path in CONFIGS:
    c = load_config(path)
    factory = FACTORIES.get(c.method.name)
    for name, p in inspect.signature(factory).parameters.items():
      if name in c.method and isinstance(p.default, (bool, int, float, str)) and \
         c.method[name] != p.default:
        assert (c.method.name, name) in CHOSEN, (path, name, c.method[name], p.default)


def _method_settings_set_in(path: str) -> dict:
  """{setting: value} a config file gives its method, read from its source: the keywords of
  `base_config(...)` and `c.method.<setting> = value` (the run's tree cannot tell a setting
  left at its default from one set to the default)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  found = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "base_config":
      found.update({k.arg: ast.literal_eval(k.value) for k in node.keywords})
    if isinstance(node, ast.Assign):
      for target in node.targets:
        pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                 else [(target, node.value)])
        for t, v in pairs:
          if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute) and \
             t.value.attr == "method":
            found[t.attr] = ast.literal_eval(v)
  return found


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(p)[:-3])
def test_config_files_set_only_what_differs_from_the_methods_defaults(path):
  """A config file carries only what differs from its method module's `defaults()`: a setting
  equal to the default is a second home for it."""
  defaults = build.method_defaults(load_config(path).method.name)
  repeated = {k: v for k, v in _method_settings_set_in(path).items()
              if k in defaults and defaults[k] == v}
  assert not repeated, f"{os.path.basename(path)} repeats its method's defaults {repeated}"


# ---------------------------------------------------------------- bad settings
def _numeric_leaves(c: ml_collections.ConfigDict, prefix: str = ""):
  for key in c.keys():
    value = c[key]
    if isinstance(value, ml_collections.ConfigDict):
      yield from _numeric_leaves(value, f"{prefix}{key}.")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      yield f"{prefix}{key}", value


def _set(c, path: str, value) -> None:
  *parents, leaf = path.split(".")
  for part in parents:
    c = c[part]
  c[leaf] = value


def _sweep_cases():
  """(config path, setting, value) for every numeric setting at 0, -1 and 3 (3 divides
  neither the 8 workers nor the default widths)."""
  cases = []
  for path in CONFIGS:
    c = load_config(path)
    for setting, value in _numeric_leaves(c):
      if setting.startswith("elastic.") and path != CONFIGS[0]:
        continue  # the same settings in every config: swept once
      for bad in ((0, -1, 3) if isinstance(value, int) else (0.0, -1.0)):
        cases.append((os.path.basename(path)[:-3], setting, bad))
  return cases


@pytest.mark.slow
def test_every_numeric_setting_builds_or_names_itself():
  """Zero, negative and non-divisible values of every numeric setting of every config either
  build (nothing is allocated: abstract parameters) or raise a ValueError naming the setting;
  a negative value never builds. Nothing else escapes (ZeroDivisionError, IndivisibleError)."""
  built, refused, wrong = 0, 0, []
  for name, setting, bad in _sweep_cases():
    c = tiny(load_config(os.path.join(ROOT, "experiments", "configs", f"{name}.py")))
    _set(c, setting, type(_get(c, setting))(bad))
    try:
      if "compare" in c:
        compare_settings.check(c)
      build.build(c, abstract=True)
    except ValueError as e:
      refused += 1
      if setting.split(".")[-1] not in str(e) or "\n" in str(e):
        wrong.append((name, setting, bad, str(e)))
    else:
      built += 1
      if bad < 0:
        wrong.append((name, setting, bad, "built"))
  assert not wrong, "\n".join(map(str, wrong))
  assert built and refused


def _get(c, path: str):
  for part in path.split("."):
    c = c[part]
  return c


@pytest.mark.parametrize("setting,value,words", [
    ("data.batch_size", 3, "batch_size (3) must be divisible by the 8 workers"),
    ("optimizer.lr", -1.0, "config.optimizer.lr must be a finite number in (0, inf), got -1.0"),
    ("mesh", "data=3", "multiplies to 3"),
    ("mesh", "data=2,sequence=2,pipeline=2", "sequence and pipeline"),
    ("model.name", "resnet", "model.name must be one of 'lm', 'mlp'"),
    ("data.split", "dev", "config.data.split must be one of 'all', 'train', 'test'; got 'dev'"),
    ("optimizer.name", "lion", "config.optimizer.name must be one of 'adamw',"),
])
def test_shared_settings_fail_early_naming_the_setting(setting, value, words):
  c = config.base_config("dp")
  _set(c, setting, value)
  with pytest.raises(ValueError, match=re.escape(words)):
    build.build(c, abstract=True)


@pytest.mark.parametrize("method,settings,words", [
    ("diloco", {"sync_every": 0}, "config.method .diloco.: sync_every"),
    ("diloco", {"codec": "zip"}, "codec must be one of .*; got 'zip'"),
    ("diloco", {"outer_lr": -0.7}, "outer_lr"),
    ("diloco", {"participation": "sometimes"}, "random:RATE; got .sometimes."),
    ("compressed", {"codec": "top_k:fractoin=0.1"}, "unexpected keyword argument 'fractoin'"),
    ("compressed", {"memory": "ef14"}, "memory"),
    ("acco", {"micro_batches": 0}, "micro_batches"),
    ("stale", {"delay": -1}, "delay"),
    ("streaming_diloco", {"compensation": "dc", "dc_lambda": -1.0}, "dc_lambda"),
    ("hierarchical", {}, "slow_axis / fast_axis"),
    ("dpsgd", {"graph": "hypercube"}, "graph must be one of .ring."),
    ("choco", {"graph": "one_peer_exponential"}, "time-varying"),
    ("choco", {"codec": "zip"}, "codec"),
    ("zero", {"stage": 3}, "fsdp axis"),
])
def test_method_settings_fail_early_naming_the_setting(method, settings, words):
  c = config.base_config(method, **settings)
  with pytest.raises(ValueError, match=words):
    build.build(c, abstract=True)


def test_unknown_methods_and_plugin_files_are_named(tmp_path):
  with pytest.raises(ValueError, match="must be one of 'acco'"):
    config.base_config("nope")
  with pytest.raises(ValueError, match="no such file"):
    config.base_config(str(tmp_path / "missing.py"))
  (tmp_path / "empty_method.py").write_text("x = 1\n")
  with pytest.raises(ValueError, match="must define defaults"):
    config.base_config(str(tmp_path / "empty_method.py"))


def test_settings_reach_the_transforms():
  params = {"w": np.zeros((64, 64), np.float32)}
  run = lambda c: build.make_optimizer(c, build.local_context(c))
  state = run(config.base_config("powersgd", rank=3, memory=None)).init(params)
  assert isinstance(state[0], sync.PowerSGDState)
  assert state[0].q[0].shape == (1, 64, 3) and state[0].error is None
  for compensation in ("dc", None):
    tx = run(config.base_config("streaming_diloco", compensation=compensation, sync_every=2,
                                codec="none"))
    assert (jax.eval_shape(tx.init, params).sent_params is None) == (compensation is None)


def test_participation_specs():
  mask = specs.participation_mask("drop:2,5@1", W, 3)
  assert mask.sum(1).tolist() == [W, W - 2, W] and not mask[1, [2, 5]].any()
  rand = specs.participation_mask("random:0.5", W, 50, seed=1)
  assert rand.any(1).all() and 0.3 < rand.mean() < 0.7
  for bad in ("drop:9@0", "drop:x", "random:1.5", "sometimes"):
    with pytest.raises(ValueError, match="participation"):
      specs.participation_mask(bad, W, 3)


def test_every_codec_name_parses():
  """One vocabulary: the codec factories of jaxcomm.codecs, by name, with their arguments."""
  for name in specs.codec_names():
    try:
      codec = specs.parse_codec(name)
    except ValueError as e:  # a factory that needs arguments says so, naming the spec
      assert str(e).startswith(f"codec {name!r}: "), (name, str(e))
    else:
      assert codec.name.startswith(name.split("_")[0]) or codec.name, name
  assert specs.parse_codec("uniform:bits=8,block=256").payload_bytes(256) == 256 + 4
  assert specs.parse_codec("none") is None and specs.parse_codec("auto") == "auto"


@pytest.mark.slow
def test_the_command_line_error_is_one_line(tmp_path):
  """A user's mistake ends train.py with one line naming the setting, no traceback."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train",
       f"--config={ROOT}/experiments/configs/diloco.py", "--config.method.sync_every=0",
       f"--workdir={tmp_path}"], capture_output=True, text=True, cwd=ROOT, env=env,
      timeout=120, check=False)
  assert result.returncode == 1
  lines = [l for l in result.stderr.splitlines() if l.strip() and not l.startswith(("I1", "W1"))]
  assert lines == ["error: config.method (diloco): sync_every must be an integer in "
                   "[1, 1073741824], got 0."], result.stderr[-2000:]
  assert not os.path.exists(tmp_path / "config.json")  # nothing written either
  typo = subprocess.run([sys.executable, "-m", "experiments.train", "--config.stepz=3"],
                        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
                        check=False)
  assert typo.returncode == 1
  assert typo.stderr.strip().splitlines()[-1] == ("error: --config.stepz=3: no such setting "
                                                  "'stepz'. Did you mean \"steps\" instead "
                                                  "of \"stepz\"?")


MY_MODEL = '''"""A linear classifier: a model of one's own is one file."""
import flax.linen as nn
import jax.numpy as jnp
import ml_collections
import optax
from experiments.models import Task

def defaults():
  return ml_collections.ConfigDict(dict(scale=0.0))  # logits x 0: the loss is ln 10 exactly

def build(settings, ctx):
  model = nn.Dense(10)
  params = ctx.init(model.init)(ctx.key, jnp.zeros((1, 64)))
  def loss_fn(params, batch):
    logits = settings.scale * model.apply(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return Task(model=model, loss_fn=loss_fn, has_aux=False, params=params, batches=ctx.batches)
'''


@pytest.mark.slow
def test_a_model_of_your_own_is_one_file(tmp_path):
  """train.py trains a model file named on the command line (`--config.model.name=x.py`) with
  its own settings' defaults: a loss that is ln 10 exactly at every step."""
  path = tmp_path / "mymodel.py"
  path.write_text(MY_MODEL)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", f"--config={ROOT}/experiments/configs/dp.py",
       f"--config.model.name={path}", "--config.data.name=digits", "--config.steps=2",
       "--config.log_every=1", "--config.checkpoint_every=0", "--config.data.batch_size=16",
       f"--workdir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=ROOT, env=env,
      timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-2000:]
  with open(tmp_path / "run" / "metrics.jsonl", encoding="utf-8") as f:
    losses = [json.loads(line)["loss"] for line in f if line.strip()]
  np.testing.assert_allclose(losses, [np.log(10)] * 2, rtol=1e-6)
  with open(tmp_path / "run" / "summary.json", encoding="utf-8") as f:
    summary = json.load(f)
  assert summary["model"] == str(path) and summary["steps"] == 2


@pytest.mark.slow
def test_nnx_models_and_a_folder_of_text_train_from_the_config(tmp_path):
  """config.model.name nnx_mlp (dropout, BatchNorm) and nnx_lm on a folder of text files
  through the grain pipeline: built by build(), trained two steps, data read from the
  folder only."""
  (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
  (tmp_path / "b.txt").write_text("pack my box with five dozen liquor jugs\n" * 40)
  for name, dataset, extra in (("nnx_mlp", "digits", {"dropout": 0.1, "batch_norm": True}),
                               ("nnx_lm", f"folder:{tmp_path}", {"dropout": 0.1})):
    c = tiny(config.base_config("diloco", sync_every=1))
    c.model.name, c.data.name, c.data.pipeline = name, dataset, "grain"
    c.model.update(**extra)
    run = build.build(c)
    trainer = run.trainer()
    state, history = train.fit(trainer, trainer.init(run.params), run.batches, 2,
                               log_every=1, progress=False)
    assert int(state.step) == 2 and all(np.isfinite(h["loss"]) for h in history)
    assert state.model_state is not None  # RNG streams (and BatchNorm statistics)
  tokens = run.batches(0)["tokens"]
  text = set((tmp_path / "a.txt").read_bytes() + (tmp_path / "b.txt").read_bytes())
  assert set(np.unique(tokens).tolist()) <= text
  c.data.pipeline = "numpy"
  with pytest.raises(ValueError, match="config.data.pipeline = 'grain'"):
    build.build(c, abstract=True)
