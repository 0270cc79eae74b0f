"""Templates rendered by infra/components/aws/user_data.py (a package so that installs carry them)."""
