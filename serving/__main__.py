"""`python -m serving`: run the inference server (see serving/cli.py)."""

import sys

from serving.cli import main

sys.exit(main())
