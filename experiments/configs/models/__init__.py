"""Model presets at real sizes, one file each (`get_config()`: config.model's settings, the
dataset, the sequence length, the batch per device and a note on where the shape differs
from the published model). `python -m experiments.plan --model=<file name>` plans them."""
