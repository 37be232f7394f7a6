"""Operator tools beside the daemon: demo, bench, local servers and check's presentation.

Nothing here is on the data path: the daemon's modules never import ``cdcd.tools``
(only ``cdcd.cli`` does), which the import-layer test enforces.
"""
