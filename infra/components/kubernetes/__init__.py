"""infra/components/kubernetes"""
