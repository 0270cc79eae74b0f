"""infra/components/aws"""
