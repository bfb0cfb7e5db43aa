"""Cost model: hardware presets, analytic step time and memory, and the layout planner."""
