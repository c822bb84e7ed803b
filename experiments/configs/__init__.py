"""Experiment configs: `get_config()` files for `--config=experiments/configs/<name>.py`."""
