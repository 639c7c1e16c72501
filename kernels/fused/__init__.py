"""Fused Mamba-block scan kernels (conv1d and dt projection inside the scan); forward only.

Nothing is registered at import: ``op.register()`` defines ``ssm::fused_mamba_scan``.
"""
