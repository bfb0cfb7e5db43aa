"""Diagnostics: memory estimator (and, from other helpers, the live ledger and hang tools)."""
