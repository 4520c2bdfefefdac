"""The accuracy eval: labelled documents (data/), their generator (generate.py) and the runner
(run_eval.py, also the loaders the precision benchmarks reuse: `from evals import run_eval`).
Installed with the checkout (pyproject.toml) so that bench/ imports it without path edits."""
