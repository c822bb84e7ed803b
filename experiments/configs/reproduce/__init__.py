"""The paper reproductions' configs, one file each, named after its program
(experiments/reproduce_<name>.py): `get_config()` gives experiments/_reproduce.py's
`base_config()` with what the reproduction changes and its own settings under `reproduce`.
`python -m experiments.reproduce_<name> --help` lists them."""
