"""infra/ops"""
