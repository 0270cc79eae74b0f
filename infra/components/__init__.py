"""infra/components"""
