"""The import graph of jaxcomm/ and experiments/, read from the source files (ast, nothing is
imported): no import circle, and the library's layers (CONTRIBUTING.md) hold.

Every import counts, also one inside a function (a lazy import hides a circle, it does not
remove it). `from pkg import name` is an edge to the module `pkg.name` when that is a module of
ours, else to `pkg`.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxcomm", "experiments")

# CONTRIBUTING.md: codecs < comm < sync/local/parallel < models/train < sim/plan; data and
# the shared validators import nothing of jaxcomm above them; the package root and
# experiments are on top.
# A module may import its own layer or a lower one, never a higher one.
LAYERS = {
    "jaxcomm._validate": 0,
    "jaxcomm.codecs": 1,
    "jaxcomm.data": 1,
    "jaxcomm.comm": 2,
    "jaxcomm.sync": 3,
    "jaxcomm.local": 3,
    "jaxcomm.parallel": 3,
    "jaxcomm.models": 4,
    "jaxcomm.train": 4,
    "jaxcomm.elastic": 4,  # beside train/, which it drives
    "jaxcomm.sim": 5,
    "jaxcomm.plan": 5,     # beside sim/, whose clock it predicts with
    "jaxcomm": 6,          # the package root re-exports every subpackage
    "experiments": 7,
}


def module_files(packages=PACKAGES) -> dict[str, pathlib.Path]:
  """{dotted module name: source file} of every module under `packages`."""
  out = {}
  for package in packages:
    for path in sorted((ROOT / package).rglob("*.py")):
      parts = path.relative_to(ROOT).with_suffix("").parts
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = path
  return out


def _target(name: str, known) -> str | None:
  """The longest prefix of a dotted name that is one of our modules."""
  parts = name.split(".")
  for end in range(len(parts), 0, -1):
    if ".".join(parts[:end]) in known:
      return ".".join(parts[:end])
  return None


def imports_of(module: str, path: pathlib.Path, known) -> set[str]:
  """Our modules that `module` imports anywhere in its source."""
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:  # relative: from .x import y
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
               for alias in node.names]
    else:
      continue
    found.update(t for t in (_target(n, known) for n in names) if t and t != module)
  return found


def import_graph(packages=PACKAGES) -> dict[str, set[str]]:
  files = module_files(packages)
  return {m: imports_of(m, p, files) for m, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import circle as [a, b, ..., a], or None (depth-first search)."""
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        cycle = visit(nxt)
        if cycle:
          return cycle
    stack.pop()
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state:
      cycle = visit(node)
      if cycle:
        return cycle
  return None


def layer(module: str) -> int:
  key = _target(module, LAYERS)
  if key is None:
    raise KeyError(f"{module} is in no layer: add its subpackage to LAYERS (and to "
                   "CONTRIBUTING.md).")
  return LAYERS[key]


@pytest.mark.parametrize("package", ["jaxcomm", "experiments"])
def test_no_import_circle(package):
  graph = import_graph()
  mine = {m: {t for t in ts if t.split(".")[0] == package}
          for m, ts in graph.items() if m.split(".")[0] == package}
  cycle = find_cycle(mine)
  assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_module_imports_a_layer_above_its_own():
  graph = import_graph()
  upward = [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
            for m, targets in sorted(graph.items()) for t in sorted(targets)
            if layer(t) > layer(m)]
  assert not upward, "\n".join(upward)


def test_the_walker_sees_lazy_and_relative_imports(tmp_path):
  # The checks above are only as good as the graph: a lazy import inside a function and a
  # relative import are edges, and a circle through them is found.
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from pkg import b\n")
  (pkg / "b.py").write_text("def f():\n  from . import a\n")
  known = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py"}
  graph = {m: imports_of(m, p, known) for m, p in known.items()}
  assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
  assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


# A module stays within MAX_LINES unless it is one algorithm or one program; each exception
# says why. The rule covers the library, the experiment programs, the benchmarks and the
# notebooks' generator.
MAX_LINES = 300
SIZED = ("jaxcomm", "experiments", "benchmarks", "colab")
LONG_MODULES = {
    "jaxcomm/comm/_cost.py": "one model: the alpha-beta cost of every collective algorithm",
    "jaxcomm/testing.py": "the public contract suite, one import for the user's own tests",
    "jaxcomm/sync/_powersgd.py": "one algorithm: PowerSGD's power iteration (LQ-SGD reuses it)",
    "jaxcomm/codecs/_quantize.py": "the quantisers, sharing one block-and-scale grid",
    "jaxcomm/parallel/_pipeline.py": "one algorithm: pipeline schedules and their executor",
    "jaxcomm/comm/_compressed.py": "one concern: the three ways a codec payload is summed",
    "jaxcomm/elastic/_membership.py": "one protocol: a round's barrier, generation, quorum "
                                      "check, vote and eviction",
    "jaxcomm/sim/_async.py": "one simulation: asynchronous worker clocks in one scan",
    "jaxcomm/comm/_collectives.py": "one concern: every lax collective with its wire bytes",
    "jaxcomm/sync/_gossip.py": "one algorithm family: D-PSGD and CHOCO over a gossip graph",
    "jaxcomm/comm/_inspect.py": "one algorithm: the collectives read out of optimised HLO",
    "jaxcomm/parallel/_zero.py": "one algorithm: ZeRO stages 1 to 3",
    "jaxcomm/sync/_muon.py": "one algorithm: Muon's Newton-Schulz step, owner-based or by Gram "
                             "all-reduces over sharded matrices",
    "experiments/build.py": "one builder: a config to a Run (method context, model, inner "
                            "optimiser and its schedule, mesh)",
    "experiments/plan.py": "one program: the planner's flags, its methods' plans in worker "
                           "processes, the table and plan.json",
    "experiments/launch_local.py": "one program: N local processes, the coordinator, the "
                                   "failure schedule and the exit report",
    "experiments/compare/trials.py": "one concern: a population of trials (one program for "
                                     "its seeds) trained, evaluated and timed on every link",
    "experiments/compare/report.py": "one concern: the report's tables, verdicts, per-seed "
                                     "times and results.json",
    "experiments/reproduce/_reproduce.py": "what every reproduction shares: its settings, one "
                                           "run, its tables and figures",
    "benchmarks/shaped_link.py": "one benchmark: namespaces, a shaped link, two processes and "
                                 "the prediction beside the measurement",
    "colab/make_notebooks.py": "the notebooks' text: every cell of colab/*.ipynb as code",
}


def test_no_module_is_over_the_size_limit_without_a_reason():
  lengths = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for p in module_files(SIZED).values()}
  over = sorted(f"{f}: {n} lines" for f, n in lengths.items()
                if n > MAX_LINES and f not in LONG_MODULES)
  assert not over, (f"modules over {MAX_LINES} lines: split them by concern, or list them in "
                    "LONG_MODULES with the reason they are one algorithm:\n" + "\n".join(over))
  stale = sorted(f for f in LONG_MODULES if lengths.get(f, 0) <= MAX_LINES)
  assert not stale, f"LONG_MODULES entries within the limit (or gone), remove them: {stale}"


def test_the_step_builder_imports_nothing_from_experiments():
  graph = import_graph()
  seen, todo = set(), [m for m in graph if m.startswith("jaxcomm.train")]
  while todo:  # everything jaxcomm.train reaches, directly or through other modules
    module = todo.pop()
    if module not in seen:
      seen.add(module)
      todo.extend(graph.get(module, ()))
  assert "jaxcomm.train._step" in seen and "jaxcomm.train._layout" in seen
  assert not sorted(m for m in seen if m.split(".")[0] == "experiments")
