"""The first module mini3d's forkserver imports (mini3d.launch.zygote's PRELOAD; nothing else
imports it): the server dies with its launcher at once, even while it is still importing torch,
and records its pid, which each rank forked from it reads to know its parent."""

import os

from mini3d.launch.boot import die_with_parent

die_with_parent()
PID = os.getpid()
