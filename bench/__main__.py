"""``python -m bench``: the quick sweep (small sizes) on whatever device is here.

Same flags as ``python -m bench.kernels`` (see ``--help``), default tier
``quick``. On a CPU it times the XLA paths only and says so: Pallas kernels
run there only in the interpreter, which is not a kernel speed.
"""

import sys

from bench.kernels import main

if __name__ == "__main__":
  main(sys.argv[1:], default_tier="quick")
