import sys

from rayspeed.cli import main

sys.exit(main())
