"""Paper reproductions, one program each at CPU scale: `python -m experiments.reproduce.<name>`
with <name> one of demo, diloco, powersgd, streaming, topk (its settings:
experiments/configs/reproduce/<name>.py; `--help` lists them). What they share (settings,
`train_run`, tables and figures) is `_reproduce.py`; the results are in
experiments/RESULTS.md."""
