"""Spec strings: one-line values of a setting or a flag that name a richer object.

* codecs (`parse_codec`, read by `jaxcomm.codecs.parse`): a factory name of `jaxcomm.codecs`,
  a module path or a `.py` file, and its arguments, `top_k:fraction=0.01`;
* links (`parse_link`): a preset of `jaxcomm.comm.PRESETS` or `name:gbit=G,latency_ms=L`;
* participation masks (`participation_mask`): `drop:W@K` or `random:RATE`;
* elastic quorum rules (`min_workers`): `N` or `N@T,...`.

Each parser raises a one-line ValueError naming the setting (`setting`) and what is allowed.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from jaxcomm import _validate, codecs, comm


def parse_codec(spec: str | None, setting: str = "codec") -> Any:
  """A codec from its spec (`jaxcomm.codecs.parse`): `name` or `name:arg,key=value,...` with
  `name` a factory of `jaxcomm.codecs`, a module path or a `.py` file; `none` (or empty) is
  None and `auto` stays "auto" (the method's default).

  >>> parse_codec("top_k:fraction=0.01").name
  'top_k(0.01, chunk=None)'
  >>> parse_codec("cast:bfloat16").name
  'cast(bfloat16)'
  """
  return "auto" if spec == "auto" else codecs.parse(spec, setting)


def codec_names() -> list[str]:
  """The codec factories of `jaxcomm.codecs`: its public functions that return a Codec."""
  return codecs.names()



LINK_KEYS = ("gbit", "latency_ms", "per")  # per is optional: "site" unless given


def parse_link(spec: str, setting: str = "link") -> Any:
  """A network link (`jaxcomm.comm.Link`) from its spec: a preset name of
  `jaxcomm.comm.PRESETS` (`wan`, `internet`, ...), or a link of your own,
  `name:gbit=G,latency_ms=L[,per=site|device]` (G Gbit/s per direction, L ms per message;
  G is a site's, shared by its devices that send at once, unless `per=device`: see
  `jaxcomm.comm.Link`).

  >>> parse_link("wan").latency
  0.03
  >>> link = parse_link("office:gbit=0.5,latency_ms=40")
  >>> link.name, link.bandwidth, link.latency, link.per
  ('office', 62500000.0, 0.04, 'site')
  >>> parse_link("rack:gbit=200,latency_ms=0.01,per=device").per
  'device'
  """
  form = "name:gbit=G,latency_ms=L[,per=site|device]"
  text = spec.strip() if isinstance(spec, str) else ""
  name, colon, rest = text.partition(":")
  name = name.strip()
  if not colon:
    if name in comm.PRESETS:
      return comm.PRESETS[name]
    raise ValueError(f"{setting} {spec!r} is not a preset; allowed: "
                     f"{', '.join(comm.PRESETS)}, or a link of your own as {form}.")
  if not name or not all(ch.isalnum() or ch in "_-." for ch in name):
    raise ValueError(f"{setting} {spec!r}: the name before ':' must be letters, digits, "
                     f"'_', '-' or '.', got {name!r} (form {form}).")
  if name in comm.PRESETS:
    raise ValueError(f"{setting} {spec!r}: the name {name!r} is a preset's; give your link "
                     "another name.")
  values = {}
  for part in (p.strip() for p in rest.split(",")):
    key, eq, value = part.partition("=")
    key = key.strip()
    if not eq:
      raise ValueError(f"{setting} {spec!r}: part {part!r} must be key=value (form {form}).")
    if key not in LINK_KEYS:
      raise ValueError(f"{setting} {spec!r}: unknown key {key!r}; allowed: "
                       f"{', '.join(LINK_KEYS)}.")
    if key in values:
      raise ValueError(f"{setting} {spec!r}: {key} is given twice.")
    if key == "per":
      values[key] = _validate.one_of(f"{setting} {spec!r}: per", value.strip(), comm.PER)
      continue
    try:
      values[key] = float(value)
    except ValueError:
      raise ValueError(f"{setting} {spec!r}: {key} must be a number, got {value.strip()!r}."
                       ) from None
  missing = [k for k in LINK_KEYS[:2] if k not in values]
  if missing:
    raise ValueError(f"{setting} {spec!r}: missing {', '.join(missing)} (form {form}).")
  _validate.number(f"{setting} {spec!r}: gbit", values["gbit"], low=0, low_open=True)
  _validate.number(f"{setting} {spec!r}: latency_ms", values["latency_ms"], low=0)
  return comm.Link.gbit(values["gbit"], values["latency_ms"] / 1e3, name=name,
                        per=values.get("per", "site"),
                        source=f"given on the command line: {text}")


def participation_mask(spec: str | None, num_workers: int, num_syncs: int, seed: int = 0,
                       setting: str = "method.participation"):
  """A bool[num_syncs, W] mask from its spec, or None (every worker takes part).

  `drop:2,5@3,4` drops workers 2 and 5 at syncs 3 and 4 (`drop:2` at every sync;
  `drop:0@3;1@6` worker 0 at sync 3 and worker 1 at sync 6);
  `random:0.25` drops each worker with probability 0.25 at each sync (seeded; at least one
  worker stays live).

  >>> participation_mask("drop:1@0", 3, 2).astype(int).tolist()
  [[1, 0, 1], [1, 1, 1]]
  """
  if not spec:
    return None
  kind, _, arg = spec.partition(":")
  mask = np.ones((max(num_syncs, 1), num_workers), bool)
  if kind == "drop":
    for group in arg.split(";"):
      workers, _, syncs = group.partition("@")
      try:
        workers = [int(w) for w in workers.split(",")]
        syncs = [int(k) for k in syncs.split(",")] if syncs else list(range(len(mask)))
      except ValueError:
        raise ValueError(f"{setting} {spec!r}: expected drop:W1,W2@K1,K2.") from None
      if not all(0 <= w < num_workers for w in workers):
        raise ValueError(f"{setting} {spec!r}: workers must be in [0, {num_workers}).")
      for k in syncs:
        if 0 <= k < len(mask):
          mask[k, workers] = False
    return mask
  if kind == "random":
    try:
      rate = float(arg)
    except ValueError:
      rate = -1.0
    if not 0 <= rate < 1:
      raise ValueError(f"{setting} {spec!r}: the drop rate must be a number in [0, 1).")
    mask = np.random.default_rng(seed).random(mask.shape) >= rate
    mask[~mask.any(axis=1), 0] = True
    return mask
  raise ValueError(f"{setting} must be drop:W1,W2@K1,K2 or random:RATE; got {spec!r}.")


def min_workers(spec: str) -> Callable[[int], int]:
  """`step -> processes a round needs` from "N" or "N@T,...": N from step T on (until
  the next rule's step).

  >>> f = min_workers("2,3@40,1@50")
  >>> f(39), f(40), f(50)
  (2, 3, 1)
  """
  rules = []
  for rule in (r.strip() for r in str(spec).split(",") if r.strip()):
    n, _, t = rule.partition("@")
    if not (n.isdigit() and int(n) >= 1 and (not t or t.isdigit())):
      raise ValueError(f"config.elastic.min_workers must be 'N' or 'N@T,...' (N >= 1 "
                       f"processes from step T), got {spec!r}.")
    rules.append((int(t or 0), int(n)))
  rules.sort()
  return lambda step: ([n for t, n in rules if step >= t] or [1])[-1]
