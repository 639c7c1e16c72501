"""x_proj and dt_proj as one op (``ssm::x_dt_proj``): the two products Mamba runs back to back.

Nothing is registered at import: ``op.register()`` defines the op.
"""
