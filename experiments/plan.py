r"""Plans communication methods at real model sizes, compiled but never allocated.

  python -m experiments.plan --model=llama_1b --mesh=data=64 \
      --links=internet,wan,ethernet_100g,infiniband
  python -m experiments.plan --model=gpt2_124m --mesh=data=8 --methods=dp,powersgd_r4,zero3
  python -m experiments.plan --model=llama_7b --mesh=replica=8,fsdp=8 --device=tpu_v5p
  python -m experiments.plan --model=llama_1b --mesh=replica=2,fsdp=4 --remat=none,block \
      --link=mydc:gbit=10,latency_ms=30 --link=office:gbit=1,latency_ms=40
  python -m experiments.plan --config=experiments/configs/default.py:/path/my_method.py \
      --methods=dp,config    # a method of your own, with its config's settings

For each method the training step of the model preset (`MODELS`) is built on the mesh by
experiments/build.py with `abstract=True` (parameters and batches are ShapeDtypeStructs) and
compiled for XLA:CPU on as many emulated CPU devices as the mesh has: the program planned is
the one that would run, nothing is derived from a smaller mesh. `jaxcomm.plan` reads it:

* wire bytes per device per step and per mesh axis, from the compiled program's collectives
  (`comm.parse_hlo`), with conditional syncs charged as often as the method's own byte
  counters say they run (its state machine run at the real size without the model);
* the train state's bytes per device (parameters, optimiser and method state) and the peak
  of the step, from XLA's memory analysis, against the device's memory: a step whose peak
  exceeds it is flagged (`fits_hbm: false` and `hbm_over_bytes` in plan.json, "no: +X" in
  the table). The peak is XLA:CPU's, an upper estimate where GPU and TPU compilers fuse
  more; `--remat` plans the LM presets with each block rematerialised (`jax.checkpoint`:
  `none`, `block`, `dots_saveable`), one row per method and policy, and says what fits;
* compute per step: the compiled step's FLOPs (XLA's cost analysis) over the device's peak
  times `--mfu` (or `--compute_seconds` measured by you);
* per link: the step time `jaxcomm.sim` predicts (communication costed with `comm.cost`, the
  method's overlap from its module's `overlap_steps`), and the crossover: the bandwidth below
  which the method is faster than exact data parallelism on a link of that latency.

The outermost mesh axis crosses the link (`--links`, presets, and `--link`, repeatable, a
link of your own: `name:gbit=G,latency_ms=L[,per=site|device]`) between sites, one per
index along it; the others are inside a site (`--inner_link`), costed as
`jaxcomm.comm.Sites`: a per-site link (wan, internet) is shared by the devices of a site
that send at once, a per-device one (infiniband, ethernet_*) is not. Methods: `METHODS`
labels (the form of experiments.compare's entries, `{"method": name, **settings,
"optimizer": {...}, "mesh": spec}`), method names of experiments/methods/, dotted module
paths or .py files of your own (their default settings), or `config`: the method of
--config with its settings. Written into --workdir: `plan.json` (every number, the table)
and `step_time_vs_bandwidth.png` (log-log, one panel per link).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import resource
import sys
import time

import jax
import numpy as np
from absl import flags

from . import _cli, build, compare, specs
from . import config as _config
from .models import lm as lm_model
from jaxcomm import _validate, comm, parallel, plan


# A model preset: config.model settings, the dataset, sequence length and batch per device,
# one file of experiments/configs/models/ each. Our LM is pre-norm with learned positions, a
# 2-matrix GELU MLP and an untied output head; the presets follow each model's published
# dimensions, and `note` says where they differ.
MODELS: dict[str, dict] = {name: compare.scale.model_preset(name)
                           for name in compare.scale.preset_names()}

# label -> a method entry: the methods of `make run` (experiments/compare/), and two
# settings meant for many workers, where a codec's payloads should not be all-gathered:
# Streaming DiLoCo's fp4 and DiLoCo every 100 steps with int8 outer gradients, both by the
# two-phase sum. "zero3" is added on meshes with a data axis: the same exact mean, with that
# axis renamed fsdp (parameters, gradients and optimiser state sharded over it, gathered
# layer by layer).
METHODS: dict[str, dict] = {
    **compare.METHODS,
    "streaming_h10_2phase": {**compare.METHODS["streaming_h10"], "collective": "two_phase"},
    "diloco_h100_int8_2phase": {"method": "diloco", "sync_every": 100,
                                "codec": "uniform:bits=8,block=256", "collective": "two_phase"},
    # Muon (data parallel over the replicas) with its matrices orthogonalised whole inside a
    # replica: by an owner (all-to-all in and out) or by Gram all-reduces per iteration.
    "muon_owner": {"method": "muon", "strategy": "owner"},
    "muon_gram": {"method": "muon", "strategy": "gram"},
    # MuLoCo (arXiv 2505.23725): Muon inner steps, H = 30, 2-bit outer gradients with EF.
    "muloco_h30_2bit_ef": {"method": "muloco", "sync_every": 30, "bits": 2, "memory": "ef"},
    # Dion (arXiv 2504.05295): the replicas all-reduce each matrix's factors P and R (rank
    # 1/4 and 1/16 of its shorter side) instead of its gradient.
    "dion_f4": {"method": "dion", "rank_fraction": 0.25},
    "dion_f16": {"method": "dion", "rank_fraction": 0.0625},
    # Dion2 (arXiv 2512.16928) at a quarter of the slices; MuonBP (arXiv 2510.16981) with a
    # full orthogonalisation every 5 steps: fewer bytes inside a replica than Muon's.
    "dion2_a25": {"method": "dion2", "fraction": 0.25},
    "muonbp_p5": {"method": "muonbp", "period": 5},
}
CONFIG_LABEL = "config"  # --methods entry: the method of --config
REFERENCE = "dp"

# The flags exist only when this module runs as a program: importing it (tests do)
# registers nothing that could clash with another program's flags.
if __name__ == "__main__":
  _CONFIG = _config.define_config_flag(
      os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py"),
      "Settings every method shares (optimizer, seed; model and data unless --model) and the "
      "method planned as `config` in --methods; default.py:NAME for any method or plugin. "
      "--config.method.<setting> sets that setting in every method planned that has it.",
      several=True)
  _MODEL = flags.DEFINE_string("model", None, f"Model preset: {', '.join(MODELS)} (default: "
                               "--config's model).")
  _MESH = flags.DEFINE_string("mesh", "data=8", "The mesh, e.g. data=64 or replica=8,fsdp=8; "
                              "emulated with as many CPU devices.")
  _METHODS = flags.DEFINE_list("methods", None, "Methods (default: every METHODS label): "
                               "labels, method names, module paths, .py files or `config`.")
  _LINKS = flags.DEFINE_list("links", ["internet", "wan", "ethernet_100g", "infiniband"],
                             "Link presets (jaxcomm.comm.PRESETS) the outermost axis crosses, "
                             "between sites (one per index of that axis): wan and internet "
                             "are per site, shared by the site's devices; infiniband and "
                             "ethernet_* per device.")
  _LINK = flags.DEFINE_multi_string("link", [], "A link of your own the outermost axis "
                                    "crosses, added to --links: "
                                    "name:gbit=G,latency_ms=L[,per=site|device] (G per site "
                                    "unless per=device; repeatable).")
  _REMAT = flags.DEFINE_list("remat", None, "What each block of an LM preset keeps for the "
                             "backward pass (jax.checkpoint): none, block, dots_saveable; "
                             "several: each method planned with each (default: "
                             "--config.model.remat, none).")
  _INNER_LINK = flags.DEFINE_string("inner_link", "nvlink", "Link preset of the other axes "
                                    "(inside a site, per device).")
  _DEVICE = flags.DEFINE_string("device", "h100", "Accelerator preset (jaxcomm.plan.DEVICES).")
  _MFU = flags.DEFINE_float("mfu", 0.4, "Model FLOPs utilisation assumed (PaLM 540B reached "
                            "0.462 on TPU v4, arXiv 2204.02311 Table 3).")
  _COMPUTE = flags.DEFINE_float("compute_seconds", None, "A measured compute time per step, "
                                "used for every method instead of FLOPs / (peak x mfu).")
  _BATCH = flags.DEFINE_integer("batch_per_device", None, "Sequences (images) per device per "
                                "step (default: the preset's).")
  _SEQ_LEN = flags.DEFINE_integer("seq_len", None, "Tokens per sequence (default: the "
                                  "preset's).")
  _STEPS = flags.DEFINE_integer("steps", 1000, "Steps whose counted bytes are simulated.")
  _WORKDIR = flags.DEFINE_string("workdir", "runs/plan", "Where plan.json and the figure go.")

_BANDWIDTHS = (1e6, 1e12)  # bytes/s: the sweep of the figure and of the crossover
JOBS = 2  # methods compiled at once
CROSSOVER_NOTE = (
    "\n\nbeats DP below: the outer link bandwidth below which the method's predicted step is "
    "shorter than DP's, on a link of that latency; swept over 8 Mbit/s - 8 Tbit/s ('always': "
    "over all of it; 'never': not even at 8 Mbit/s).")


# ---------------------------------------------------------------- settings, checked first
def _positive_int(value, name: str, allow_none: bool = True):
  if value is None and allow_none:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
  return value


def mesh_devices(mesh: str, available: int) -> dict:
  """{axis: size} of `mesh`; its devices must divide the `available` ones."""
  try:
    shape = parallel.parse_mesh(mesh)
  except ValueError as e:
    raise ValueError(f"mesh {mesh!r}: {e}") from None
  n = math.prod(shape.values())
  if n < 1 or available % n:
    raise ValueError(f"mesh {mesh!r} has {n} devices, which does not divide the {available} "
                     "devices there are (the command line emulates as many as the mesh has).")
  return shape


def model_config(base, model: str | None, mesh: str, batch_per_device=None, seq_len=None):
  """`base` with the model preset, the mesh and a global batch of `batch_per_device` per
  worker (the mesh's batch axes)."""
  if model is not None:
    _validate.one_of("model", model, tuple(MODELS))
  _positive_int(batch_per_device, "batch_per_device")
  _positive_int(seq_len, "seq_len")
  workers = math.prod(n for a, n in parallel.parse_mesh(mesh).items()
                      if a not in build.MODEL_AXES)
  c = base.copy_and_resolve_references()
  with c.unlocked():
    c.mesh = mesh
    c.checkpoint_every = 0
    if model is not None:
      preset = MODELS[model]
      c.model.update(preset["model"])
      c.data.name = preset["data"]
      c.data.seq_len = preset["seq_len"]
      c.data.batch_size = preset["batch_per_device"] * workers
    if seq_len is not None:
      c.data.seq_len = seq_len
    if batch_per_device is not None:
      c.data.batch_size = batch_per_device * workers
  return c


def catalog(mesh_shape: dict, model_name: str) -> dict:
  """The labelled methods one can plan on this mesh: METHODS, and zero3 on a data axis."""
  out = dict(METHODS)
  if "data" in mesh_shape and "fsdp" not in mesh_shape and model_name == "lm":
    out["zero3"] = {"method": "dp", "mesh": ",".join(
        f"{'fsdp' if a == 'data' else a}={n}" for a, n in mesh_shape.items())}
  return out


def resolve_methods(names, labelled: dict, config) -> dict:
  """{label: entry}, DP (the reference of the crossover) first (`config.resolve_methods`);
  CONFIG_LABEL names the method of `config` with its settings, under its own label."""
  own = build.method_defaults(config.method.name).keys()  # not the other methods' settings
  mine = {"method": config.method.name, **{k: config.method[k] for k in own}}
  chosen = _config.resolve_methods(names, labelled, first=REFERENCE, setting="methods",
                                   known={**labelled, CONFIG_LABEL: mine})
  label = _config.method_label(config.method.name)
  return {(label if k == CONFIG_LABEL else k): v for k, v in chosen.items()}


def _links(names, inner: str, own=()) -> tuple[dict, object]:
  """({name: Link} of the presets `names` and the links of your own `own` (spec strings,
  `specs.parse_link`), the inner link)."""
  names, own = list(names or ()), list(own or ())
  if not names and not own:
    raise ValueError("links must name at least one link preset (or give --link).")
  for name in names + [inner]:
    if name not in comm.PRESETS:
      what = "inner_link" if name == inner else "links"
      hint = (" A link of your own goes in --link=name:gbit=G,latency_ms=L (--links is split "
              "at commas)." if ":" in name or "=" in name else "")
      raise ValueError(f"{what}: {name!r} is not a link preset; allowed: "
                       f"{', '.join(comm.PRESETS)}.{hint}")
  out = {n: comm.PRESETS[n] for n in names}
  for spec in own:
    link = specs.parse_link(spec, "link")
    if link.name in out:
      raise ValueError(f"link {spec!r}: the name {link.name!r} is given twice.")
    out[link.name] = link
  return out, comm.PRESETS[inner]


def remat_policies(remat, config) -> tuple:
  """The rematerialisation policies to plan with (`remat`, default: config.model.remat):
  names of experiments/models/lm.py's REMAT, for the LM only."""
  policies = (config.model.get("remat", "none"),) if remat is None else tuple(remat)
  allowed = lm_model.REMAT
  if not policies or any(p not in allowed for p in policies) or \
     len(set(policies)) != len(policies):
    raise ValueError(f"remat must be distinct names out of {', '.join(allowed)}, got "
                     f"{', '.join(map(repr, policies)) or 'none'}.")
  if config.model.name != "lm" and policies != ("none",):
    raise ValueError(f"remat applies to the LM (model 'lm'), not to model "
                     f"{config.model.name!r}; leave it 'none'.")
  return policies


def with_remat(config, policy: str):
  """`config` with the LM's blocks rematerialised by `policy` (a copy)."""
  c = config.copy_and_resolve_references()
  if "remat" in c.model:
    with c.unlocked():
      c.model.remat = policy
  return c


def memory_note(records: list, rows: dict, dev) -> str:
  """What fits the device's memory, per method across the planned remat policies."""
  over = [r for r in records if not r["fits_hbm"]]
  where = (f"{dev.name or 'the device'}'s {_bytes(dev.hbm_bytes)} per device (XLA:CPU's "
           "peak, an upper estimate where GPU and TPU compilers fuse more)")
  if not over:
    return f"\n\nmemory: every planned step fits {where}."
  policies = list(dict.fromkeys(p for _, p in rows.values()))
  lines = [f"\n\nmemory: steps over {where}:"]
  for label in dict.fromkeys(k for k, _ in rows.values()):
    mine = [r for r in records if rows[r["method"]][0] == label]
    bad = [r for r in mine if not r["fits_hbm"]]
    if not bad:
      continue
    good = [r["remat"] for r in mine if r["fits_hbm"]]
    fit = f"fits with remat {', '.join(good)}" if good else (
        "fits with none of the planned policies" if len(policies) > 1 else
        "try --remat=block,dots_saveable (LM presets), a larger fsdp axis or a smaller batch")
    lines.append(f"\n* {label}: " + ", ".join(
        f"+{_bytes(r['hbm_over_bytes'])} with remat {r['remat']}" for r in bad) + f"; {fit}")
  return "".join(lines)


def topology(mesh_shape: dict, link, inner):
  """The outermost axis crosses `link` between sites (one per index along it), every other
  axis is inside a site on `inner`: `comm.Sites`, so a per-site link (wan, internet) is
  shared by a site's devices and a per-device one (infiniband) is not."""
  axes = list(mesh_shape)
  per_site = math.prod(mesh_shape[a] for a in axes[1:])
  return comm.Sites(mesh_shape[axes[0]], per_site, link, inner, axis=axes[0])


# ---------------------------------------------------------------- planning
def _param_count(params) -> int:
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params) if comm.is_numeric(x)))


def _record(label, entry, c, run, step, compute, links, inner, dev, tokens) -> dict:
  """Every number of one planned method (plan.json)."""
  overlap = int(build.hooks(c.method.name).overlap_steps(c.method))
  shape = step.mesh_shape
  record = {
      "method": label, "entry": entry, "mesh": c.mesh, "algo": c.method.name,
      "remat": c.model.get("remat", "none"),
      "settings": c.method.to_dict(), "overlap_steps": overlap,
      "parameters": _param_count(run.params),
      "bytes_per_step": step.bytes_per_step(),
      "bytes_per_axis": {",".join(a) or "?": b for a, b in step.bytes_per_axis().items()},
      # Over the link: collectives whose groups span the outermost mesh axis.
      "outer_bytes_per_step": sum(b for a, b in step.bytes_per_axis().items()
                                  if next(iter(shape)) in a),
      "every_step_bytes": step.report.wire_bytes(conditional=False),
      "conditional_bytes": step.report.wire_bytes(conditional=True),
      "sync_fraction": step.sync_fraction(),
      "counted": None if step.counted is None else {
          "mean": float(step.counted.mean()), "min": float(step.counted.min()),
          "max": float(step.counted.max()), "steps": step.steps},
      "why_not_counted": step.why_not_counted,
      "collectives": len(step.report),
      "state_bytes": step.state_bytes,
      "memory": {**dataclasses.asdict(step.memory), "peak": step.memory.peak},
      "flops": step.flops, "bytes_accessed": step.bytes_accessed,
      "compute_seconds": compute,
      # XLA:CPU's bytes accessed over HBM bandwidth: the memory side of a roofline, an
      # over-estimate where GPU/TPU compilers fuse more (not part of the step time).
      "hbm_seconds": step.bytes_accessed / dev.hbm_bandwidth,
      # The step's peak (XLA:CPU's: an upper estimate) against the device's memory.
      "fits_hbm": step.memory.peak <= dev.hbm_bytes,
      "hbm_bytes": dev.hbm_bytes,
      "hbm_over_bytes": max(0, step.memory.peak - dev.hbm_bytes),
      "links": {},
  }
  for name, link in links.items():
    p = plan.predict(step, topology(shape, link, inner), compute, overlap_steps=overlap)
    record["links"][name] = {**dataclasses.asdict(p), "seconds_per_token": p.step / tokens}
  return record


def _seconds_at(step, shape, link, inner, compute, overlap):
  """Step seconds as a function of the outer link's bandwidth (bytes/s, per `link.per`)."""
  return lambda b: plan.predict(step, topology(shape, comm.Link(b, link.latency, per=link.per),
                                               inner), compute,
                                overlap_steps=overlap).step


def run(config, workdir: str, *, model: str | None = None, mesh: str = "data=8",
        methods=None, links=("internet", "wan", "ethernet_100g", "infiniband"),
        inner_link: str = "nvlink", device: str = "h100", mfu: float = 0.4,
        compute_seconds: float | None = None, batch_per_device: int | None = None,
        seq_len: int | None = None, steps: int = 1000, verbose: bool = True,
        figure: bool = True, link=(), remat=None,
        method_settings: dict | None = None) -> dict:
  """Plans every method; prints the table, writes plan.json and the figure into `workdir`.

  `device` is a preset name (`jaxcomm.plan.DEVICES`) or a `plan.Device`; `link` holds links
  of your own (`name:gbit=G,latency_ms=L`), crossed like `links`; `remat` the policies an LM
  is planned with (default: the config's `model.remat`), each method once per policy, its
  row labelled `method (policy)` when there are several.

  Every argument is checked, and every method's run built (abstract), before anything
  compiles: a mistake is one ValueError naming the argument or setting. `method_settings`
  (`--config.method.<setting>`) are set in every method that has them.
  """

  started = time.perf_counter()
  shape = mesh_devices(mesh, jax.device_count())
  devices = jax.devices()[:math.prod(shape.values())]
  dev = device if isinstance(device, plan.Device) else plan.device(device)
  mfu = plan.check_mfu(mfu)
  if compute_seconds is not None and (isinstance(compute_seconds, bool) or not isinstance(
      compute_seconds, (int, float)) or not 0 <= compute_seconds < math.inf):
    raise ValueError(f"compute_seconds must be a finite number >= 0, got {compute_seconds!r}.")
  steps = _positive_int(steps, "steps", allow_none=False)
  link_of, inner = _links(links, inner_link, link)
  base = model_config(config, model, mesh, batch_per_device, seq_len)
  with base.unlocked():
    base.steps = steps  # participation masks and schedules cover the planned steps
  policies = remat_policies(remat, base)
  labels = _config.with_settings(resolve_methods(methods, catalog(shape, base.model.name),
                                                 base), method_settings)
  # One row per method and policy; each row's crossover is against DP with its policy.
  rows = {(k if len(policies) == 1 else f"{k} ({p})"): (k, p) for p in policies for k in labels}
  reference_of = {row: next(r for r, (k, p) in rows.items() if k == REFERENCE and p == policy)
                  for row, (_, policy) in rows.items()}
  entries = {row: labels[k] for row, (k, _) in rows.items()}
  configs = {row: with_remat(_config.with_method(base, entries[row]), p)
             for row, (_, p) in rows.items()}
  runs = {label: build.build(c, devices, abstract=True) for label, c in configs.items()}
  tokens = base.data.batch_size * (base.data.seq_len if base.model.name in ("lm", "nnx_lm")
                                   else 1)
  compiled = _compile_all(runs, steps, verbose)
  records, steps_of, failed = [], {}, {}
  for label, c in configs.items():
    step, seconds = compiled[label]
    if isinstance(step, str):
      if reference_of[label] == label:
        raise RuntimeError(f"the reference {label} could not be planned: {step}")
      failed[label] = step
      continue
    compute = compute_seconds if compute_seconds is not None else \
        plan.compute_seconds(step.flops, dev, mfu)
    rec = _record(label, entries[label], c, runs[label], step, compute, link_of, inner, dev,
                  tokens)
    rec["plan_seconds"] = seconds
    records.append(rec)
    steps_of[label] = (step, compute, rec["overlap_steps"])
  curves = _sweeps(steps_of, link_of, inner, records, reference_of)
  text = table(records, link_of, dev, reference_of) + CROSSOVER_NOTE + memory_note(
      records, rows, dev) + "".join(
      f"\n\n{label}: not planned ({why})" for label, why in failed.items())
  os.makedirs(workdir, exist_ok=True)
  figure_path = plot(curves, link_of, os.path.join(workdir, "step_time_vs_bandwidth.png")) \
      if figure else None
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
  head = _header(base, model, mesh, dev, mfu, compute_seconds, records, tokens, steps)
  summary = {
      "model": model, "model_note": MODELS[model]["note"] if model else "the config's model",
      "config": base.to_dict(), "mesh": mesh, "devices": len(devices),
      "emulated": "compiled on as many emulated CPU devices as the mesh has (not derived)",
      "device": dataclasses.asdict(dev), "mfu": mfu, "compute_seconds": compute_seconds,
      "links": {n: dataclasses.asdict(l) for n, l in link_of.items()},
      "inner_link": dataclasses.asdict(inner), "tokens_per_step": tokens, "steps": steps,
      "remat": list(policies),
      "methods": records, "failed": failed, "header": head, "table": text, "figure": figure_path,
      "sweep": {"bandwidths": np.asarray(curves["bandwidths"]).tolist(),
                "seconds": {k: {n: list(v) for n, v in per.items()}
                            for k, per in curves["seconds"].items()}},
      "elapsed_seconds": time.perf_counter() - started, "peak_rss_bytes": rss}
  with open(os.path.join(workdir, "plan.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1, allow_nan=False, default=str)
  if verbose:
    print(head)
    print(text)
    print(f"peak process memory {_bytes(rss)}; planned in {summary['elapsed_seconds']:.0f} s; "
          f"wrote {os.path.join(workdir, 'plan.json')}"
          + (f" and {figure_path}" if figure_path else ""))
  return summary


def _compile_all(runs: dict, steps: int, verbose: bool) -> dict:
  """{label: (StepPlan or why it failed, seconds)}, two methods compiling at a time (XLA's
  compile of one program is single-threaded)."""

  def one(label):
    t0 = time.perf_counter()
    r = runs[label]
    try:
      step = plan.compile_step(r.program(), r.params, r.batches(0), steps=steps)
    except Exception as e:
      # A library limit met at this size (the user's input is checked before): reported in
      # the table and plan.json, and the other methods are planned.
      step = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    if verbose:
      print(f"planned {label} on {r.config.mesh} in {time.perf_counter() - t0:.1f} s"
            + (f" -- failed: {step}" if isinstance(step, str) else ""), file=sys.stderr,
            flush=True)
    return step, time.perf_counter() - t0

  with concurrent.futures.ThreadPoolExecutor(max_workers=JOBS) as pool:
    return dict(zip(runs, pool.map(one, runs)))


def _sweeps(steps_of: dict, links: dict, inner, records: list, reference_of: dict) -> dict:
  """Step seconds over the bandwidth grid per method and link, and each method's crossover
  against DP with its remat policy (`reference_of`; written into `records`)."""
  grid = np.geomspace(*_BANDWIDTHS, 49)
  seconds = {label: {} for label in steps_of}
  for name, link in links.items():
    fns = {label: _seconds_at(s, s.mesh_shape, link, inner, compute, overlap)
           for label, (s, compute, overlap) in steps_of.items()}
    for rec in records:
      label = rec["method"]
      seconds[label][name] = [fns[label](b) for b in grid]
      if label != reference_of[label]:  # bytes/s, or "always" / "never" over the sweep
        b = plan.crossover(fns[label], fns[reference_of[label]], low=_BANDWIDTHS[0],
                           high=_BANDWIDTHS[1])
        rec.setdefault("crossover_bandwidth", {})[name] = \
            "never" if b is None else "always" if math.isinf(b) else b
  return {"bandwidths": grid, "seconds": seconds}


# ---------------------------------------------------------------- output
def _bytes(n: float) -> str:
  for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(n) >= size:
      return f"{n / size:.3g} {unit}"
  return f"{n:.0f} B"


def _seconds(s: float) -> str:
  if s >= 100:
    return f"{s:,.0f} s"
  if s >= 1:
    return f"{s:.3g} s"
  return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _bandwidth(b) -> str:
  """A crossover: Gbit/s, or "always" / "never" over the whole sweep."""
  if isinstance(b, str):
    return b
  gbit = b * 8 / 1e9
  return f"{gbit:,.0f} Gb/s" if gbit >= 100 else f"{gbit:.3g} Gb/s"


def _header(c, model, mesh, dev, mfu, compute_seconds, records, tokens, steps) -> str:
  params = records[0]["parameters"]
  what = f"{model} ({MODELS[model]['note']})" if model else f"the config's {c.model.name}"
  compute = (f"compute {_seconds(compute_seconds)}/step measured" if compute_seconds is not None
             else f"{dev.name} at MFU {mfu:g}: compute = compiled FLOPs / "
                  f"({dev.peak_flops / 1e12:g} TFLOP/s x {mfu:g})")
  return (f"{what}: {params:,} parameters; mesh {mesh} (emulated, compiled for XLA:CPU); "
          f"{tokens:,} "
          f"{'tokens' if c.model.name in ('lm', 'nnx_lm') else 'samples'} per step; {compute}; "
          f"conditional syncs charged as counted over {steps} steps")


def table(records: list, links: dict, dev=None, reference_of=None) -> str:
  """Markdown: bytes, memory (against `dev`'s) and compute per method; step time and
  crossover per link. `reference_of`: each row's DP row (default: the row `dp`)."""
  reference_of = reference_of or {r["method"]: REFERENCE for r in records}
  by_label = {r["method"]: r for r in records}
  head = ["method", "mesh", "bytes/device, mean per step", "by axis, mean per step",
          "DP bytes / bytes (outer axis, mean per step)",
          "state/device", "peak/device (XLA:CPU)"]
  if dev is not None:
    head.append(f"fits {dev.name or 'the device'} ({_bytes(dev.hbm_bytes)})")
  head.append("compute/step")
  head += [f"step on {n}" for n in links] + [f"beats DP below ({n})" for n in links]
  rows = []
  for r in records:
    dp = by_label[reference_of[r["method"]]]
    state = sum(r["state_bytes"][k] for k in ("params", "opt_state", "model_state"))
    outer = r["outer_bytes_per_step"]
    ratio = f"{dp['outer_bytes_per_step'] / outer:.3g}x" if outer else "nothing sent"
    fits = [] if dev is None else [
        "yes" if r["fits_hbm"] else f"no: +{_bytes(r['hbm_over_bytes'])}"]
    rows.append([r["method"], r["mesh"], _bytes(r["bytes_per_step"]),
                 ", ".join(f"{a} {_bytes(b)}" for a, b in r["bytes_per_axis"].items()) or "-",
                 ratio, _bytes(state), _bytes(r["memory"]["peak"])] + fits
                + [_seconds(r["compute_seconds"])]
                + [_seconds(r["links"][n]["step"]) for n in links]
                + ["-" if r["method"] == reference_of[r["method"]] else
                   _bandwidth(r["crossover_bandwidth"][n]) for n in links])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  return "\n".join(lines)


def plot(curves: dict, links: dict, path: str) -> str:
  """Predicted step time against the outer link's bandwidth, one panel per link latency."""
  import matplotlib  # lazy: heavy, and only plots need it
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  gbit = np.asarray(curves["bandwidths"]) * 8 / 1e9
  fig, axes = plt.subplots(1, len(links), figsize=(4.6 * len(links) + 2.0, 4.2),
                           squeeze=False, sharey=True)
  colors = matplotlib.colormaps["tab10"].colors + matplotlib.colormaps["Dark2"].colors
  for ax, (name, link) in zip(axes[0], links.items()):
    for i, (label, per) in enumerate(curves["seconds"].items()):
      ax.plot(gbit, per[name], color=colors[i % len(colors)], label=label,
              linewidth=2.0 if label == REFERENCE else 1.3,
              linestyle="-" if i < 10 else "--")
    ax.axvline(link.bandwidth * 8 / 1e9, color="black", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"outer link bandwidth (Gbit/s per {link.per}, log)")
    ax.set_title(f"{name}'s latency ({_seconds(link.latency)}); dotted: its bandwidth",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
  axes[0][0].set_ylabel("predicted seconds per step (log)")
  handles, labels = axes[0][0].get_legend_handles_labels()
  fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
  fig.tight_layout(rect=(0, 0, 1 - 1.8 / fig.get_figwidth(), 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv):
  del argv
  try:
    n = math.prod(parallel.parse_mesh(_MESH.value).values())
  except ValueError as e:
    _cli.fail(f"--mesh {_MESH.value!r}: {e}")
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", n)
  try:
    run(_CONFIG.value, _WORKDIR.value, model=_MODEL.value, mesh=_MESH.value,
        methods=_METHODS.value, links=_LINKS.value, inner_link=_INNER_LINK.value,
        device=_DEVICE.value, mfu=_MFU.value, compute_seconds=_COMPUTE.value,
        batch_per_device=_BATCH.value, seq_len=_SEQ_LEN.value, steps=_STEPS.value,
        link=_LINK.value, remat=_REMAT.value,
        method_settings=_cli.method_settings(_CONFIG.value))
  except ValueError as e:  # a user's mistake: one line, no traceback
    _cli.fail(e)


if __name__ == "__main__":
  _cli.run(main)
