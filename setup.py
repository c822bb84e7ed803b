"""The wheel's packages (the rest of the metadata is pyproject.toml's).

One folder, two names: the programs of experiments/ install as `jaxcomm.experiments` (no
generic top-level name in site-packages, which a folder `experiments/` in the working
directory would hide), and a checkout runs them as `python -m experiments.<program>`. The
modules of experiments/ import each other relatively, so either name works.
"""

import setuptools

EXPERIMENTS = setuptools.find_packages(include=["experiments", "experiments.*"])

setuptools.setup(
    packages=setuptools.find_packages(include=["jaxcomm", "jaxcomm.*"])
    + [f"jaxcomm.{name}" for name in EXPERIMENTS],
    package_dir={"jaxcomm.experiments": "experiments"},
)
