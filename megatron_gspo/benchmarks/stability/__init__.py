"""The MoE stability benchmark: runs per variant and seed (benchmark.py), per-run curves and seed bands
(curves.py), the collapse verdicts and report (report.py), its figures (plots.py)."""
