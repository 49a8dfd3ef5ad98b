"""Versions of each model: their traffic weights (weights.py) and the canary guard that judges
them by what clients saw (guard.py)."""
