"""What report.md and the terminal say about the scale (config.compare.scale="scenario"): the
scenario and its networks, where each number comes from, each method's step at scale per
link, and the verdict on the proxy's own clock beside the scenario's."""

from __future__ import annotations

import dataclasses

from ..reproduce import _reproduce as rep
from . import report
from . import scale as scale_
from . import summary as summary_


def _bytes(n: float) -> str:
  for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(n) >= size:
      return f"{n / size:.3g} {unit}"
  return f"{n:.0f} B"


def _rate(bytes_per_s: float) -> str:
  gbit = bytes_per_s * 8 / 1e9
  return f"{gbit:g} Gbit/s" if gbit >= 1 else f"{gbit * 1e3:g} Mbit/s"


def summary(clock, sc, links_: dict) -> dict:
  """What report.md and results.json say of the scale: the scenario, each link's network,
  and per method (its first setting) the plan's numbers and its step time per link."""
  out = {"scenario": sc.text(), "mesh": sc.mesh, "model": sc.name, "sites": sc.sites,
         "per_site": sc.per_site, "device": sc.device.name, "mfu": sc.mfu,
         "compute_seconds": sc.compute_seconds, "cache": sc.cache,
         "networks": {}, "methods": {}}
  for name, link in links_.items():
    share = sc.network(link).share
    out["networks"][name] = {"bandwidth": link.bandwidth, "per": link.per,
                             "latency": link.latency, "device_share": share.bandwidth,
                             "inside": sc.inside.name, "inside_bandwidth": sc.inside.bandwidth}
  for (label, k), p in clock.plans.items():
    if k:
      continue
    out["methods"][label] = {
        "flops": p.flops, "bytes_per_step": p.bytes_per_step(),
        "bytes_per_axis": {",".join(a): b for a, b in p.bytes_per_axis().items()},
        "state_bytes": p.state_bytes, "peak_bytes": p.memory.peak,
        "fits": p.memory.peak <= sc.device.hbm_bytes,
        "overlap": list(clock.overlaps[(label, k)]),
        "links": {n: dataclasses.asdict(clock.prediction((label, k), n)) for n in links_}}
  return out


def networks(scale: dict) -> str:
  """Each link between the sites in words: whose bandwidth it is and a device's share."""
  parts = []
  for name, n in scale["networks"].items():
    if n["per"] == "site":
      what = (f"{_rate(n['bandwidth'])} per site, shared by its {scale['per_site']} devices "
              f"that send at once: {_rate(n['device_share'])} each")
    else:
      what = f"{_rate(n['bandwidth'])} per device"
    parts.append(f"{name} ({what}; {report._seconds(n['latency'])} per message)")
  return "; ".join(parts)


def heading(scale: dict, config) -> str:
  """The scenario and where each number comes from (one paragraph)."""
  return (f"Scenario: {scale['scenario']}. Between the sites: {networks(scale)}. "
          f"Steps to the target come from the proxy (the LM below, trained on "
          f"{config.mesh}: one replica per site, so DiLoCo's K, PowerSGD's averaging and "
          f"every method's statistics are the scenario's); time to the target is the "
          f"scenario's clock at those steps: each method's step compiled at {scale['model']}'s "
          f"size on {scale['mesh']} (plans of 1 and 2 blocks extrapolated), compute from its "
          f"FLOPs, communication from its collectives on the two-level network, less what "
          f"its schedule overlaps.")


def step_rows(scale: dict, links: list) -> tuple[list, list]:
  """(headers, rows): per method its plan at scale and its step time on each link."""
  headers = ["method", "FLOPs/device/step", "peak/device (XLA:CPU)",
             "bytes/device/step across sites", "bytes/device/step inside"] + [
                 f"step on {n} (exposed comm)" for n in links]
  rows = []
  for label, m in scale["methods"].items():
    across = sum(b for a, b in m["bytes_per_axis"].items() if "replica" in a.split(","))
    inside = sum(b for a, b in m["bytes_per_axis"].items() if "replica" not in a.split(","))
    peak = _bytes(m["peak_bytes"]) + ("" if m["fits"] else f" (over {scale['device']}'s)")
    rows.append([label, f"{m['flops']:.3g}", peak, _bytes(across), _bytes(inside)]
                + [f"{report._seconds(m['links'][n]['step'])} "
                   f"({report._seconds(m['links'][n]['exposed'])})" for n in links])
  return headers, rows


def proxy_lines(proxy: dict, links: list, reference: str, target: float) -> list:
  """The verdict per link on the proxy's own clock (the same trials)."""
  return [report.verdict(proxy["summary"], n, reference, target, proxy["budgets"][n])
          for n in links]


def text(scale: dict, proxy: dict, config, links: list, target: float) -> dict:
  """{"top": the terminal's scenario lines, "bottom": the proxy-clock verdict lines}."""
  lines = proxy_lines(proxy, links, config.compare.reference, target)
  return {"top": heading(scale, config),
          "bottom": ("On the proxy's own clock (its compiled step on its mesh, the same "
                     f"links; compute from its FLOPs on the same {scale['device']}):\n"
                     + "\n".join(f"  {v}" for v in lines)),
          "proxy_verdicts": lines}


def sections(scale: dict, proxy: dict, config, links: list, target: float,
             not_planned: dict) -> dict:
  """report.md's sections about the scale: {"top", "proxy", "steps"}."""
  lines = proxy_lines(proxy, links, config.compare.reference, target)
  headers, rows = step_rows(scale, links)
  missing = "".join(f"\n\n{label}: not planned at {scale['mesh']} ({why}); not trained."
                    for label, why in not_planned.items())
  return {
      "top": "## The scenario\n\n" + heading(scale, config),
      "proxy": ("## The same trials on the proxy's own clock\n\nThe proxy's compiled step "
                f"at its size on its mesh ({config.mesh}: the same links between and inside "
                f"its sites), compute from its FLOPs on the same {scale['device']} at MFU "
                f"{scale['mfu']:g}: the regime of a small model, where a step's messages, "
                "not its bytes, set the time (`--scale=proxy` is the comparison without a "
                "scenario: measured compute, every link per device). Same steps to the "
                "target, the proxy's clock:\n\n"
                + "\n".join(f"* {v}" for v in lines)),
      "steps": ("## Step time at scale\n\nEach method's step at the scenario's size (its "
                "first setting), mean over the planned steps: the step and, in brackets, the "
                "communication its schedule does not hide; its peak memory per device is "
                "XLA:CPU's (extrapolated from 1 and 2 blocks), an upper estimate for GPU and "
                "TPU compilers, which fuse more.\n\n"
                + rep.markdown_table(headers, rows) + missing
                + f"\n\nPlans kept in {scale['cache']}.")}


def extra(clock, sc, links_: dict, pops: dict, trials: dict, target: float, config,
          not_planned: dict, records: list) -> dict:
  """What `compare.run` adds to its report at scale: the scenario's step times ("scale"),
  the same trials on the proxy's own clock ("proxy_clock"), the text and sections above;
  and each record's plan at scale (`record["scale"]`)."""
  scale = summary(clock, sc, links_)
  pclock = scale_.proxy_clock(pops, sc, links_)
  budgets, refs = summary_.budgets_and_references(trials, pclock, target, config)
  proxy = {"budgets": budgets, "references": refs,
           "summary": summary_.summarise(trials, pclock, target, config, budgets, refs)[1]}
  for r in records:
    r["scale"] = scale["methods"].get(r["method"])
  return {"scale": scale, "proxy_clock": proxy,
          "scale_text": text(scale, proxy, config, list(links_), target),
          "scale_sections": sections(scale, proxy, config, list(links_), target, not_planned)}
