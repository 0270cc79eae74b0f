"""The launch suite: pytest checks of one running deployment, shipped with the package.

``specdeploy validate`` (:func:`infra.validation.runner.run_validation`) runs this directory
in its own pytest process, from a source checkout or an installed wheel alike; in the
repository ``pytest tests/launch`` runs the same checks through thin re-exports.
"""
