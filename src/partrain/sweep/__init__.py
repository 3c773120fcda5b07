"""Parallel hyper-parameter search on Optuna: ``partrain sweep``.

space.py   what is searched (parsed from ``--space``), and how a trial's values become a RunConfig
study.py   the Optuna study: storage, counting finished trials, reclaiming interrupted ones, one slot's loop
plan.py    how to spend W workers: k-way data parallel trials, W/k side by side, predicted from the profiles
report.py  the table of trials, the best configuration and its command, plots of accuracy against each value
command.py the ``partrain sweep`` parser and handler
"""
