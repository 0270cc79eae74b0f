"""Templates rendered by infra/user_data.py (a package so that installs carry them)."""
