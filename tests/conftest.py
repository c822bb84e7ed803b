"""Eight emulated CPU devices for every test, set once before JAX starts a backend."""

import os

# Each XLA program single-threaded inside (no Eigen thread pool): the 8 emulated devices and the
# two xdist workers already keep both cores busy, and the pools' threads only contend with
# them (4 modules under -n 2, same code, alternating: 58 -> 46-51 s wall; an hour later, the
# machine slower, 74 -> 70 s). XLA:CPU's older loop emitters for fusions instead of its MLIR
# fusion emitters, and each program's LLVM module compiled in one piece: the same HLO,
# collectives and bytes, compiled in about half the CPU time (`python -m
# benchmarks.xla_compile_flags`: four trainer steps and 236 eager ops, 15.3 -> 8.4-8.7 CPU-s;
# the whole suite 17m45s -> 9m15s wall on 2 cores). The one piece gains little by itself, but
# it is what the suite passes under: with the loop emitters alone, float32 roundings move one
# of 8192 MuLoCo 2-bit codes across a level (test_muon's sharded-equals-unsharded check).
# Subprocesses inherit all of it.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false"
    " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")
# XLA without most of its optimisation work (JAX's `jax_disable_most_optimizations`: LLVM at
# -O0, no expensive passes; the HLO, its collectives and bytes are the same, only the machine
# code is less tuned). The suite mostly compiles small programs that run a few steps: this cuts
# a module's CPU seconds by about a third (test_train + test_sync_powersgd 58 -> 37 s,
# test_compare 140 -> 93 s, cold). Subprocesses inherit it, so bit-for-bit comparisons with them
# hold. A module that trains for hundreds of steps, where the slower code costs more than the
# compile saves, sets `XLA_OPTIMISED = True` (see `_optimised_xla`); so does a module whose
# cross-process comparison is to float32 rounding of the optimised code (test_multihost).
_SWITCH = "JAX_DISABLE_MOST_OPTIMIZATIONS"
os.environ.setdefault(_SWITCH, "1")
# JAX's persistent compilation cache, opt-in (JAXCOMM_TEST_CACHE=<folder>, best started empty):
# for this run and every subprocess a test starts (they inherit the environment). Every program is
# cached, the eager ops too. Off by default, and a module may keep its programs out of it
# (`PERSISTENT_CACHE = False`, see `_kept_out_of_the_cache`): XLA:CPU (jaxlib 0.10) runs some
# executables loaded from the cache with their 8 device threads out of step. test_replicas'
# every-method program, loaded warm in one process, deadlocked in 5 of 7 runs with XLA's default
# flags and 5 of 6 with the suite's: five devices in a collective-permute, three each in an
# all-reduce of two devices whose partner never came (inside a conditional), until XLA's 40 s
# rendezvous timeout aborts the process ("Fatal Python error: Aborted"). Compiled afresh, it never
# has. (JAX also writes its cache files without a lock, the two xdist workers and their
# subprocesses side by side.) The whole suite warm took 6m13s wall against 8m06s for the run that
# filled the cache; with test_replicas kept out, an hour later on a machine 12 % slower, 6m54s
# against 8m33s, and 9m20s without any cache (2 cores, 2026-12-02).
_CACHE = os.environ.get("JAXCOMM_TEST_CACHE", "")
if _CACHE:
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(autouse=True, scope="module")
def _optimised_xla(request):
  """XLA's full optimisation for a module with `XLA_OPTIMISED = True`, in this process and in
  the subprocesses it starts."""
  if not getattr(request.module, "XLA_OPTIMISED", False):
    yield
    return
  before = jax.config.values["jax_disable_most_optimizations"], os.environ.get(_SWITCH)
  # The switch is not part of jit's cache key: without clearing, a function compiled before
  # would run its old executable, and bit-for-bit comparisons with subprocesses (which compile
  # afresh under the switch they inherit) fail in whichever module runs next on this worker.
  jax.clear_caches()
  jax.config.update("jax_disable_most_optimizations", False)
  os.environ[_SWITCH] = "0"
  yield
  jax.clear_caches()
  jax.config.update("jax_disable_most_optimizations", before[0])
  if before[1] is None:
    os.environ.pop(_SWITCH, None)
  else:
    os.environ[_SWITCH] = before[1]


@pytest.fixture(autouse=True, scope="module")
def _kept_out_of_the_cache(request):
  """Nothing a module with `PERSISTENT_CACHE = False` compiles is written to the persistent
  cache (JAXCOMM_TEST_CACHE), so a warm run compiles its programs afresh."""
  if not _CACHE or getattr(request.module, "PERSISTENT_CACHE", True):
    yield
    return
  name = "jax_persistent_cache_min_compile_time_secs"  # read each time JAX would write
  before = jax.config.values[name]
  jax.config.update(name, float("inf"))
  yield
  jax.config.update(name, before)


@pytest.fixture(scope="session")
def mesh8():
  from jaxcomm import train
  return train.make_mesh({"data": 8})


@pytest.fixture(scope="session")
def mesh4x2():
  from jaxcomm import train
  return train.make_mesh({"data": 4, "tensor": 2})


# End-to-end modules (subprocess runs, kill-and-heal), marked `slow` here for `make test-fast`
# (their own files may mark finer).
_END_TO_END = ("tests/test_compare.py", "tests/test_elastic.py", "tests/test_multihost.py")


def pytest_itemcollected(item):
  if item.nodeid.split("::")[0] in _END_TO_END:
    item.add_marker(pytest.mark.slow)


# `make test` runs `pytest -n 2 --dist loadscope --no-loadscope-reorder`: every module goes whole
# to one xdist worker, so a module fixture (a compiled trainer, a subprocess run) is built once,
# not once per worker, in the order collected here. These modules, the slowest of the suite (each
# module's total of junit seconds in the run that filled a test cache, 2 cores, 2026-12-02), start
# first, slowest first, so that the two workers end together (longest-first scheduling: the last
# modules handed out are the short ones; that run's times replayed, the two workers would end at
# 452 and 467 s in the order before, at 461 and 458 s in this one).
_SLOWEST_FIRST = (
    "test_elastic", "test_replicas", "test_doctests", "test_plan", "test_experiments",
    "test_notebooks", "test_cli", "test_multihost", "test_compare", "test_local_convergence",
    "test_checkpoint", "test_codec_fast_paths", "test_local", "test_reproduce", "test_nnx",
    "test_zero", "test_wheel", "test_muon", "test_readme", "test_codecs", "test_pipeline",
    "test_sequence_parallel", "test_overlap", "test_sync_compressed", "test_program")


def pytest_collection_modifyitems(items):
  rank = {f"tests/{name}.py": i for i, name in enumerate(_SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable
