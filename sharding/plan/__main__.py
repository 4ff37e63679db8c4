"""`python -m sharding.plan ...`: the documented name of the memory planner's command line.

The planner is `parallel/plan.py` (it reads the model) and its command line `launch/plan.py` (`--compile` builds
the learner); this file only forwards the command, so it is the one module of sharding/ that imports upward
(allowed by name in `tests/test_layers.py`). Import `parallel.plan` for the API.
"""

import sys

from launch.plan import main

sys.exit(main())
