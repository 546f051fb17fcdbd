from __future__ import annotations

import os

# Keep torch from oversubscribing the two cores CI has when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "1")
