"""Reference answers to the exercises in `exercises/` (same module and function names)."""
