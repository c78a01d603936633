"""The tasks' floor: what every task pipeline shares (resolving a model, loading its decoder,
running generation for it) and :func:`detect`, which says which task a model folder is for."""
