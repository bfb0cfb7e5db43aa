"""The run shell: what `mini3d train`, `sample`, `estimate` and `plan` do around the engine. The
training loop and its flags, the run configuration and its checks, records and reports, periodic
validation and samples, the stop agreement, the dry run and torchrun's entry. It sits above
`mini3d.diagnose` (the loop arms the watchdog and the fault injector; the dry run is judged by the
rendezvous simulation), so nothing below imports it."""
