"""DES-LOC (`local.des_loc`, arXiv 2505.22549): local steps of the inner optimiser (AdamW);
parameters averaged every `sync_every` = K_x steps and each optimiser-state field on its own
period, `state_every` = "mu=48,nu=96" (unset: the factory's K_u = 3 K_x, K_v = 6 K_x).
`participation` (a mask spec) counts every update as one sync: row t - 1 applies to update t."""

from .. import toolkit
from jaxcomm import local


def defaults():
  return toolkit.from_factory(local.des_loc, skip=("inner", "axis_name"),
                             types={"state_every": str, "participation": str}, sync_every=16)


def _parse_periods(spec):
  """'mu=48,nu=96' -> {'mu': 48, 'nu': 96}; None stays None (the factory's default)."""
  if spec is None:
    return None
  out = {}
  for part in str(spec).split(","):
    name, _, period = part.partition("=")
    if not name.strip() or not period.strip().isdigit():
      raise ValueError(f"state_every must read like 'mu=48,nu=96' (field=period, ...), got "
                       f"{spec!r}.")
    out[name.strip()] = int(period)
  return out


def build(settings, ctx):
  return toolkit.call(local.des_loc, settings, inner=ctx.inner, axis_name=ctx.axis_name,
                     state_every=_parse_periods(settings.state_every),
                     participation=ctx.participation(settings.participation,
                                                     settings.sync_every))


def period(settings) -> int:
  """The parameters are averaged every `sync_every` = K_x steps (the optimiser
  states on their own multiples of it)."""
  return settings.sync_every


failure_semantics = toolkit.elastic_rounds  # a failed replica leaves the quorum until healed
