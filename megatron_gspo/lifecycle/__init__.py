"""The run's lifecycle around the trainer: run directory safety and resume compatibility (run_dir.py), stop
signals (signals.py), training health (health.py), the phase watchdog (watchdog.py)."""
