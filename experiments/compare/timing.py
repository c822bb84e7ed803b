"""One method's step time at a scenario's scale, for programs that score methods on the
comparison's clock without training them (a failure model's goodput, say)."""

from __future__ import annotations

from jaxcomm import plan

from .. import specs
from . import plans, scale
from . import settings as settings_


def step_time(entry: dict, config, link: str) -> plan.Prediction:
  """One method's seconds per step at the scenario of `config` on `link` (a link between the
  sites: a preset or `name:gbit=G,latency_ms=L[,per=site|device]`): compute, communication,
  exposed communication and the step, means over config.compare.max_steps steps, as the
  comparison's clock at scale charges them. Nothing trains; the step is planned (in a
  subprocess) unless the plan cache has it.

  Args:
    entry: a METHODS-style entry, e.g. {"method": "diloco", "sync_every": 10}.
    config: the comparison's config (config.compare.scenario, the model's settings).
    link: the link between sites.

  Raises:
    ValueError: the method cannot be planned at this scale (the reason), or a bad setting.
  """
  sc = scale.scenario(config)
  c = scale.plan_config(settings_.method_config(config, entry), sc)
  found = plans.Plans({"method": c}, sc.cache, sc.devices).get("method")
  if isinstance(found, str):
    raise ValueError(f"{entry}: not planned at {sc.mesh} ({found}).")
  overlaps = {("m", 0): scale.overlaps_of(c)}
  between = specs.parse_link(link, "link")
  clock_ = scale.ScaleClock({("m", 0): found}, overlaps, sc, {between.name: between},
                            scale.buckets(c))
  return clock_.prediction(("m", 0), between.name)
