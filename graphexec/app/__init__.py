"""The command line (`python -m graphexec`): demo, inspect, determinism, models, serve, and
the workloads they run."""
