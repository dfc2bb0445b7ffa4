"""Entry point for `ray job submit -- python jobs/train.py --config x.yaml` and `make train`."""

import os
import sys

try:
    import rayspeed  # noqa: F401  (installed by `make setup`)
except ImportError:  # a bare checkout: use the source tree next to this file
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "platform"))

from rayspeed.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]], prog="jobs/train.py"))
