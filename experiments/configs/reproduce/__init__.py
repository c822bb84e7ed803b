"""The paper reproductions' configs, one file each, named after its program
(experiments/reproduce/<name>.py): `get_config()` gives experiments/reproduce/_reproduce.py's
`base_config()` with what the reproduction changes and its own settings under `reproduce`.
`python -m experiments.reproduce.<name> --help` lists them."""
