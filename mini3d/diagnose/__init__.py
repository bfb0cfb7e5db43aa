"""Diagnostics: OOM report, hang watchdog and `explain-hang`, fault injection, the dry run (they read `mini3d.cost`)."""
