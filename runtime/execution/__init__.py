"""Running calls: the one room for it (``runner`` is the seam, ``pool`` and ``hosted`` its two kinds)."""
