import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def tiny():
    from mini3d.config import PRESETS

    return PRESETS["tiny"]
