"""Starting processes: the local launcher (ranks forked from a preloaded forkserver, die with the
launcher, first-failure report),
device and backend choice, what a failed job reports, and each worker's recorded p2p program.

Nothing here imports torch at package import: a worker imports `mini3d.launch.boot` first."""
